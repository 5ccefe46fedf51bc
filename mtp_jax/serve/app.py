"""The FastAPI application: :func:`create_app` over a loaded :class:`~mtp_jax.LLM`. Its
lifespan starts the engine thread (:class:`~mtp_jax.serve.worker.EngineWorker`) and stops it;
``--api-key`` guards every ``/v1`` route with a bearer token."""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import time

from fastapi import Depends, FastAPI, Request

from mtp_jax.serve import admin, generation
from mtp_jax.serve.errors import APIError, install_error_handlers
from mtp_jax.serve.metrics import ServerMetrics
from mtp_jax.serve.worker import EngineWorker

__all__ = ["ServerState", "create_app"]


@dataclasses.dataclass
class ServerState:
    """What the routes share: the LLM, its engine thread, the metrics, the served model
    names (the first is the default), and the API key (None: none asked)."""

    llm: object
    worker: EngineWorker
    metrics: ServerMetrics
    served: list[str]
    model_path: str | None
    api_key: str | None = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


def require_key(request: Request) -> None:
    """401 unless the request carries ``Authorization: Bearer <api key>`` (when one is set)."""
    key = request.app.state.server.api_key
    if key is None:
        return
    got = request.headers.get("authorization", "")
    scheme, _, token = got.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(),
                                                                key.encode()):
        raise APIError(401, "missing or wrong API key; send 'Authorization: Bearer <key>' "
                            "with the server's --api-key.", code="invalid_api_key")


def create_app(llm, served_model_name: str | list[str] | None = None,
               api_key: str | None = None, model_path: str | None = None) -> FastAPI:
    """The server's app over ``llm``. ``served_model_name``: the name(s) clients pass as
    ``model`` (default: ``model_path``, or ``"default"``). The engine thread starts with the
    app's lifespan (uvicorn, or ``with TestClient(app)``)."""
    names = ([served_model_name] if isinstance(served_model_name, str)
             else list(served_model_name or [model_path or "default"]))
    metrics = ServerMetrics()
    state = ServerState(llm=llm, worker=EngineWorker(llm, metrics), metrics=metrics,
                        served=names, model_path=model_path, api_key=api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.worker.start()
        try:
            yield
        finally:
            state.worker.stop()

    app = FastAPI(title="mtp_jax", lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app, metrics.count_error)
    guarded = [Depends(require_key)]
    app.include_router(generation.router, dependencies=guarded)
    app.include_router(admin.router, dependencies=guarded)
    app.include_router(admin.open_router)
    return app
