"""The synchronous engine: requests in, one scheduler + runner step at a time, outputs out.

Single-threaded: whoever owns an LLMEngine calls add_request / step / abort_request from
one thread (the AsyncEngine runs it on its own loop thread). `step()` schedules, runs
the jitted step, applies stop checks, detokenizes incrementally and returns a
RequestOutput for every request that changed. `n > 1` becomes n sibling core requests
that share the prompt's KV blocks through the prefix cache.

With data_parallel_size > 1 the engine holds several replicas (scheduler + runner on its
own devices); each new request is routed to one (`_route`), and a step launches every
replica's work before collecting any. In a multi-process engine, process 0 runs this
loop and publishes each step's scheduler outputs; the others call `follow()`.
"""

from __future__ import annotations

import atexit
import dataclasses
import time
from collections.abc import Iterable

from jaxserve.config import EngineConfig
from jaxserve.core import EngineCoreOutput, Request, RequestStatus, SamplingParams
from jaxserve.engine.builder import Replica, build_engine_parts
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, logprobs_dict
from jaxserve.runner.inputs import MAX_BANNED
from sharding.distributed import STOP, StepChannel

PromptType = str | list[int] | dict


@dataclasses.dataclass
class _Sequence:
    """One of a request's n completions."""

    index: int
    core_id: str
    detok: IncrementalDetokenizer
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[_Sequence]
    metrics: RequestMetrics
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        parts = build_engine_parts(config)
        self.config = config
        self.model_name = parts.checkpoint_name
        self.model_config = parts.model_config
        self.tokenizer = parts.tokenizer
        self.replicas = parts.replicas
        # The first replica's scheduler and runner (the only ones unless data_parallel_size > 1).
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.startup_seconds = parts.startup_seconds
        self.max_model_len = self.scheduler.config.max_model_len
        self._requests: dict[str, _RequestState] = {}
        self._core_to_seq: dict[str, tuple[_RequestState, _Sequence]] = {}
        self._replica_of: dict[str, Replica] = {}       # core request id -> the replica running it
        # Multi-process: the leader (process 0) publishes each step's scheduler output before
        # launching it; followers run `follow()` and launch the same steps.
        self.is_leader = config.process_id == 0
        self._channel = StepChannel() if config.num_processes > 1 else None
        if self._channel is not None and self.is_leader:
            atexit.register(self.shutdown)
        self.num_prompt_tokens_total = 0      # prompt tokens computed (not served from the cache)
        self.num_generation_tokens_total = 0

    @classmethod
    def from_kwargs(cls, model=None, **kwargs) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(model, **kwargs))

    # ---- requests ------------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text, token ids, or {"prompt" | "prompt_token_ids": ...}."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                return (text if isinstance(text, str) else None), self.tokenize_prompt(prompt["prompt_token_ids"])[1]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, *,
                    arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {vocab})")
        params = self._check_params(params, vocab)
        if priority != 0 and self.scheduler.config.policy != "priority":
            raise ValueError(f"priority={priority} needs --scheduling-policy priority (the engine runs "
                             f"{self.scheduler.config.policy!r})")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        state = _RequestState(request_id, text, token_ids, params, [], RequestMetrics(arrival))
        eos = self.tokenizer.eos_token_ids
        replica = None
        for i in range(params.n):
            core_id = request_id if params.n == 1 else f"{i}_{request_id}"
            seq_params = params
            if params.n > 1 and params.seed is not None:
                seq_params = params.clone(seed=params.seed + i)   # distinct, reproducible siblings
            request = Request(core_id, token_ids, seq_params, eos_token_ids=eos, arrival_time=arrival,
                              priority=priority, cache_salt=cache_salt)
            replica = replica or self._route(request)      # siblings share the replica (and the prompt's blocks)
            try:
                replica.scheduler.add_request(request)
            except ValueError:
                self._finish_core([s.core_id for s in state.seqs], RequestStatus.FINISHED_ABORTED)
                raise
            self._replica_of[core_id] = replica
            seq = _Sequence(i, core_id, IncrementalDetokenizer(self.tokenizer, token_ids, params),
                            logprobs=[] if params.logprobs is not None else None,
                            cumulative_logprob=0.0 if params.logprobs is not None else None)
            state.seqs.append(seq)
        self._requests[request_id] = state
        for seq in state.seqs:
            self._core_to_seq[seq.core_id] = (state, seq)

    def _check_params(self, params: SamplingParams, vocab: int) -> SamplingParams:
        """Engine-dependent limits of SamplingParams (the vocabulary, max_logprobs, banned-id slots)."""
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} exceeds max_logprobs={self.config.max_logprobs}")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids={params.stop_token_ids!r} has id {bad[0]} outside the vocabulary "
                             f"[0, {vocab})")
        if params.min_tokens and len(params.stop_token_ids) + len(self.tokenizer.eos_token_ids) > MAX_BANNED:
            raise ValueError(f"with min_tokens, at most {MAX_BANNED - len(self.tokenizer.eos_token_ids)} "
                             f"stop_token_ids are supported, got {len(params.stop_token_ids)}")
        if params.top_k >= vocab:
            params = params.clone(top_k=0)   # keeping the whole vocabulary is no truncation at all
        return params

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Abort requests (unknown or finished ids are ignored); returns their final outputs."""
        outputs = []
        for request_id in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            state = self._requests.get(request_id)
            if state is None:
                continue
            for seq in state.seqs:
                if seq.finish_reason is None:
                    seq.finish_reason = "abort"
            self._finish_core([s.core_id for s in state.seqs], RequestStatus.FINISHED_ABORTED)
            outputs.append(self._finish(state))
        return outputs

    def abort_all(self) -> list[RequestOutput]:
        return self.abort_request(list(self._requests))

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---- one step --------------------------------------------------------------------

    def _route(self, request: Request) -> Replica:
        """The replica for a new request: the least loaded one, preferring one that holds its prefix.

        Among replicas within `max_num_seqs // 4` requests of the least loaded, the one with
        the longest cached prefix wins; ties go to the least loaded.
        """
        if len(self.replicas) == 1:
            return self.replicas[0]
        request.update_block_hashes(self.scheduler.config.block_size)   # what the prefix lookup reads
        loads = [r.scheduler.num_running + r.scheduler.num_waiting for r in self.replicas]
        slack = max(1, self.config.max_num_seqs // 4)
        candidates = [i for i, load in enumerate(loads) if load <= min(loads) + slack]
        hits = {i: self.replicas[i].scheduler.kv.get_computed_blocks(request)[1] for i in candidates}
        return self.replicas[max(candidates, key=lambda i: (hits[i], -loads[i]))]

    def _finish_core(self, core_ids: list[str], status: RequestStatus) -> None:
        for core_id in core_ids:
            replica = self._replica_of.pop(core_id, None)
            if replica is not None:
                replica.scheduler.finish_requests([core_id], status)

    def step(self) -> list[RequestOutput]:
        now = time.monotonic()
        plans = [(replica, replica.scheduler.schedule()) for replica in self.replicas]
        for replica, so in plans:
            for req_id, n in so.num_scheduled_tokens.items():
                request = replica.scheduler.requests[req_id]
                before = request.num_computed_tokens - n        # schedule() already advanced it
                self.num_prompt_tokens_total += max(0, min(n, request.num_prompt_tokens - before))
            for new in so.scheduled_new_reqs:
                state, _ = self._core_to_seq[new.req_id]
                if state.metrics.first_scheduled_time is None:
                    state.metrics.first_scheduled_time = now
        if self._channel is not None:
            self._channel.publish([so for _, so in plans])
        # Every replica's step is dispatched before any result is awaited: replicas run together.
        launched = [(replica, so, replica.runner.launch(so)) for replica, so in plans]
        core_outputs = []
        for replica, so, handle in launched:
            core_outputs += replica.scheduler.update_from_output(so, replica.runner.collect(handle))
        now = time.monotonic()
        changed: dict[str, _RequestState] = {}
        for co in core_outputs:
            if co.finished:
                self._replica_of.pop(co.req_id, None)
            entry = self._core_to_seq.get(co.req_id)
            if entry is not None:
                self._apply(entry[0], entry[1], co, now)
                changed[entry[0].request_id] = entry[0]
        outputs = []
        for state in changed.values():
            outputs.append(self._finish(state) if state.finished else self._output(state))
        return outputs

    def follow(self) -> None:
        """A follower's loop: run the leader's steps until it shuts down (multi-process only)."""
        if self._channel is None or self.is_leader:
            raise RuntimeError("follow() is for processes other than 0 of a multi-process engine")
        while (message := self._channel.receive()) != STOP:
            for replica, so in zip(self.replicas, message):
                replica.runner.execute(so)

    def shutdown(self) -> None:
        """Release followers (multi-process leader); a no-op otherwise. Idempotent."""
        if self._channel is not None and self.is_leader:
            self._channel.publish(STOP)
            self._channel = None

    def _apply(self, state: _RequestState, seq: _Sequence, co: EngineCoreOutput, now: float) -> None:
        m = state.metrics
        if co.new_token_ids:
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            m.token_times.append(now)
            self.num_generation_tokens_total += len(co.new_token_ids)
        state.num_cached_tokens = max(state.num_cached_tokens, co.num_cached_tokens)
        seq.token_ids += co.new_token_ids
        if seq.logprobs is not None:
            for token_id, lp in zip(co.new_token_ids, co.new_logprobs):
                seq.logprobs.append(logprobs_dict(token_id, lp))
                seq.cumulative_logprob += lp.token_logprob
        new_ids = co.new_token_ids
        if co.finish_reason == "stop" and not state.params.include_stop_str_in_output:
            new_ids = new_ids[:-1]   # EOS or a stop token id: its text is not part of the output (as vLLM)
        stop = seq.detok.update(new_ids)
        if co.finished and stop is None:
            stop = seq.detok.flush()
        if stop is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop
            if not co.finished:
                self._finish_core([seq.core_id], RequestStatus.FINISHED_STOPPED)
        elif co.finished:
            seq.finish_reason, seq.stop_reason = co.finish_reason, co.stop_reason

    def _output(self, state: _RequestState) -> RequestOutput:
        outs = [CompletionOutput(index=s.index, text=s.detok.output_text(s.finish_reason is not None),
                                 token_ids=list(s.token_ids), cumulative_logprob=s.cumulative_logprob,
                                 logprobs=None if s.logprobs is None else list(s.logprobs),
                                 finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                for s in state.seqs]
        return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                             prompt_token_ids=state.prompt_token_ids, outputs=outs, finished=state.finished,
                             num_cached_tokens=state.num_cached_tokens, metrics=state.metrics)

    def _finish(self, state: _RequestState) -> RequestOutput:
        state.metrics.finished_time = time.monotonic()
        self._requests.pop(state.request_id, None)
        for seq in state.seqs:
            self._core_to_seq.pop(seq.core_id, None)
        return self._output(state)

    # ---- introspection ---------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Counters and gauges summed over the data-parallel replicas (kv_usage: their mean)."""
        schedulers = [r.scheduler for r in self.replicas]
        return {
            "num_running": sum(s.num_running for s in schedulers),
            "num_waiting": sum(s.num_waiting for s in schedulers),
            "kv_usage": sum(s.kv_usage for s in schedulers) / len(schedulers),
            "kv_free_blocks": sum(s.kv.pool.num_free_blocks for s in schedulers),
            "kv_total_blocks": sum(s.kv.num_usable_blocks for s in schedulers),
            "prefix_cache_queries": sum(s.kv.stats.queries for s in schedulers),
            "prefix_cache_hits": sum(s.kv.stats.hits for s in schedulers),
            "num_preemptions": sum(s.num_preemptions for s in schedulers),
            "compiles_after_warmup": sum(r.runner.compiles_after_warmup for r in self.replicas),
            "prompt_tokens": self.num_prompt_tokens_total,
            "generation_tokens": self.num_generation_tokens_total,
        }
