import pytest

from jaxserve.core import Request, RequestStatus, SamplingParams

from .sim import make_scheduler, run_until_done, step


def req(req_id, n_prompt, max_tokens=4, start=0, **kw):
    params = kw.pop("params", None) or SamplingParams(max_tokens=max_tokens, **kw.pop("sp", {}))
    return Request(req_id, list(range(start, start + n_prompt)), params, **kw)


def test_decode_and_prefill_share_one_step_under_the_budget():
    s, r = make_scheduler(max_num_batched_tokens=16)
    s.add_request(req("a", 5))
    out, _ = step(s, r)
    assert out.num_scheduled_tokens == {"a": 5}
    s.add_request(req("b", 30, start=100))
    out, _ = step(s, r)
    # a decodes one token; b's 30-token prompt is chunked into what is left (15).
    assert out.num_scheduled_tokens == {"a": 1, "b": 15}
    out, _ = step(s, r)
    assert out.num_scheduled_tokens == {"a": 1, "b": 15}
    assert [c.req_id for c in out.scheduled_cached_reqs] == ["a", "b"] and out.scheduled_new_reqs == []


def test_long_prefill_threshold_caps_one_requests_chunk():
    s, r = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=8)
    s.add_request(req("a", 20))
    s.add_request(req("b", 20))
    out, _ = step(s, r)
    assert out.num_scheduled_tokens == {"a": 8, "b": 8}


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    s, r = make_scheduler(max_num_batched_tokens=256, enable_chunked_prefill=False, max_model_len=256)
    s.add_request(req("a", 200))
    s.add_request(req("b", 100, start=1000))
    out, _ = step(s, r)
    assert out.num_scheduled_tokens == {"a": 200}   # b does not fit in the 56 left and is not split


def test_max_num_seqs_caps_running_requests():
    s, r = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add_request(req(f"r{i}", 3))
    out, _ = step(s, r)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"} and s.num_waiting == 2


def test_stop_conditions():
    s, r = make_scheduler()
    first = r.next_token(list(range(5)))
    s.add_request(req("eos", 5, max_tokens=10, eos_token_ids=(first,)))
    s.add_request(req("ignore", 5, max_tokens=3, start=0, eos_token_ids=(first,), sp={"ignore_eos": True}))
    s.add_request(req("stopid", 5, max_tokens=10, sp={"stop_token_ids": [first]}))
    s.add_request(req("min", 5, max_tokens=2, eos_token_ids=(first,), sp={"min_tokens": 2}))
    results, _ = run_until_done(s, r)
    assert results["eos"] == ([first], "stop")
    assert len(results["ignore"][0]) == 3 and results["ignore"][1] == "length"
    assert results["stopid"] == ([first], "stop")
    assert results["min"][0][0] == first and results["min"][1] == "length"  # EOS ignored before min_tokens


def test_an_extra_eos_id_ends_as_a_stop_token_with_its_id_as_stop_reason():
    """A generation config's EOS ids beside the tokenizer's own (Llama 3's <|eom_id|> beside <|eot_id|>)
    finish a sequence as stop token ids do, the id reported as stop_reason (vLLM moves them into
    stop_token_ids); the tokenizer's own EOS reports none. ignore_eos ignores them all."""
    s, r = make_scheduler()
    first = r.next_token(list(range(5)))
    s.add_request(req("extra", 5, max_tokens=10, eos_token_ids=(7777, first), eos_token_id=7777))
    s.add_request(req("own", 5, max_tokens=10, eos_token_ids=(first, 7777), eos_token_id=first))
    s.add_request(req("no_own", 5, max_tokens=10, eos_token_ids=(first,)))   # the tokenizer names no EOS
    s.add_request(req("ignored", 5, max_tokens=3, eos_token_ids=(7777, first), eos_token_id=7777,
                      sp={"ignore_eos": True}))
    finished = {}
    while s.has_unfinished_requests():
        for o in step(s, r)[1]:
            if o.finish_reason is not None:
                finished[o.req_id] = (o.finish_reason, o.stop_reason)
    assert finished == {"extra": ("stop", first), "own": ("stop", None), "no_own": ("stop", first),
                        "ignored": ("length", None)}


def test_context_length_caps_generation():
    s, r = make_scheduler(max_model_len=12)
    s.add_request(req("a", 10, max_tokens=None))
    results, _ = run_until_done(s, r)
    assert len(results["a"][0]) == 2 and results["a"][1] == "length"


def test_refuses_what_can_never_fit_with_the_numbers():
    s, _ = make_scheduler(max_model_len=64, num_blocks=5)   # 4 usable blocks of 4 = 16 tokens
    with pytest.raises(ValueError, match="64 tokens.*maximum context length is 64"):
        s.add_request(req("long", 64))
    with pytest.raises(ValueError, match=r"needs up to 30 tokens = 8 KV blocks of 4.*only 4 blocks"):
        s.add_request(req("big", 20, max_tokens=10))
    s.add_request(req("ok", 10, max_tokens=7))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("ok", 10))
    with pytest.raises(ValueError, match="empty"):
        Request("e", [], SamplingParams())


