"""The FastAPI application: routes, error handlers, middleware and lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken._version import __version__
from freetoken.server import anthropic_messages, chat, completions
from freetoken.server.anthropic_protocol import response_for
from freetoken.server.errors import APIError
from freetoken.server.metrics import CONTENT_TYPE
from freetoken.server.middleware import APIKeyMiddleware, BodyLimitMiddleware, ErrorAndMetricsMiddleware
from freetoken.server.protocol import ModelCard, ModelList
from freetoken.server.state import EngineHolder, ServerSettings

logger = logging.getLogger(__name__)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/models",
             "/health", "/metrics")

#: Keys of the backend report that /health passes on when the report has them (a CPU
#: backend's report has fewer than a GPU session's); backend, io_path, graphs and reason
#: are always in the answer.
HEALTH_DECISION_KEYS = ("sync_mode", "warnings", "act_dtype", "moe_cpu_layers", "moe_gpu_layers",
                        "graph_batch_sizes")


async def list_models(request: Request) -> Response:
    holder: EngineHolder = request.app.state.holder
    engine = holder.require_engine()
    cards = [ModelCard(id=name, max_model_len=engine.max_model_len) for name in holder.model_names()]
    return JSONResponse(ModelList(data=cards).model_dump(mode="json"))


async def retrieve_model(request: Request) -> Response:
    holder: EngineHolder = request.app.state.holder
    engine = holder.require_engine()
    name = holder.check_model(request.path_params["model"])
    return JSONResponse(ModelCard(id=name, max_model_len=engine.max_model_len).model_dump(mode="json"))


async def health(request: Request) -> Response:
    holder: EngineHolder = request.app.state.holder
    if holder.draining:
        return JSONResponse({"status": "shutting_down"}, status_code=503)
    if holder.engine is None:
        if holder.load_error is not None:
            return JSONResponse({"status": "error", "error": f"model failed to load: {holder.load_error}"},
                                status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)
    info = holder.backend_info()
    engine = holder.engine
    if not getattr(engine, "running", True):
        return JSONResponse({"status": "error", "error": "the engine loop is not running (see the server log)",
                             "model": engine.model_name}, status_code=503)
    body: dict[str, Any] = {
        "status": "ok",
        "model": engine.model_name,
        "served_model_names": holder.model_names(),
        "max_model_len": engine.max_model_len,
        "backend": info.get("backend"),
        "io_path": info.get("io_path"),
        "graphs": info.get("graphs"),
        "reason": info.get("reason"),
    }
    body.update({key: info[key] for key in HEALTH_DECISION_KEYS if key in info})
    if info.get("memory_plan"):  # a GPU session under a memory budget: the plan's parts, in bytes
        body["memory_plan"] = info["memory_plan"]
    body["version"] = __version__
    return JSONResponse(body)


async def metrics(request: Request) -> Response:
    holder: EngineHolder = request.app.state.holder
    return Response(holder.metrics.render(), media_type=CONTENT_TYPE)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return response_for(request.url.path, exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        error = APIError(404, f"Unknown endpoint: {request.method} {request.url.path}", code="unknown_url")
    elif exc.status_code == 405:
        error = APIError(405, f"Method {request.method} is not allowed for {request.url.path}",
                         code="method_not_allowed")
    else:
        error = APIError(exc.status_code, str(exc.detail))
    return response_for(request.url.path, error, headers=dict(exc.headers) if exc.headers else None)


def create_app(engine_config: Any, settings: Optional[ServerSettings] = None,
               engine_factory: Optional[Callable[[Any], Any]] = None) -> FastAPI:
    """Build the app. The model starts loading when the app starts (lifespan), in a
    thread, so the server listens (and /health says 503) while it loads."""
    settings = settings or ServerSettings()
    holder = EngineHolder(engine_config, settings, engine_factory)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(holder.load())
        try:
            yield
        finally:
            if not loader.done():
                loader.cancel()
                with contextlib.suppress(BaseException):
                    await loader
            await holder.shutdown()

    app = FastAPI(title="FreeToken", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.holder = holder
    app.add_api_route("/v1/chat/completions", chat.create_chat_completion, methods=["POST"])
    app.add_api_route("/v1/completions", completions.create_completion, methods=["POST"])
    app.add_api_route("/v1/messages", anthropic_messages.create_message, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", anthropic_messages.count_tokens, methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", retrieve_model, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    # Added innermost first: body limit, then API key, then errors+metrics outermost.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(ErrorAndMetricsMiddleware, metrics=holder.metrics, endpoints=ENDPOINTS)
    return app
