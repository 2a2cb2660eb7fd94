"""Run by tests/engine/test_kv_transfer.py with 4 forced CPU devices: producers with tp=2 and
tp=4 export, a tp=1 consumer pulls; prints how many outputs equal a plain tp=1 engine's."""

import sys

import numpy as np

from jaxserve.core import SamplingParams
from jaxserve.engine.llm_engine import LLMEngine
from tests.conftest import TINY_ENGINE_OPTIONS

from .kv_harness import KVServer, consume, produce, run


def main(model: str) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain = LLMEngine.from_kwargs(model, **TINY_ENGINE_OPTIONS)
    consumer = LLMEngine.from_kwargs(model, kv_role="consumer", **TINY_ENGINE_OPTIONS)
    for tp in (2, 4):
        # New prompts per producer: the consumer's prefix cache must not already hold them.
        rng = np.random.default_rng(tp)
        prompts = [[int(t) for t in rng.integers(3, 500, size=n)] for n in (20, 47, 90)]
        want = [run(plain, f"ref{tp}-{i}", p, greedy).outputs[0].token_ids for i, p in enumerate(prompts)]
        producer = LLMEngine.from_kwargs(model, kv_role="producer", tensor_parallel_size=tp, **TINY_ENGINE_OPTIONS)
        server = KVServer(producer)
        same = 0
        for i, p in enumerate(prompts):
            kv = produce(producer, f"p{tp}-{i}", p, greedy, f"t{tp}-{i}")
            got = consume(consumer, f"c{tp}-{i}", p, greedy, kv, server.address)
            same += got.outputs[0].token_ids == want[i]
        server.stop()
        received = consumer.kv_stats.snapshot()["outcomes"].get("received", 0)
        print(f"tp={tp} identical {same}/{len(prompts)}, pulls received so far {received}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
