"""Async scheduling on the tiny model: the engine schedules and launches step N + 1 before step
N's tokens come back, and the step reads them on the device. Every output must be what the
same requests get with the steps run one by one (the executables and their inputs are the
same, so the outputs are equal bit for bit, logprobs included)."""

import numpy as np
import pytest
from flax import nnx

from jaxserve import LLM, SamplingParams, StructuredOutputsParams
from kernels_pallas import native_cpu


@pytest.fixture
def llm(tiny_engine):
    yield LLM.from_engine(tiny_engine)
    tiny_engine.async_scheduling = True


@pytest.fixture
def overlapped(llm, monkeypatch):
    """Counts the steps launched while the one before was still in flight."""
    runner, counts = llm.engine.runner, {"overlapped": 0}
    real = runner.launch

    def launch(so, grammars=None, prev=None):
        counts["overlapped"] += prev is not None and prev.outs is not None and not so.is_empty
        return real(so, grammars, prev)
    monkeypatch.setattr(runner, "launch", launch)
    return counts


def prompts(n, seed=0, longest=110):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 500, size=int(k))] for k in rng.integers(1, longest, size=n)]


def generate(llm, async_scheduling, *args):
    """Every run from an empty prefix cache: a run that reuses an earlier run's blocks is scheduled
    otherwise, and a request whose step holds only its row takes the float32 one-row dot products,
    not the tiles (benchmarks/RESULTS.md), which is not what these tests compare (prefix-cache hits:
    the test below)."""
    llm.engine.async_scheduling = async_scheduling
    llm.engine.scheduler.kv.reset_prefix_cache()
    return llm.generate(*args, use_tqdm=False)


def summary(outs):
    return [(o.prompt_token_ids, o.prompt_logprobs,
             [(c.index, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob, c.text)
              for c in o.outputs]) for o in outs]


def test_mixed_requests_get_the_outputs_of_steps_run_one_by_one(llm, overlapped):
    ps = prompts(24, seed=5)
    free = generate(llm, False, ps[:2], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    stop_at = free[1].outputs[0].token_ids[3]
    kinds = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=1.0, top_p=0.9, top_k=40, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.7, seed=11, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0.0, prompt_logprobs=1, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_at]),     # stops mid-way
        SamplingParams(max_tokens=6, temperature=0.0, min_tokens=5, stop_token_ids=[stop_at]),
        SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={5: 3.0, 9: -100}),
        SamplingParams(max_tokens=8, temperature=1.0, seed=4, ignore_eos=True, allowed_token_ids=[5, 9, 13, 21]),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, bad_words_token_ids=[[5], [9]]),
    ]
    params = [kinds[i % len(kinds)] for i in range(len(ps))]
    params[1] = kinds[5]                         # the prompt whose 4th greedy token is the stop token
    sync = generate(llm, False, ps, params)
    before = overlapped["overlapped"]
    assert summary(generate(llm, True, ps, params)) == summary(sync)
    assert overlapped["overlapped"] - before > 10
    assert sync[1].outputs[0].finish_reason == "stop" and len(sync[1].outputs[0].token_ids) == 4


