"""What the sampling controls cost a step: logit_bias, allowed_token_ids and bad words against
the same batch without them.

One engine (the default model), one process, the runs interleaved `--repeats` times, each
the same prompts (the random workload's), greedy, EOS ignored, so every run takes the same
steps over the same batch sizes:
  plain        no control: the step skips the bias and the bitmask (lax.cond)
  logit_bias   300 tokens biased in every request (the most a request may give): [rows, 300]
               ids and values filled per step on the host, added on the device
  allowed      allowed_token_ids of all but 64 of the vocabulary: each request's mask made
               once, AND-ed into the step's bitmask, which the step applies
  bad_words_1  eight one-token bad words: banned in the bitmask every step
  bad_words_2  eight two-token bad words: read the output on the host, so these requests run
               their steps one by one (no async scheduling)
Reported as ms per step (median) and the ratio to plain.

    python benchmarks/sampling_controls.py [--batch 64] [--tokens 64] [--repeats 3] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
from structured_output_bench import timed
from workloads import offline_random_prompts

from jaxserve import LLM, SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.batch, 1))
    vocab = llm.engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": p} for p in offline_random_prompts(args.batch, vocab)]
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.choice(np.arange(100, vocab), size=300, replace=False)]
    plain = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    runs = {
        "plain": plain,
        "logit_bias": plain.clone(logit_bias={t: 0.5 for t in ids}),
        "allowed": plain.clone(allowed_token_ids=sorted(set(range(vocab)) - set(ids[:64]))),
        "bad_words_1": plain.clone(bad_words_token_ids=[[t] for t in ids[:8]]),
        "bad_words_2": plain.clone(bad_words_token_ids=[[a, b] for a, b in zip(ids[:8], ids[8:16])]),
    }
    for params in runs.values():        # warm the host paths
        timed(llm, prompts[:2], params)
    results: dict[str, list] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, params in runs.items():
            results[name].append(timed(llm, prompts, params))
    print(f"{args.batch} sequences x {args.tokens} tokens, greedy, {args.dtype}, median of {args.repeats}:")
    base = statistics.median(1000 * s / n for s, n, _ in results["plain"])
    for name, rs in results.items():
        ms = statistics.median(1000 * s / n for s, n, _ in rs)
        steps = statistics.median(n for _, n, _ in rs)
        print(f"  {name:12s} {ms:7.1f} ms per step over {steps:.0f} steps, {ms / base:.3f} x plain")
    print(f"  compiles after warm-up: {llm.engine.stats()['compiles_after_warmup']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
