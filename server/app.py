"""The OpenAI-compatible HTTP app: `create_app(engine)` and `serve(config, ...)`.

Handlers run on uvicorn's event loop and reach the engine only through AsyncEngine's
public API (`generate`, `abort`, `is_healthy`, `stats`). Bodies are validated by
jaxserve.protocol; every error leaves in OpenAI's JSON error shape with its status.
Streaming responses are Server-Sent Events ending in `data: [DONE]`; a client that
disconnects stops the stream, which aborts its request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jaxserve.config import EngineConfig
from jaxserve.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream
from jaxserve.outputs import RequestOutput
from jaxserve.protocol import (ChatCompletionRequest, CompletionRequest, RequestError, chat_logprobs,
                               chat_response, completion_logprobs, completion_response, new_id, parse,
                               prepare, usage)
from server.limits import BodySizeLimit
from server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


def error_response(e: RequestError) -> JSONResponse:
    return JSONResponse(e.to_dict(), status_code=e.status)


def create_app(engine: AsyncEngine, *, served_model_name: str | None = None, api_key: str | None = None,
               max_request_body_bytes: int = 8 * 2**20) -> FastAPI:
    model_name = served_model_name or engine.model_name
    metrics = ServerMetrics(engine, model_name)

    @asynccontextmanager
    async def lifespan(app):
        yield
        engine.shutdown()   # uvicorn has stopped accepting and drained (or timed out) in-flight work

    app = FastAPI(title="jaxserve", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)
    app.state.engine, app.state.metrics = engine, metrics

    @app.middleware("http")
    async def auth_and_errors(request: Request, call_next):
        path = request.url.path
        if api_key and (path.startswith("/v1") or path in ("/tokenize", "/detokenize")):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return error_response(RequestError("invalid or missing API key", status=401,
                                                   type="authentication_error"))
        return await call_next(request)

    async def body_of(request: Request, model):
        req = parse(model, await _json(request))
        if getattr(req, "model", None) not in (None, model_name):
            raise RequestError(f"The model `{req.model}` does not exist.", status=404, param="model",
                               type="NotFoundError")
        return req

    def check_engine() -> None:
        if not engine.is_healthy:
            raise RequestError(f"the engine is not running ({engine.dead_error!r})", status=503,
                               type="service_unavailable")

    async def run_all(items, req) -> list[RequestStream]:
        """Admit every prompt of a request at once (they batch together); errors surface before streaming."""
        results = await asyncio.gather(
            *(engine.add_request(prompt, params, new_id("req"), priority=req.priority, cache_salt=req.cache_salt)
              for prompt, params in items), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for r in results:
                if isinstance(r, RequestStream):
                    r.close()
            if isinstance(errors[0], (ValueError, QueueFullError, EngineDeadError)):
                raise _as_request_error(errors[0]) from errors[0]
            raise errors[0]
        return results

    async def prepared(req):
        # Chat templates and tokenization of long prompts run off the event loop.
        return await asyncio.to_thread(prepare, req, engine.tokenizer, engine.max_model_len)

    @app.exception_handler(RequestError)
    async def _request_error(request, e: RequestError):
        return error_response(e)

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(RequestError(f"internal error: {e!r}", status=500, type="internal_error"))

    @app.get("/health")
    async def health():
        if engine.is_healthy:
            return Response(status_code=200)
        return error_response(RequestError("the engine is not running", status=503, type="service_unavailable"))

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "jaxserve", "root": engine.model_name,
                                            "max_model_len": engine.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _json(request)
        tok = engine.tokenizer
        if "messages" in body:
            try:
                text = tok.apply_chat_template(body["messages"],
                                               add_generation_prompt=body.get("add_generation_prompt", True))
            except ValueError as e:
                raise RequestError(str(e), param="messages") from e
            ids = tok.encode(text, add_special_tokens=False)
        elif isinstance(body.get("prompt"), str):
            ids = tok.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
        else:
            raise RequestError("give 'prompt' (a string) or 'messages'", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _json(request)
        ids = body.get("tokens")
        vocab = engine.engine.model_config.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise RequestError(f"tokens must be a list of token ids in [0, {vocab})", param="tokens")
        return {"prompt": engine.tokenizer.decode(ids)}

    async def admit(request: Request, model):
        """Validate the body, then queue every prompt of it on the engine."""
        req = await body_of(request, model)
        check_engine()
        items = await prepared(req)
        return req, items, await run_all(items, req)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, items, streams = await admit(request, CompletionRequest)
        if req.stream:
            return _sse(_completion_chunks(req, items, streams, model_name, engine.tokenizer, metrics))
        outputs = await _finals(request, streams, metrics)
        return completion_response(req, outputs, model_name, engine.tokenizer)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, _, streams = await admit(request, ChatCompletionRequest)
        if req.stream:
            return _sse(_chat_chunks(req, streams[0], model_name, engine.tokenizer, metrics))
        (output,) = await _finals(request, streams, metrics)
        return chat_response(req, output, model_name, engine.tokenizer)

    return app


async def _json(request: Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def _as_request_error(e: Exception) -> RequestError:
    if isinstance(e, (QueueFullError, EngineDeadError)):
        return RequestError(str(e), status=503, type="service_unavailable")
    return RequestError(str(e))


async def _finals(request: Request, streams, metrics: ServerMetrics) -> list[RequestOutput]:
    """The final output of each stream; a client that goes away aborts them all."""
    async def last(stream):
        out = None
        async for out in stream:
            pass
        metrics.observe(out.metrics)
        return out
    gathered = asyncio.gather(*(last(s) for s in streams))
    try:
        while True:
            done, _ = await asyncio.wait({gathered}, timeout=0.5)
            if done:
                return gathered.result()
            if await request.is_disconnected():
                raise asyncio.CancelledError("client disconnected")
    except (EngineDeadError, QueueFullError, ValueError) as e:
        raise _as_request_error(e) from e
    finally:
        if not gathered.done():
            gathered.cancel()
        for s in streams:
            s.close()


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except (EngineDeadError, ValueError) as e:
            err = _as_request_error(e)
            yield f"data: {json.dumps(err.to_dict())}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _merge(streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as they produce: (stream index, output)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        try:
            async for out in s:
                await queue.put((i, out, None))
        except Exception as e:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, None, e))
            return
        await queue.put((i, None, None))
    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            s.close()


async def _completion_chunks(req: CompletionRequest, items, streams, model: str, tokenizer,
                             metrics: ServerMetrics) -> AsyncIterator[dict]:
    cid, created = new_id("cmpl"), int(time.time())
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    totals = {"prompt": 0, "completion": 0, "cached": 0}
    seen_prompt = set()

    def chunk(choices, usage_=None):
        c = {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices}
        if req.stream_options and req.stream_options.include_usage:
            c["usage"] = usage_
        return c

    async for i, out in _merge(streams):
        if i not in seen_prompt:
            seen_prompt.add(i)
            totals["prompt"] += len(out.prompt_token_ids)
        for c in out.outputs:
            index = i * req.n + c.index
            start, ntok = sent_text.get(index), sent_tokens.get(index, 0)
            prefix = ""
            if start is None:
                start = 0
                if req.echo:
                    prefix = out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)
            delta = prefix + c.text[start:]
            new_tokens = c.token_ids[ntok:]
            if not delta and not new_tokens and c.finish_reason is None:
                continue
            sent_text[index], sent_tokens[index] = len(c.text), len(c.token_ids)
            lp = None
            if req.logprobs is not None:
                part = type(c)(index=c.index, text="", token_ids=new_tokens,
                               logprobs=(c.logprobs or [])[ntok:])
                lp = completion_logprobs(tokenizer, part)
            if c.finish_reason is not None:
                totals["completion"] += len(c.token_ids)
            yield chunk([{"index": index, "text": delta, "logprobs": lp, "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason}])
        if out.finished:
            totals["cached"] += out.num_cached_tokens
            metrics.observe(out.metrics)
    if req.stream_options and req.stream_options.include_usage:
        yield chunk([], usage(totals["prompt"], totals["completion"], totals["cached"]))


async def _chat_chunks(req: ChatCompletionRequest, stream, model: str, tokenizer,
                       metrics: ServerMetrics) -> AsyncIterator[dict]:
    cid, created = new_id("chatcmpl"), int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(choices, usage_=None):
        c = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
        if include_usage:
            c["usage"] = usage_
        return c

    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    last = None
    try:
        for index in range(req.n):
            yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        async for out in stream:
            last = out
            for c in out.outputs:
                start, ntok = sent_text.get(c.index, 0), sent_tokens.get(c.index, 0)
                delta, new_tokens = c.text[start:], c.token_ids[ntok:]
                if not delta and not new_tokens and c.finish_reason is None:
                    continue
                sent_text[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                lp = chat_logprobs(tokenizer, new_tokens, (c.logprobs or [])[ntok:], req.top_logprobs or 0) \
                    if req.logprobs else None
                yield chunk([{"index": c.index, "delta": {"content": delta} if delta else {}, "logprobs": lp,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}])
    finally:
        stream.close()   # a client that went away aborts the request
    if last is not None:
        metrics.observe(last.metrics)
        if include_usage:
            completion = sum(len(c.token_ids) for c in last.outputs)
            yield chunk([], usage(len(last.prompt_token_ids), completion, last.num_cached_tokens))


def serve(config: EngineConfig, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_num_queued_requests: int | None = None, max_request_body_bytes: int = 8 * 2**20) -> int:
    import uvicorn

    engine = AsyncEngine.from_config(config, max_num_queued_requests=max_num_queued_requests)
    app = create_app(engine, served_model_name=config.served_model_name, api_key=api_key,
                     max_request_body_bytes=max_request_body_bytes)
    logger.info("serving %s on http://%s:%d", config.served_model_name or engine.model_name, host, port)
    # uvicorn handles SIGTERM (stop accepting, drain in-flight requests up to the timeout, run the
    # lifespan shutdown that stops the engine), then re-raises it to the handler that was there
    # before; a no-op one lets the process exit 0 after that clean shutdown.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=30)
    return 0
