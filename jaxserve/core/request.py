"""A request's state as the scheduler sees it: token ids, progress, status, block hashes.

Created on the caller's thread when the request is added, then owned by the engine
thread (scheduler) until it finishes. Plain Python: no jax.
"""

from __future__ import annotations

import enum
import itertools
import time

from jaxserve.core.hashing import BlockHash, hash_block_tokens
from jaxserve.core.kv_transfer import KVTransferParams
from jaxserve.core.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()   # holds blocks while a producer's KV is pulled into them
    FINISHED_STOPPED = enum.auto()        # EOS or a stop token / stop string
    FINISHED_LENGTH_CAPPED = enum.auto()  # max_tokens or the context length
    FINISHED_ABORTED = enum.auto()        # aborted by the caller
    FINISHED_ERROR = enum.auto()          # this request alone failed (its grammar raised, or no token was left)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


_serials = itertools.count()


class Request:
    """One sequence to generate. `n > 1` is several sibling Requests (engine level)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...] = (),
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer: KVTransferParams | None = None,
        wait_for: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt_token_ids is empty")
        self.request_id = request_id
        # Unique per Request object: a step still in flight when its request ends must not touch a
        # later request that reuses the id.
        self.serial = next(_serials)
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        # The tokenizer's own EOS: finishing on another of eos_token_ids reports it as stop_reason.
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # Disaggregated prefill/decode: a producer exports the prompt's blocks when this request
        # finishes; a consumer pulls them before computing the rest (once: kv_load_pending).
        self.kv_transfer = kv_transfer
        self.kv_load_pending = kv_transfer is not None and kv_transfer.role == "consume"
        self.wait_for = wait_for       # a sibling whose KV pull this request waits for (n > 1 on a consumer)
        # Structured output: the sequence's grammar matcher (jaxserve.engine.structured_output.Grammar,
        # duck-typed: accept_token(id), is_terminated(), error: what raised in it, or None), advanced with
        # every token appended.
        self.grammar = None
        self.ngram_index = None        # speculative decoding's proposer state (jaxserve.core.speculative)

        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)  # prompt + output
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0   # tokens whose K/V are in the cache (after the last schedule)
        # Tokens being sampled by steps launched but not yet collected (their ids are not known):
        # 1 between a step's schedule and its update; 2 while a step overlaps the next one's
        # scheduling (the engine's async scheduling). The next step computes them as placeholders.
        self.num_pending = 0
        self.num_cached_tokens = -1    # prefix-cache hit at first admission (-1: not admitted yet)
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.block_hashes: list[BlockHash] = []    # hashes of every full block of all_token_ids
        self.num_prompt_logprobs_emitted = 0       # prompt_logprobs entries already output (kept across preemption)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Prompt logprobs need logits at every prompt position, which cached blocks lack (as vLLM)."""
        return self.sampling_params.prompt_logprobs is not None

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def update_block_hashes(self, block_size: int) -> None:
        """Hash every full block not hashed yet (chained: each hash covers its prefix)."""
        tokens = self.all_token_ids
        if (len(self.block_hashes) + 1) * block_size > len(tokens):
            return
        while (len(self.block_hashes) + 1) * block_size <= len(tokens):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if i else None
            extra = self.cache_salt if i == 0 else None  # chaining carries the salt onward
            self.block_hashes.append(
                hash_block_tokens(parent, tokens[i * block_size:(i + 1) * block_size], extra))

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