@pytest.mark.skipif(not native_cpu.available(), reason="no native kernels here")
def test_prefix_cache_hits_leave_every_output_bit_for_bit(llm):
    """The same requests from an empty prefix cache and again over the blocks the first run cached
    (their rest computed in other steps, of other token buckets): the same tokens and logprobs,
    bit for bit. (XLA's fusions took a float32 row's norm and its logprobs' sum of exponentials in
    an order that follows the step's row count; the native add-and-norm and log_softmax take a
    fixed order per row: JAXSERVE_NATIVE_NORM=0 or JAXSERVE_NATIVE_LOG_SOFTMAX=0 fails this.) A
    long request keeps two rows or more in every step: a row alone in its step takes the one-row
    dot products, whose sums run in another order than the tiles'."""
    ps = prompts(24, seed=9) + [[7] * 20]
    sp = [SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True, prompt_logprobs=1 if i % 4 == 0
                         else None) for i in range(len(ps) - 1)]   # (prompt logprobs are computed whole: no hits)
    sp.append(SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    if llm.engine.runner.config.attention_backend != "cpu":
        pytest.skip("the native add-and-norm and log_softmax serve the cpu backend")
    llm.engine.async_scheduling = False
    assert llm.engine.scheduler.kv.reset_prefix_cache()
    cold = llm.generate(ps, sp, use_tqdm=False)
    hits = llm.engine.scheduler.kv.stats.hits
    warm = llm.generate(ps, sp, use_tqdm=False)
    assert llm.engine.scheduler.kv.stats.hits > hits
    assert summary(warm[:-1]) == summary(cold[:-1])   # the long one ends alone in its steps


def test_one_sequence_at_a_time_overlaps_every_decode(llm, overlapped):
    p = list(range(200, 216))                   # one prefill step (a whole bucket)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    sync = generate(llm, False, [p], params)
    before = overlapped["overlapped"]
    assert summary(generate(llm, True, [p], params)) == summary(sync)
    # The prefill is launched alone; each of the 29 decodes overlaps the step before it (none is
    # launched past max_tokens).
    assert overlapped["overlapped"] - before == 29


def test_grammars_penalties_and_bad_words_run_their_steps_one_by_one_beside_plain_requests(llm, overlapped):
    ps = prompts(12, seed=6, longest=40)
    choice = StructuredOutputsParams(choice=["red", "green", "blue"])
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=i, ignore_eos=True) for i in range(12)]
    params[3] = SamplingParams(max_tokens=12, temperature=1.0, seed=1, structured_outputs=choice)
    params[7] = SamplingParams(max_tokens=16, temperature=1.0, seed=2, presence_penalty=1.5,
                               repetition_penalty=1.3, ignore_eos=True)
    params[9] = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True,
                               bad_words_token_ids=[[5], [9, 13], [40, 41, 42]])
    sync = generate(llm, False, ps, params)
    assert summary(generate(llm, True, ps, params)) == summary(sync)
    assert sync[3].outputs[0].text in ("red", "green", "blue")


def test_a_stop_string_ends_the_request_as_when_steps_run_one_by_one(llm):
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    text = generate(llm, False, ["once upon"], greedy)[0].outputs[0].text
    stop = text[len(text) // 3: len(text) // 3 + 3]
    params = SamplingParams(max_tokens=30, temperature=0.0, stop=[stop], ignore_eos=True)
    sync = generate(llm, False, ["once upon", "a time"], params)
    assert summary(generate(llm, True, ["once upon", "a time"], params)) == summary(sync)
    assert sync[0].outputs[0].finish_reason == "stop"


def test_an_abort_with_a_step_in_flight_then_the_same_id_again(llm):
    engine = llm.engine
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = generate(llm, False, [[40, 41, 42]], greedy)[0].outputs[0].token_ids
    engine.async_scheduling = True
    engine.add_request("x", list(range(60, 90)), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None        # a step that samples for "x" is in flight
    engine.abort_request("x")
    engine.add_request("x", [40, 41, 42], greedy)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.outputs[0].token_ids for o in outs] == [expected]
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["kv_free_blocks"] == stats["kv_total_blocks"]


def test_sleep_and_update_params_after_a_step_was_left_in_flight(llm):
    engine = llm.engine
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = generate(llm, False, [[7, 8, 9]], greedy)[0].outputs[0].token_ids
    stop_at = expected[2]
    out = generate(llm, True, [[7, 8, 9]], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_at]))
    assert out[0].outputs[0].token_ids == expected[:3]
    assert engine._in_flight is not None        # launched before the stop token came back
    engine.update_params(nnx.traversals.unflatten_mapping(engine.runner.param_arrays()))
    engine.sleep(1)
    engine.wake_up()
    assert engine._in_flight is None
    assert generate(llm, True, [[7, 8, 9]], greedy)[0].outputs[0].token_ids == expected
