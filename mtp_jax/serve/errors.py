"""OpenAI error objects: ``{"error": {"message", "type", "param", "code"}}`` for every failure
the server reports, and the FastAPI handlers that turn exceptions into them."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

__all__ = ["APIError", "error_body", "install_error_handlers"]

log = logging.getLogger("mtp_jax.serve")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 409: "conflict_error", 500: "server_error",
          503: "server_error"}


class APIError(Exception):
    """A failure reported to the client as an OpenAI error object with HTTP ``status``.
    ``param`` names the request field at fault (None: none); ``code`` a short machine tag."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def install_error_handlers(app: FastAPI,
                           on_error: Callable[[int], None] | None = None) -> None:
    """Answer :class:`APIError`, FastAPI's validation errors, Starlette's HTTP errors (404,
    405) and anything unexpected (500, logged) with OpenAI error objects; ``on_error`` is
    called with each one's HTTP status (the server's error counter)."""

    def answer(err: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(err.status)
        return err.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return answer(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": str(exc)}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return answer(APIError(400, f"{param}: {first.get('msg')}", param=param))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return answer(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error serving %s", request.url.path)
        return answer(APIError(500, f"internal error: {exc!r}", code="internal_error"))
