"""The synchronous engine: requests in, one scheduler + runner step at a time, outputs out.

Single-threaded: whoever owns an LLMEngine calls add_request / step / abort_request from
one thread (the AsyncEngine runs it on its own loop thread). `step()` schedules, runs
the jitted step and hands the token diffs to the OutputProcessor (detokenization, stop
strings, n > 1), which returns the RequestOutputs due (jaxserve.engine.output_processor).
`n > 1` becomes n sibling core requests that share the prompt's KV blocks through the
prefix cache.

With data_parallel_size > 1 the engine holds several replicas (scheduler + runner on its
own devices); each new request is routed to one (jaxserve.engine.routing), and a step launches every
replica's work before collecting any. In a multi-process engine, process 0 runs this
loop and publishes each step's scheduler outputs; the others call `follow()`.

Disaggregated prefill/decode (`kv_role`): a producer gathers each finished "produce"
request's full prompt blocks into its `exports` (a host copy under a lease) right after
the step that finished it, before any later step can reuse the blocks, and puts the
transfer's parameters on the request's final output. A consumer's "consume" requests are
parked by the scheduler while `kv_connector` pulls the blocks; each step first writes the
pulls that landed into the pool (engine thread only) and lets their requests continue.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Iterable
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import EngineConfig
from jaxserve.core import Request, RequestStatus, SamplingParams, SchedulerOutput
from jaxserve.core.kv_transfer import ExportRegistry, IncompatibleKVError, KVTransferParams, KVTransferStats
from jaxserve.engine.builder import Replica, build_engine_parts
from jaxserve.engine.kv_connector import KVConnector, PullResult
from jaxserve.engine.structured_output import GrammarCompiler
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.routing import route
from jaxserve.engine.weights import checked_update, flat_params
from jaxserve.outputs import RequestOutput
from jaxserve.core.sampling_params import truncated_length
from jaxserve.runner.inputs import MAX_BANNED
from sharding import replicate_kv_heads
from sharding.distributed import STOP, StepChannel

PromptType = str | list[int] | dict

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, params: Any = None) -> None:
        """`params`: weights the caller already holds (jaxserve.engine.weights lists the forms),
        used instead of the checkpoint's; `config.model` still gives the config and tokenizer."""
        parts = build_engine_parts(config, params)
        self._checkpoint_model_config = parts.checkpoint_model_config
        self._kv_head_replicas = parts.kv_head_replicas
        self.sleep_level = 0                  # 0 awake; 1 KV pool released; 2 weights offloaded too
        self.config = parts.config           # with "auto" choices resolved (dtype)
        self.model_name = parts.checkpoint_name
        self.model_config = parts.model_config
        self.tokenizer = parts.tokenizer
        # The model's sampling defaults for the fields a request leaves out (--generation-config auto):
        # SamplingParams keyword arguments; empty when the model sets none.
        self.sampling_defaults = parts.sampling_defaults
        self.replicas = parts.replicas
        # The first replica's scheduler and runner (the only ones unless data_parallel_size > 1).
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.startup_seconds = parts.startup_seconds
        self.max_model_len = self.scheduler.config.max_model_len
        self.output_processor = OutputProcessor(self.tokenizer)
        self._replica_of: dict[str, Replica] = {}       # core request id -> the replica running it
        # Multi-process: the leader (process 0) publishes each step's scheduler output before
        # launching it; followers run `follow()` and launch the same steps.
        self.is_leader = config.process_id == 0
        self._channel = StepChannel() if config.num_processes > 1 else None
        if self._channel is not None and self.is_leader:
            atexit.register(self.shutdown)
        self.num_prompt_tokens_total = 0      # prompt tokens computed (not served from the cache)
        self.num_generation_tokens_total = 0
        self._in_flight: list | None = None   # async scheduling: the launched step not yet collected
        self.async_scheduling = self.config.async_scheduling   # may be switched between steps
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        self.kv_role = self.config.kv_role
        self.compat_hash = compat_hash(self._checkpoint_model_config, self.model_name, self.config)
        self.kv_stats = KVTransferStats()
        self.exports: ExportRegistry | None = None
        self.kv_connector: KVConnector | None = None
        if self.kv_role is not None:
            self._start_kv_role()

    def _start_kv_role(self) -> None:
        if self._channel is not None:
            raise ValueError(f"--kv-role {self.kv_role} is for single-process engines (this one spans "
                             f"{self.config.num_processes} processes)")
        if self.kv_role == "producer":
            self.exports = ExportRegistry(self.config.kv_lease_seconds, stats=self.kv_stats)
        else:
            self.kv_connector = KVConnector(self.compat_hash)
            atexit.register(self.kv_connector.close)
        t0 = time.perf_counter()
        for replica in self.replicas:
            replica.runner.warmup_kv_transfer("gather" if self.kv_role == "producer" else "write")
        logger.info("kv role %s: block %s compiled in %.1f s; compat hash %s", self.kv_role,
                    "gathers" if self.kv_role == "producer" else "writes", time.perf_counter() - t0, self.compat_hash)

    @classmethod
    def from_kwargs(cls, model=None, params: Any = None, **kwargs) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(model, **kwargs), params=params)

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
                    arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                    kv_transfer: KVTransferParams | None = None) -> int:
        """Returns the number of prompt tokens the request runs with (after `truncate_prompt_tokens`).
        `kv_transfer`: role "produce" on a producer (export the prompt's blocks when it finishes;
        n must be 1) or "consume" on a consumer (pull them from the producer first)."""
        if self.sleep_level:
            raise RuntimeError("the engine is asleep (sleep() released its memory): call wake_up() first")
        params = params or SamplingParams(**self.sampling_defaults)
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        keep = truncated_length(params.truncate_prompt_tokens, self.max_model_len)
        if keep is not None and len(token_ids) > keep:
            text, token_ids = None, self.tokenizer.truncate_left(text, token_ids, keep)
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {vocab})")
        if params.bad_words:
            params = params.clone(bad_words_token_ids=(params.bad_words_token_ids or [])
                                  + bad_words_token_ids(params.bad_words, self.tokenizer))
        params = self._check_params(params, vocab)
        if priority != 0 and self.scheduler.config.policy != "priority":
            raise ValueError(f"priority={priority} needs --scheduling-policy priority (the engine runs "
                             f"{self.scheduler.config.policy!r})")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if kv_transfer is not None and kv_transfer.role is None:
            kv_transfer = None
        if kv_transfer is not None:
            self._check_kv_transfer(kv_transfer, params)
        if params.structured_outputs is not None:
            if self._channel is not None:
                raise ValueError("structured outputs are not supported on multi-process engines yet")
            self.grammars.compile(params.structured_outputs)    # a bad schema fails here, before any sequence
        eos = self.tokenizer.eos_token_ids
        wanted = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        taken = [c for c in wanted if c in self._replica_of or self.output_processor.request_of(c) is not None]
        if taken:
            raise ValueError(f"request id {request_id!r} clashes with the running sequence {taken[0]!r}")
        replica, core_ids = None, []
        for i, core_id in enumerate(wanted):
            seq_params = params
            if params.n > 1 and params.seed is not None:
                # distinct, reproducible siblings (wrapping in int64: a seed of 2**63 - 1 has siblings too)
                seq_params = params.clone(seed=(params.seed + i + 2**63) % 2**64 - 2**63)
            # One sibling pulls the prompt's blocks; the others wait for it and share them.
            request = Request(core_id, token_ids, seq_params, eos_token_ids=eos,
                              eos_token_id=self.tokenizer.eos_token_id, arrival_time=arrival,
                              priority=priority, cache_salt=cache_salt, kv_transfer=kv_transfer if i == 0 else None,
                              wait_for=core_ids[0] if i and kv_transfer is not None else None)
            if i == 0 and kv_transfer is not None and kv_transfer.role == "consume":
                self._check_same_prompt(request, kv_transfer)
            if params.structured_outputs is not None:
                request.grammar = self.grammars.grammar(params.structured_outputs)
            # Siblings share the replica (and the prompt's blocks).
            replica = replica or route(self.replicas, request, block_size=self.scheduler.config.block_size,
                                       max_num_seqs=self.config.max_num_seqs)
            try:
                replica.scheduler.add_request(request)
            except Exception:
                self._finish_core(core_ids, RequestStatus.FINISHED_ABORTED)
                raise
            self._replica_of[core_id] = replica
            core_ids.append(core_id)
            if request.kv_load_pending:
                self.kv_connector.watch(core_id, kv_transfer)   # renew the lease while it waits
        try:
            self.output_processor.add(request_id, text, token_ids, params, core_ids, arrival)
        except Exception:
            self._finish_core(core_ids, RequestStatus.FINISHED_ABORTED)
            raise
        return len(token_ids)

    def _check_kv_transfer(self, kv: KVTransferParams, params: SamplingParams) -> None:
        wanted = "producer" if kv.role == "produce" else "consumer"
        if self.kv_role != wanted:
            raise ValueError(f"kv transfer role {kv.role!r} needs an instance started with --kv-role {wanted} "
                             f"(this one: {self.kv_role or 'no kv role'})")
        if kv.role == "produce":
            if params.n != 1:
                raise ValueError(f"a request that produces KV for a transfer must have n=1, got n={params.n}")
            return
        if kv.compat_hash != self.compat_hash:
            raise IncompatibleKVError(
                f"the producer's KV blocks (compat hash {kv.compat_hash or 'none'}) cannot be used by this consumer "
                f"(compat hash {self.compat_hash}: {self.model_name}, dtype {self.config.dtype}, block size "
                f"{self.config.block_size}); run both with the same model, --dtype and --block-size")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs needs the prompt computed here: send it without kv transfer params")

    def _check_same_prompt(self, request: Request, kv: KVTransferParams) -> None:
        request.update_block_hashes(self.scheduler.config.block_size)
        n = min(kv.num_full_blocks, len(request.block_hashes))
        if request.block_hashes[:n] != list(kv.block_hashes[:n]):
            raise ValueError("the producer's KV blocks are of another prompt (their block hashes differ from this "
                             "request's): send the consumer the producer's prompt_token_ids and the same cache_salt")

    def _check_params(self, params: SamplingParams, vocab: int) -> SamplingParams:
        """Engine-dependent limits of SamplingParams (the vocabulary, max_logprobs, banned-id slots)."""
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} exceeds max_logprobs={self.config.max_logprobs}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > self.config.max_logprobs:
            raise ValueError(f"prompt_logprobs={params.prompt_logprobs} exceeds "
                             f"max_logprobs={self.config.max_logprobs}")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids={params.stop_token_ids!r} has id {bad[0]} outside the vocabulary "
                             f"[0, {vocab})")
        if params.allowed_token_ids and len(params.allowed_token_ids) > vocab:
            raise ValueError(f"allowed_token_ids has {len(params.allowed_token_ids)} ids, more than the vocabulary's "
                             f"{vocab} tokens")
        _check_in_vocabulary("logit_bias", list(params.logit_bias or ()), vocab)
        _check_in_vocabulary("allowed_token_ids", params.allowed_token_ids or [], vocab)
        _check_in_vocabulary("bad_words_token_ids", [t for w in params.bad_words_token_ids or () for t in w], vocab)
        if params.allowed_token_ids:     # what is plain before any step (the runner checks every row too)
            banned = {w[0] for w in params.bad_words_token_ids or () if len(w) == 1}
            if params.min_tokens:
                banned |= set(params.stop_token_ids) | set(() if params.ignore_eos else self.tokenizer.eos_token_ids)
            if banned.issuperset(params.allowed_token_ids):
                raise ValueError("no token can be sampled: one-token bad words and min_tokens' ban of EOS and the "
                                 "stop tokens ban every one of allowed_token_ids")
        num_eos = 0 if params.ignore_eos else len(self.tokenizer.eos_token_ids)   # EOS is banned too, unless ignored
        if params.min_tokens and len(params.stop_token_ids) + num_eos > MAX_BANNED:
            raise ValueError(f"with min_tokens, at most {MAX_BANNED - num_eos} stop_token_ids are supported, "
                             f"got {len(params.stop_token_ids)}")
        if params.top_k >= vocab:
            params = params.clone(top_k=0)   # keeping the whole vocabulary is no truncation at all
        return params

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Abort requests (unknown or finished ids are ignored); returns their final outputs."""
        outputs, now = [], time.monotonic()
        for request_id in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            core_ids = self.output_processor.core_ids(request_id)
            self._drop_kv_transfers(core_ids)
            self._finish_core(core_ids, RequestStatus.FINISHED_ABORTED)
            out = self.output_processor.abort(request_id, now)
            if out is not None:
                outputs.append(out)
        return outputs

    def abort_all(self) -> list[RequestOutput]:
        return self.abort_request(self.output_processor.request_ids)

    def has_unfinished_requests(self) -> bool:
        return len(self.output_processor) > 0

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.output_processor)

    def _drop_kv_transfers(self, core_ids: list[str]) -> None:
        """Release the exports that aborted consume requests will never pull."""
        if self.kv_connector is None:
            return
        for core_id in core_ids:
            replica = self._replica_of.get(core_id)
            request = replica.scheduler.requests.get(core_id) if replica is not None else None
            self.kv_connector.unwatch(core_id)
            if request is not None and request.kv_load_pending:
                self.kv_connector.release(request.kv_transfer)

    # ---- one step --------------------------------------------------------------------

    def _finish_core(self, core_ids: list[str], status: RequestStatus) -> None:
        for core_id in core_ids:
            replica = self._replica_of.pop(core_id, None)
            if replica is not None:
                replica.scheduler.finish_requests([core_id], status)

    def step(self) -> list[RequestOutput]:
        """Run one step and return the outputs it brings.

        With async scheduling the next step is scheduled and launched before this one's sampled
        tokens come back (it reads them on the device): the host's scheduling, input preparation
        and output processing overlap the device's work instead of following it. A request that
        stops on a token (EOS, a stop token or string) then has one more token computed and
        dropped. Steps run one by one (the next one is scheduled after this one's update) while a
        running request needs its last token on the host first: a grammar's bitmask, penalties'
        counts, bad words of two tokens or more, n-gram drafts; and with data parallelism, several
        processes or a KV role.
        """
        outputs = self._land_kv_pulls(self.kv_connector.done()) if self.kv_connector is not None else []
        launched, self._in_flight = self._in_flight, None
        if launched is None:
            plans = self._schedule()
            if self.kv_connector is not None:
                self._start_kv_pulls()
                if self.kv_connector.num_pending and all(
                        so.is_empty and not so.finished_req_ids and not so.preempted_req_ids for _, so in plans):
                    # Only pulls are in flight: wait for one instead of spinning. (A plan that names
                    # requests that ended is launched, empty: the runner forgets their state, and the
                    # scheduler names each of them once.)
                    return outputs + self._land_kv_pulls(self.kv_connector.done(timeout=0.05))
            launched = self._launch(plans)
        if self._can_overlap():
            # Launched even when empty: the runner learns which requests ended.
            following = self._launch(self._schedule(), prev=launched)
            if any(handle.outs is not None for *_, handle in following):
                self._in_flight = following
        return outputs + self._finish(launched)

    def _schedule(self) -> list[tuple[Replica, SchedulerOutput]]:
        now = time.monotonic()
        for replica in self.replicas:   # while larger buckets still compile in the background
            replica.scheduler.token_budget_cap = replica.runner.ready_budget
            replica.scheduler.step_buckets = replica.runner.ready_buckets
            replica.scheduler.step_fixed_tokens = replica.runner.step_fixed_tokens
        plans = [(replica, replica.scheduler.schedule()) for replica in self.replicas]
        for replica, so in plans:
            for req_id, n in so.num_scheduled_tokens.items():
                request = replica.scheduler.requests[req_id]
                before = request.num_computed_tokens - n        # schedule() already advanced it
                self.num_prompt_tokens_total += max(0, min(n, request.num_prompt_tokens - before))
            for new in so.scheduled_new_reqs:
                state = self.output_processor.request_of(new.req_id)
                if state is not None and state.metrics.first_scheduled_time is None:
                    state.metrics.first_scheduled_time = now
        return plans

    def _launch(self, plans, prev: list | None = None) -> list:
        """Dispatch every replica's step before any result is awaited: replicas run together.
        `prev`: the launched steps still in flight, whose sampled tokens these steps read."""
        if self._channel is not None:
            self._channel.publish([so for _, so in plans])
        before = {id(replica): handle for replica, _, handle in prev or ()}
        return [(replica, so, replica.runner.launch(so, _sampling_grammars(replica.scheduler, so),
                                                    before.get(id(replica))))
                for replica, so in plans]

    def _finish(self, launched: list) -> list[RequestOutput]:
        """Wait for launched steps; apply their tokens to the schedulers and make the outputs."""
        core_outputs = []
        for replica, so, handle in launched:
            core_outputs += replica.scheduler.update_from_output(so, replica.runner.collect(handle))
        for co in core_outputs:
            if co.finished:
                self._replica_of.pop(co.req_id, None)
            self.num_generation_tokens_total += len(co.new_token_ids)
        processed, stopped, failed = self.output_processor.process(core_outputs, time.monotonic())
        self._finish_core(stopped, RequestStatus.FINISHED_STOPPED)   # stop strings end them here
        if failed:   # requests whose output processing or grammar raised: they alone end, with an error
            self._drop_kv_transfers(failed)
            self._finish_core(failed, RequestStatus.FINISHED_ABORTED)
        if self.exports is not None:
            self._export_kv(processed, skip=set(failed))
        return processed

    def _can_overlap(self) -> bool:
        """May the next step be scheduled before the one in flight is collected?"""
        if (not self.async_scheduling or len(self.replicas) > 1 or self._channel is not None
                or self.kv_role is not None):
            return False
        scheduler = self.scheduler
        if scheduler.config.speculative is not None or not scheduler.has_unfinished_requests():
            return False
        return not any(r.grammar is not None or r.sampling_params.reads_output_tokens for r in scheduler.running)

    def _drain(self) -> None:
        """Collect a step still in flight whose requests have all ended (its tokens are dropped)."""
        launched, self._in_flight = self._in_flight, None
        if launched is not None:
            self._finish(launched)

    def _export_kv(self, outputs: list[RequestOutput], skip: set[str] = frozenset()) -> None:
        """Gather the blocks of the produce requests that just finished (before any later step reuses
        them) into host exports, and put the transfer on each one's final output. Those in `skip`
        (failed: no consumer will pull them) are dropped."""
        exported = {}
        for replica in self.replicas:
            for ex in replica.scheduler.take_kv_exports():
                if ex.request_id in skip:
                    continue
                n = len(ex.block_ids)
                if n:
                    payload = self._canonical(replica.runner.gather_blocks(ex.block_ids))
                    self.exports.add(ex.params.transfer_id, payload, self.config.dtype, n)
                    self.kv_stats.record("exported", payload.nbytes)
                exported[ex.request_id] = dataclasses.replace(
                    ex.params, num_full_blocks=n, block_hashes=ex.block_hashes, block_size=self.config.block_size,
                    compat_hash=self.compat_hash, lease_seconds=self.config.kv_lease_seconds)
        for out in outputs:
            if out.request_id in exported:
                out.kv_transfer_params = exported[out.request_id]
        self.exports.expire()

    def _canonical(self, blocks: np.ndarray) -> np.ndarray:
        """Pool blocks -> the transfer layout: the logical dtype (the CPU pool keeps bfloat16 as
        uint16 bits), each checkpoint KV head once (tp > KV heads repeats them in the pool)."""
        blocks = blocks.view(jnp.dtype(self.config.dtype))
        return np.ascontiguousarray(blocks[:, :, :, ::self._kv_head_replicas])

    def _pool_blocks(self, payload: np.ndarray, runner) -> np.ndarray:
        """The transfer layout -> this pool's blocks (the inverse of `_canonical`)."""
        if payload.dtype != jnp.dtype(self.config.dtype):
            raise ValueError(f"the producer sent {payload.dtype} blocks; this pool holds {self.config.dtype}")
        if self._kv_head_replicas > 1:
            payload = np.repeat(payload, self._kv_head_replicas, axis=3)
        return payload.view(runner.kv_dtype)

    def _start_kv_pulls(self) -> None:
        for replica in self.replicas:
            for load in replica.scheduler.take_kv_loads():
                if load.block_ids:
                    self.kv_connector.start(replica, load)
                else:   # the prefix cache held every block
                    self.kv_connector.unwatch(load.request_id)
                    self.kv_stats.record("not_needed")
                    if load.params.num_full_blocks:
                        self.kv_connector.release(load.params)

    def _land_kv_pulls(self, results: list[PullResult]) -> list[RequestOutput]:
        """Write landed pulls into the pool and let their requests go on; returns the outputs of
        requests a failed pull ended (--kv-load-failure-policy fail)."""
        outputs = []
        for r in results:
            scheduler, runner = r.replica.scheduler, r.replica.runner
            parked = scheduler.loading.get(r.load.request_id)
            if parked is None or parked.serial != r.load.serial:
                # aborted while its pull ran (its blocks may belong to another request now), perhaps
                # followed by a new request of the same id (a client's retry) with a pull of its own
                continue
            error = r.error
            if error is None:
                try:
                    runner.write_blocks(r.load.block_ids, self._pool_blocks(r.payload, runner))
                except ValueError as e:
                    error = str(e)
            self.kv_stats.record("received" if error is None else "failed", r.nbytes, r.seconds)
            if error is None:
                scheduler.finish_kv_load(r.load.request_id, ok=True)
                continue
            logger.warning("pulling the KV of request %s from %s failed (%s); %s", r.load.request_id,
                           r.load.params.producer_address, error,
                           "computing its prompt here" if self.config.kv_load_failure_policy == "recompute"
                           else "the request fails (--kv-load-failure-policy fail)")
            scheduler.finish_kv_load(r.load.request_id, ok=False)
            if self.config.kv_load_failure_policy == "fail":
                state = self.output_processor.request_of(r.load.request_id)
                if state is not None:
                    outputs += self.abort_request(state.request_id)
        return outputs

    def compile_clock(self) -> tuple[bool, float]:
        """(a compile inside the current step is running, monotonic end of the last one): a step
        watchdog does not count compile time (e.g. the prompt-logprobs step, compiled on first use)."""
        runners = [r.runner for r in self.replicas]
        return any(r.compiling for r in runners), max(r.last_compile_end for r in runners)

    def follow(self) -> None:
        """A follower's loop: run the leader's steps until it shuts down (multi-process only)."""
        if self._channel is None or self.is_leader:
            raise RuntimeError("follow() is for processes other than 0 of a multi-process engine")
        while (message := self._channel.receive()) != STOP:
            if len(message) != len(self.replicas):
                raise RuntimeError(f"the leader sent work for {len(message)} replicas; this process has "
                                   f"{len(self.replicas)} (every process must use the same --data-parallel-size)")
            for replica, so in zip(self.replicas, message):
                replica.runner.execute(so)

    def shutdown(self) -> None:
        """Release followers (multi-process leader); a no-op otherwise. Idempotent."""
        if self._channel is not None and self.is_leader:
            self._channel.publish(STOP)
            self._channel = None

    # ---- weights and memory between generations --------------------------------------

    def _require_idle(self, what: str) -> None:
        if self.has_unfinished_requests():
            raise RuntimeError(f"{what} needs an idle engine: {self.num_unfinished_requests} request(s) are in "
                               "flight; let them finish (step until has_unfinished_requests() is False) or abort them")
        if self._channel is not None:
            raise RuntimeError(f"{what} is for single-process engines")
        self._drain()

    def update_params(self, params: Any) -> None:
        """Serve new weights from the next step: all of the model's params or a subset (e.g. merged
        LoRA projections), in any form `LLMEngine(params=...)` takes, with the engine's shapes and
        dtypes. No step compiles again (the compiled steps take params as an argument). The prefix
        cache is emptied: its KV was computed by the old weights. Refused while requests are in
        flight; a refused update leaves the old weights serving. An engine that pre-packed its
        projections for AMX tiles (it loaded its weights itself; bf16 in the tiles' layout, float32
        as [N, K]) packs the new ones into its own copies (~80 ms for the default bf16 model; the
        first update compiles the packing per shape); other arrays already in place are served as
        they are, not copied."""
        self._require_idle("update_params")
        if self.sleep_level >= 2:
            raise RuntimeError("the weights are offloaded (sleep(level=2)): call wake_up() first")
        flat = flat_params(params, self._checkpoint_model_config)
        if self._kv_head_replicas > 1:   # the engine holds each KV head several times (tp > KV heads)
            flat = nnx.traversals.flatten_mapping(
                replicate_kv_heads(nnx.traversals.unflatten_mapping(flat), self._kv_head_replicas))
        # Every replica is checked before any is changed.
        placed = [checked_update(r.runner.param_specs(), dict(flat), cast=False) for r in self.replicas]
        for replica, arrays in zip(self.replicas, placed):
            replica.runner.replace_params(arrays)
            replica.scheduler.kv.reset_prefix_cache()

    def sleep(self, level: int = 1) -> int:
        """Release device memory between generations: level 1 frees the KV pool (its cached
        prefixes are forgotten), level 2 also moves the weights to host memory. Returns the bytes
        of KV pool freed. Refused while requests are in flight; `wake_up()` undoes it."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (KV pool) or 2 (KV pool and weights), got {level!r}")
        self._require_idle("sleep")
        freed = 0
        for replica in self.replicas:
            if self.sleep_level < 1:
                freed += replica.runner.release_kv_pool()
                replica.scheduler.kv.reset_prefix_cache()
            if level == 2 and self.sleep_level < 2:
                replica.runner.offload_params()
        self.sleep_level = max(self.sleep_level, level)
        return freed

    def wake_up(self) -> None:
        """Bring back what sleep() released, on the same shardings: nothing compiles again."""
        for replica in self.replicas:
            if self.sleep_level >= 2:
                replica.runner.reload_params()
            if self.sleep_level >= 1:
                replica.runner.restore_kv_pool()
        self.sleep_level = 0

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
            "num_waiting_for_kv": sum(len(s.loading) for s in schedulers),
            "spec_decode_num_drafts": sum(s.spec_stats.num_drafts for s in schedulers),
            "spec_decode_num_draft_tokens": sum(s.spec_stats.num_draft_tokens for s in schedulers),
            "spec_decode_num_accepted_tokens": sum(s.spec_stats.num_accepted_tokens for s in schedulers),
            "num_kv_exports": len(self.exports) if self.exports is not None else 0,
            "prompt_tokens": self.num_prompt_tokens_total,
            "generation_tokens": self.num_generation_tokens_total,
        }


def _check_in_vocabulary(name: str, ids: list[int], vocab: int) -> None:
    """A ValueError naming the first of `ids` past the vocabulary (looked for only when max() finds one:
    an allowed_token_ids list may hold the whole vocabulary)."""
    if ids and max(ids) >= vocab:
        bad = next(t for t in ids if t >= vocab)
        raise ValueError(f"{name} has token id {bad} outside the vocabulary [0, {vocab})")


def bad_words_token_ids(words: list[str], tokenizer) -> list[list[int]]:
    """The token sequences of bad words, as vLLM forms them: each word as it starts a text, and with
    a space before it when that tokenizes to as many tokens with another first one."""
    seqs = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            continue
        seqs.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if len(spaced) == len(plain) and spaced[0] != plain[0]:
            seqs.append(spaced)
    return seqs


def _sampling_grammars(scheduler, so) -> dict | None:
    """{request id: Grammar} of the structured-output requests that sample in this step."""
    grammars = {}
    for req_id in so.sampling_req_ids:
        request = scheduler.requests[req_id]
        if request.grammar is not None:
            grammars[req_id] = request.grammar
    return grammars or None


def compat_hash(model_config, model_name: str, config: EngineConfig) -> str:
    """Equal on two engines whose KV blocks are interchangeable: the same model (architecture and
    checkpoint name), KV dtype and block size. Tensor parallelism does not enter it: transfers
    use a layout independent of it."""
    fields = {k: v for k, v in dataclasses.asdict(model_config).items() if k != "attention_backend"}
    key = json.dumps({"model": fields, "name": model_name, "dtype": config.dtype, "block_size": config.block_size},
                     sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:16]
