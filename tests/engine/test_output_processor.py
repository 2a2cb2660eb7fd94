"""The OutputProcessor on hand-made token diffs: what each output kind carries, n > 1 siblings
finishing at different steps, stop strings with min_tokens, and the real engine's outputs
being the same whatever the kind."""

import pytest

from checkpoints import load_hf_folder
from jaxserve import RequestOutputKind, SamplingParams
from jaxserve.core import EngineCoreOutput
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_models):
    return Tokenizer.from_checkpoint(load_hf_folder(tiny_models["llama"]))


def run(tok, kind, plan, **params):
    """Feed per-step diffs {core index: [tokens]} (a sibling finishes with 'length' on its last
    step); returns the outputs of every step."""
    p = SamplingParams(n=len(plan), max_tokens=100, output_kind=kind, **params)
    proc = OutputProcessor(tok)
    proc.add("r", None, [5, 6], p, [f"{i}_r" for i in range(p.n)], 0.0)
    steps = []
    for step in range(max(len(x) for x in plan)):
        diffs = [EngineCoreOutput(f"{i}_r", [tokens[step]], [],
                                  finish_reason="length" if step == len(tokens) - 1 else None)
                 for i, tokens in enumerate(plan) if step < len(tokens)]
        outputs, _, _ = proc.process(diffs, float(step))
        steps.append(outputs)
    assert len(proc) == 0
    return steps


PLAN = [[71, 72, 73, 74, 75], [81, 82], [91, 92, 93]]    # three siblings, finishing at steps 2, 3 and 5


def test_delta_outputs_carry_only_news_and_each_finish_once(tok):
    steps = run(tok, RequestOutputKind.DELTA, PLAN)
    got = {i: [] for i in range(3)}
    finishes = {i: 0 for i in range(3)}
    for outputs in steps:
        (out,) = outputs
        for c in out.outputs:
            assert len(c.token_ids) == 1            # one new token per step, nothing repeated
            got[c.index] += c.token_ids
            finishes[c.index] += c.finish_reason is not None
        assert out.finished == (outputs is steps[-1])
    assert got == {i: PLAN[i] for i in range(3)} and finishes == {0: 1, 1: 1, 2: 1}
    # After sibling 1 finished (step 2) it never appears again.
    assert [sorted(c.index for c in out.outputs) for (out,) in steps] == [[0, 1, 2], [0, 1, 2], [0, 2], [0], [0]]


def test_final_only_is_one_whole_output(tok):
    steps = run(tok, RequestOutputKind.FINAL_ONLY, PLAN)
    assert [len(s) for s in steps] == [0, 0, 0, 0, 1]
    (out,) = steps[-1]
    assert out.finished and [c.token_ids for c in out.outputs] == PLAN
    assert [c.text for c in out.outputs] == [tok.decode(p) for p in PLAN]


def test_cumulative_repeats_everything_every_step(tok):
    steps = run(tok, RequestOutputKind.CUMULATIVE, PLAN)
    for k, (out,) in enumerate(steps):
        assert [c.token_ids for c in out.outputs] == [p[:k + 1] for p in PLAN]


def test_the_three_kinds_agree_on_the_text(tok):
    deltas = run(tok, RequestOutputKind.DELTA, PLAN)
    text = {i: "" for i in range(3)}
    for (out,) in deltas:
        for c in out.outputs:
            text[c.index] += c.text
    (final,) = run(tok, RequestOutputKind.FINAL_ONLY, PLAN)[-1]
    assert [text[i] for i in range(3)] == [c.text for c in final.outputs]


def test_stop_strings_wait_for_min_tokens(tok):
    words = tok.encode(" a b a b a b", add_special_tokens=False)
    assert len(words) == 6                       # one token per word
    # Without min_tokens the first " b" (token 2) stops it; with min_tokens=4 the " b" that is
    # token 4 does not count yet, only one after the 4th token does (token 6), as in vLLM.
    for min_tokens, expect_tokens in ((0, 2), (4, 6), (3, 4)):
        p = SamplingParams(max_tokens=100, stop=[" b"], min_tokens=min_tokens)
        proc = OutputProcessor(tok)
        proc.add("r", None, [5], p, ["r"], 0.0)
        stopped_at = None
        for k, t in enumerate(words):
            outputs, stopped, _ = proc.process([EngineCoreOutput("r", [t], [])], float(k))
            if stopped:
                stopped_at = k + 1
                (out,) = outputs
                assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == " b"
                break
        assert stopped_at == expect_tokens, (min_tokens, stopped_at)


def test_engine_outputs_agree_across_kinds(tiny_engine):
    results = {}
    for kind in RequestOutputKind:
        params = SamplingParams(n=2, max_tokens=6, seed=3, temperature=1.0, ignore_eos=True, output_kind=kind,
                                logprobs=1)
        tiny_engine.add_request(f"k{kind.value}", [3, 4, 5, 6], params)
        outs = []
        while tiny_engine.has_unfinished_requests():
            outs += tiny_engine.step()
        results[kind] = outs
    final = results[RequestOutputKind.FINAL_ONLY]
    assert len(final) == 1
    assert [c.token_ids for c in results[RequestOutputKind.CUMULATIVE][-1].outputs] == \
        [c.token_ids for c in final[0].outputs]
    merged = {0: [], 1: []}
    lps = {0: [], 1: []}
    for out in results[RequestOutputKind.DELTA]:
        for c in out.outputs:
            merged[c.index] += c.token_ids
            lps[c.index] += c.logprobs
    assert [merged[0], merged[1]] == [c.token_ids for c in final[0].outputs]
    assert [lps[0], lps[1]] == [c.logprobs for c in final[0].outputs]


def test_a_request_id_that_clashes_with_a_running_sibling_is_refused(tiny_engine):
    tiny_engine.add_request("abc", [3, 4, 5], SamplingParams(n=2, max_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match="clashes with the running sequence '0_abc'"):
        tiny_engine.add_request("0_abc", [3, 4], SamplingParams(max_tokens=2))
    while tiny_engine.has_unfinished_requests():
        tiny_engine.step()
