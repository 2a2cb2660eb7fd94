"""Seeded, deterministic benchmark workloads as token-id prompts (nothing is downloaded).

Plain Python + numpy, shared by the serving benchmark (`serve_bench.py`), the ablations
and the offline benchmark. The same arguments always give the same token ids. Ids are
drawn from `[FIRST_ID, vocab_size - FIRST_ID)`, away from the special tokens at the
start of the vocabulary.

- `random_requests`: input and output lengths drawn from ranges (vLLM's `random`).
- `offline_random_prompts` / `shared_prefix_prompts`: the two offline workloads.
- `AgentWorkload`: many agents share a long system + tool-schema + repository-context
  prefix; each runs several turns whose prompt is the previous conversation plus a new
  user message. `ideal_prefill_tokens` is what a perfect prefix cache computes.
- `BurstWorkload`: N streams decoding steadily, then one prompt of 8x the token budget.
"""

from __future__ import annotations

import dataclasses

import numpy as np

FIRST_ID = 100   # skip the lowest ids (special tokens live there in most vocabularies)


def _ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    if vocab_size <= 2 * FIRST_ID:
        raise ValueError(f"vocab_size={vocab_size} is too small: ids are drawn from [{FIRST_ID}, vocab - {FIRST_ID})")
    return rng.integers(FIRST_ID, vocab_size - FIRST_ID, size=int(n)).tolist()


def _length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's random dataset: lengths uniform in [length * (1 - r), length * (1 + r)]."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio={range_ratio} must be in [0, 1)")
    return max(1, int(length * (1 - range_ratio))), max(1, int(length * (1 + range_ratio)))


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]     # token ids
    max_tokens: int       # output tokens (EOS is ignored, so exactly this many)


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                    seed: int = 0) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    in_lo, in_hi = _length_range(input_len, range_ratio)
    out_lo, out_hi = _length_range(output_len, range_ratio)
    ins = rng.integers(in_lo, in_hi + 1, size=num)
    outs = rng.integers(out_lo, out_hi + 1, size=num)
    return [BenchRequest(_ids(rng, n, vocab_size), int(m)) for n, m in zip(ins, outs)]


def offline_random_prompts(num: int, vocab_size: int, seed: int = 0, min_len: int = 64,
                           max_len: int = 256) -> list[list[int]]:
    """The offline workload: prompts of min_len..max_len tokens (as in JAX_NOTES' reference points)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(FIRST_ID, vocab_size - FIRST_ID, size=int(k)).tolist()
            for k in rng.integers(min_len, max_len + 1, size=num)]


def shared_prefix_prompts(num: int, prefix_len: int, suffix_range: tuple[int, int], vocab_size: int,
                          seed: int = 0) -> list[list[int]]:
    """`num` prompts: one shared `prefix_len`-token prefix, then each its own suffix_range tokens."""
    rng = np.random.default_rng(seed)
    prefix = _ids(rng, prefix_len, vocab_size)
    lo, hi = suffix_range
    return [prefix + _ids(rng, k, vocab_size) for k in rng.integers(lo, hi + 1, size=num)]


# ---- the agent workload -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AgentWorkload:
    """Agents sharing one prefix; turn k+1's prompt = turn k's prompt + its reply + a new user message."""

    shared_prefix: list[int]             # system prompt + tool schemas + repository context
    tasks: list[list[int]]               # per agent: its first user message (turn 1 = prefix + task)
    user_messages: list[list[list[int]]]  # per agent, per later turn: the new user message (tool output)
    output_len: int                      # reply tokens per turn
    block_size: int                      # the server's KV block size (for the "within one block" check)

    @property
    def num_agents(self) -> int:
        return len(self.tasks)

    @property
    def num_turns(self) -> int:
        return 1 + (len(self.user_messages[0]) if self.user_messages else 0)

    @property
    def num_requests(self) -> int:
        return self.num_agents * self.num_turns

    def first_prompt(self, agent: int) -> list[int]:
        return self.shared_prefix + self.tasks[agent]

    def next_prompt(self, agent: int, turn: int, previous_prompt: list[int], reply: list[int]) -> list[int]:
        """Prompt of `turn` (0-based, >= 1): the conversation so far plus that turn's user message."""
        return previous_prompt + reply + self.user_messages[agent][turn - 1]

    def ideal_prefill_tokens(self) -> int:
        """Prompt tokens a perfect prefix cache computes: the shared prefix once, each agent's new tokens once.

        A reply's tokens are computed while decoding, except its last one (sampled, never fed
        back), which the next turn must compute along with its new user message.
        """
        later = sum(len(m) + 1 for msgs in self.user_messages for m in msgs)
        return len(self.shared_prefix) + sum(len(t) for t in self.tasks) + later

    def max_prompt_len(self) -> int:
        return max(len(self.first_prompt(a)) + sum(len(m) for m in self.user_messages[a])
                   + self.output_len * (self.num_turns - 1) for a in range(self.num_agents))


def agent_workload(num_agents: int = 8, num_turns: int = 4, *, system_len: int = 256, tools_len: int = 256,
                   repo_len: int = 512, task_len: int = 64, user_len: tuple[int, int] = (32, 64),
                   output_len: int = 32, vocab_size: int, block_size: int = 16, seed: int = 0) -> AgentWorkload:
    if num_agents < 1 or num_turns < 1:
        raise ValueError(f"num_agents={num_agents} and num_turns={num_turns} must be >= 1")
    rng = np.random.default_rng(seed)
    prefix = _ids(rng, system_len, vocab_size) + _ids(rng, tools_len, vocab_size) + _ids(rng, repo_len, vocab_size)
    tasks = [_ids(rng, task_len, vocab_size) for _ in range(num_agents)]
    lo, hi = user_len
    users = [[_ids(rng, int(rng.integers(lo, hi + 1)), vocab_size) for _ in range(num_turns - 1)]
             for _ in range(num_agents)]
    return AgentWorkload(prefix, tasks, users, output_len, block_size)


# ---- the long-prompt burst ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BurstWorkload:
    """`stream_prompts` decode steadily; once each has `steady_tokens` tokens, `long_prompt` arrives."""

    stream_prompts: list[list[int]]
    stream_max_tokens: int      # long enough to outlast the burst
    steady_tokens: int          # tokens every stream has before the long prompt is sent
    long_prompt: list[int]      # `factor` x the server's token budget
    long_max_tokens: int


def long_prompt_burst(num_streams: int = 16, *, token_budget: int, factor: int = 8, stream_prompt_len: int = 32,
                      steady_tokens: int = 24, stream_max_tokens: int | None = None, long_max_tokens: int = 4,
                      vocab_size: int, seed: int = 0) -> BurstWorkload:
    rng = np.random.default_rng(seed)
    streams = [_ids(rng, stream_prompt_len, vocab_size) for _ in range(num_streams)]
    long_prompt = _ids(rng, factor * token_budget, vocab_size)
    if stream_max_tokens is None:
        # Every stream must still be decoding when the long prompt's prefill ends. The first stream
        # starts decoding while the others' prompts are still being admitted (up to one budget of
        # prompt tokens a step), and each step gives the long prompt what the decodes leave of it.
        admission = -(-num_streams * stream_prompt_len // token_budget)
        burst = -(-len(long_prompt) // max(1, token_budget - num_streams))
        stream_max_tokens = steady_tokens + admission + burst + 16
    return BurstWorkload(streams, stream_max_tokens, steady_tokens, long_prompt, long_max_tokens)
