"""Plain data exchanged each step between the scheduler, the runner and the engine.

`SchedulerOutput` goes from the scheduler to the runner (new requests whole, running
ones as diffs); `ModelRunnerOutput` comes back with the sampled tokens; the scheduler
turns it into `EngineCoreOutput`s for the engine's detokenizer. No jax here.
"""

from __future__ import annotations

import dataclasses

from jaxserve.core.sampling_params import SamplingParams


@dataclasses.dataclass(slots=True)
class NewRequestData:
    """A request the runner has no state for: first admission, or resumed after preemption."""

    req_id: str                      # request id
    prompt_token_ids: list[int]      # the prompt
    output_token_ids: list[int]      # tokens generated before a preemption (empty when new)
    sampling_params: SamplingParams  # how to sample it
    seed: int                        # the request's RNG seed (drawn at random when the user gave none)
    block_ids: list[int]             # all KV blocks of the request, in order
    num_computed_tokens: int         # tokens already in the cache (prefix-cache hits) before this step


@dataclasses.dataclass(slots=True)
class CachedRequestData:
    """Diffs for requests the runner already holds, one entry per request."""

    req_id: str                      # request id
    new_block_ids: list[int]         # blocks appended to the request's block table this step
    num_computed_tokens: int         # tokens in the cache before this step


@dataclasses.dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]          # requests the runner sees whole
    scheduled_cached_reqs: list[CachedRequestData]    # running requests, as diffs
    num_scheduled_tokens: dict[str, int]              # tokens to compute this step, per request id
    total_num_scheduled_tokens: int                   # sum of num_scheduled_tokens (<= the token budget)
    preempted_req_ids: set[str]                       # dropped this step; the runner forgets their state
    finished_req_ids: set[str]                        # ended since the last step; the runner forgets them
    # Speculative decoding: the draft tokens computed after each listed request's last token this step
    # (its num_scheduled_tokens counts them); the runner samples at each and keeps what matches.
    scheduled_spec_decode_tokens: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # The requests whose scheduled tokens reach their last token (known or pending): they sample
    # this step. The others computed a prefill chunk short of the prompt's end.
    sampling_req_ids: set[str] = dataclasses.field(default_factory=set)
    # Request.serial of each scheduled request: the update of a step that finishes after its
    # request ended (and the id went to a new request) leaves the new one alone.
    request_serials: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclasses.dataclass(slots=True)
class Logprobs:
    """Logprobs of one token: a generated one, or a prompt token given the tokens before it."""

    token_logprob: float             # logprob of the token (raw model distribution)
    top_token_ids: list[int]         # top-N token ids, best first
    top_logprobs: list[float]        # their logprobs


@dataclasses.dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]                          # requests of the step, in the order they were scheduled
    sampled_token_ids: list[list[int]]          # per request: the new token, or [] for a partial prefill chunk
    logprobs: list[Logprobs | None] | None = None   # per request, when it asked for logprobs
    # Per request, when it asked for prompt_logprobs and this step computed prompt positions:
    # (index of the first prompt token covered, one entry per prompt token from there on).
    prompt_logprobs: list[tuple[int, list[Logprobs]] | None] | None = None
    # Requests whose next token could not be sampled (NoTokenAllowedError): their row is dropped.
    errors: dict[str, Exception] | None = None


class NoTokenAllowedError(ValueError):
    """A request's own constraints leave no token to sample next: allowed_token_ids, bad words, its
    grammar and min_tokens' ban of EOS and stop tokens together allow none. It ends that request
    (the client's fault: a 400 where it can still be one)."""


@dataclasses.dataclass(slots=True)
class EngineCoreOutput:
    req_id: str                          # request id
    new_token_ids: list[int]             # tokens appended this step
    new_logprobs: list[Logprobs]         # one per new token when logprobs were asked for
    finish_reason: str | None = None     # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None # the stop token id (or stop string, set by the engine)
    num_cached_tokens: int = 0           # prompt tokens served from the prefix cache
    # prompt_logprobs: entries for the prompt tokens whose logprobs this step computed, in order
    # (token i >= 1 given tokens < i); over a request's outputs they add up to P - 1 entries for a
    # P-token prompt, never repeated after a preemption. None when there are none this step.
    new_prompt_logprobs: list[Logprobs] | None = None
    error: Exception | None = None       # with finish_reason "error": what raised (the engine logs it)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
