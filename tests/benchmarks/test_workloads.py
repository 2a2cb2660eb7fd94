"""The benchmark workloads are deterministic token-id prompts of the sizes asked for."""

import pytest
from workloads import (FIRST_ID, agent_workload, long_prompt_burst, offline_random_prompts, random_requests,
                       shared_prefix_prompts)


def test_random_requests_are_seeded_and_within_ranges():
    a = random_requests(50, 100, 20, 0.5, vocab_size=1000, seed=3)
    assert a == random_requests(50, 100, 20, 0.5, vocab_size=1000, seed=3)
    assert a != random_requests(50, 100, 20, 0.5, vocab_size=1000, seed=4)
    assert all(50 <= len(r.prompt) <= 150 and 10 <= r.max_tokens <= 30 for r in a)
    assert all(FIRST_ID <= t < 1000 - FIRST_ID for r in a for t in r.prompt)
    fixed = random_requests(5, 64, 8, 0.0, vocab_size=1000)
    assert [len(r.prompt) for r in fixed] == [64] * 5 and [r.max_tokens for r in fixed] == [8] * 5
    with pytest.raises(ValueError, match="range_ratio"):
        random_requests(1, 10, 10, 1.0, vocab_size=1000)


def test_offline_prompts_are_the_recorded_workload():
    prompts = offline_random_prompts(64, 49152)
    # The workload of RESULTS.md's offline table (64 prompts of 64-256 tokens, 10,361 in all).
    assert len(prompts) == 64 and sum(map(len, prompts)) == 10361
    assert all(64 <= len(p) <= 256 for p in prompts)


def test_shared_prefix_prompts_share_exactly_the_prefix():
    prompts = shared_prefix_prompts(8, 100, (5, 9), vocab_size=1000, seed=1)
    assert all(p[:100] == prompts[0][:100] for p in prompts)
    assert all(105 <= len(p) <= 109 for p in prompts)
    assert len({tuple(p[100:]) for p in prompts}) == 8


def test_agent_conversation_grows_by_reply_and_user_message():
    wl = agent_workload(3, 3, system_len=10, tools_len=20, repo_len=30, task_len=5, user_len=(2, 4),
                        output_len=6, vocab_size=1000, seed=7)
    assert wl == agent_workload(3, 3, system_len=10, tools_len=20, repo_len=30, task_len=5, user_len=(2, 4),
                                output_len=6, vocab_size=1000, seed=7)
    assert wl.num_agents == 3 and wl.num_turns == 3 and wl.num_requests == 9
    assert len(wl.shared_prefix) == 60
    p0 = wl.first_prompt(1)
    assert p0 == wl.shared_prefix + wl.tasks[1] and len(p0) == 65
    reply = [500] * 6
    p1 = wl.next_prompt(1, 1, p0, reply)
    assert p1 == p0 + reply + wl.user_messages[1][0]
    # Ideal: the 60-token prefix once, 3 tasks of 5, and per later turn its user message + the
    # previous reply's last token (sampled, never fed back).
    users = [len(m) for msgs in wl.user_messages for m in msgs]
    assert len(users) == 6 and all(2 <= n <= 4 for n in users)
    assert wl.ideal_prefill_tokens() == 60 + 15 + sum(users) + 6


def test_burst_prompt_is_factor_times_the_budget_and_streams_outlast_it():
    wl = long_prompt_burst(4, token_budget=32, factor=8, stream_prompt_len=10, steady_tokens=12,
                           vocab_size=1000, seed=2)
    assert len(wl.long_prompt) == 256 and len(wl.stream_prompts) == 4
    assert all(len(p) == 10 for p in wl.stream_prompts)
    # Admitting 4 x 10 prompt tokens takes up to 2 steps of 32, and 256 prompt tokens at 32 - 4 per
    # step take 10: the first stream needs 12 + 2 + 10 tokens at least.
    assert wl.stream_max_tokens >= 12 + 2 + 10
