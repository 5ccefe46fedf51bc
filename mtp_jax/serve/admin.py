"""The routes around generation: ``/health``, ``/v1/models``, ``/metrics`` and the cache
administration ``/v1/cache/status``, ``/v1/cache/resize``, ``/v1/cache/flush`` (run on the
engine thread; a resize waits for the running requests to finish and holds new ones back
until it is done)."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from mtp_jax.cache_admin import cache_status
from mtp_jax.config import ConfigError
from mtp_jax.serve.errors import APIError
from mtp_jax.serve.metrics import CONTENT_TYPE_LATEST
from mtp_jax.serve.protocol import parse_body

__all__ = ["router", "open_router", "ResizeBody"]

router = APIRouter()  # /v1 routes (behind the API key)
open_router = APIRouter()  # /health and /metrics


@open_router.get("/health")
async def health(request: Request):
    """200 ``{"status": "ok"}`` while the engine thread runs, else 503."""
    if not request.app.state.server.worker.alive():
        raise APIError(503, "the engine thread is not running.", code="engine_down")
    return {"status": "ok"}


@router.get("/v1/models")
async def models(request: Request):
    """The served model names (OpenAI's list of models)."""
    state = request.app.state.server
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": state.created, "owned_by": "mtp_jax",
         "root": state.model_path, "max_model_len": state.llm.engine.max_model_len}
        for name in state.served]}


@open_router.get("/metrics")
async def metrics(request: Request):
    """Prometheus text exposition of the server's metrics."""
    return Response(request.app.state.server.metrics.render(),
                    media_type=CONTENT_TYPE_LATEST)


async def _on_engine(request: Request, fn, idle: bool = False):
    """``fn(engine)`` run on the engine thread; ``ConfigError`` / ``ValueError`` /
    ``RuntimeError`` from it are a 400 with its message."""
    state = request.app.state.server
    fut = state.worker.call(fn, idle=idle)
    try:
        return await asyncio.wrap_future(fut)
    except (ConfigError, ValueError, RuntimeError, MemoryError) as e:
        raise APIError(400, str(e), code="cache_refused") from None


@router.get("/v1/cache/status")
async def status(request: Request):
    """:func:`mtp_jax.cache_admin.cache_status` of the engine."""
    llm = request.app.state.server.llm
    return await _on_engine(request, lambda: cache_status(llm.engine))


class ResizeBody(BaseModel):
    """``num_pages`` (KV pool, with the draft KV; prefix cache flushed) and/or
    ``max_running_requests`` (slot pool; KV and prefix cache kept)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    num_pages: int | None = None
    max_running_requests: int | None = None


@router.post("/v1/cache/resize")
async def resize(request: Request):
    """``LLM.resize_cache`` once no request runs; a size that does not fit is refused (400)
    with the caches as they were. Answers the new status."""
    from mtp_jax.serve.generation import read_json

    body = parse_body(await read_json(request), ResizeBody)
    if body.num_pages is None and body.max_running_requests is None:
        raise APIError(400, "pass num_pages and/or max_running_requests.", param="num_pages")
    llm = request.app.state.server.llm
    t0 = time.perf_counter()

    def run():
        llm.resize_cache(num_pages=body.num_pages,
                         max_running_requests=body.max_running_requests)
        return cache_status(llm.engine)

    out = await _on_engine(request, run, idle=True)
    return {**out, "seconds": round(time.perf_counter() - t0, 3)}


@router.post("/v1/cache/flush")
async def flush(request: Request):
    """``LLM.flush_cache``: the prefix cache's entries no running request uses are dropped.
    Answers the new status."""
    llm = request.app.state.server.llm

    def run():
        llm.flush_cache()
        return cache_status(llm.engine)

    return await _on_engine(request, run)
