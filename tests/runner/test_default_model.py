"""The default model (SmolLM2-135M-Instruct from the GGUF) end to end through the runner."""

import pytest

from jaxserve.config import EngineConfig
from jaxserve.core import Request, SamplingParams
from jaxserve.engine.builder import build_engine_parts

pytestmark = pytest.mark.slow

# Greedy continuation recorded in JAX_NOTES.md (same in transformers and a numpy reimplementation).
EXPECTED = (", the city of Nova Haven was a thriving metropolis, with towering skyscrapers and bustling "
            "streets. But as")


def test_once_upon_a_time_greedy_continuation():
    parts = build_engine_parts(EngineConfig(dtype="float32", max_num_batched_tokens=32, max_num_seqs=8,
                                            max_model_len=256))
    tok = parts.tokenizer
    prompt = tok.encode("Once upon a time")
    parts.scheduler.add_request(Request("a", prompt, SamplingParams(max_tokens=22, temperature=0),
                                        eos_token_ids=tok.eos_token_ids))
    out = []
    while parts.scheduler.has_unfinished_requests():
        so = parts.scheduler.schedule()
        for o in parts.scheduler.update_from_output(so, parts.runner.execute(so)):
            out += o.new_token_ids
    assert tok.decode(out).startswith(EXPECTED), tok.decode(out)
    assert parts.runner.compiles_after_warmup == 0
