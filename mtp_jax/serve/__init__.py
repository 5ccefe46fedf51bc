"""An OpenAI-compatible server over one :class:`~mtp_jax.LLM` (needs the ``serve`` extra:
FastAPI, uvicorn, prometheus_client).

Layout: :mod:`~mtp_jax.serve.cli` (``python -m mtp_jax.serve``), :mod:`~mtp_jax.serve.app`
(the FastAPI app), :mod:`~mtp_jax.serve.worker` (the engine thread: admit -> step -> emit),
:mod:`~mtp_jax.serve.calls` (one HTTP call's requests, aborted when the call ends early),
:mod:`~mtp_jax.serve.generation` (completions and chat), :mod:`~mtp_jax.serve.admin` (health,
models, metrics, cache), :mod:`~mtp_jax.serve.protocol` and :mod:`~mtp_jax.serve.prepare`
(request bodies), :mod:`~mtp_jax.serve.responses` (response objects; streamed text through
:class:`mtp_jax.tokenizer.TextStream`), :mod:`~mtp_jax.serve.metrics`,
:mod:`~mtp_jax.serve.errors`.

Python: ``create_app(LLM(...), served_model_name="m")`` gives the ASGI app (run it with
uvicorn, or test it with FastAPI's ``TestClient``)."""

__all__ = ["create_app"]


def create_app(*args, **kwargs):
    """:func:`mtp_jax.serve.app.create_app` (imported on first use: FastAPI loads only
    then)."""
    from mtp_jax.serve.app import create_app as make

    return make(*args, **kwargs)
