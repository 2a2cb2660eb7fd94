"""The scheduler + runner loop on tiny models, against Hugging Face transformers.

Greedy tokens must equal transformers' `generate` token for token, through chunked
prefill, mixed batches and prefix-cache hits, with zero compiles after warm-up.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from jaxserve.config import EngineConfig
from jaxserve.core import Request, SamplingParams
from jaxserve.engine.builder import build_engine_parts
from tests.fixtures.tiny_models import TINY_MODEL_NAMES


def build(path, **kw):
    opts = dict(dtype="float32", max_num_batched_tokens=32, max_num_seqs=16, num_kv_blocks=128, max_model_len=128,
                token_buckets=(1, 8, 32))
    opts.update(kw)
    return build_engine_parts(EngineConfig(model=str(path), **opts))


def run(parts, requests):
    """Add requests, step to completion; returns {id: output token ids}."""
    for r in requests:
        parts.scheduler.add_request(r)
    out = {r.request_id: [] for r in requests}
    while parts.scheduler.has_unfinished_requests():
        so = parts.scheduler.schedule()
        for o in parts.scheduler.update_from_output(so, parts.runner.execute(so)):
            out[o.req_id] += o.new_token_ids
    return out


def hf_greedy(path, prompt, n, logit_bias=None, allowed=None, bad_words_ids=None):
    """transformers' greedy tokens; `logit_bias` {token: bias} as its one-token sequence biases,
    `allowed` token ids as its prefix_allowed_tokens_fn, `bad_words_ids` as its own."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    kw = {"sequence_bias": [[[t], b] for t, b in logit_bias.items()]} if logit_bias else {}
    if allowed:
        kw["prefix_allowed_tokens_fn"] = lambda batch_id, ids: list(allowed)
    if bad_words_ids:
        kw["bad_words_ids"] = bad_words_ids
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=0, **kw)
    return ids[0, len(prompt):].tolist()


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


# llama and qwen3 run by default; the other families' layers are covered by the parity tests in
# tests/models, and their end-to-end runs are slow-marked to keep the default run short.
@pytest.mark.parametrize("name", [n if n in ("llama", "qwen3") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in TINY_MODEL_NAMES])
def test_greedy_matches_transformers_generate_for_32_steps(tiny_models, name):
    parts = build(tiny_models[name])
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, 500, size=40)]  # 40 tokens: 2 chunks of 16, then 8
    out = run(parts, [Request("a", prompt, greedy(32))])
    assert out["a"] == hf_greedy(tiny_models[name], prompt, 32)
    assert parts.runner.compiles_after_warmup == 0


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["llama"], build(tiny_models["llama"])


def test_mixed_batch_equals_each_request_alone_and_never_recompiles(llama):
    path, parts = llama
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(3, 500, size=int(n))] for n in rng.integers(1, 60, size=12)]
    reqs = [Request(f"g{i}", p, greedy(12)) for i, p in enumerate(prompts)]
    seeded = [Request(f"s{i}", p, SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=100 + i))
              for i, p in enumerate(prompts[:4])]
    together = run(parts, reqs + seeded)
    for i, p in enumerate(prompts[:3]):
        assert together[f"g{i}"] == hf_greedy(path, p, 12)
    alone = {}
    for r in [Request("g5", prompts[5], greedy(12)), Request("s1", prompts[1], seeded[1].sampling_params)]:
        alone.update(run(parts, [r]))
    assert together["g5"] == alone["g5"]
    assert together["s1"] == alone["s1"], "a seeded request must not depend on its batch"
    assert parts.runner.compiles_after_warmup == 0
    assert parts.scheduler.kv.pool.num_free_blocks == parts.scheduler.kv.num_usable_blocks


def test_prefix_cache_hit_gives_the_same_tokens(llama):
    path, parts = llama
    shared = list(range(10, 58))                      # 48 tokens = 3 full blocks of 16
    run(parts, [Request("first", shared + [5, 6], greedy(4))])
    hits = parts.scheduler.kv.stats.hits
    prompt = shared + [7, 8, 9]
    out = run(parts, [Request("second", prompt, greedy(16))])
    assert parts.scheduler.kv.stats.hits - hits == 48
    assert out["second"] == hf_greedy(path, prompt, 16)


def test_logprobs_match_transformers(llama):
    path, parts = llama
    prompt = list(range(20, 45))
    parts.scheduler.add_request(Request("lp", prompt, greedy(3, logprobs=5)))
    got = []
    while parts.scheduler.has_unfinished_requests():
        so = parts.scheduler.schedule()
        for o in parts.scheduler.update_from_output(so, parts.runner.execute(so)):
            got += list(zip(o.new_token_ids, o.new_logprobs))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = prompt + [t for t, _ in got]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()
    for k, (tok, lp) in enumerate(got):
        row = ref[len(prompt) - 1 + k]
        assert lp.token_logprob == pytest.approx(row[tok], abs=1e-4)
        assert lp.top_token_ids == list(np.argsort(-row)[:5])
        np.testing.assert_allclose(lp.top_logprobs, np.sort(row)[::-1][:5], atol=1e-4)


