"""What callers get back: vLLM-compatible RequestOutput / CompletionOutput, plus timing.

Built on the engine thread after each step (jaxserve.engine.output_processor) and handed
to the caller (LLM.generate, the async engine's consumers, the server). What one output
holds depends on SamplingParams.output_kind: everything so far (CUMULATIVE), what is new
(DELTA) or the whole result once (FINAL_ONLY). Plain data; no jax.
"""

from __future__ import annotations

import dataclasses

from jaxserve.core import Logprobs
from jaxserve.core.kv_transfer import KVTransferParams


@dataclasses.dataclass
class RequestMetrics:
    """Monotonic timestamps (time.monotonic()) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None   # when it first ran (queue time = this - arrival)
    first_token_time: float | None = None       # time to first token = this - arrival
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)  # one per generated token

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclasses.dataclass
class CompletionOutput:
    index: int                                   # which of the n completions
    text: str                                    # generated text so far (stop string excluded unless asked)
    token_ids: list[int]                         # generated token ids so far
    cumulative_logprob: float | None = None      # sum of sampled tokens' logprobs, when logprobs were asked for
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: logprob}, sampled token + top-N
    finish_reason: str | None = None             # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None         # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0                   # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    # With SamplingParams.prompt_logprobs: per prompt token {token id: logprob}, None for the first.
    # A DELTA output carries the entries computed since the last output.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # A producer's finished request (kv role "produce"): the export a consumer pulls.
    kv_transfer_params: KVTransferParams | None = None
    # Set on the final output of a request that failed on its own (processing its output or its
    # grammar raised: what went wrong, by type, the traceback in the log; or its constraints left no
    # token to sample: why). Its unfinished sequences end with finish_reason "error"; the engine and
    # the other requests carry on. `error_status`: 400 where the request itself was at fault, else 500.
    error: str | None = None
    error_status: int | None = None


def logprobs_dict(token_id: int, lp: Logprobs) -> dict[int, float]:
    """vLLM's per-token logprobs: the top-N and the sampled token."""
    d = dict(zip(lp.top_token_ids, lp.top_logprobs))
    d.setdefault(token_id, lp.token_logprob)
    return d
