"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs) through the scheduler + runner loop.

The oracle is Hugging Face transformers on the tiny llama: the entry for prompt token i is
log_softmax of transformers' logits at position i - 1, and its top-N are that row's best.
The EngineCoreOutputs are read straight from `scheduler.update_from_output`, chunked
prefill spreads each prompt over several steps, and the variant of the step that computes
them runs only in steps that need it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from jaxserve.config import EngineConfig
from jaxserve.core import Request, SamplingParams
from jaxserve.engine.builder import build_engine_parts
from jaxserve.runner import model_runner
from jaxserve.runner.inputs import RequestState, num_prompt_logprob_positions, prepare_prompt_logprobs

ATOL = 1e-4   # as tests/runner/test_runner.py's logprobs check


def build(path, **kw):
    opts = dict(dtype="float32", max_num_batched_tokens=16, max_num_seqs=4, num_kv_blocks=64, max_model_len=128,
                token_buckets=(4, 16))
    opts.update(kw)
    return build_engine_parts(EngineConfig(model=str(path), **opts))


def drive(parts, requests, on_schedule=None):
    """Add requests and step until they end; returns {id: [EngineCoreOutput, ...]}."""
    for r in requests:
        parts.scheduler.add_request(r)
    outs = {r.request_id: [] for r in requests}
    while parts.scheduler.has_unfinished_requests():
        so = parts.scheduler.schedule()
        if on_schedule is not None:
            on_schedule(so)
        for o in parts.scheduler.update_from_output(so, parts.runner.execute(so)):
            outs[o.req_id].append(o)
    return outs


def prompt_entries(outputs):
    return [e for o in outputs for e in (o.new_prompt_logprobs or [])]


def tokens(outputs):
    return [t for o in outputs for t in o.new_token_ids]


def random_prompt(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, size=n)]


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def hf(tiny_models):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()

    def logprobs(ids):
        """[len(ids), V] float64 log_softmax of transformers' logits."""
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()
    return logprobs


@pytest.fixture(scope="module")
def parts(tiny_models):
    return build(tiny_models["llama"])


@pytest.fixture
def used_variant(parts, monkeypatch):
    """Per executed step, whether it ran the prompt-logprobs variant of the step."""
    calls, original = [], parts.runner._executable

    def spy(bucket, prompt_logprobs=False):
        calls.append(prompt_logprobs)
        return original(bucket, prompt_logprobs)
    monkeypatch.setattr(parts.runner, "_executable", spy)
    return calls


def assert_matches(entries, prompt, ref, k):
    """entries[j] is prompt token j + 1 given tokens 0..j: ref row j."""
    assert len(entries) == len(prompt) - 1
    rows = ref[:len(prompt) - 1]
    np.testing.assert_allclose([e.token_logprob for e in entries], rows[np.arange(len(rows)), prompt[1:]], atol=ATOL)
    for j, e in enumerate(entries):
        assert e.top_token_ids == np.argsort(-rows[j], kind="stable")[:k].tolist(), j
        np.testing.assert_allclose(e.top_logprobs, np.sort(rows[j])[::-1][:k], atol=ATOL)


def test_prompt_logprobs_over_chunked_prefill_match_transformers(parts, hf, used_variant):
    prompt = random_prompt(1, 40)    # budget 16: chunks of 16, 16, 8
    other = random_prompt(2, 5)      # shares the steps, asks for nothing
    outs = drive(parts, [Request("p", prompt, greedy(4, prompt_logprobs=5)), Request("o", other, greedy(4))])
    p = outs["p"]
    # Two outputs while prefilling (no token, prompt logprobs only), then the one with the first token.
    assert [len(o.new_token_ids) for o in p[:3]] == [0, 0, 1]
    assert [len(o.new_prompt_logprobs) for o in p[:3]] == [16, 16, 7]
    assert all(o.new_prompt_logprobs is None for o in p[3:] + outs["o"])
    assert_matches(prompt_entries(p), prompt, hf(prompt), 5)
    # The variant ran exactly in the three prefill steps; decode steps ran the warmed-up step.
    assert used_variant[:3] == [True] * 3 and not any(used_variant[3:])
    assert parts.runner.compiles_after_warmup == 0
    # Greedy tokens are the same as without prompt logprobs, and as transformers'.
    again = drive(parts, [Request("p2", prompt, greedy(4)), Request("o2", other, greedy(4))])
    assert tokens(p) == tokens(again["p2"]) and tokens(outs["o"]) == tokens(again["o2"])
    assert tokens(p) == np.argmax(hf(prompt + tokens(p)[:3])[len(prompt) - 1:], -1).tolist()


def test_prompt_logprobs_zero_gives_only_each_tokens_own(parts, hf):
    prompt = random_prompt(3, 21)
    outs = drive(parts, [Request("z", prompt, greedy(1, prompt_logprobs=0)),
                         Request("one", [7], greedy(1, prompt_logprobs=3))])
    entries = prompt_entries(outs["z"])
    assert all(e.top_token_ids == [] and e.top_logprobs == [] for e in entries)
    assert_matches(entries, prompt, hf(prompt), 0)
    assert prompt_entries(outs["one"]) == []    # a one-token prompt has no defined prompt logprob


