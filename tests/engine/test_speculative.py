"""n-gram speculative decoding on the tiny model: the tokens of plain decoding, greedy and seeded,
in batches mixed with requests that do not speculate; preemption, n > 1, stop conditions;
counters; bad configs refused."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams, StructuredOutputsParams
from jaxserve.core.speculative import SpeculativeConfig
from tests.conftest import TINY_ENGINE_OPTIONS

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def plain(tiny_engine):
    return LLM.from_engine(tiny_engine)


@pytest.fixture(scope="module")
def spec(tiny_models):
    return LLM(str(tiny_models["llama"]), speculative_config=NGRAM, **TINY_ENGINE_OPTIONS)


def prompts(n, seed, vocab=30):
    """Prompts over a small alphabet: the random model falls into loops, so n-grams repeat."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, vocab, size=int(k))] for k in rng.integers(4, 70, size=n)]


def token_ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_greedy_and_seeded_tokens_equal_plain_decoding_and_drafts_are_accepted(plain, spec):
    ps = prompts(32, seed=0)
    # The controls apply on every row of a request: its last token's and each draft's.
    for params in (SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=40, temperature=0.8, top_k=20, seed=5, ignore_eos=True),
                   SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                  logit_bias={3: 2.0, 5: -1.5, 11: 4}),
                   SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                  allowed_token_ids=list(range(3, 24))),
                   SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                  bad_words_token_ids=[[3], [11], [17]])):
        before = spec.engine.stats()
        assert token_ids(spec.generate(ps, params, use_tqdm=False)) == \
            token_ids(plain.generate(ps, params, use_tqdm=False))
        stats = spec.engine.stats()
        drafted = stats["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        accepted = stats["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        assert drafted > 30 and accepted > 0, (params, drafted, accepted)
    assert stats["compiles_after_warmup"] == 0


def test_every_seed_gives_plain_decodings_tokens(plain, spec):
    """Each output token is drawn from the target with the request's own key, so any seed's
    sample is plain decoding's: the sampled distribution is the target's."""
    ps = prompts(1, seed=1) * 64
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True) for s in range(64)]
    assert token_ids(spec.generate(ps, params, use_tqdm=False)) == token_ids(plain.generate(ps, params, use_tqdm=False))


def test_requests_that_cannot_speculate_share_the_batch_unchanged(plain, spec):
    ps = prompts(12, seed=2)
    kinds = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=3),
             SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
             SamplingParams(max_tokens=30, temperature=0.0, min_tokens=10),
             SamplingParams(max_tokens=30, temperature=1.0, seed=1, n=3, ignore_eos=True),
             SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=StructuredOutputsParams(
                 regex="[a-z ]{5,40}"))]
    params = [kinds[i % len(kinds)] for i in range(len(ps))]
    got, want = spec.generate(ps, params, use_tqdm=False), plain.generate(ps, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    for g, w in zip(got, want):
        for a, b in zip(g.outputs, w.outputs):
            assert a.finish_reason == b.finish_reason and a.text == b.text
            if b.logprobs is not None:    # same tokens; the values from another compiled shape agree to f32 noise
                assert [d.keys() for d in a.logprobs] == [d.keys() for d in b.logprobs]
                assert [v for d in a.logprobs for v in d.values()] == pytest.approx(
                    [v for d in b.logprobs for v in d.values()], abs=1e-5)


def test_stop_tokens_and_max_tokens_end_where_plain_decoding_ends(plain, spec):
    ps = prompts(16, seed=3)
    ref = plain.generate(ps, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), use_tqdm=False)
    stops = [o.outputs[0].token_ids[7] for o in ref]      # a token each greedy output reaches
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[s]) for s in stops]
    got = spec.generate(ps, params, use_tqdm=False)
    want = plain.generate(ps, params, use_tqdm=False)
    assert token_ids(got) == token_ids(want)
    assert all(o.outputs[0].finish_reason == "stop" for o in got)
    for k in (1, 2, 3, 9):
        p = SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
        assert token_ids(spec.generate(ps, p, use_tqdm=False)) == token_ids(plain.generate(ps, p, use_tqdm=False))


def test_stop_strings_end_where_plain_decoding_ends(plain, spec):
    # A stop string completed by an accepted draft token, not the step's last: the tokens after it
    # were kept (token_ids, usage), and with several stop strings the first in the list won, not the
    # first completed. Stops cut from each greedy output at every token it has, so many fall inside
    # a step's accepted drafts; the outputs, texts and reasons must be plain decoding's (requests
    # with logprobs do not speculate).
    ps = prompts(8, seed=4)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tok = plain.get_tokenizer()
    params, cases = [], []
    for prompt, out in zip(ps, plain.generate(ps, greedy, use_tqdm=False)):
        ids = out.outputs[0].token_ids
        for cut in range(2, len(ids), 3):
            text, longer = tok.decode(ids[:cut]), tok.decode(ids[:cut + 2])
            for stop, include in (([text], True), ([longer, text], False)):
                params.append(greedy.clone(stop=stop, include_stop_str_in_output=include))
                cases.append(prompt)
    before = spec.engine.stats()["spec_decode_num_accepted_tokens"]
    got = spec.generate(cases, params, use_tqdm=False)
    want = plain.generate(cases, params, use_tqdm=False)
    assert spec.engine.stats()["spec_decode_num_accepted_tokens"] - before > 50

    def seen(outs):
        return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]
    assert seen(got) == seen(want)
    assert sum(o.outputs[0].finish_reason == "stop" for o in got) > len(got) // 2


def test_disable_by_batch_size_stops_drafting_in_large_batches(tiny_models, plain):
    capped = LLM(str(tiny_models["llama"]), speculative_config={**NGRAM, "disable_by_batch_size": 4},
                 **TINY_ENGINE_OPTIONS)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ps = prompts(16, seed=5)
    assert token_ids(capped.generate(ps, params, use_tqdm=False)) == token_ids(plain.generate(ps, params,
                                                                                             use_tqdm=False))
    drafts = capped.engine.stats()["spec_decode_num_drafts"]
    capped.generate(ps[:2], params, use_tqdm=False)        # 2 running: below the cap, it drafts
    assert capped.engine.stats()["spec_decode_num_drafts"] > drafts
    # 16 at once: it drafted only once fewer than 4 were left running
    assert drafts < 16 * 30 // 4


def test_preemption_under_a_small_pool_keeps_the_tokens(tiny_models, plain):
    small = LLM(str(tiny_models["llama"]), speculative_config=NGRAM,
                **{**TINY_ENGINE_OPTIONS, "num_kv_blocks": 40})
    ps = prompts(16, seed=4)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    assert token_ids(small.generate(ps, params, use_tqdm=False)) == token_ids(plain.generate(ps, params, use_tqdm=False))
    stats = small.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"] and stats["compiles_after_warmup"] == 0


@pytest.mark.parametrize("config,match", [
    ('{"method": "eagle"}', "not supported"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "exceeds"),
    ({"method": "ngram", "k": 3}, "unknown field"),
    ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"num_speculative_tokens": 3}, "needs \"method\""),
    ("{nope", "not JSON"),
    ([1], "JSON object"),
])
def test_bad_speculative_configs_are_refused(config, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse(config)
