"""``freetoken serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import logging
import os
import socket
from typing import TYPE_CHECKING, Any

from freetoken.cli.engine_options import add_engine_arguments, engine_config_from_args, non_negative_int, positive_int

if TYPE_CHECKING:
    from freetoken.engine.config import EngineConfig

logger = logging.getLogger("freetoken.serve")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
                    "/v1/models, /health, /metrics). Without --model the built-in demo model is served.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=non_negative_int, default=8000,
                   help="port (0 picks a free one; the log says which) (default: 8000)")
    p.add_argument("--api-key", default=os.environ.get("FREETOKEN_API_KEY"),
                   help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on /v1/* "
                        "(default: $FREETOKEN_API_KEY, else open)")
    p.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                   help="model name(s) clients use (repeatable; default: the model's own name)")
    p.add_argument("--max-queued-requests", type=positive_int, default=256, metavar="N",
                   help="requests waiting for a batch slot before new ones get HTTP 429 (default: 256)")
    p.add_argument("--max-body-bytes", type=positive_int, default=None, metavar="N",
                   help="largest accepted request body; larger ones get HTTP 413 (default: 8 MiB)")
    p.add_argument("--access-log", action="store_true", help="log one line per HTTP request (uvicorn.access)")
    add_engine_arguments(p)
    p.set_defaults(func=run)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine options, with the queue limit and the first served model name."""
    served = args.served_model_name or []
    return engine_config_from_args(
        args, max_queued_requests=args.max_queued_requests, served_model_name=served[0] if served else None,
    )


def _bind(host: str, port: int) -> socket.socket:
    """Bind the listening socket ourselves, so the log can name the real port (also for --port 0)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise SystemExit(f"freetoken serve: cannot listen on {host}:{port}: {exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _server_class() -> Any:
    import contextlib
    import signal
    import threading

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that SIGINT/SIGTERM end in a clean exit (status 0) after the
        graceful shutdown, instead of re-raising the signal once the server has stopped."""

        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)
                for sig in self._captured_signals[:1]:
                    logger.info("received %s: shut down", signal.Signals(sig).name)

        async def shutdown(self, sockets: Any = None) -> None:
            holder = getattr(self.config.app, "state", None)
            holder = getattr(holder, "holder", None)
            if holder is not None:
                holder.drain()
            await super().shutdown(sockets)

    return Server


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from freetoken.server.app import create_app
    from freetoken.server.faults import enabled_by_env
    from freetoken.server.state import DEFAULT_MAX_BODY_BYTES, ServerSettings

    served = args.served_model_name or []
    config = engine_config(args)
    settings = ServerSettings(
        api_key=args.api_key or None,
        served_model_names=served,
        max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
        enable_fault_injection=enabled_by_env(),
    )
    if settings.enable_fault_injection:
        logger.warning("fault injection is ON (FREETOKEN_SERVER_FAULTS=1): for tests only")
    app = create_app(config, settings)
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    server = _server_class()(uvicorn.Config(
        app, log_config=None, access_log=bool(args.access_log), timeout_graceful_shutdown=5, timeout_keep_alive=30,
    ))

    def on_load_failure(exc: BaseException) -> None:
        server.should_exit = True

    app.state.holder.on_load_failure = on_load_failure
    logger.info("listening on http://%s:%d (API key %s); the model loads in the background, /health says 503 "
                "until it is ready", shown, port, "required" if settings.api_key else "not required")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
        logger.warning("listening on %s without --api-key: anyone who can reach this address can use the server",
                       args.host)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if app.state.holder.load_error is not None:
        logger.error("exiting: the model failed to load (%s)", app.state.holder.load_error)
        return 1
    logger.info("server stopped")
    return 0
