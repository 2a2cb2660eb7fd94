"""n-gram speculative decoding, the plain-Python half: the config and the proposer.

The scheduler asks `propose` for up to K draft tokens per decoding request: the tokens that
followed the most recent earlier occurrence of the sequence's last n tokens (n from
prompt_lookup_max down to prompt_lookup_min), in its own prompt and output. The step then
computes the last token and the drafts together and samples a token at every one of those
positions with the sequence's own seed and output index, exactly as plain decoding would;
a draft is kept while it equals the token sampled before it (jaxserve.runner). For a draft
that is a single token (an n-gram proposal) this is rejection sampling: the draft survives
with the target's probability of it, and a rejected position keeps a token drawn from the
target without it, so outputs keep the target distribution; greedy and seeded requests
get the tokens plain decoding gives. Rejected positions' KV slots are rolled back by the
scheduler and rewritten later.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config names."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # No drafts while this many requests run or more (vLLM's name): a large batch already keeps the
    # device busy, and each draft costs a token of compute there. None: speculate at any batch size.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; known: {', '.join(METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative {name}={value!r} must be a positive integer")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative num_speculative_tokens={self.num_speculative_tokens} exceeds "
                             f"{MAX_SPECULATIVE_TOKENS}")
        if self.disable_by_batch_size is not None and (not isinstance(self.disable_by_batch_size, int)
                                                        or self.disable_by_batch_size < 1):
            raise ValueError(f"speculative disable_by_batch_size={self.disable_by_batch_size!r} must be a positive "
                             "integer")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative prompt_lookup_min={self.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max={self.prompt_lookup_max}")

    @classmethod
    def parse(cls, value: Any) -> "SpeculativeConfig | None":
        """From a dict, its JSON text, a SpeculativeConfig, or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {', '.join(unknown)}; known: method, "
                             "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, disable_by_batch_size")
        if "method" not in value:
            raise ValueError('speculative_config needs "method" (e.g. "ngram")')
        return cls(**value)


@dataclasses.dataclass
class SpecDecodeStats:
    """Counters for /metrics, vLLM's: drafts proposed, draft tokens, draft tokens accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted


class NgramIndex:
    """Where each n-gram of a sequence last started, for n in [n_min, n_max], kept up to date as the
    sequence grows: one dict update per n per new token, so a proposal costs O(n_max) however long
    the sequence is. The n-grams ending at the last token are left out (a proposal looks its suffix
    up among the earlier ones)."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.last_start: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.indexed = 0           # n-grams ending before this position are in last_start

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        end = len(tokens) - 1      # index the n-grams ending at positions < end
        for e in range(self.indexed, end):
            for n in range(self.n_min, min(self.n_max, e + 1) + 1):
                self.last_start[n][tuple(tokens[e - n + 1:e + 1])] = e - n + 1
        self.indexed = max(self.indexed, end)
        if k <= 0:
            return []
        for n in range(min(self.n_max, len(tokens)), self.n_min - 1, -1):
            start = self.last_start[n].get(tuple(tokens[len(tokens) - n:]))
            if start is not None:
                return tokens[start + n:start + n + k]
        return []
