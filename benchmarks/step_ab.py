"""Two builds of the engine's step side by side in one process: A/B of an environment switch.

Each configuration is an `LLMEngine` built (and warmed up) with its environment variables set
(e.g. `JAXSERVE_NATIVE_GEMM=0` keeps XLA's dots); the synthetic steps of roofline.py then run
alternately on the two engines, so machine noise hits both alike. Prints the median step time
of each and the ratio B / A.

    python benchmarks/step_ab.py --a JAXSERVE_NATIVE_GEMM=1 --b JAXSERVE_NATIVE_GEMM=0 \\
        [--dtype float32] [--steps 64x1@256,1x512@256,32x1@1104/1024] [--rounds 5] [--buckets 1,64,512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from roofline import synthetic_step_time

from jaxserve.engine.llm_engine import LLMEngine


def build(env: list[str], args) -> LLMEngine:
    for item in env:
        name, _, value = item.partition("=")
        os.environ[name] = value
    buckets = sorted(int(b) for b in args.buckets.split(","))
    return LLMEngine.from_kwargs(None, dtype=args.dtype, max_num_seqs=min(64, buckets[-1]),
                                 max_num_batched_tokens=buckets[-1], token_buckets=buckets)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", nargs="*", default=[], help="NAME=VALUE settings of configuration A")
    ap.add_argument("--b", nargs="*", default=[], help="NAME=VALUE settings of configuration B")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--steps", default="64x1@256,1x512@256",
                    help="SEQSxTOKENS@CONTEXT[/SHARED], comma-separated; SHARED: tokens of the context whose "
                         "blocks every sequence shares (a cached prefix)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--buckets", default="64,512", help="the engines' token buckets (add 1 for batch-1 steps)")
    args = ap.parse_args(argv)
    engines = {"A": build(args.a, args), "B": build(args.b, args)}
    print(f"A: {' '.join(args.a) or '(default)'}   B: {' '.join(args.b) or '(default)'}   dtype {args.dtype}")
    print("| step | A ms | B ms | B / A |\n|---|---:|---:|---:|")
    for spec in args.steps.split(","):
        shape, _, context = spec.partition("@")
        context, _, shared = context.partition("/")
        seqs, tokens = map(int, shape.split("x"))
        times = {"A": [], "B": []}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                times[name].append(synthetic_step_time(engine, seqs, tokens, int(context), reps=2,
                                                       shared=int(shared or 0))[0])
        a, b = statistics.median(times["A"]), statistics.median(times["B"])
        label = f"{seqs} x {tokens} after {context}" + (f" ({shared} shared)" if shared else "")
        print(f"| {label} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
