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
