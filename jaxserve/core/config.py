"""Scheduler and KV cache settings: plain numbers, checked once at start-up."""

from __future__ import annotations

import dataclasses

from jaxserve.core.speculative import SpeculativeConfig

POLICIES = ("fcfs", "priority")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int = 2048                # longest sequence (prompt + output) in tokens
    max_num_batched_tokens: int = 512        # token budget of one step
    max_num_seqs: int = 64                   # running requests at most
    block_size: int = 16                     # tokens per KV block
    num_blocks: int = 1024                   # KV blocks in the pool, the null block included
    enable_prefix_caching: bool = True       # reuse full blocks across requests by hash
    enable_chunked_prefill: bool = True      # split prompts longer than what is left of the budget
    long_prefill_token_threshold: int = 0    # cap on one request's prefill chunk (0: no cap)
    policy: str = "fcfs"                     # "fcfs" or "priority" (lower value first)
    speculative: SpeculativeConfig | None = None   # n-gram speculative decoding (jaxserve.core.speculative)

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not isinstance(self.num_blocks, int) or self.num_blocks < 2:
            raise ValueError(f"num_blocks={self.num_blocks!r} must be an integer >= 2 (block 0 is reserved)")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold={self.long_prefill_token_threshold} must be >= 0")
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} must be one of {POLICIES}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_model_len={self.max_model_len}: without chunked prefill a long prompt could never "
                "be scheduled; raise the budget or enable chunked prefill")