def test_logprobs_and_prompt_logprobs_together(parts, hf):
    prompt = random_prompt(4, 30)
    out = drive(parts, [Request("b", prompt, greedy(3, logprobs=2, prompt_logprobs=3))])["b"]
    generated = tokens(out)
    ref = hf(prompt + generated)
    assert_matches(prompt_entries(out), prompt, ref, 3)
    gen_lps = [lp for o in out for lp in o.new_logprobs]
    assert len(gen_lps) == 3
    for j, (tok, lp) in enumerate(zip(generated, gen_lps)):
        row = ref[len(prompt) - 1 + j]
        assert lp.token_logprob == pytest.approx(row[tok], abs=ATOL)
        assert lp.top_token_ids == np.argsort(-row, kind="stable")[:2].tolist()


def test_siblings_each_get_them_and_no_prompt_logprobs_request_reads_the_prefix_cache(parts, hf):
    prompt = random_prompt(5, 36)    # two full blocks of 16
    drive(parts, [Request("warm", prompt, greedy(1))])               # writes the prompt's blocks
    hits = parts.scheduler.kv.stats.hits
    outs = drive(parts, [Request(f"{i}_n2", prompt, greedy(2, prompt_logprobs=2)) for i in range(2)])
    ref = hf(prompt)
    for i in range(2):
        assert outs[f"{i}_n2"][-1].num_cached_tokens == 0
        assert_matches(prompt_entries(outs[f"{i}_n2"]), prompt, ref, 2)
    assert parts.scheduler.kv.stats.hits == hits
    # The cache is still there for requests that do not ask.
    after = drive(parts, [Request("reader", prompt, greedy(1))])
    assert after["reader"][-1].num_cached_tokens == 32


def test_preempted_mid_prompt_emits_each_entry_once(tiny_models, hf, monkeypatch):
    # 10 usable blocks of 4 tokens: "b" (older) grows to 40 tokens while "a" prefills 30 in
    # chunks of 7, so "a" (newest) is preempted mid-prompt and recomputed from scratch.
    # This runner's variant also computes its 8 positions in chunks of 3 (the last one padded).
    monkeypatch.setattr(model_runner, "_PROMPT_LOGPROBS_ROWS", 3)
    parts = build(tiny_models["llama"], block_size=4, num_kv_blocks=11, max_model_len=40,
                  max_num_batched_tokens=8, max_num_seqs=4, token_buckets=(8,), enable_prefix_caching=False)
    prompt = random_prompt(6, 30)
    emitted_when_preempted = []

    def on_schedule(so):
        if "a" in so.preempted_req_ids:
            emitted_when_preempted.append(parts.scheduler.requests["a"].num_prompt_logprobs_emitted)
    outs = drive(parts, [Request("b", random_prompt(7, 8), greedy(32)),
                         Request("a", prompt, greedy(2, prompt_logprobs=1))], on_schedule)
    assert emitted_when_preempted and 0 < emitted_when_preempted[0] < len(prompt) - 1
    assert_matches(prompt_entries(outs["a"]), prompt, hf(prompt), 1)
    assert tokens(outs["a"]) == np.argmax(hf(prompt + tokens(outs["a"])[:1])[len(prompt) - 1:], -1).tolist()
    assert parts.runner.compiles_after_warmup == 0


def test_prompt_logprobs_inputs_by_hand():
    """Flat positions whose next token is a prompt token get that token; others 0 (no device)."""
    def state(req_id, tokens, num_prompt, computed, prompt_logprobs):
        return RequestState(req_id, token_ids=tokens, num_prompt_tokens=num_prompt, block_ids=[1, 2],
                            num_computed_tokens=computed, sampling_params=SamplingParams(prompt_logprobs=prompt_logprobs),
                            seed=0)
    decode = state("d", [10, 11, 12, 13], 3, 3, 2)        # past its prompt: nothing
    chunk = state("c", [20, 21, 22, 23, 24], 5, 1, 0)     # positions 1..3 -> tokens 22, 23, 24
    plain = state("p", [30, 31, 32], 3, 0, None)          # did not ask
    last = state("l", [40, 41, 42], 3, 1, 1)              # positions 1..2: only 1 has a prompt token after it
    scheduled = [(decode, 1), (chunk, 3), (plain, 3), (last, 2)]
    assert [num_prompt_logprob_positions(st, n) for st, n in scheduled] == [0, 3, 0, 1]
    x = prepare_prompt_logprobs(scheduled, num_tokens_bucket=16)
    assert x.next_token_ids.tolist() == [0, 22, 23, 24, 0, 0, 0, 42] + [0] * 8
    assert bool(x.want_top)
    assert not bool(prepare_prompt_logprobs([(chunk, 3)], num_tokens_bucket=4).want_top)
    assert prepare_prompt_logprobs([(decode, 1), (plain, 3), (last, 1)], num_tokens_bucket=8) is not None
    assert prepare_prompt_logprobs([(decode, 1), (plain, 3)], num_tokens_bucket=8) is None


@pytest.mark.parametrize("value", [-1, 1.5, True, "3"])
def test_bad_prompt_logprobs_value_is_named(value):
    with pytest.raises(ValueError) as e:
        SamplingParams(prompt_logprobs=value)
    assert "prompt_logprobs" in str(e.value) and repr(value) in str(e.value)


def test_prompt_logprobs_above_max_logprobs_is_refused(tiny_engine):
    with pytest.raises(ValueError, match=r"prompt_logprobs=21 exceeds max_logprobs=20"):
        tiny_engine.add_request("too-many", [5, 6, 7], SamplingParams(prompt_logprobs=21))
    assert not tiny_engine.has_unfinished_requests()
