"""The decode leg's answer as the engine's outputs: a consumer's Generate call (Chunk / Complete
messages) turned into the RequestOutputs and errors an AsyncEngine hands out, so that
create_app forwards them as it does a single server's.

Runs on the router's event loop (server.router); nothing here blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from jaxserve.core import Logprobs, RequestOutputKind, SamplingParams
from jaxserve.engine.async_engine import EngineDeadError, QueueFullError
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, logprobs_dict
from jaxserve.protocol import RequestError, param_of
from jaxserve.proto import jaxserve_pb2 as pb


def engine_error(e: grpc.aio.AioRpcError, instance) -> Exception:
    """What AsyncEngine raises for the same failure, so create_app answers as a single server does."""
    code = e.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        # The client's fault whenever it comes: at admission (a check) or mid-stream (the request's
        # own constraints left no token), where a plain ValueError would read as ours (a 500).
        return RequestError(e.details(), param=param_of(e.details()))
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return QueueFullError(e.details())
    if code == grpc.StatusCode.UNAVAILABLE:
        return EngineDeadError(e.details())
    return RuntimeError(f"{instance} failed: {code.name}: {e.details()}")   # a 500; the details are logged


async def read_message(call, consumer) -> pb.GenerateResponse:
    """The call's next message; a failure as the engine's error, naming `consumer` (the instance) when it is a 500."""
    try:
        msg = await call.read()
    except grpc.aio.AioRpcError as e:
        raise engine_error(e, consumer) from None
    if msg is grpc.aio.EOF:
        raise EngineDeadError(f"{consumer} ended the request's stream before it finished")
    return msg


class OutputAssembler:
    """A consumer's Chunk/Complete messages folded into one request's RequestOutputs, as the engine's
    OutputProcessor hands them out: DELTA, what each message adds (a choice's finish arrives once);
    FINAL_ONLY, the whole result once. Timing is measured here, as the router's client sees it."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 metrics: RequestMetrics, num_cached_tokens: int | None) -> None:
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.kind, self.metrics = params.output_kind, metrics
        logprobs = params.logprobs is not None
        self.seqs = [CompletionOutput(i, "", [], 0.0 if logprobs else None, [] if logprobs else None)
                     for i in range(params.n)]
        # The producer's prefix-cache hits when there was one (the consumer counts pulled tokens as cached).
        self.num_cached_tokens = num_cached_tokens or 0
        self.cached_by_producer = num_cached_tokens is not None
        self.num_finished = 0

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.seqs)

    def feed(self, msg: pb.GenerateResponse, now: float) -> RequestOutput | None:
        """The output due after `msg`, if any."""
        kind = msg.WhichOneof("response")
        delta = self._chunk(msg.chunk, now) if kind == "chunk" else self._complete(msg.complete, now)
        if self.kind == RequestOutputKind.DELTA:
            return self._output([delta])
        return self._output(self.seqs) if self.finished else None

    def _chunk(self, chunk: pb.Chunk, now: float) -> CompletionOutput:
        seq = self.seqs[chunk.index]
        seq.text += chunk.text
        seq.token_ids += chunk.token_ids
        if chunk.token_ids:
            m = self.metrics
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            m.token_times.append(now)
        logprobs = None
        if seq.logprobs is not None:
            logprobs = [_logprobs_dict(lp) for lp in chunk.logprobs]
            seq.logprobs += logprobs
            seq.cumulative_logprob += sum(lp.logprob for lp in chunk.logprobs)
        return CompletionOutput(chunk.index, chunk.text, list(chunk.token_ids), seq.cumulative_logprob, logprobs)

    def _complete(self, complete: pb.Complete, now: float) -> CompletionOutput:
        seq = self.seqs[complete.index]
        which = complete.WhichOneof("stop_reason")
        seq.finish_reason, seq.stop_reason = complete.finish_reason, getattr(complete, which) if which else None
        self.num_finished += 1
        if not self.cached_by_producer:
            self.num_cached_tokens = max(self.num_cached_tokens, complete.cached_tokens)
        if self.finished:
            self.metrics.finished_time = now
        return CompletionOutput(complete.index, "", [], seq.cumulative_logprob,
                                None if seq.logprobs is None else [], seq.finish_reason, seq.stop_reason)

    def _output(self, completions: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, self.finished,
                             num_cached_tokens=self.num_cached_tokens, metrics=self.metrics)


def _logprobs_dict(lp: pb.TokenLogprobs) -> dict[int, float]:
    """vLLM's per-token logprobs of a Chunk's entry, as the engine's output processor builds them."""
    return logprobs_dict(lp.token_id, Logprobs(lp.logprob, [t.token_id for t in lp.top], [t.logprob for t in lp.top]))


class RouterStream:
    """A consumer's Generate call as one request's RequestOutputs (AsyncEngine's RequestStream interface):
    closing it before the end cancels the call, which aborts the request on the consumer."""

    def __init__(self, call, consumer, outputs: OutputAssembler, first: pb.GenerateResponse,
                 on_close: Callable[["RouterStream"], None]) -> None:
        self.call, self.consumer, self.outputs = call, consumer, outputs
        self.num_prompt_tokens = len(outputs.prompt_token_ids)   # the ids the router sent to both legs
        self._pending = [first]
        self._on_close = on_close
        self.finished = False
        self._closed = False

    def __aiter__(self) -> "RouterStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while not self.finished:
            try:
                msg = self._pending.pop() if self._pending else await read_message(self.call, self.consumer)
                out = self.outputs.feed(msg, time.monotonic())
            except Exception:
                self.close()        # cancels the call if it is still open
                self.finished = True
                raise
            if out is not None:
                if out.finished:
                    self.finished = True
                    self.close(abort=False)
                return out
        raise StopAsyncIteration

    def close(self, abort: bool = True) -> None:
        """Stop listening; cancels the consumer's call unless the request already finished. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if abort and not self.finished:
            self.call.cancel()
        self._on_close(self)

    async def aclose(self) -> None:
        self.close(abort=True)
