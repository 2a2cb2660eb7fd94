"""Serving before every token bucket is compiled: the budget is capped at the largest ready bucket."""

from jaxserve import LLM, SamplingParams
from jaxserve.core import Request, Scheduler, SchedulerConfig

OPTIONS = dict(dtype="float32", max_num_batched_tokens=64, max_num_seqs=8, num_kv_blocks=64, max_model_len=128,
               token_buckets=(4, 16, 64))


def test_the_scheduler_keeps_to_a_capped_budget():
    s = Scheduler(SchedulerConfig(max_model_len=128, max_num_batched_tokens=64, max_num_seqs=8, block_size=16,
                                  num_blocks=64))
    s.add_request(Request("a", list(range(3, 53)), SamplingParams(max_tokens=4)))
    s.token_budget_cap = 16
    assert s.schedule().total_num_scheduled_tokens == 16       # a 50-token prompt, in chunks of 16
    s.token_budget_cap = None
    assert s.schedule().total_num_scheduled_tokens == 34


def test_background_warmup_serves_at_once_with_the_same_tokens_and_no_late_compile(tiny_models):
    path = str(tiny_models["llama"])
    prompts = [list(range(5, 60)), [3, 4], list(range(100, 130))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    early = LLM(path, background_warmup_after=4, **OPTIONS)
    runner = early.engine.runner
    assert (4, runner.rows(4)) in runner._executables
    got = [o.outputs[0].token_ids for o in early.generate(prompts, params, use_tqdm=False)]
    assert runner.wait_for_warmup(120) and runner.ready_budget is None
    assert runner.compiles_after_warmup == 0
    want = [o.outputs[0].token_ids for o in LLM(path, **OPTIONS).generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_first_buckets_are_the_smallest_the_first_of_16_and_every_second_one_above():
    from jaxserve.runner.inputs import first_buckets, token_buckets
    assert first_buckets(token_buckets(512), 64) == [1, 16, 64]
    assert first_buckets(token_buckets(512), 512) == [1, 16, 32, 128, 512]
    assert first_buckets(token_buckets(512), 32) == [1, 16, 32]
    assert first_buckets(token_buckets(512), 8) == [1, 8]   # the largest small one, even under 16
    assert first_buckets([1, 24, 48, 96], 96) == [1, 24, 96]
    assert first_buckets([4, 16, 64], 4) == [4]
    assert first_buckets([4, 16, 64], 2) == [4]             # below the smallest: the smallest
    assert first_buckets([8, 512], 100) == [8]


def test_later_buckets_raise_the_cap_first_then_fill_the_gaps():
    from jaxserve.runner.inputs import first_buckets, later_buckets, token_buckets
    buckets = token_buckets(512)
    assert later_buckets(buckets, first_buckets(buckets, 16)) == [32, 64, 128, 256, 512, 2, 4, 8]
    assert later_buckets(buckets, [1, 16, 64]) == [128, 256, 512, 2, 4, 8, 32]
    assert later_buckets(buckets, buckets) == []


def test_serve_compiles_1_and_16_first_by_default():
    from jaxserve.cli import build_parser
    from jaxserve.runner.inputs import first_buckets, token_buckets
    args = build_parser().parse_args(["serve"])
    assert first_buckets(token_buckets(512), args.background_warmup_after) == [1, 16]


def test_a_step_pads_to_a_ready_bucket_while_the_gaps_compile(tiny_models):
    """Steps of 5-8 tokens pad to 16 while bucket 8 is missing: no compile inside a step, same tokens."""
    path = str(tiny_models["llama"])
    options = {**OPTIONS, "token_buckets": (2, 4, 8, 16, 64)}
    llm = LLM(path, background_warmup_after=16, **options)
    runner = llm.engine.runner
    assert runner.ready_buckets[0] == 2 and 16 in runner.ready_buckets
    assert runner.wait_for_warmup(120) and runner.ready_buckets == (2, 4, 8, 16, 64)
    # Back to the state just after start-up, as if bucket 8 and 64 were still compiling.
    for key in [k for k in runner._executables if k[0] in (8, 64)]:
        del runner._executables[key]
    runner._mark_ready([2, 4, 16])
    assert runner.ready_budget == 16
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], [17, 18], [19]]   # then 6 decodes a step
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert runner.compiles_after_warmup == 0
    assert {k[0] for k in runner._executables} == {2, 4, 16}
    want = [o.outputs[0].token_ids for o in LLM(path, **options).generate(prompts, params, use_tqdm=False)]
    assert got == want
