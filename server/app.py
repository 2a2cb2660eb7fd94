"""The OpenAI-compatible HTTP app: `create_app(engine)` (routes) and `serve(config, ...)` (the process).

Handlers run on uvicorn's event loop and reach the engine only through AsyncEngine's
public API. Bodies are validated by jaxserve.protocol; every error leaves in OpenAI's
JSON error shape with its status, and a 500 tells only a request id (the details are
logged under it). Generation routes return an EngineResponse (server.streaming), which
adds the requests when it starts and aborts them when the client leaves.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxserve.config import EngineConfig
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest, RequestError, RequestLimits,
                               chat_response, completion_response, parse, parse_json_text, prepare)
from jaxserve.tool_parsers import get_tool_parser
from server.limits import BodySizeLimit
from server.metrics import ServerMetrics
from server.middleware import ApiKeyAuth, RequestId
from server.streaming import EngineResponse, chat_chunks, completion_chunks, finals, internal_error

logger = logging.getLogger(__name__)


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False          # vLLM's: also the vocabulary's string of each token


class TokenizeChatRequest(BaseModel):
    """Renders exactly what /v1/chat/completions renders for the same fields."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorBody


_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 500, 503)}
# A generation route answers JSON, or Server-Sent Events when the body asks for `stream`: each
# event's data is a JSON chunk, an error object, or `[DONE]`.
_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
_GENERATION = {**_ERRORS, 200: {"description": "the completion (JSON), or its chunks (`stream: true`)",
                                "content": {"application/json": {},
                                            "text/event-stream": {"schema": _SSE_EVENT}}}}


def _body(model: type[BaseModel] | list[type[BaseModel]]) -> dict:
    """OpenAPI request body of a route that parses its JSON itself (so that every error is ours)."""
    models = model if isinstance(model, list) else [model]
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def error_response(e: RequestError) -> JSONResponse:
    return JSONResponse(e.to_dict(), status_code=e.status)


