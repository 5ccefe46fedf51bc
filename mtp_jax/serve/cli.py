"""python -m mtp_jax.serve: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one
loaded model, with MTP speculative decoding and continuous batching of concurrent clients.
Takes the CLI's engine flags (python -m mtp_jax.generate) plus --host, --port,
--served-model-name and --api-key."""

from __future__ import annotations

import argparse
import os
import sys

from mtp_jax.cli_parser import CliParser

__all__ = ["build_parser", "main", "warm_up"]


def build_parser() -> argparse.ArgumentParser:
    """The server's flags: the engine flags of :func:`mtp_jax.generate.add_engine_flags` and
    the HTTP ones."""
    from mtp_jax.generate import add_engine_flags

    p = CliParser(prog="python -m mtp_jax.serve", description=__doc__, allow_abbrev=False)
    add_engine_flags(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default %(default)s; 0.0.0.0 for every "
                        "interface)")
    p.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="the name clients pass as \"model\"; repeat for aliases (default: the "
                        "--model path, or \"default\" for the built-in model)")
    p.add_argument("--api-key", default=os.environ.get("MTP_JAX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: "
                        "$MTP_JAX_API_KEY; none when unset)")
    p.add_argument("--warmup", default="background", choices=["background", "blocking", "none"],
                   help="compiling the programs serving can call (every prompt-length and batch "
                        "bucket, greedy and sampled): background = on threads while the server "
                        "listens, a request waiting only for the programs it calls (default); "
                        "blocking = all before listening; none = each when first called")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default %(default)s)")
    return p


def make_llm(args: argparse.Namespace):
    """The :class:`~mtp_jax.LLM` of the engine flags; ``ValueError`` for a bad seed."""
    from mtp_jax import LLM
    from mtp_jax.generate import llm_kwargs

    if not 0 <= args.seed < 2**32:
        raise ValueError(f"seed (--seed) {args.seed} must be an int in [0, 2**32).")
    return LLM(**llm_kwargs(args))


def warm_up(llm, mode: str) -> None:
    """Compile (or load from the compilation cache) every program serving can call
    (:meth:`mtp_jax.engine.engine.Engine.warmup`): on threads with ``mode="background"``
    (requests then wait only for the programs they call, building those not started yet
    themselves), before returning with ``"blocking"``, not at all with ``"none"``; a line on
    stderr says which."""
    if mode == "none":
        return
    seconds = llm.engine.warmup(background=mode == "background")
    building = llm.engine.device.building()
    if building:
        print(f"[serve] {building} programs compiling or loading in the background; a request "
              "waits only for the programs it calls", file=sys.stderr, flush=True)
    else:
        print(f"[serve] programs compiled or loaded in {seconds:.1f}s", file=sys.stderr,
              flush=True)


def check_address(host: str, port: int) -> None:
    """Raise ``ValueError`` naming ``--host`` / ``--port`` and the fix when the server could
    not listen there (a port another process holds, a host this machine does not have): checked
    by binding once before the model loads, instead of uvicorn's error after it."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: not an address of this machine ({e.strerror}); "
                         "pass 127.0.0.1, 0.0.0.0 or one of its names.") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as e:
            raise ValueError(f"--port {port} on {host}: cannot listen there ({e.strerror}); "
                             "pass a free --port, or stop what holds it.") from None


def main(argv=None) -> int:
    """Load the model and serve until interrupted. Returns 0, or 2 for bad settings (message
    on stderr), an address it cannot listen on included (before the load)."""
    args = build_parser().parse_args(argv)
    try:
        import uvicorn

        from mtp_jax.serve.app import create_app
    except ImportError as e:
        print(f"error: the server needs the serve extra ({e}); install it with "
              "scripts/setup_venv.sh serve (or pip install 'mtp_jax[serve]').", file=sys.stderr)
        return 2
    from mtp_jax.config import ConfigError

    try:
        check_address(args.host, args.port)
        llm = make_llm(args)
    except (ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = create_app(llm, served_model_name=args.served_model_name, api_key=args.api_key,
                     model_path=args.model)
    warm_up(llm, args.warmup)
    print(f"[serve] model {args.model or 'built-in default'} as "
          f"{app.state.server.served}; http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
