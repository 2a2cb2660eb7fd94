"""Structured output on the tiny model through LLM.generate: every output obeys its constraint,
unconstrained requests in the same batch are untouched, nothing compiles after warm-up."""

import json
import re

import jsonschema
import pytest

from jaxserve import LLM, SamplingParams, StructuredOutputsParams

from .structured_cases import CHOICES, REGEX, SCHEMAS


@pytest.fixture(scope="module")
def llm(tiny_engine):
    return LLM.from_engine(tiny_engine)


def sampled(i, **kw):
    return SamplingParams(max_tokens=100, temperature=1.0, seed=i, **kw)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_50_generations_are_valid_against_the_schema(llm, name):
    schema = SCHEMAS[name]
    so = StructuredOutputsParams(json=schema)
    outs = llm.generate(["Describe it as JSON:"] * 50, [sampled(i, structured_outputs=so) for i in range(50)],
                        use_tqdm=False)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), schema)
    assert llm.engine.stats()["compiles_after_warmup"] == 0


def test_json_object_choice_and_regex_always_match(llm):
    params = ([sampled(i, structured_outputs=StructuredOutputsParams(json_object=True)) for i in range(10)]
              + [sampled(i, structured_outputs=StructuredOutputsParams(choice=CHOICES)) for i in range(20)]
              + [sampled(i, structured_outputs=StructuredOutputsParams(regex=REGEX)) for i in range(20)])
    outs = llm.generate(["x"] * len(params), params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    # Any object: a random model may write a key longer than max_tokens; what finishes is an object.
    done = [o.outputs[0].text for o in outs[:10] if o.outputs[0].finish_reason == "stop"]
    assert done and all(isinstance(json.loads(t), dict) for t in done)
    assert all(o.outputs[0].finish_reason in ("stop", "length") and o.outputs[0].text.startswith("{")
               for o in outs[:10])
    assert all(t in CHOICES for t in texts[10:30]) and len(set(texts[10:30])) > 1
    assert all(re.fullmatch(REGEX, t) for t in texts[30:]), texts[30:]


def test_unconstrained_requests_in_a_constrained_batch_are_token_identical(llm):
    prompts = [[int(t) for t in range(3 + i, 40 + 2 * i)] for i in range(8)]
    plain = [SamplingParams(max_tokens=12, temperature=t, seed=i, ignore_eos=True)
             for i, t in enumerate([0.0, 1.0] * 4)]
    alone = llm.generate(prompts, plain, use_tqdm=False)
    constrained = [sampled(i, structured_outputs=StructuredOutputsParams(json=SCHEMAS["nested"])) for i in range(8)]
    mixed = llm.generate(prompts + prompts, plain + constrained, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:8]] == [o.outputs[0].token_ids for o in alone]
    assert llm.engine.stats()["compiles_after_warmup"] == 0


def test_max_tokens_before_the_grammar_completes_is_length(llm):
    (out,) = llm.generate(["x"], SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(
        regex="[a-z]{40}")), use_tqdm=False)
    assert out.outputs[0].finish_reason == "length" and re.fullmatch("[a-z]+", out.outputs[0].text)


def test_n_siblings_each_get_their_own_matcher(llm):
    (out,) = llm.generate(["x"], sampled(3, n=4, structured_outputs=StructuredOutputsParams(regex=REGEX)),
                          use_tqdm=False)
    assert all(re.fullmatch(REGEX, c.text) for c in out.outputs)


@pytest.mark.parametrize("so,match", [
    (StructuredOutputsParams(json={"type": "nosuch"}), "(?s)invalid JSON schema: .*nosuch"),
    (StructuredOutputsParams(json="{not json"), "invalid JSON schema: not JSON"),
    (StructuredOutputsParams(regex="[a-"), "(?s)invalid regex: .*unclosed character class"),
    (StructuredOutputsParams(grammar="start: ???"), "invalid grammar"),
])
def test_a_bad_constraint_is_refused_naming_the_problem(llm, so, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["x"], SamplingParams(structured_outputs=so), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kw", [dict(), dict(json="{}", regex="a"), dict(choice=[]), dict(regex="")])
def test_structured_outputs_params_need_exactly_one_constraint(kw):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**kw)


def test_allowed_token_ids_and_a_grammar_both_apply(llm):
    """With a choice grammar and allowed_token_ids holding only "no"'s tokens and EOS, every sample is
    "no" (a sample outside either mask would show); free of the allowed set, the choices vary."""
    tok = llm.get_tokenizer()
    allowed = tok.encode("no", add_special_tokens=False) + list(tok.eos_token_ids)
    choice = StructuredOutputsParams(choice=CHOICES)
    outs = llm.generate(["x"] * 12, [sampled(i, structured_outputs=choice, allowed_token_ids=allowed)
                                     for i in range(12)], use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == ["no"] * 12
    free = llm.generate(["x"] * 12, [sampled(i, structured_outputs=choice) for i in range(12)], use_tqdm=False)
    assert len({o.outputs[0].text for o in free}) > 1


@pytest.mark.parametrize("case", ["allowed outside the grammar", "allowed tokens all bad after the first"])
def test_constraints_that_leave_no_token_end_the_request_with_the_reason(llm, case):
    """Where a request's own constraints allow no token (its bitmask row, less the min_tokens bans,
    is empty), it ends with error_status 400 and the reason, instead of sampling an arbitrary token;
    a request beside it is untouched and the pool is as full as before."""
    tok = llm.get_tokenizer()
    yes_no = StructuredOutputsParams(choice=["yes", "no"])
    params, kept = {
        "allowed outside the grammar": (dict(allowed_token_ids=[t for t in range(3, 60) if t not in set(
            tok.encode("yes", add_special_tokens=False) + tok.encode("no", add_special_tokens=False))][:20],
            structured_outputs=yes_no), 0),
        "allowed tokens all bad after the first": (dict(allowed_token_ids=[40, 41], bad_words_token_ids=[
            [40, 40], [40, 41], [41, 40], [41, 41]]), 1),
    }[case]
    engine = llm.engine
    free = engine.stats()["kv_free_blocks"]
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = llm.generate([[7, 8, 9]], plain, use_tqdm=False)[0].outputs[0].token_ids
    bad, good = llm.generate([[3, 4, 5], [7, 8, 9]], [SamplingParams(max_tokens=6, temperature=1.0, seed=1, **params),
                                                       plain], use_tqdm=False)
    assert bad.error_status == 400 and "no token can be sampled" in bad.error
    assert bad.outputs[0].finish_reason == "error" and len(bad.outputs[0].token_ids) == kept
    assert good.error is None and good.outputs[0].token_ids == alone
    assert engine.stats()["kv_free_blocks"] == free


@pytest.mark.parametrize("params", [dict(allowed_token_ids=[2], min_tokens=3),      # the tiny model's EOS
                                    dict(allowed_token_ids=[40, 41], bad_words_token_ids=[[40], [41]]),
                                    dict(allowed_token_ids=[40, 7], bad_words_token_ids=[[40]], min_tokens=1,
                                         stop_token_ids=[7])])
def test_constraints_that_leave_no_first_token_are_refused_before_any_step(llm, params):
    with pytest.raises(ValueError, match="no token can be sampled"):
        llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, **params), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