def test_preemption_recomputes_the_newest_and_everything_finishes():
    # 8 usable blocks of 4 tokens; two requests of up to 28 tokens each cannot both stay.
    s, r = make_scheduler(num_blocks=9, max_num_batched_tokens=64)
    s.add_request(req("old", 8, max_tokens=20))
    s.add_request(req("new", 8, max_tokens=20, start=100))
    preempted = []
    results = {}
    while s.has_unfinished_requests():
        out, outs = step(s, r)
        preempted += list(out.preempted_req_ids)
        for o in outs:
            results.setdefault(o.req_id, []).extend(o.new_token_ids)
    assert preempted and set(preempted) == {"new"}
    assert s.num_preemptions == len(preempted)
    assert len(results["old"]) == 20 and len(results["new"]) == 20
    # Recompute must give the same tokens as an uninterrupted run.
    s2, r2 = make_scheduler(num_blocks=64)
    s2.add_request(req("new", 8, max_tokens=20, start=100))
    alone, _ = run_until_done(s2, r2)
    assert results["new"] == alone["new"][0]
    assert s.kv.pool.num_free_blocks == 8


def test_preempted_request_goes_to_the_front_of_the_queue():
    s, r = make_scheduler(num_blocks=9, max_num_batched_tokens=64, max_num_seqs=2)
    s.add_request(req("a", 8, max_tokens=20))
    s.add_request(req("b", 8, max_tokens=20, start=50))
    s.add_request(req("c", 4, max_tokens=2, start=90))
    while not s.num_preemptions:
        step(s, r)
    assert [x.request_id for x in s.waiting][:2] == ["b", "c"]
    assert s.requests["b"].status == RequestStatus.PREEMPTED


def test_priority_policy_admits_and_preempts_by_priority():
    s, r = make_scheduler(policy="priority", max_num_seqs=1)
    s.add_request(req("low", 4, priority=5, arrival_time=1.0))
    s.add_request(req("high", 4, priority=0, arrival_time=2.0))
    out, _ = step(s, r)
    assert list(out.num_scheduled_tokens) == ["high"]

    s, r = make_scheduler(policy="priority", num_blocks=9, max_num_batched_tokens=64)
    s.add_request(req("low", 8, max_tokens=20, priority=5, arrival_time=1.0))
    s.add_request(req("high", 8, max_tokens=20, priority=0, arrival_time=2.0, start=100))
    preempted = set()
    while s.has_unfinished_requests():
        out, _ = step(s, r)
        preempted |= out.preempted_req_ids
    assert preempted == {"low"}


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_equal_requests_that_cannot_both_fit_do_not_preempt_each_other_forever(policy):
    """n>1 siblings share their priority and arrival time; when the pool holds one but not both, the
    one admitted last yields (under priority the first in `running` preempted itself, in turn forever)."""
    from jaxserve.core import Request
    s, r = make_scheduler(policy=policy, max_model_len=64, max_num_batched_tokens=4, max_num_seqs=2, block_size=1,
                          num_blocks=11, enable_prefix_caching=False, long_prefill_token_threshold=3)
    for i in range(2):
        s.add_request(Request(f"{i}_r", [7] * 9 + [0], SamplingParams(max_tokens=1), arrival_time=1.0))
    results, steps = run_until_done(s, r, max_steps=200)
    assert sorted(results) == ["0_r", "1_r"] and steps < 50 and s.num_preemptions <= 2


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "decoding"])
def test_abort_at_any_point_frees_everything(when):
    s, r = make_scheduler(max_num_batched_tokens=8)
    s.add_request(req("a", 20, max_tokens=50))
    if when == "mid_prefill":
        step(s, r)
    elif when == "decoding":
        for _ in range(5):
            step(s, r)
        assert s.requests["a"].num_output_tokens > 0
    s.abort("a")
    s.abort("a")             # idempotent
    s.abort("never-added")   # unknown ids are ignored
    assert not s.has_unfinished_requests()
    assert s.kv.pool.num_free_blocks == s.kv.num_usable_blocks
    out = s.schedule()
    assert out.finished_req_ids == {"a"} and out.is_empty


def test_results_of_an_aborted_step_are_dropped():
    s, r = make_scheduler()
    s.add_request(req("a", 4, max_tokens=5))
    out = s.schedule()
    s.abort("a")
    assert s.update_from_output(out, r.execute(out)) == []


BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def bucketed(**overrides):
    s, r = make_scheduler(**{"max_num_batched_tokens": 512, "max_model_len": 1024, "num_blocks": 512,
                             "max_num_seqs": 64, **overrides})
    s.step_buckets, s.step_fixed_tokens = BUCKETS, 24
    return s, r


