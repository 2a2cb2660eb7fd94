"""Engine-thread cost of building outputs: CUMULATIVE (every step copies everything so far)
against DELTA (only what is new) and FINAL_ONLY, for long generations with logprobs.

Feeds the OutputProcessor the token diffs of `--requests` sequences generating `--tokens`
tokens each (one per step, 5 logprobs each, the default model's tokenizer), and times
`process()` over the whole run for each kind, interleaved, `--repeats` times; prints the
medians and the ratios. No model runs: this is the host-side work a step adds.

    python benchmarks/output_kinds.py [--requests 64] [--tokens 1000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from checkpoints import load_default_model
from jaxserve.core import EngineCoreOutput, Logprobs, RequestOutputKind, SamplingParams
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.tokenizer import Tokenizer


def run(tokenizer, kind: RequestOutputKind, requests: int, tokens: int, seed: int) -> float:
    rng = random.Random(seed)
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=tokens, logprobs=5, output_kind=kind)
    for r in range(requests):
        proc.add(f"r{r}", None, [1, 2, 3], params, [f"r{r}"], 0.0)
    diffs = [[EngineCoreOutput(f"r{r}", [t := rng.randrange(100, 20000)],
                               [Logprobs(-1.0, [t, 5, 6, 7, 8], [-1.0, -2.0, -3.0, -4.0, -5.0])],
                               finish_reason="length" if step == tokens - 1 else None)
              for r in range(requests)] for step in range(tokens)]
    start = time.perf_counter()
    for step, outs in enumerate(diffs):
        proc.process(outs, float(step))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    tokenizer = Tokenizer.from_checkpoint(load_default_model())
    times: dict[RequestOutputKind, list[float]] = {k: [] for k in RequestOutputKind}
    for repeat in range(args.repeats):
        for kind in RequestOutputKind:
            times[kind].append(run(tokenizer, kind, args.requests, args.tokens, repeat))
    delta = statistics.median(times[RequestOutputKind.DELTA])
    steps = args.tokens
    print(f"{args.requests} sequences x {args.tokens} tokens, logprobs=5, median of {args.repeats}:")
    for kind in RequestOutputKind:
        med = statistics.median(times[kind])
        print(f"  {kind.name:11s} {med:7.2f} s total, {1000 * med / steps:6.2f} ms per step, "
              f"{med / delta:5.2f}x DELTA")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
