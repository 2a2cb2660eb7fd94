"""The public LLM API on the default model (SmolLM2-135M-Instruct from the GGUF)."""

import pytest

from jaxserve import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_num_batched_tokens=64, max_num_seqs=16, max_model_len=512,
               token_buckets=(1, 4, 16, 64))


def test_generate_in_order_and_batch_invariant(llm):
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    prompts = ["Once upon a time", "The capital of France is", "def fibonacci(n):",
               "List three colors:", "In 1492,", "Water boils at"] * 2
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert outs[0].outputs[0].text.startswith(", the city of Nova Haven was a thriving metropolis")
    assert [o.prompt for o in outs] == prompts
    alone = llm.generate(["def fibonacci(n):"], greedy, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outs[2].outputs[0].token_ids == outs[8].outputs[0].token_ids
    assert llm.engine.stats()["compiles_after_warmup"] == 0


def test_chat_uses_the_gguf_chat_template(llm):
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    tok = llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids, skip_special_tokens=False).startswith("<|im_start|>")
    assert "Paris" in out.outputs[0].text


def test_ngram_speculation_gives_the_same_greedy_tokens(llm):
    """The default model copying passages (where drafts are accepted) and free generation,
    with and without n-gram speculation, in one mixed batch."""
    spec = LLM(dtype="float32", max_num_batched_tokens=64, max_num_seqs=16, max_model_len=512,
               token_buckets=(1, 4, 16, 64), speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                                 "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    passage = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil and "
               "a rag, and lit the lamp that warned the boats away from the rocks.")
    chats = [[{"role": "user", "content": f"Repeat this text exactly: {passage}"}],
             [{"role": "user", "content": "List the days of the week, then list them again."}]]
    greedy = SamplingParams(max_tokens=60, temperature=0.0)
    want = [o.outputs[0].token_ids for o in llm.chat(chats, greedy, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.chat(chats, greedy, use_tqdm=False)]
    assert got == want
    prompts = ["Once upon a time", "def fibonacci(n):", "1, 2, 3, 4, 5,"]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    stats = spec.engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 20 and stats["compiles_after_warmup"] == 0
