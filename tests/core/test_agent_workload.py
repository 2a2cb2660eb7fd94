"""The agent workload from DESIGN.md: a long shared system prompt, many requests, and
multi-turn conversations that extend what came before."""

from jaxserve.core import Request, SamplingParams

from .sim import make_scheduler, run_until_done

SYSTEM = list(range(1000, 1000 + 200))   # a 200-token shared prefix (50 blocks of 4)


def test_shared_prefix_is_computed_once():
    s, r = make_scheduler(max_model_len=512, max_num_batched_tokens=256, max_num_seqs=32, num_blocks=400)
    s.add_request(Request("first", SYSTEM + [1, 2, 3], SamplingParams(max_tokens=4)))
    run_until_done(s, r)
    computed = {}
    for i in range(16):
        s.add_request(Request(f"q{i}", SYSTEM + [10 + i] * 5, SamplingParams(max_tokens=4)))
    while s.has_unfinished_requests():
        out = s.schedule()
        for req_id, n in out.num_scheduled_tokens.items():
            computed[req_id] = computed.get(req_id, 0) + n
        s.update_from_output(out, r.execute(out))
    # Each follower computes only its 5-token tail plus 3 decode steps; the 200 prefix tokens never again.
    assert computed == {f"q{i}": 5 + 3 for i in range(16)}
    assert s.kv.stats.hits == 16 * 200


def test_second_turn_reuses_every_full_block_of_the_first():
    s, r = make_scheduler(max_model_len=512, max_num_batched_tokens=64, num_blocks=200)
    turn1 = Request("turn1", SYSTEM + [5, 6, 7], SamplingParams(max_tokens=9))
    s.add_request(turn1)
    first_blocks = []
    while s.has_unfinished_requests():
        out = s.schedule()
        first_blocks = s.kv.get_block_ids("turn1")
        s.update_from_output(out, r.execute(out))
    history = turn1.all_token_ids            # 203 prompt + 9 generated = 212 tokens = 53 full blocks
    assert len(history) == 212
    turn2 = Request("turn2", history + [42, 43, 44], SamplingParams(max_tokens=2))
    s.add_request(turn2)
    out = s.schedule()
    (new,) = out.scheduled_new_reqs
    # Turn 1 computed K/V for 211 tokens (its last sampled token was never fed back), i.e. 52 full
    # blocks, generated tokens included: all of them come from the cache; 4 + 3 tokens run.
    assert new.num_computed_tokens == 208 and out.num_scheduled_tokens == {"turn2": 7}
    assert s.kv.get_block_ids("turn2")[:52] == first_blocks[:52]
