"""What structured output costs a step: the same batch unconstrained, with the bitmask input
present but unused (the common case), and with every sequence under a JSON schema.

One engine (the default model), one process, the runs interleaved `--repeats` times:
  plain        --batch requests, greedy, no constraint: the step skips the bitmask (lax.cond)
  constrained  the same prompts, each under a JSON schema (llguidance fills a bitmask row per
               sequence per step on the host; the step applies it)
The constraint is a JSON object no run can complete, so both runs take the same steps over
the same batch sizes: reported as ms per step and tokens per step (medians) and their ratio,
with the host time llguidance spends filling one bitmask row for a typical schema (measured
apart, the default model's vocabulary).

    python benchmarks/structured_output_bench.py [--batch 32] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from jaxserve import LLM, SamplingParams, StructuredOutputsParams
from jaxserve.engine.structured_output import bitmask_width

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
# A JSON object no run can complete (a string of at least 2,000 characters): every constrained
# sequence generates all its tokens, so the two runs have the same steps and batch sizes.
UNFINISHABLE = {"type": "object", "properties": {"text": {"type": "string", "minLength": 2000}},
                "required": ["text"], "additionalProperties": False}


def timed(llm: LLM, prompts, params) -> tuple[float, int, int]:
    """(seconds, engine steps, tokens generated) of one generate call."""
    engine, steps = llm.engine, [0]
    step = engine.step

    def counted():
        steps[0] += 1
        return step()
    engine.step = counted
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
    finally:
        del engine.step
    return seconds, steps[0], sum(len(o.outputs[0].token_ids) for o in outs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.batch, 1))
    engine = llm.engine
    prompts = [f"Write a JSON record for person number {i}:" for i in range(args.batch)]
    plain = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.tokens, temperature=0.0,
                                 structured_outputs=StructuredOutputsParams(json=UNFINISHABLE))
    timed(llm, prompts[:2], [plain, constrained])          # compile the grammar, warm the caches
    runs = {"plain": [], "constrained": []}
    for _ in range(args.repeats):
        for name, params in (("plain", plain), ("constrained", constrained)):
            runs[name].append(timed(llm, prompts, params))
    print(f"{args.batch} sequences x up to {args.tokens} tokens, greedy, {args.dtype}, median of {args.repeats}:")
    per_step = {}
    for name, results in runs.items():
        per_step[name] = statistics.median(1000 * s / n for s, n, _ in results)
        tokens = statistics.median(t / n for _, n, t in results)
        print(f"  {name:11s} {per_step[name]:7.1f} ms per step, {tokens:5.1f} tokens per step")
    print(f"  constrained / plain ms per step: {per_step['constrained'] / per_step['plain']:.3f}")
    # Host cost of one bitmask row (llguidance), apart from the model.
    grammar = engine.grammars.grammar(StructuredOutputsParams(json=SCHEMA))
    row = np.zeros((1, bitmask_width(engine.model_config.vocab_size)), np.int32)
    t0, n = time.perf_counter(), 200
    for _ in range(n):
        grammar.fill_bitmask(row, 0)
    print(f"  one bitmask row: {1e6 * (time.perf_counter() - t0) / n:.0f} us (vocabulary "
          f"{engine.model_config.vocab_size}); compiles after warm-up: {engine.stats()['compiles_after_warmup']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
