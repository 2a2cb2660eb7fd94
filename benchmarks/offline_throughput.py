"""Offline throughput of `LLM.generate` on the default model, side by side with
transformers' batched `generate` on the same prompts (same process, same machine).

Workload (as in JAX_NOTES.md's reference points): N requests, prompts of 64-256 tokens,
M output tokens each, greedy, EOS ignored so every request produces exactly M tokens.

    python benchmarks/offline_throughput.py [--num-requests 64] [--output-len 128] [--transformers]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from jaxserve import LLM, SamplingParams


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab - 100, size=int(k)).tolist() for k in rng.integers(64, 257, size=n)]


def run_jaxserve(args, prompts) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    llm = LLM(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              max_model_len=512)
    startup = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)   # first-call costs
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    stats = llm.engine.stats()
    print(f"jaxserve: start-up {startup:.1f} s ({llm.engine.startup_seconds}), "
          f"compiles after warm-up {stats['compiles_after_warmup']}, preemptions {stats['num_preemptions']}")
    return elapsed, [o.outputs[0].token_ids for o in outs]


def run_transformers(args, prompts, batch_size: int) -> float:
    import torch
    import transformers

    from checkpoints.default_model import load_default_model
    ckpt = load_default_model()
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i:i + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.output_len,
                           min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--transformers", action="store_true", help="also time transformers' batched generate")
    ap.add_argument("--transformers-batch", type=int, default=64)
    args = ap.parse_args()
    prompts = make_prompts(args.num_requests, 49152)
    total_out = args.num_requests * args.output_len
    elapsed, _ = run_jaxserve(args, prompts)
    print(f"| engine | requests | prompt tokens | output tokens | seconds | output tok/s |")
    print(f"|---|---:|---:|---:|---:|---:|")
    print(f"| jaxserve LLM.generate | {len(prompts)} | {sum(map(len, prompts))} | {total_out} | {elapsed:.1f} "
          f"| {total_out / elapsed:.1f} |")
    if args.transformers:
        hf = run_transformers(args, prompts, args.transformers_batch)
        print(f"| transformers generate (batch {args.transformers_batch}) | {len(prompts)} | "
              f"{sum(map(len, prompts))} | {total_out} | {hf:.1f} | {total_out / hf:.1f} |")
        print(f"ratio jaxserve / transformers: {hf / elapsed:.2f}x")


if __name__ == "__main__":
    main()
