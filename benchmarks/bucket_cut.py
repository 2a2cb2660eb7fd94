"""Time to the first token of lone prompts with and without the scheduler's cut at a token bucket.

A step pads its tokens to the next token bucket. On CPU the scheduler cuts the step's last
prefill chunk at the bucket below when padding costs more than one more step for the rest
(`Scheduler._fit_bucket`; the runner's `step_fixed_tokens`, 24 on CPU). This times one prompt at
a time (`LLM.generate`, max_tokens 1, prefix caching off) with the cut on and off, alternating
in one process (medians), and first prints what a step costs at each bucket (one sequence's
prefill from an empty cache), the numbers behind the 24.

    python benchmarks/bucket_cut.py [--dtype bfloat16] [--lengths 71,130,300] [--reps 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from roofline import synthetic_step_time

from jaxserve import LLM, SamplingParams

BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lengths", default="71,130,162,186,228,300,400,700", help="prompt lengths in tokens")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    llm = LLM(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=1024, dtype=args.dtype,
              enable_prefix_caching=False)
    runner = llm.engine.runner
    cut_tokens = runner.step_fixed_tokens
    print(f"step cost by bucket, {args.dtype} (one sequence's prefill from an empty cache, ms):")
    costs = {b: min(synthetic_step_time(llm.engine, 1, b, 0, reps=5)[0] for _ in range(2)) for b in BUCKETS}
    print("| bucket | " + " | ".join(map(str, BUCKETS)) + " |\n|---|" + "---:|" * len(BUCKETS))
    print("| ms | " + " | ".join(f"{costs[b] * 1e3:.1f}" for b in BUCKETS) + " |")
    if cut_tokens is None:
        print("the runner does not cut chunks on this platform")
        return 0
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([[7] * 8], params, use_tqdm=False)
    print(f"\ntime to first token, {args.dtype}, cut at {cut_tokens} tokens of fixed cost vs no cut:")
    print("| prompt tokens | no cut ms | cut ms | cut / no cut |\n|---:|---:|---:|---:|")
    for n in map(int, args.lengths.split(",")):
        prompt = [rng.randrange(100, 40000) for _ in range(n)]
        times = {None: [], cut_tokens: []}
        for _ in range(args.reps):
            for setting in times:
                runner.step_fixed_tokens = setting
                t0 = time.perf_counter()
                llm.generate([prompt], params, use_tqdm=False)
                times[setting].append(time.perf_counter() - t0)
        off, on = (statistics.median(times[k]) * 1e3 for k in times)
        print(f"| {n} | {off:.0f} | {on:.0f} | {on / off:.2f} |", flush=True)
    runner.step_fixed_tokens = cut_tokens
    return 0


if __name__ == "__main__":
    sys.exit(main())
