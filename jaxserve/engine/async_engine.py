"""AsyncEngine: the LLMEngine stepping on its own thread, consumed from asyncio.

Threads: one engine thread owns the LLMEngine and steps while work exists, sleeping on a
command queue when idle; callers live on an asyncio event loop. Adds and aborts cross
to the engine thread through the command queue and are applied between steps; outputs
cross back through `loop.call_soon_threadsafe` into one asyncio.Queue per request. A
consumer that stops iterating (cancelled, disconnected) aborts its request, freeing its
blocks. An exception in a step fails every in-flight request with that error and marks
the engine dead (unhealthy); nothing hangs. A watchdog thread does the same when one step
runs longer than `step_timeout_s` (a hung device, or a dead multi-host follower inside a
collective): the stuck thread cannot be recovered, so the engine is declared dead and
`on_dead` (the server's exit) is called. A request that fails on its own (processing its
output or its grammar raised, or its constraints left no token: its final output carries
`error`) ends only its stream, with RequestFailedError; the engine carries on. Queue limits count sequences (n x prompts).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from jaxserve.config import EngineConfig
from jaxserve.core import SamplingParams
from jaxserve.engine.llm_engine import LLMEngine, PromptType, bad_words_token_ids
from jaxserve.outputs import RequestOutput

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed or was shut down; no request can be served."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, max_num_queued_requests: int | None = None,
                 step_timeout_s: float | None = None, on_dead: Callable[[BaseException], None] | None = None) -> None:
        """`max_num_queued_requests`: sequences in flight at most (None: no limit).
        `step_timeout_s`: a step running longer kills the engine (None: wait forever).
        `on_dead(error)`: called once, from an engine-side thread, when the engine dies of an error."""
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.sampling_defaults = getattr(engine, "sampling_defaults", {})   # the model's (LLMEngine)
        self.max_num_queued_requests = max_num_queued_requests
        self.step_timeout_s = step_timeout_s
        self._on_dead = on_dead
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # request id -> (loop, queue, n, serial) of the stream reading it. An id is free again as
        # soon as its stream closes, while the engine may still hold the old request until its abort
        # is applied: `_live` (the engine thread's own) says which stream's request the engine holds
        # under each id, and outputs go to a stream only when their serials agree.
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, int, int]] = {}
        self._live: dict[str, int] = {}
        self._serials = itertools.count()
        self._num_seqs = 0                      # sum of n over _streams
        self._lock = threading.Lock()           # guards _streams, _num_seqs and _error
        self._error: BaseException | None = None
        self._stopping = False
        self.last_step_time = time.monotonic()
        self._step_started: float | None = None  # monotonic start of the step in progress
        self._thread = threading.Thread(target=self._loop, name="jaxserve-engine", daemon=True)
        self._thread.start()
        if step_timeout_s is not None:
            threading.Thread(target=self._watchdog, name="jaxserve-watchdog", daemon=True).start()

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> "AsyncEngine":
        return cls(LLMEngine(config), **kwargs)

    # ---- health ----------------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return self._thread.is_alive() and self._error is None and not self._stopping

    @property
    def dead_error(self) -> BaseException | None:
        return self._error

    @property
    def num_in_flight(self) -> int:
        """Requests someone is waiting for."""
        with self._lock:
            return len(self._streams)

    @property
    def num_sequences_in_flight(self) -> int:
        """Sequences (n per request) someone is waiting for: what --max-num-queued-requests counts."""
        with self._lock:
            return self._num_seqs

    @property
    def loop_alive(self) -> bool:
        """The engine thread is still running (after a step timeout: stuck in that step)."""
        return self._thread.is_alive()

    def stats(self) -> dict[str, float]:
        """The engine's stats, plus the requests someone waits for (`num_in_flight`) and the
        requests the engine tracks (`num_unfinished`): both 0 once every client is gone."""
        with self._lock:
            in_flight = len(self._streams)
        return {**self.engine.stats(), "num_in_flight": in_flight,
                "num_unfinished": self.engine.num_unfinished_requests}

    # ---- requests --------------------------------------------------------------------

    async def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                          request_id: str | None = None, **kwargs: Any) -> "RequestStream":
        """Queue a request and wait until the engine accepted it; returns its output stream.

        Raises ValueError for a bad request, QueueFullError past --max-num-queued-requests and
        EngineDeadError if the engine loop is dead. The caller must iterate the stream to its end
        or `aclose()` it (which aborts the request).
        """
        if not self.is_healthy:
            raise self._dead_error()
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        grammars = getattr(self.engine, "grammars", None)
        if params.structured_outputs is not None and grammars is not None:
            # Compiled (and checked) on a worker thread: the engine thread finds it in the cache.
            await asyncio.to_thread(grammars.compile, params.structured_outputs)
        tokenizer = getattr(self.engine, "tokenizer", None)
        if params.bad_words and tokenizer is not None:   # tokenized on a worker thread too
            seqs = await asyncio.to_thread(bad_words_token_ids, params.bad_words, tokenizer)
            params = params.clone(bad_words=None, bad_words_token_ids=(params.bad_words_token_ids or []) + seqs)
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, next(self._serials))
        accepted = loop.create_future()
        with self._lock:
            full = self._queue_full(params.n)
            if full is not None:
                raise full
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (loop, stream.queue, params.n, stream.serial)
            self._num_seqs += params.n
        self._commands.put(("add", request_id, prompt, params, kwargs, loop, accepted, stream.serial))
        if self._error is not None and not accepted.done():  # died after the check above
            accepted.set_exception(self._dead_error())
        try:
            stream.num_prompt_tokens = await accepted
        except BaseException:
            stream.close(abort=True)
            raise
        return stream

    def check_room(self, num_sequences: int) -> None:
        """Raise unless `num_sequences` more fit under --max-num-queued-requests now: ValueError if
        they never could, QueueFullError if they must wait for others to finish. A request of
        several prompts checks its whole size here before adding any of them."""
        limit = self.max_num_queued_requests
        if limit is not None and num_sequences > limit:
            raise ValueError(f"the request asks for {num_sequences} sequences (n x prompts); the server queues "
                             f"at most {limit} (--max-num-queued-requests)")
        with self._lock:
            full = self._queue_full(num_sequences)
        if full is not None:
            raise full

    def _queue_full(self, num_sequences: int) -> QueueFullError | None:
        """The error if `num_sequences` more would pass the limit (the caller holds the lock)."""
        limit = self.max_num_queued_requests
        if limit is None or self._num_seqs + num_sequences <= limit:
            return None
        return QueueFullError(f"the engine has {self._num_seqs} sequences in flight and this request adds "
                              f"{num_sequences}; the limit (--max-num-queued-requests) is {limit}")

    async def generate(self, prompt: PromptType, params: SamplingParams | None = None,
                       request_id: str | None = None, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        """Yield cumulative RequestOutputs of one request until it finishes; stopping early aborts it."""
        stream = await self.add_request(prompt, params, request_id, **kwargs)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close(abort=True)

    def _forget(self, request_id: str, serial: int) -> None:
        with self._lock:
            entry = self._streams.get(request_id)
            if entry is not None and entry[3] == serial:
                del self._streams[request_id]
                self._num_seqs -= entry[2]

    def abort(self, request_id: str, serial: int | None = None) -> None:
        """Abort the request the engine holds under `request_id` (with `serial`: only if it is that
        stream's; a newer request reusing the id is left alone)."""
        self._commands.put(("abort", request_id, serial))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop: in-flight requests are aborted and their consumers get EngineDeadError."""
        self._stopping = True
        self._commands.put(("stop",))
        # A dead engine's thread may be stuck inside its last step: do not wait for it long.
        self._thread.join(timeout if self._error is None else min(timeout, 1.0))
        if not self._thread.is_alive():
            self.engine.shutdown()   # releases the followers of a multi-process engine

    # ---- the engine thread -----------------------------------------------------------

    def _loop(self) -> None:
        engine = self.engine
        try:
            while True:
                block = not engine.has_unfinished_requests()
                if not self._drain_commands(block):
                    break
                if engine.has_unfinished_requests():
                    self._step_started = time.monotonic()
                    outputs = engine.step()
                    self._step_started = None
                    self.last_step_time = time.monotonic()
                    if self._error is not None:
                        return   # the watchdog gave up on this step meanwhile
                    for out in outputs:
                        self._deliver(out.request_id, out)
        except BaseException as e:  # noqa: BLE001 - any failure must reach every waiting consumer
            logger.exception("engine step failed; failing %d in-flight requests", self.num_in_flight)
            self._die(e)
            return
        with self._lock:
            self._error = self._error or EngineDeadError("the engine was shut down")
        engine.abort_all()
        self._fail_all(self._error)

    def _dead_error(self) -> EngineDeadError:
        error = self._error
        if isinstance(error, EngineDeadError):
            return EngineDeadError(f"the engine is not running: {error}")
        return EngineDeadError("the engine is not running: " + str(_step_failed(error)) if error else
                               "the engine is not running")

    def _die(self, error: BaseException) -> None:
        """Record the engine's fatal error (the first one wins), fail every consumer, tell on_dead."""
        with self._lock:
            if self._error is not None:
                return
            self._error = error
        self._fail_all(error)
        if self._on_dead is not None:
            try:
                self._on_dead(error)
            except Exception:  # noqa: BLE001 - the callback must not hide the engine's own error
                logger.exception("on_dead callback failed")

    def _watchdog(self) -> None:
        """Declare the engine dead when one step runs past step_timeout_s."""
        timeout = self.step_timeout_s
        compile_clock = getattr(self.engine, "compile_clock", lambda: (False, 0.0))
        while self._thread.is_alive() and self._error is None:
            started = self._step_started
            compiling, compiled_at = compile_clock()    # compiles inside a step do not count
            if started is not None and not compiling and time.monotonic() - max(started, compiled_at) > timeout:
                logger.error("an engine step has run for more than %.1f s (--step-timeout-s); the engine is "
                             "declared dead", timeout)
                self._die(StepTimeoutError(f"an engine step made no progress for {timeout:g} s"))
                return
            time.sleep(min(1.0, timeout / 10))

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued adds/aborts; returns False on stop."""
        while True:
            try:
                cmd = self._commands.get(block=block, timeout=None if block else 0)
            except queue.Empty:
                return True
            block = False
            kind = cmd[0]
            if kind == "stop":
                return False
            if kind == "abort":
                _, request_id, serial = cmd
                if serial in (None, self._live.get(request_id)):
                    self._abort_live(request_id)
                continue   # else never added, already ended, or the id now names a newer request
            _, request_id, prompt, params, kwargs, loop, accepted, serial = cmd
            with self._lock:
                entry = self._streams.get(request_id)
            if entry is None or entry[3] != serial:
                _resolve(loop, accepted, None)   # the consumer already gave up
                continue
            if request_id in self._live:
                # The id's last stream closed, and its abort is queued behind this add (the two
                # streams' threads raced): nobody reads that request any more, so it ends now.
                self._abort_live(request_id)
            try:
                num_prompt_tokens = self.engine.add_request(request_id, prompt, params, **kwargs)
            except Exception as e:  # noqa: BLE001 - a bad request fails only itself
                _resolve(loop, accepted, e)
            else:
                self._live[request_id] = serial
                _resolve(loop, accepted, None, num_prompt_tokens)

    def _abort_live(self, request_id: str) -> None:
        """Abort the request the engine holds under `request_id`; a stream still reading it (abort()
        by id) ends with its final "abort" output."""
        for out in self.engine.abort_request(request_id):
            self._deliver(out.request_id, out)
        self._live.pop(request_id, None)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        """Hand `item` to the stream of the request the engine holds under `request_id` (an error
        from _fail_all: to whichever stream reads the id)."""
        if isinstance(item, RequestOutput):
            serial = self._live.get(request_id)
            if item.finished:
                self._live.pop(request_id, None)   # the engine has let go of it
        with self._lock:
            entry = self._streams.get(request_id)
        if entry is not None and (not isinstance(item, RequestOutput) or entry[3] == serial):
            loop, stream, _, _ = entry
            try:
                loop.call_soon_threadsafe(stream.put_nowait, item)
            except RuntimeError:
                pass  # the consumer's loop is closed

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            ids = list(self._streams)
        dead = error if isinstance(error, EngineDeadError) else _step_failed(error)
        dead.__cause__ = None if error is dead else error
        for request_id in ids:
            self._deliver(request_id, dead)
        # Commands that arrive later are refused by is_healthy; fail any adds already queued.
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                _resolve(cmd[5], cmd[6], dead)


def _step_failed(error: BaseException) -> EngineDeadError:
    # What clients see: the error's type only; its message and traceback are in the server log.
    return EngineDeadError(f"the engine step failed ({type(error).__name__}; details in the server log)")


class RequestFailedError(RuntimeError):
    """One request failed on its own (its output or grammar raised, or its constraints left no token:
    `output.error_status` 400); the engine carries on."""

    def __init__(self, output: RequestOutput) -> None:
        super().__init__(f"request {output.request_id} failed: {output.error}")
        self.output = output


class QueueFullError(RuntimeError):
    """Too many sequences in flight (--max-num-queued-requests)."""


class StepTimeoutError(EngineDeadError):
    """One engine step ran past --step-timeout-s."""


class RequestStream:
    """Outputs of one accepted request, in order; closing it before the end aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str, serial: int) -> None:
        self.engine, self.request_id, self.serial = engine, request_id, serial
        self.num_prompt_tokens: int | None = None   # known once accepted (before any output)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self._closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            self.close(abort=False)
            raise item
        if item.error is not None:
            self.finished = True
            self.close(abort=False)
            raise RequestFailedError(item)
        if item.finished:
            self.finished = True
            self.close(abort=False)
        return item

    def close(self, abort: bool = True) -> None:
        """Stop listening; aborts the request unless it already finished. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.engine._forget(self.request_id, self.serial)
        if abort and not self.finished:
            self.engine.abort(self.request_id, self.serial)

    async def aclose(self) -> None:
        self.close(abort=True)


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, error: BaseException | None,
             result: Any = None) -> None:
    def set_result():
        if not fut.done():
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)
    try:
        loop.call_soon_threadsafe(set_result)
    except RuntimeError:
        pass
