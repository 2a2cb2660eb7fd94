"""The offline LLM API and LLMEngine on the tiny model, through the public interface."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.protocol import ChatCompletionRequest


@pytest.fixture(scope="module")
def llm(tiny_engine):
    return LLM.from_engine(tiny_engine)


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 500, size=int(k))] for k in rng.integers(1, 120, size=n)]


def test_outputs_come_back_in_input_order(llm):
    ps = ["hello there", [5, 6, 7], {"prompt_token_ids": [9, 10]}, {"prompt": "the cat"}]
    outs = llm.generate(ps, [SamplingParams(max_tokens=k, ignore_eos=True) for k in (5, 1, 3, 2)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 1, 3, 2]
    assert outs[0].prompt == "hello there" and outs[1].prompt_token_ids == [5, 6, 7]
    assert outs[2].prompt_token_ids == [9, 10] and outs[3].prompt == "the cat"
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_greedy_is_batch_invariant_with_chunked_prefill(llm):
    ps = prompts(32, seed=1)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    batch = llm.generate(ps, greedy, use_tqdm=False)
    for i in (0, 7, 31):
        alone = llm.generate([ps[i]], greedy, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == batch[i].outputs[0].token_ids
    assert llm.engine.stats()["compiles_after_warmup"] == 0


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    ps = prompts(10, seed=2)
    params = [SamplingParams(max_tokens=10, temperature=1.0, top_k=50, seed=i, ignore_eos=True) for i in range(10)]
    a = llm.generate(ps, params, use_tqdm=False)
    b = llm.generate(ps, params, use_tqdm=False)
    alone = llm.generate([ps[4]], params[4], use_tqdm=False)[0]
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert alone.outputs[0].token_ids == a[4].outputs[0].token_ids
    assert len({tuple(o.outputs[0].token_ids) for o in a}) > 5   # different seeds, different samples


def test_n2_returns_two_completions_and_computes_the_prompt_once(llm):
    engine = llm.engine
    prompt = list(range(100, 180))                                       # 80 tokens = 5 full blocks
    before = engine.stats()
    (out,) = llm.generate([prompt], SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True),
                          use_tqdm=False)
    after = engine.stats()
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    # The second sibling hits every full block of the prompt but the last (one token is always computed).
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 64
    assert after["prompt_tokens"] - before["prompt_tokens"] == 80 + 16


def test_stop_string_across_tokens(llm):
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    free = llm.generate(["once upon"], greedy, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    # Choose a stop string that starts inside one token's text and ends inside a later one.
    pieces = [tok.decode(free.token_ids[:i]) for i in range(len(free.token_ids) + 1)]
    start = next(i for i in range(2, len(pieces) - 2) if len(pieces[i + 1]) - len(pieces[i]) >= 2)
    cut = len(pieces[start]) + 1
    stop = free.text[cut:cut + 3]
    stopped = llm.generate(["once upon"], greedy.clone(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == free.text[:free.text.index(stop)]
    kept = llm.generate(["once upon"], greedy.clone(stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == free.text[:free.text.index(stop) + len(stop)]


def test_abort_mid_generation_returns_every_block(llm):
    engine = llm.engine
    total = engine.stats()["kv_total_blocks"]
    for i, p in enumerate(prompts(6, seed=3)):
        engine.add_request(f"abort-{i}", p, SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.stats()["kv_free_blocks"] < total
    outs = engine.abort_request([f"abort-{i}" for i in range(6)])
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished_requests()
    assert engine.stats()["kv_free_blocks"] == total
    assert engine.step() == []


def test_logprobs_and_metrics(llm):
    (out,) = llm.generate(["abc"], SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True), use_tqdm=False)
    c = out.outputs[0]
    assert len(c.logprobs) == 4 and all(t in lp for t, lp in zip(c.token_ids, c.logprobs))
    assert c.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs)))
    m = out.metrics
    assert m.ttft > 0 and len(m.token_times) == 4 and m.e2e_latency >= m.ttft


@pytest.mark.parametrize("bad,match", [
    ({"prompts": [[]]}, "empty"),
    ({"prompts": [[1, 99999]]}, "token id 99999 is out of range"),
    ({"prompts": [[1] * 200]}, "200 tokens.*maximum context length is 128"),
    ({"prompts": [1.5]}, "prompt must be a string or a list of token ids"),
    ({"prompts": ["a"], "sampling_params": SamplingParams(logprobs=50)}, "logprobs=50 exceeds max_logprobs=20"),
    ({"prompts": ["a", "b"], "sampling_params": [SamplingParams()]}, "1 sampling_params for 2 prompts"),
])
def test_bad_inputs_raise_clear_errors_and_leave_nothing_behind(llm, bad, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(bad["prompts"], bad.get("sampling_params"), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats()["kv_free_blocks"] == llm.engine.stats()["kv_total_blocks"]


def test_unknown_engine_option_is_refused(tiny_models):
    with pytest.raises(TypeError, match="unknown engine option.*max_num_seq\\b"):
        LLM(str(tiny_models["llama"]), max_num_seq=4)


def test_chat_applies_the_template(llm):
    (out,) = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, ignore_eos=True),
                      use_tqdm=False)
    tok = llm.get_tokenizer()
    expected = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]), add_special_tokens=False)
    assert out.prompt_token_ids == expected and len(out.outputs[0].token_ids) == 3


def test_chat_takes_openai_messages_as_the_server_does(llm):
    # Content as text parts (it raised TypeError inside the template), an assistant's tool call
    # with its arguments as a JSON string; the output's prompt is the rendered text.
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
             {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    (out,) = llm.chat(parts, params, use_tqdm=False)
    tok = llm.get_tokenizer()
    rendered = ChatCompletionRequest(messages=parts).render(tok)
    assert out.prompt == rendered and out.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    assert "hi there" in rendered
    (plain,) = llm.chat([{"role": "user", "content": "hi there"}], params, use_tqdm=False)
    (joined,) = llm.chat(parts[:1], params, use_tqdm=False)
    assert joined.prompt_token_ids == plain.prompt_token_ids
    assert joined.outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(ValueError, match="only text content parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params,
                 use_tqdm=False)


def test_min_tokens_bans_every_stop_token_id(llm):
    # vLLM bans EOS and every stop token id until min_tokens: 40 of them were a ValueError (the
    # step had room for 8, EOS included even under ignore_eos).
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    free = llm.generate(["abc"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    stops = sorted(set(free) | set(range(100, 140)))
    assert len(stops) >= 40
    for ignore_eos in (True, False):
        params = greedy.clone(min_tokens=10, stop_token_ids=stops, ignore_eos=ignore_eos)
        out = llm.generate(["abc"], params, use_tqdm=False)[0].outputs[0]
        assert not set(out.token_ids[:10]) & set(stops) and len(out.token_ids) >= 10
        assert out.finish_reason == "length" or out.token_ids[-1] in stops or not ignore_eos
    with pytest.raises(ValueError, match="with min_tokens, at most 136 stop_token_ids are supported, got 137"):
        llm.generate(["abc"], greedy.clone(min_tokens=1, stop_token_ids=list(range(137))), use_tqdm=False)


def test_stop_token_text_is_not_in_the_output(llm):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    free = llm.generate(["abc"], greedy, use_tqdm=False)[0].outputs[0]
    stop_id = free.token_ids[3]
    first = free.token_ids.index(stop_id)
    out = llm.generate(["abc"], greedy.clone(stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == free.token_ids[:first + 1]           # the stop token is in token_ids ...
    assert out.text == tok.decode(free.token_ids[:first])         # ... but not in the text


def test_kv_pool_smaller_than_the_context_is_refused(tiny_models):
    with pytest.raises(ValueError, match="KV pool holds 48 tokens.*less than max_model_len=128"):
        LLM(str(tiny_models["llama"]), num_kv_blocks=4, max_model_len=128, max_num_batched_tokens=16,
            max_num_seqs=4, token_buckets=(16,))


@pytest.mark.parametrize("option,match", [({"attention_backend": "pallas_gpu"},
                                           "'pallas_gpu' needs an NVIDIA GPU.*available: 'auto', 'reference'"),
                                          ({"attention_backend": "pallas_tpu"}, "'pallas_tpu' needs a TPU"),
                                          ({"tensor_parallel_size": 2}, "needs 2 devices, but only 1 cpu device"),
                                          ({"dtype": "float64"}, "dtype='float64' must be one of")])
def test_options_not_built_yet_fail_loudly(tiny_models, option, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_models["llama"]), **option)


def test_bad_words_are_never_generated(llm):
    """bad_words as vLLM takes them: the words of the free greedy text's first tokens, tokenized
    alone and after a space; no sequence of them occurs in the output, which changes."""
    from jaxserve.engine.llm_engine import bad_words_token_ids

    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    free = llm.generate(["once upon"], greedy, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    words = sorted({tok.decode([t]).strip() for t in free.token_ids[:10]} - {""})
    seqs = bad_words_token_ids(words, tok)
    assert [free.token_ids[0]] in seqs and any(len(s) > 1 for s in seqs)
    out = llm.generate(["once upon"], greedy.clone(bad_words=words), use_tqdm=False)[0].outputs[0]
    ids = out.token_ids
    assert len(ids) == 30 and ids != free.token_ids
    assert not any(ids[i:i + len(s)] == s for s in seqs for i in range(len(ids)))


def test_chat_continues_the_final_message(llm):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well, the"}]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    (out,) = llm.chat(messages, params, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)
    (closed,) = llm.chat(messages, params, add_generation_prompt=False, use_tqdm=False)
    tok = llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids, skip_special_tokens=False).endswith("Well, the")
    assert len(closed.prompt_token_ids) > len(out.prompt_token_ids)
    with pytest.raises(ValueError, match="cannot both be set"):
        llm.chat(messages, params, continue_final_message=True, use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    prompt = [int(t) for t in np.random.default_rng(8).integers(3, 500, size=40)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    cut, whole, short = llm.generate([prompt, prompt, prompt[-10:]],
                                     [greedy.clone(truncate_prompt_tokens=10), greedy.clone(truncate_prompt_tokens=-1),
                                      greedy], use_tqdm=False)
    assert cut.prompt_token_ids == prompt[-10:] and cut.outputs[0].token_ids == short.outputs[0].token_ids
    assert whole.prompt_token_ids == prompt
    with pytest.raises(ValueError, match="at most the model's context length"):
        llm.generate([prompt], greedy.clone(truncate_prompt_tokens=llm.engine.max_model_len + 1), use_tqdm=False)
