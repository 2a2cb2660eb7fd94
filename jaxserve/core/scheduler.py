"""The scheduler: one token-budget rule over running and waiting requests.

Runs on the engine thread. Each step `schedule()` lets every running request catch up
(`num_tokens - num_computed_tokens`: one token for a decode, the next chunk for a
prefill) as far as the budget allows, then admits waiting requests after a prefix-cache
lookup. Mixed batches and chunked prefill fall out of that one rule. When blocks run
out, the newest (or lowest-priority) running request is preempted and recomputed
later. `update_from_output()` appends the sampled tokens and applies stop checks.

Disaggregated prefill/decode (jaxserve.core.kv_transfer): a consumer's request that carries
a producer's export is admitted by allocating blocks for the prompt blocks its own prefix
cache lacks, then parks in WAITING_FOR_REMOTE_KV (off the budget and the sequence cap)
until the engine reports the pull written (`finish_kv_load`); it then waits in `ready`,
holding its blocks, and is admitted before the waiting queue, as a prefix-cache hit. A
producer's finished request leaves a `KVExport` (its full prompt blocks) for the engine to
gather before the next step.
"""

from __future__ import annotations

import random

from jaxserve.core.config import SchedulerConfig
from jaxserve.core.kv_cache_manager import KVCacheManager, cdiv
from jaxserve.core.kv_transfer import KVExport, KVLoad, blocks_to_load
from jaxserve.core.outputs import (CachedRequestData, EngineCoreOutput, Logprobs, ModelRunnerOutput,
                                   NewRequestData, SchedulerOutput)
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.request_queue import make_queue
from jaxserve.core.speculative import NgramIndex, SpecDecodeStats


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        self.seeds: dict[str, int] = {}
        self.num_preemptions = 0
        self._finished_req_ids: set[str] = set()
        self._rng = random.Random()
        # A lower token budget while the runner still compiles its larger buckets (None: no cap).
        self.token_budget_cap: int | None = None
        # The token counts the runner pads a step to, and one step's cost beyond its tokens, in
        # tokens (None: never cut a prefill chunk to a bucket; see `_fit_bucket`). The engine sets them.
        self.step_buckets: tuple[int, ...] | None = None
        self.step_fixed_tokens: int | None = None
        self.loading: dict[str, Request] = {}       # WAITING_FOR_REMOTE_KV, by request id
        self.ready: list[Request] = []              # pulls ended; they hold their blocks and go first
        self.spec_stats = SpecDecodeStats()
        self._kv_loads: list[KVLoad] = []           # pulls to start (take_kv_loads)
        self._kv_exports: list[KVExport] = []       # finished producer requests (take_kv_exports)

    # ---- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; refuse one that could never fit, with the numbers."""
        cfg = self.config
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens >= cfg.max_model_len:
            raise ValueError(
                f"prompt of request {request.request_id!r} has {request.num_prompt_tokens} tokens, but the "
                f"maximum context length is {cfg.max_model_len} tokens (prompt + at least one generated token)")
        max_tokens = request.sampling_params.max_tokens or cfg.max_model_len
        max_len = min(request.num_prompt_tokens + max_tokens, cfg.max_model_len)
        blocks_needed = cdiv(max_len - 1, cfg.block_size)
        if blocks_needed > self.kv.num_usable_blocks:
            raise ValueError(
                f"request {request.request_id!r} needs up to {max_len} tokens = {blocks_needed} KV blocks of "
                f"{cfg.block_size}, but the pool has only {self.kv.num_usable_blocks} blocks")
        seed = request.sampling_params.seed
        self.seeds[request.request_id] = seed if seed is not None else self._rng.getrandbits(31)
        request.update_block_hashes(cfg.block_size)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string); unknown or finished ids are ignored."""
        assert status.is_finished
        for req_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                del self.loading[req_id]
            elif request in self.ready:
                self.ready.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)

    def abort(self, request_id: str) -> None:
        self.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or bool(self.loading) or bool(self.ready)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.ready)

    def _free(self, request: Request) -> None:
        kv = request.kv_transfer
        if (kv is not None and kv.role == "produce"
                and request.status not in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)
                and request.num_computed_tokens >= request.num_prompt_tokens):
            # The blocks stay intact until the next step allocates: the engine gathers them first.
            n = min(request.num_prompt_tokens // self.config.block_size, len(request.block_hashes))
            self._kv_exports.append(KVExport(request.request_id, kv, self.kv.get_block_ids(request.request_id)[:n],
                                             request.block_hashes[:n]))
        self.kv.free(request)
        self.requests.pop(request.request_id, None)
        self.seeds.pop(request.request_id, None)
        self._finished_req_ids.add(request.request_id)

    # ---- one step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens if self.token_budget_cap is None else \
            min(cfg.max_num_batched_tokens, self.token_budget_cap)
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: set[str] = set()
        spec_tokens: dict[str, list[int]] = {}

        spec = self.config.speculative
        speculate = spec is not None and (spec.disable_by_batch_size is None
                                          or len(self.running) < spec.disable_by_batch_size)
        # Running requests first: each catches up as far as the budget allows.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_pending and self._ends_with_pending(request):
                i += 1      # its last token is being sampled: the update ends it
                continue
            num_new = self._chunk(self._num_uncomputed(request), budget)
            if num_new > 1 and not self.ready and not len(self.waiting):
                # the step's last prefill (none waits, none runs after it): cut to a bucket? Each later
                # decode counts with the drafts it may add, so they cannot push the step past the cut.
                later = [self._num_uncomputed(r) for r in self.running[i + 1:]]
                if all(n <= 1 for n in later):
                    per_decode = 1 + (spec.num_speculative_tokens if speculate else 0)
                    num_new = self._fit_bucket(sum(num_scheduled.values()), num_new, per_decode * sum(later))
            if num_new == 0:
                i += 1
                continue
            drafts = self._drafts(request, budget) if num_new == 1 and speculate else []
            # Drafts only where they fit as they are: short of blocks, the request decodes plainly.
            new_block_ids = self.kv.allocate_slots(request, num_new + len(drafts)) if drafts else None
            if new_block_ids is not None:
                num_new += len(drafts)
                spec_tokens[request.request_id] = drafts
            else:
                while (new_block_ids := self.kv.allocate_slots(request, num_new)) is None:
                    victim = self._pick_victim(request)
                    if victim is None:
                        break   # every other request ends with a step in flight: its update frees blocks
                    j = self.running.index(victim)
                    self._preempt(victim)
                    preempted.add(victim.request_id)
                    if victim.request_id in num_scheduled:  # priority policy may pick an earlier one
                        budget += num_scheduled.pop(victim.request_id)
                        spec_tokens.pop(victim.request_id, None)
                        cached_reqs = [c for c in cached_reqs if c.req_id != victim.request_id]
                    if j < i:   # an earlier one (scheduled, or skipped this step): the list moved down
                        i -= 1
                    if victim is request:
                        break
            if request.request_id in preempted:
                continue
            if new_block_ids is None:   # it waits for the blocks those requests free
                i += 1
                continue
            num_scheduled[request.request_id] = num_new
            cached_reqs.append(CachedRequestData(request.request_id, new_block_ids, request.num_computed_tokens))
            budget -= num_new
            i += 1

        # Then requests whose KV pull ended (they hold their blocks), then waiting requests,
        # unless this step had to preempt.
        def admit(request: Request, computed_blocks, num_computed: int, last: bool) -> bool:
            """`last`: no other request waits to join the step (its chunk may be cut to a bucket)."""
            remaining = request.num_tokens - num_computed
            if not cfg.enable_chunked_prefill and remaining > budget:
                return False
            num_new = self._chunk(remaining, budget)
            if last:
                num_new = self._fit_bucket(sum(num_scheduled.values()), num_new, 0)
            if self.kv.allocate_slots(request, num_new, computed_blocks, num_computed) is None:
                return False
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:   # first admission (not a resume after preemption)
                request.num_cached_tokens = num_computed
                if cfg.enable_prefix_caching and not request.skip_reading_prefix_cache:
                    self.kv.record_prefix_lookup(request.num_tokens, num_computed)
            num_scheduled[request.request_id] = num_new
            new_reqs.append(NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                seed=self.seeds[request.request_id],
                block_ids=self.kv.get_block_ids(request.request_id),
                num_computed_tokens=num_computed,
            ))
            return True

        while not preempted and self.ready and budget > 0 and len(self.running) < cfg.max_num_seqs:
            request = self.ready[0]
            if admit(request, [], request.num_computed_tokens, last=len(self.ready) == 1 and not len(self.waiting)):
                self.ready.pop(0)
                budget -= num_scheduled[request.request_id]
            elif not self.running and len(self.ready) > 1:
                self._unload(self.ready.pop())   # pulled requests alone fill the pool: one starts over
            else:
                break
        while not preempted and not self.ready and len(self.waiting) and budget > 0 \
                and len(self.running) < cfg.max_num_seqs:
            request = self.waiting.peek()
            if request.wait_for in self.loading:
                break   # a sibling's pull brings this prompt's blocks: wait for it (FCFS keeps the order)
            computed_blocks, num_computed = self.kv.get_computed_blocks(request)
            if request.kv_load_pending:
                parked = self._admit_kv_load(request, computed_blocks, num_computed)
                if parked is None:
                    break      # the pool is short: the request waits (it is not refused)
                if parked:
                    continue   # in WAITING_FOR_REMOTE_KV
                # Nothing to pull (the prefix cache has it all): an ordinary admission.
            if not admit(request, computed_blocks, num_computed, last=len(self.waiting) == 1):
                break
            self.waiting.pop()
            budget -= num_scheduled[request.request_id]

        sampling, serials = set(), {}
        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            serials[req_id] = request.serial
            if request.num_computed_tokens >= request.num_tokens + request.num_pending:
                request.num_pending += 1      # this step samples its next token
                sampling.add(req_id)
        finished, self._finished_req_ids = self._finished_req_ids, set()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            preempted_req_ids=preempted,
            finished_req_ids=finished,
            scheduled_spec_decode_tokens=spec_tokens,
            sampling_req_ids=sampling,
            request_serials=serials,
        )

    @staticmethod
    def _num_uncomputed(request: Request) -> int:
        """Tokens to compute before the request samples again: its known tokens and the pending
        ones (sampled by a step in flight, fed to the next step on the device) not in the cache."""
        return request.num_tokens + request.num_pending - request.num_computed_tokens

    def _ends_with_pending(self, request: Request) -> bool:
        """The request's pending tokens reach max_tokens or the context length: the update that
        brings them finishes it, so no later step is scheduled for it."""
        max_tokens = request.sampling_params.max_tokens
        return ((max_tokens is not None and request.num_output_tokens + request.num_pending >= max_tokens)
                or request.num_tokens + request.num_pending >= self.config.max_model_len)

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """n-gram draft tokens for a decoding request, within what the budget, max_model_len and
        max_tokens leave (every draft accepted still leaves room for the bonus token)."""
        p = request.sampling_params
        if (request.num_tokens - request.num_computed_tokens != 1 or request.grammar is not None
                or p.logprobs is not None or p.reads_output_tokens or request.num_output_tokens < p.min_tokens):
            return []   # these sample with state a draft would change: they decode plainly
        limit = min(budget - 1, self.config.max_model_len - request.num_tokens - 1)
        if p.max_tokens is not None:
            limit = min(limit, p.max_tokens - request.num_output_tokens - 1)
        spec = self.config.speculative
        if request.ngram_index is None:
            request.ngram_index = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max)
        return request.ngram_index.propose(request.all_token_ids, min(spec.num_speculative_tokens, limit))

    def _admit_kv_load(self, request: Request, computed_blocks, num_computed: int) -> bool | None:
        """Allocate blocks for the prompt blocks a pull brings and park the request; False if the
        prefix cache already holds them all, None if the pool is short."""
        bs, kv = self.config.block_size, request.kv_transfer
        num_local = num_computed // bs
        target = blocks_to_load(request.num_prompt_tokens, bs, kv.num_full_blocks, num_local)
        request.kv_load_pending = False
        if target == num_local:
            self._kv_loads.append(KVLoad(request.request_id, kv, num_local, [],    # only releases the export
                                         serial=request.serial))
            return False
        if self.kv.allocate_slots(request, target * bs - num_computed, computed_blocks, num_computed,
                                  cache=False) is None:
            request.kv_load_pending = True
            return None
        self.waiting.pop()
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens < 0 and self.config.enable_prefix_caching:
            self.kv.record_prefix_lookup(request.num_tokens, num_computed)
        self.loading[request.request_id] = request
        self._kv_loads.append(KVLoad(request.request_id, kv, num_local,
                                     self.kv.get_block_ids(request.request_id)[num_local:target], serial=request.serial))
        return True

    def finish_kv_load(self, request_id: str, ok: bool) -> bool:
        """A pull for a parked request ended: with `ok` its blocks now hold the producer's KV (the
        engine wrote them), else they hold nothing and the prompt is computed here. The request
        then waits in `ready`, keeping its blocks. False if it is no longer parked (aborted)."""
        request = self.loading.pop(request_id, None)
        if request is None:
            return False
        if ok:
            num_loaded = len(self.kv.req_to_blocks[request_id]) * self.config.block_size
            request.num_computed_tokens = num_loaded
            self.kv.cache_loaded_blocks(request, num_loaded)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = request.num_computed_tokens
        request.status = RequestStatus.WAITING
        self.ready.append(request)
        return True

    def _unload(self, request: Request) -> None:
        """Give up a pulled request's blocks (it waits again and recomputes, or hits the prefix cache)."""
        self.kv.free(request)
        request.num_computed_tokens = 0
        self.waiting.prepend(request)

    def take_kv_loads(self) -> list[KVLoad]:
        loads, self._kv_loads = self._kv_loads, []
        return loads

    def take_kv_exports(self) -> list[KVExport]:
        exports, self._kv_exports = self._kv_exports, []
        return exports

    def _chunk(self, remaining: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold:
            remaining = min(remaining, threshold)
        return min(remaining, budget)

    def _fit_bucket(self, scheduled: int, num_new: int, later: int) -> int:
        """`num_new` prefill tokens, or fewer when ending the step at a token bucket and leaving the
        rest to a later step costs less than padding this step up to the next bucket.

        `scheduled`: the step's tokens so far; `later`: tokens still to come in it (decodes).
        With T the step's tokens, `upper` the bucket T pads to and `lower` the one below, the step
        is cut to `lower` when upper > lower + bucket(T - lower) + step_fixed_tokens (a later step
        for the rest, counted as if alone). E.g. a lone 300-token prompt runs as 256 + 44 (a
        64-token step) instead of one 512-token step: ~30% less time to its first token on CPU.
        """
        buckets, fixed = self.step_buckets, self.step_fixed_tokens
        if not buckets or fixed is None or num_new < 2 or not self.config.enable_chunked_prefill:
            return num_new
        total = scheduled + num_new + later
        upper = next((b for b in buckets if b >= total), None)
        if upper is None or upper == total:
            return num_new
        lower = max((b for b in buckets if b < total), default=0)
        rest = total - lower
        if rest >= num_new:   # the cut would take this whole chunk
            return num_new
        rest_bucket = next(b for b in buckets if b >= rest)
        return num_new - rest if upper > lower + rest_bucket + fixed else num_new

    def _pick_victim(self, request: Request) -> Request | None:
        """The running request to preempt so that `request` gets its blocks, or None: then it
        waits a step. A request whose last token a step in flight samples (async scheduling) is
        never picked, since its update ends it and frees its blocks (a preemption would drop that
        token and compute the whole sequence again for it); and while such a request holds
        blocks, `request` waits for them rather than preempting itself."""
        ending = [r for r in self.running if r.num_pending and self._ends_with_pending(r)]
        candidates = [r for r in self.running if r not in ending]
        if not candidates:
            return None
        if self.config.policy == "priority":
            # The least important, latest arrived; among equals (n>1 siblings share both) the one admitted
            # last, as FCFS picks: the first in `running` preempting itself would let equals preempt each
            # other in turn forever.
            victim = max(reversed(candidates), key=lambda r: (r.priority, r.arrival_time))
        else:
            victim = candidates[-1]
        return None if victim is request and ending else victim

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_pending = 0     # a token a step in flight samples for it is dropped, and sampled again
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop checks, free what finished."""
        outputs = []
        num_reqs = len(runner_output.req_ids)
        logprobs = runner_output.logprobs or [None] * num_reqs
        prompt_logprobs = runner_output.prompt_logprobs or [None] * num_reqs
        requests, block_size, running = self.requests, self.config.block_size, RequestStatus.RUNNING
        for req_id, token_ids, lp, plp in zip(runner_output.req_ids, runner_output.sampled_token_ids, logprobs,
                                              prompt_logprobs):
            request = requests.get(req_id)
            if (request is None or request.status != running
                    or request.serial != scheduler_output.request_serials.get(req_id)):
                continue  # aborted, preempted or finished while the step ran (the id may be another's now)
            new_prompt_lps = self._new_prompt_logprobs(request, *plp) if plp is not None else None
            if req_id not in scheduler_output.sampling_req_ids:
                # A prefill chunk that did not reach the end of the prompt yet: only prompt logprobs.
                if new_prompt_lps:
                    outputs.append(EngineCoreOutput(req_id, [], [], num_cached_tokens=max(request.num_cached_tokens, 0),
                                                    new_prompt_logprobs=new_prompt_lps))
                continue
            request.num_pending -= 1
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts:
                # The runner kept len(token_ids) - 1 drafts; the KV of the rest is rewritten later.
                accepted = len(token_ids) - 1
                request.num_computed_tokens -= len(drafts) - accepted
                self.spec_stats.record(len(drafts), accepted)
            new_ids = []
            grammar = request.grammar
            error = runner_output.errors.get(req_id) if runner_output.errors else None
            if error is None and grammar is not None:
                error = grammar.error
            if error is not None:
                # Its bitmask could not be filled, or allowed no token: the row's token is dropped.
                request.status = RequestStatus.FINISHED_ERROR
                token_ids = []
            for token_id in token_ids:
                request.append_output_token_id(token_id)
                new_ids.append(token_id)
                if grammar is not None:
                    grammar.accept_token(token_id)
                    if grammar.error is not None:    # the token kept (the mask allowed it); the request ends
                        request.status, error = RequestStatus.FINISHED_ERROR, grammar.error
                        break
                if self._check_stop(request, token_id):
                    break
                if grammar is not None and grammar.is_terminated():   # complete, or it raised asking
                    request.status, error = ((RequestStatus.FINISHED_STOPPED, None) if grammar.error is None else
                                             (RequestStatus.FINISHED_ERROR, grammar.error))
                    break
            request.update_block_hashes(block_size)
            finish_reason = None
            if request.status != running:
                finish_reason = request.status.finish_reason
                self.running.remove(request)
                self._free(request)
            outputs.append(EngineCoreOutput(req_id, new_ids, [lp] if (lp is not None and new_ids) else [],
                                            finish_reason, request.stop_reason,
                                            max(request.num_cached_tokens, 0), new_prompt_lps or None, error))
        return outputs

    @staticmethod
    def _new_prompt_logprobs(request: Request, first: int, entries: list[Logprobs]) -> list[Logprobs]:
        """The entries (for prompt tokens first, first + 1, ...) not output before: a request
        recomputed after a preemption computes its prompt's logprobs again."""
        done = request.num_prompt_logprobs_emitted     # entries for prompt tokens 1..done were output
        assert first <= done + 1, (request.request_id, first, done)
        new = entries[done + 1 - first:]
        request.num_prompt_logprobs_emitted += len(new)
        return new

    def _check_stop(self, request: Request, token_id: int) -> bool:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if token_id in request.eos_token_ids and not params.ignore_eos:
                request.status = RequestStatus.FINISHED_STOPPED
                if token_id != request.eos_token_id:   # a generation config's extra EOS id: a stop token (vLLM)
                    request.stop_reason = token_id
                return True
            if params.stop_token_ids and token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return True
        if (params.max_tokens is not None and num_output >= params.max_tokens) \
                or len(request.all_token_ids) >= self.config.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    # ---- introspection for metrics ---------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