def create_app(engine: AsyncEngine, *, served_model_name: str | None = None, api_key: str | None = None,
               max_request_body_bytes: int = 8 * 2**20, limits: RequestLimits | None = None,
               enable_docs: bool = False, tool_parser: str | None = None) -> FastAPI:
    """The app; `enable_docs` serves /docs and /openapi.json (off by default, as they list every route).

    `tool_parser` (a jaxserve.tool_parsers name, e.g. "hermes") parses the tool calls of chat requests
    with tools and tool_choice "auto" (vLLM's --enable-auto-tool-choice --tool-call-parser); without
    it such requests get a 400.
    """
    model_name = served_model_name or engine.model_name
    tools = get_tool_parser(tool_parser) if tool_parser is not None else None
    metrics = ServerMetrics(engine, model_name)
    limits = limits or RequestLimits(max_logprobs=engine.engine.config.max_logprobs)

    @asynccontextmanager
    async def lifespan(app):
        yield
        engine.shutdown()   # uvicorn has stopped accepting and drained (or timed out) in-flight work

    app = FastAPI(title="jaxserve", lifespan=lifespan, docs_url="/docs" if enable_docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if enable_docs else None)
    # Outermost last: request id, then the API key, then the body size.
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    app.add_middleware(RequestId)
    app.state.engine, app.state.metrics = engine, metrics

    @app.exception_handler(RequestError)
    async def _request_error(request, e: RequestError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return error_response(RequestError(str(e.detail), status=e.status_code,
                                           type="not_found_error" if e.status_code == 404 else "invalid_request_error"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        return error_response(internal_error(e, request.scope.get("state", {}).get("request_id")))

    def parsed(body: dict, model):
        req = parse(model, body)
        if req.model not in (None, model_name):
            raise RequestError(f"The model `{req.model}` does not exist.", status=404, param="model",
                               type="NotFoundError")
        return req

    async def body_of(request: Request, model):
        return parsed(await _json(request), model)

    def check_engine() -> None:
        if not engine.is_healthy:
            raise RequestError("the engine is not running", status=503, type="service_unavailable")

    async def prepared(req):
        # Chat templates and tokenization of long prompts run off the event loop.
        return await asyncio.to_thread(prepare, req, engine.tokenizer, engine.max_model_len, limits, tools,
                                       engine.sampling_defaults)

    @app.get("/health", response_class=Response, responses={200: {"description": "the engine is running"},
                                                             503: {"model": ErrorResponse}})
    async def health():
        if engine.is_healthy:
            return Response(status_code=200)
        return error_response(RequestError("the engine is not running", status=503, type="service_unavailable"))

    @app.get("/metrics", response_class=Response,
             responses={200: {"description": "Prometheus metrics", "content": {CONTENT_TYPE_LATEST: {}}}})
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=_ERRORS)
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "jaxserve", "root": engine.model_name,
                                            "max_model_len": engine.max_model_len}]}

    @app.post("/tokenize", responses=_ERRORS, openapi_extra=_body([TokenizeCompletionRequest, TokenizeChatRequest]))
    async def tokenize(request: Request):
        body = await _json(request)
        tok = engine.tokenizer
        if "messages" in body:
            t = parsed(body, TokenizeChatRequest)
            chat = parse(ChatCompletionRequest, {**t.model_dump(exclude_none=True, exclude={"return_token_strs"}),
                                                 "tool_choice": "none" if t.tools else None})
            text = await asyncio.to_thread(chat.render, tok)
            ids = tok.encode(text, add_special_tokens=t.add_special_tokens)      # as the chat route encodes it
        else:
            t = parsed(body, TokenizeCompletionRequest)
            ids = tok.encode(t.prompt, add_special_tokens=t.add_special_tokens)
        response = {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}
        if t.return_token_strs:
            response["token_strs"] = tok.convert_ids_to_tokens(ids)
        return response

    @app.post("/detokenize", responses=_ERRORS, openapi_extra=_body(DetokenizeRequest))
    async def detokenize(request: Request):
        req = await body_of(request, DetokenizeRequest)
        vocab = engine.engine.model_config.vocab_size
        if not all(0 <= t < vocab for t in req.tokens):
            raise RequestError(f"tokens must be a list of token ids in [0, {vocab})", param="tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}   # as vLLM's

    async def generation(request: Request, model, respond_stream, respond_final):
        req = await body_of(request, model)
        check_engine()
        items = await prepared(req)
        produce = respond_stream(req) if req.stream else respond_final(req)
        return EngineResponse(engine, items, produce, stream=req.stream, priority=req.priority,
                              cache_salt=req.cache_salt)

    @app.post("/v1/completions", responses=_GENERATION, openapi_extra=_body(CompletionRequest))
    async def completions(request: Request):
        def stream(req):
            return lambda streams: completion_chunks(req, streams, model_name, engine.tokenizer, metrics)

        def final(req):
            async def produce(streams):
                return completion_response(req, await finals(streams, metrics), model_name, engine.tokenizer)
            return produce
        return await generation(request, CompletionRequest, stream, final)

    @app.post("/v1/chat/completions", responses=_GENERATION, openapi_extra=_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        def stream(req):
            return lambda streams: chat_chunks(req, streams, model_name, engine.tokenizer, metrics, tools)

        def final(req):
            async def produce(streams):
                (output,) = await finals(streams, metrics)
                return chat_response(req, output, model_name, engine.tokenizer, tools)
            return produce
        return await generation(request, ChatCompletionRequest, stream, final)

    if enable_docs:
        _document_bodies(app, [CompletionRequest, ChatCompletionRequest, TokenizeCompletionRequest,
                               TokenizeChatRequest, DetokenizeRequest])
    return app


def _document_bodies(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Put the request models (and the models they use) into the OpenAPI components."""
    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version="1", routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for m in models:
                js = m.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(js.pop("$defs", {}))
                components[m.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi


async def _json(request: Request) -> dict:
    body = parse_json_text(await request.body())
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def serve(config: EngineConfig, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_num_queued_requests: int | None = None, max_request_body_bytes: int = 8 * 2**20,
          limits: RequestLimits | None = None, step_timeout_s: float | None = 180.0,
          enable_docs: bool = False, tool_parser: str | None = None, grpc_port: int | None = None) -> int:
    """Serve until SIGTERM/SIGINT (exit 0 after draining) or an engine failure (exit 1).

    When the engine dies (a step raised, or ran past `step_timeout_s`) its in-flight
    requests get an error, the server drains them and the process exits 1, so that a
    supervisor restarts it. With `grpc_port`, the gRPC API (server.grpc_server) runs in the
    same event loop on that port; on shutdown it drains after HTTP, before the engine stops.
    """
    import uvicorn

    server: uvicorn.Server | None = None
    failed = threading.Event()

    def on_dead(error: BaseException) -> None:
        logger.error("the engine died (%s); shutting the server down", error)
        failed.set()
        if server is not None:
            server.should_exit = True

    engine = AsyncEngine.from_config(config, max_num_queued_requests=max_num_queued_requests,
                                     step_timeout_s=step_timeout_s, on_dead=on_dead)
    app = create_app(engine, served_model_name=config.served_model_name, api_key=api_key,
                     max_request_body_bytes=max_request_body_bytes, limits=limits, enable_docs=enable_docs,
                     tool_parser=tool_parser)
    if grpc_port is not None:
        from server.grpc_server import run_with_app

        run_with_app(app, engine, grpc_port, host=host, served_model_name=config.served_model_name, limits=limits)
    logger.info("serving %s on http://%s:%d", config.served_model_name or engine.model_name, host, port)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                           timeout_graceful_shutdown=30))
    # uvicorn handles SIGTERM (stop accepting, drain in-flight requests up to the timeout, run the
    # lifespan shutdown that stops the engine), then re-raises it to the handler that was there
    # before; a no-op one lets the process exit 0 after that clean shutdown.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    if failed.is_set():
        return 1
    try:
        server.run()
    finally:
        if not server.started:   # the app's start-up failed (the gRPC port could not be bound)
            engine.shutdown()
        if engine.loop_alive:   # a step still running (hung): its thread can never be joined
            logger.error("the engine thread is still inside a step; exiting without it")
            logging.shutdown()
            os._exit(1)
    return 1 if failed.is_set() or not server.started else 0
