"""Responses that own their engine requests: added when the response starts, aborted when
the client leaves, forwarded as OpenAI JSON or Server-Sent Events.

`EngineResponse` is an ASGI response. Its requests are added to the engine only once the
server starts sending it (a client gone before that adds nothing), and a task watching
for the client's disconnect cancels the work at any point (before the headers, while
waiting for a non-streaming result, mid-stream), which closes every stream and so aborts
its request and frees its KV blocks. An error before the headers is an ordinary JSON
error response; after them, a stream ends with an error event, and every stream ends
with `data: [DONE]`.

The chunk generators only forward the engine's DELTA outputs (each finished choice
arrives once) and keep the running counts that usage, `text_offset` and echo need. With a
tool parser, each chat choice's text goes through its own incremental parser
(jaxserve.tool_parsers), which sends content and whole tool calls as they close.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.responses import Response

from jaxserve.engine.async_engine import (AsyncEngine, EngineDeadError, QueueFullError, RequestFailedError,
                                          RequestStream)
from jaxserve.outputs import RequestOutput
from jaxserve.protocol import (ChatCompletionRequest, CompletionRequest, RequestError, chat_logprobs,
                               completion_logprobs, echo_text, end_offset, join_logprobs, new_id, param_of,
                               prompt_logprobs_json, prompt_only_finish, usage)
from jaxserve.tool_parsers import HermesStream, ToolParser, finish_reason
from server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

Produce = Callable[[list[RequestStream]], Awaitable[dict]]
ProduceChunks = Callable[[list[RequestStream]], AsyncIterator[dict]]


def as_request_error(e: BaseException, request_id: str | None = None, *, admitted: bool = False) -> RequestError:
    """The client-facing error of a failure; anything unexpected is an internal error.

    A ValueError is the client's fault only while its request is being admitted (the
    engine's checks); after that it is ours.
    """
    if isinstance(e, RequestError):
        return e
    if isinstance(e, RequestFailedError) and e.output.error_status == 400:   # its constraints left no token
        return RequestError(e.output.error)
    if isinstance(e, (QueueFullError, EngineDeadError)):
        return RequestError(str(e), status=503, type="service_unavailable")
    if isinstance(e, ValueError) and not admitted:
        return RequestError(str(e), param=param_of(str(e)))
    return internal_error(e, request_id)


def internal_error(e: BaseException, request_id: str | None = None) -> RequestError:
    """A 500 that tells the client only an id; the details go to the log under that id (a request
    that failed in the engine: its traceback is there already, under the engine's id)."""
    request_id = request_id or new_id("err")
    if isinstance(e, RequestFailedError):
        logger.error("internal error (request %s): %s", request_id, e)
    else:
        logger.error("internal error (request %s)", request_id, exc_info=e)
    return RequestError(f"internal error (request id {request_id})", status=500, type="internal_error")


def json_bytes(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode()


class EngineResponse(Response):
    """Adds `items` (prompt, params) to the engine when sent; `produce` turns their streams into the body.

    With `stream=True`, `produce` is an async generator of chunks sent as Server-Sent Events;
    otherwise an awaitable of one JSON object.
    """

    def __init__(self, engine: AsyncEngine, items: list[tuple[dict, object]], produce: Produce | ProduceChunks, *,
                 stream: bool, priority: int = 0, cache_salt: str | None = None) -> None:
        super().__init__(status_code=200)
        self.engine, self.items, self.produce, self.stream = engine, items, produce, stream
        self.priority, self.cache_salt = priority, cache_salt
        self.streams: list[RequestStream] = []
        self.request_id: str | None = None     # the RequestId middleware's, once called

    async def __call__(self, scope, receive, send) -> None:
        self.request_id = scope.get("state", {}).get("request_id")
        work = asyncio.ensure_future(self._run(send))
        watch = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            try:
                for task in (work, watch):
                    task.cancel()
                await asyncio.gather(work, watch, return_exceptions=True)
            finally:
                for s in self.streams:      # whatever happened: nothing stays in the engine
                    s.close()
        if work.done() and not work.cancelled() and work.exception() is not None:
            raise work.exception()      # before the headers: the app's error handlers answer

    async def _admit(self) -> list[RequestStream]:
        """Add every prompt (they batch together); returns their streams in prompt order.

        Every accepted stream is in self.streams at once, so that cancelling or failing
        the rest still closes it.
        """
        try:
            self.engine.check_room(sum(params.n for _, params in self.items))
        except QueueFullError as e:
            raise as_request_error(e) from e
        except ValueError as e:     # more sequences than the queue ever holds
            raise RequestError(str(e), param="n") from e

        async def add(prompt, params):
            stream = await self.engine.add_request(prompt, params, new_id("req"), priority=self.priority,
                                                   cache_salt=self.cache_salt)
            self.streams.append(stream)
            return stream
        results = await asyncio.gather(*(add(p, params) for p, params in self.items), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise as_request_error(r, self.request_id) from r
        return results

    async def _run(self, send) -> None:
        streams = await self._admit()
        if not self.stream:
            try:
                body = json_bytes(await self.produce(streams))
            except Exception as e:  # noqa: BLE001 - an engine that died is a 503, anything else ours
                raise as_request_error(e, self.request_id, admitted=True) from e
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache")]})
        try:
            async with contextlib.aclosing(self.produce(streams)) as chunks:
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": b"data: " + json_bytes(chunk) + b"\n\n",
                                "more_body": True})
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every stream ends with an error event and [DONE]
            err = as_request_error(e, self.request_id, admitted=True)
            await send({"type": "http.response.body", "body": b"data: " + json_bytes(err.to_dict()) + b"\n\n",
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def _wait_for_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


# ---- non-streaming ---------------------------------------------------------------------


async def finals(streams: list[RequestStream], metrics: ServerMetrics) -> list[RequestOutput]:
    """The one FINAL_ONLY output of each stream, in order."""
    async def last(stream):
        out = None
        async for out in stream:
            pass
        metrics.observe(out.metrics)
        return out
    tasks = [asyncio.ensure_future(last(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:   # one failed (or the client left): the others' waits end here, not at garbage collection
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---- streaming -------------------------------------------------------------------------


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as they produce: (stream index, output)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
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


class _Usage:
    """Running token counts of a streamed response."""

    def __init__(self) -> None:
        self.prompt, self.completion, self.cached = 0, 0, 0

    def json(self) -> dict:
        return usage(self.prompt, self.completion, self.cached)


def _running_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """A chunk's continuous usage: the counts so far (the cached tokens are known once the request ends)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _usage_flags(req) -> tuple[bool, bool]:
    """(a final usage chunk, usage in every chunk): vLLM's continuous usage needs include_usage too."""
    opts = req.stream_options
    include = bool(opts and opts.include_usage)
    return include, include and bool(opts.continuous_usage_stats)


async def completion_chunks(req: CompletionRequest, streams: list[RequestStream], model: str, tokenizer,
                            metrics: ServerMetrics) -> AsyncIterator[dict]:
    cid, created = new_id("cmpl"), int(time.time())
    include_usage, continuous = _usage_flags(req)
    counts = _Usage()
    offsets: dict[int, int] = {}                          # choice index -> text_offset of its next token
    pending_prompt_lps: dict[int, list] = {}              # prompt index -> prompt logprobs not yet echoed

    prompt_tokens: dict[int, int] = {}                    # prompt index -> its token count
    choice_tokens: dict[int, int] = {}                    # choice index -> its tokens so far

    def chunk(choices, i: int, index: int):
        c = {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices}
        if continuous:   # vLLM's: the chunk's own prompt and choice
            c["usage"] = _running_usage(prompt_tokens[i], choice_tokens[index])
        return c

    async with contextlib.aclosing(merge(streams)) as merged:
        async for i, out in merged:
            if i not in pending_prompt_lps:
                pending_prompt_lps[i] = []
                prompt_tokens[i] = len(out.prompt_token_ids)
                counts.prompt += len(out.prompt_token_ids)
            if out.prompt_logprobs:
                pending_prompt_lps[i] += out.prompt_logprobs
            for c in out.outputs:
                index = i * req.n + c.index
                token_ids, text = ([], "") if req.prompt_only else (c.token_ids, c.text)
                counts.completion += len(token_ids)
                choice_tokens[index] = choice_tokens.get(index, 0) + len(token_ids)
                prefix, lp, first = "", None, index not in offsets
                if first:
                    offsets[index] = 0
                    if req.echo:
                        prefix = echo_text(out, tokenizer)
                        if req.logprobs is not None:
                            lp = completion_logprobs(tokenizer, out.prompt_token_ids, pending_prompt_lps[i],
                                                     top_n=req.logprobs)
                            offsets[index] = end_offset(lp)
                if req.logprobs is not None:
                    new = completion_logprobs(tokenizer, token_ids, c.logprobs or [], offsets[index])
                    offsets[index] = end_offset(new) or offsets[index]
                    lp = new if lp is None else join_logprobs(lp, new)
                if req.prompt_only and not (first or c.finish_reason):
                    continue   # the one token run for it: nothing of it is sent
                choice = {"index": index, "text": prefix + text, "logprobs": lp,
                          "finish_reason": prompt_only_finish(c.finish_reason) if req.prompt_only else c.finish_reason,
                          "stop_reason": None if req.prompt_only else c.stop_reason}
                if first and req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(tokenizer, pending_prompt_lps[i],
                                                                     out.prompt_token_ids, req.prompt_logprobs)
                yield chunk([choice], i, index)
            if out.finished:
                counts.cached += out.num_cached_tokens
                metrics.observe(out.metrics)
    if include_usage:
        yield {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [],
               "usage": counts.json()}


async def chat_chunks(req: ChatCompletionRequest, streams: list[RequestStream], model: str, tokenizer,
                      metrics: ServerMetrics, tool_parser: ToolParser | None = None) -> AsyncIterator[dict]:
    (stream,) = streams
    cid, created = new_id("chatcmpl"), int(time.time())
    include_usage, continuous = _usage_flags(req)
    counts = _Usage()
    tool_parser = req.output_tool_parser(tool_parser)
    parsers: dict[int, HermesStream] | None = {} if tool_parser is not None else None  # by choice

    choice_tokens = [0] * req.n                           # each choice's tokens so far

    def chunk(choices):
        c = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
        if continuous:   # vLLM's: the prompt and the chunk's own choice (the role chunks count the prompt too)
            c["usage"] = _running_usage(counts.prompt, choice_tokens[choices[0]["index"]])
        return c

    counts.prompt = stream.num_prompt_tokens or 0
    for index in range(req.n):
        yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    if echoed := req.echoed():   # vLLM's order: every choice's role, then every choice's echo
        for index in range(req.n):
            yield chunk([{"index": index, "delta": {"content": echoed}, "logprobs": None, "finish_reason": None}])
    async for out in stream:
        counts.prompt = len(out.prompt_token_ids)
        for c in out.outputs:
            counts.completion += len(c.token_ids)
            choice_tokens[c.index] += len(c.token_ids)
            lp = chat_logprobs(tokenizer, c.token_ids, c.logprobs, req.top_logprobs or 0) if req.logprobs else None
            delta, reason = {"content": c.text} if c.text else {}, c.finish_reason
            if parsers is not None:
                if c.index not in parsers:
                    parsers[c.index] = tool_parser.stream()
                parser = parsers[c.index]
                parsed = parser.feed(c.text)
                if c.finish_reason is not None:
                    parsed += parser.finish()
                delta = parsed.json()
                reason = finish_reason(c.finish_reason, called=tool_parser.calls_finish and parser.num_calls > 0)
            yield chunk([{"index": c.index, "delta": delta, "logprobs": lp,
                          "finish_reason": reason, "stop_reason": c.stop_reason}])
        if out.finished:
            counts.cached = out.num_cached_tokens
            metrics.observe(out.metrics)
    if include_usage:
        yield {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
               "usage": counts.json()}