def test_logit_bias_matches_transformers_sequence_bias_beside_unbiased_requests(llama):
    """A greedy request with a logit_bias (its first choice banned, a few tokens raised) gives
    transformers' greedy tokens under the same biases, through a chunked prompt and beside unbiased
    requests (which keep their own tokens) and a sampled one whose +100 token always wins."""
    path, parts = llama
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(3, 500, size=40)]
    plain = hf_greedy(path, prompt, 12)
    bias = {plain[0]: -100.0, **{int(t): 3.5 for t in rng.integers(3, 500, size=6)}, int(plain[3]): -1.25}
    others = [[int(t) for t in rng.integers(3, 500, size=int(n))] for n in (9, 30)]
    reqs = [Request("biased", prompt, greedy(12, logit_bias=bias)),
            Request("forced", others[0], SamplingParams(max_tokens=6, temperature=1.0, seed=5, logit_bias={77: 100})),
            *(Request(f"plain{i}", p, greedy(12)) for i, p in enumerate(others))]
    out = run(parts, reqs)
    assert out["biased"] == hf_greedy(path, prompt, 12, logit_bias=bias)
    assert out["biased"] != plain and plain[0] not in out["biased"]
    assert out["forced"] == [77] * 6
    for i, p in enumerate(others):
        assert out[f"plain{i}"] == hf_greedy(path, p, 12)
    assert parts.runner.compiles_after_warmup == 0


def test_allowed_token_ids_match_transformers_prefix_allowed_tokens_fn(llama):
    """Only the allowed tokens are sampled: greedy tokens equal transformers' with the same allowed
    set, through a chunked prompt, beside a free request (its own tokens) and a sampled one."""
    path, parts = llama
    rng = np.random.default_rng(4)
    prompt = [int(t) for t in rng.integers(3, 500, size=40)]
    allowed = sorted({int(t) for t in rng.integers(3, 500, size=24)})
    other = [int(t) for t in rng.integers(3, 500, size=20)]
    out = run(parts, [Request("allowed", prompt, greedy(12, allowed_token_ids=allowed)),
                      Request("sampled", other, SamplingParams(max_tokens=16, temperature=1.5, seed=9,
                                                               allowed_token_ids=allowed[:3])),
                      Request("free", other, greedy(12))])
    assert out["allowed"] == hf_greedy(path, prompt, 12, allowed=allowed)
    assert out["allowed"] != hf_greedy(path, prompt, 12)
    assert set(out["sampled"]) <= set(allowed[:3]) and len(set(out["sampled"])) > 1
    assert out["free"] == hf_greedy(path, other, 12)
    assert parts.runner.compiles_after_warmup == 0


def test_bad_words_match_transformers_bad_words_ids(llama):
    """A one-token bad word is never sampled; a two-token one bans its second token right after its
    first. Greedy tokens equal transformers' with the same bad_words_ids (whose prefix is not the
    prompt's last token: transformers matches over the prompt too, vLLM and we over the output)."""
    path, parts = llama
    rng = np.random.default_rng(6)
    prompt = [int(t) for t in rng.integers(3, 500, size=40)]
    plain = hf_greedy(path, prompt, 16)
    one = [[plain[1]]]
    once = hf_greedy(path, prompt, 16, bad_words_ids=one)
    pair = [once[5], once[6]]
    assert pair[0] != prompt[-1]
    want = hf_greedy(path, prompt, 16, bad_words_ids=one + [pair])
    assert want[:6] == once[:6] and want[6] != once[6]      # the pair's ban changed the 7th token
    out = run(parts, [Request("worded", prompt, greedy(16, bad_words_token_ids=one + [pair])),
                      Request("free", prompt[:20], greedy(8))])
    assert out["worded"] == want
    assert out["free"] == hf_greedy(path, prompt[:20], 8)
    assert parts.runner.compiles_after_warmup == 0


def test_bfloat16_engine_follows_transformers_bfloat16(tiny_models):
    """bf16 end to end (uint16-bits KV pool on the CPU path): every greedy token is one transformers'
    bf16 forward also ranks best, up to bf16 rounding, and nothing compiles after warm-up.

    Tokens are not compared one for one: near-ties in a random tiny model may round either way in
    bf16. Instead, transformers (bf16, teacher-forced on our tokens) must give each of our tokens a
    logit within 0.05 of its best: ~3 bf16 ulps of these O(1)-O(5) logits; a wrong token in a random
    model is off by ~1.
    """
    path = tiny_models["llama"]
    parts = build(path, dtype="bfloat16")
    assert all(c.dtype == np.uint16 for c in parts.runner.kv_caches)
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, 500, size=40)]
    ours = run(parts, [Request("a", prompt, greedy(16))])["a"]
    assert parts.runner.compiles_after_warmup == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:-1].float().numpy()
    gaps = logits.max(-1) - logits[np.arange(len(ours)), ours]
    assert gaps.max() <= 0.05, gaps
    assert len(set(ours)) > 1
