"""The server's engine holder: loads the model in a thread (so /health answers 503
meanwhile), starts and stops the engine, and exposes what the routes need."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Optional

from freetoken._version import __version__
from freetoken.server.errors import APIError
from freetoken.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

#: Default cap on a request body (bytes); larger bodies get 413.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclasses.dataclass
class ServerSettings:
    """HTTP-side settings (the engine's own live in EngineConfig)."""

    api_key: Optional[str] = None
    served_model_names: list[str] = dataclasses.field(default_factory=list)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    #: Lets a request ask for an injected internal error (header ``x-freetoken-fault``); tests only.
    enable_fault_injection: bool = False


class EngineHolder:
    """Owns the AsyncEngine: its loading, readiness and shutdown."""

    def __init__(self, engine_config: Any, settings: ServerSettings,
                 engine_factory: Optional[Callable[[Any], Any]] = None) -> None:
        self.engine_config = engine_config
        self.settings = settings
        self._factory = engine_factory
        self.engine: Optional[Any] = None
        self.load_error: Optional[BaseException] = None
        self.load_seconds: Optional[float] = None
        self._ready = asyncio.Event()
        self._thread: Optional[threading.Thread] = None
        self.metrics = ServerMetrics(self.stats, self.backend_info)
        #: requests being generated (ChoiceStreams), so a shutdown can end them cleanly
        self.active: set[Any] = set()
        self.draining = False
        self.on_load_failure: Optional[Callable[[BaseException], None]] = None

    # ------------------------------------------------------------- lifecycle

    def _create(self) -> Any:
        if self._factory is not None:
            return self._factory(self.engine_config)
        from freetoken.engine.async_engine import AsyncEngine

        return AsyncEngine(self.engine_config)

    async def load(self) -> None:
        """Load in a daemon thread, then start the engine on this loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def work() -> None:
            try:
                engine = self._create()
            except BaseException as exc:  # noqa: BLE001 - reported to the loop
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                loop.call_soon_threadsafe(_set_result, future, engine)

        start = time.monotonic()
        what = getattr(self.engine_config, "model", None) or "the built-in demo model"
        logger.info("loading %s ...", what)
        self._thread = threading.Thread(target=work, name="freetoken-load", daemon=True)
        self._thread.start()
        try:
            engine = await future
            await engine.start()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001
            self.load_error = exc
            logger.exception("loading the model failed")
            if self.on_load_failure is not None:
                self.on_load_failure(exc)
            return
        self.load_seconds = time.monotonic() - start
        self.engine = engine
        self._ready.set()
        info = self.backend_info()
        logger.info("loaded model %r in %.1f s: %s, context %d tokens, serving it as %s; why: %s",
                    engine.model_name, self.load_seconds, describe_decision(info), engine.max_model_len,
                    ", ".join(self.model_names()), info.get("reason") or "-")
        for warning in info.get("warnings") or ():
            logger.warning("startup check: %s", warning)

    def drain(self) -> None:
        """Server shutdown begins: refuse new requests and end the ones in flight with a 503
        error (an error event for streams) instead of cutting their connections."""
        self.draining = True
        if self.active:
            logger.info("shutting down: ending %d request(s) in flight", len(self.active))
        for streams in list(self.active):
            streams.interrupt(APIError(503, "The server is shutting down; retry on another instance or later.",
                                       code="server_shutting_down"))

    async def shutdown(self) -> None:
        engine, self.engine = self.engine, None
        self._ready.clear()
        if engine is not None:
            try:
                await engine.shutdown()
            except Exception:  # noqa: BLE001
                logger.exception("engine shutdown failed")
            logger.info("engine stopped")

    # ------------------------------------------------------------- queries

    @property
    def ready(self) -> bool:
        return self.engine is not None

    def require_engine(self) -> Any:
        if self.draining:
            raise APIError(503, "The server is shutting down.", code="server_shutting_down")
        if self.engine is None:
            if self.load_error is not None:
                raise APIError(503, f"the model failed to load: {self.load_error}", code="model_load_failed")
            raise APIError(503, "the model is still loading; retry shortly", code="model_loading")
        return self.engine

    def stats(self) -> Optional[Any]:
        engine = self.engine
        return engine.stats() if engine is not None else None

    def backend_info(self) -> dict[str, Any]:
        engine = self.engine
        if engine is None:
            return {}
        try:
            return dict(engine.backend_info())
        except Exception:  # noqa: BLE001
            logger.exception("engine.backend_info() failed")
            return {}

    def model_names(self) -> list[str]:
        if self.settings.served_model_names:
            return list(self.settings.served_model_names)
        if self.engine is not None:
            return [str(self.engine.model_name)]
        return []

    def check_model(self, name: str) -> str:
        names = self.model_names()
        if name not in names:
            raise APIError(404, f"The model '{name}' does not exist. Served: {', '.join(names)}.",
                           param="model", code="model_not_found")
        return name

    def system_fingerprint(self) -> str:
        info = self.backend_info()
        return f"fp_freetoken-{__version__}-{info.get('backend', 'unknown')}"


def describe_decision(info: dict[str, Any]) -> str:
    """The backend's startup decision, short: backend, IO path, sync mode, decode graphs
    (with their batch sizes), activation dtype and expert placement (only what the report
    holds; the reason is separate)."""
    parts = [f"backend {info.get('backend', 'unknown')}"]
    if "io_path" in info:
        parts.append(f"IO path {info['io_path']}")
    if "sync_mode" in info:
        parts.append(f"sync mode {info['sync_mode'] or 'none'}")
    if "graphs" in info:
        graphs = "on" if info["graphs"] else "off"
        sizes = info.get("graph_batch_sizes")
        if info["graphs"] and sizes:
            graphs += f" (batch sizes {','.join(map(str, sizes))})"
        parts.append(f"decode graphs {graphs}")
    if "act_dtype" in info:
        parts.append(f"activations {info['act_dtype']}")
    if "moe_cpu_layers" in info:
        gpu = info.get("moe_gpu_layers")
        parts.append(f"MoE CPU layers {info['moe_cpu_layers']}" + (f" ({gpu} on the GPU)" if gpu is not None else ""))
    return ", ".join(parts)


def _set_result(future: "asyncio.Future[Any]", value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: "asyncio.Future[Any]", exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