@pytest.mark.parametrize("prompt,chunks", [
    (300, [256, 44]),          # one 512-token step -> 256 + a 64-token step
    (162, [128, 32, 2]),       # 256 -> 128, then the 34 left -> 32 + 2
    (71, [64, 7]),
    (228, [228]),              # 256 is cheaper than 128 + 128 + a step
    (116, [116]),
    (256, [256]),              # on a bucket already
    (700, [512, 128, 60]),     # the budget's chunk, then the rest as above
])
def test_a_lone_prompt_is_cut_at_a_bucket_when_padding_costs_more(prompt, chunks):
    s, r = bucketed()
    s.add_request(req("a", prompt, max_tokens=2))
    got = []
    while True:
        out, outs = step(s, r)
        got.append(out.num_scheduled_tokens["a"])
        if outs:   # the first token comes with the prompt's last chunk
            break
    assert got == chunks


def test_cut_chunks_give_the_same_tokens_and_a_consistent_cache():
    """Prompts arriving one step apart, so their chunks are cut (checked), against the same run
    uncut: the same sampled tokens, and every step the pool's ref counts and the prefix cache's
    blocks match what the fake runner wrote (prefix caching on, a prefix shared between prompts)."""
    from .sim import assert_pool_consistent

    def run(cut):
        s, r = bucketed()
        if not cut:
            s.step_buckets = None
        arrivals = [req("r0", 300, max_tokens=6), req("r1", 130, max_tokens=6, start=5000),
                    req("r2", 162, max_tokens=6), req("r3", 71, max_tokens=6, start=9000)]   # r2 shares r0's prefix
        seen, hashes, results, chunks = [], {}, {}, []
        while arrivals or s.has_unfinished_requests():
            if arrivals:
                seen.append(arrivals.pop(0))
                s.add_request(seen[-1])
            out, outs = step(s, r)
            chunks.append(dict(out.num_scheduled_tokens))
            assert_pool_consistent(s, r, seen, hashes)
            for o in outs:
                results[o.req_id] = results.get(o.req_id, []) + o.new_token_ids
        return results, chunks

    cut, cut_chunks = run(True)
    whole, whole_chunks = run(False)
    assert cut == whole and all(len(t) == 6 for t in cut.values())
    assert cut_chunks != whole_chunks and cut_chunks[0] == {"r0": 256}


def test_drafts_of_later_decodes_count_toward_the_cut():
    """With speculative decoding, a decode after a cut prefill may add drafts: the cut leaves room
    for them (4 each), so the step still ends within the bucket it was cut to."""
    from jaxserve.core.speculative import SpeculativeConfig

    s, r = bucketed(speculative=SpeculativeConfig("ngram", 4, 1, 2), long_prefill_token_threshold=256)
    s.add_request(req("p", 600, max_tokens=2))
    out, _ = step(s, r)
    assert out.num_scheduled_tokens == {"p": 256}
    # d runs after p; the fake runner samples 5 after its prompt, so the n-gram lookup drafts 6, 7, 8, 9
    s.add_request(Request("d", [5, 6, 7, 8, 9, 10, 11, 331], SamplingParams(max_tokens=40)))
    out, _ = step(s, r)
    assert out.num_scheduled_tokens == {"p": 256, "d": 8}   # d waited: p was not the last prefill
    out, _ = step(s, r)                                      # p's last 88, d decodes with drafts
    drafts = out.scheduled_spec_decode_tokens.get("d", [])
    assert drafts and out.num_scheduled_tokens["p"] == 64 - 5 and out.total_num_scheduled_tokens <= 64


def test_decodes_count_toward_the_step_the_chunk_is_cut_to():
    """With 40 sequences decoding, a 100-token prompt is cut so the step holds 128 tokens."""
    s, r = bucketed()
    for i in range(40):
        s.add_request(req(f"d{i}", 3, max_tokens=50, start=10 * i))
    step(s, r)                              # their prompts (120 tokens)
    s.add_request(req("p", 100, start=5000))
    out, _ = step(s, r)
    assert out.num_scheduled_tokens["p"] == 88 and out.total_num_scheduled_tokens == 128
    out, _ = step(s, r)
    assert out.num_scheduled_tokens["p"] == 12


def test_only_the_steps_last_prefill_is_cut():
    """A prompt with others waiting behind it is not cut (they fill the step); the last one may be."""
    s, r = bucketed()
    s.add_request(req("a", 300))
    s.add_request(req("b", 50, start=1000))
    out, _ = step(s, r)
    assert out.num_scheduled_tokens == {"a": 300, "b": 50}   # b cannot give back the 94 over 256
    s.add_request(req("c", 300, start=2000))
    out, _ = step(s, r)                                      # a and b decode; c runs as 256 + 44
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 254}
    out, _ = step(s, r)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 46}


@pytest.mark.parametrize("setting", ["no buckets", "no fixed cost", "no chunked prefill"])
def test_no_cut_without_buckets_a_cost_or_chunked_prefill(setting):
    s, r = bucketed(**({"enable_chunked_prefill": False, "max_model_len": 512} if setting == "no chunked prefill" else {}))
    if setting == "no buckets":
        s.step_buckets = None
    elif setting == "no fixed cost":
        s.step_fixed_tokens = None
    s.add_request(req("a", 300))
    out, _ = step(s, r)
    assert out.num_scheduled_tokens == {"a": 300}
