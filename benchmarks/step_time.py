"""Step time of the jitted step on the default model, with and without attention.

For each token bucket: one step computing that many tokens (a prefill chunk continuing
a 256-token context), timed with the real ragged paged attention and with attention
replaced by a pass-through (K/V still written) -- the floor the attention path should
approach. Then decode throughput: B requests (128-token prompts) decoding together.

    python benchmarks/step_time.py [--buckets 16,64,256] [--batches 1,8,32,64]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax

from checkpoints import load_checkpoint
from jaxserve.core import Request, SamplingParams, Scheduler, SchedulerConfig
from jaxserve.engine.builder import build_model
from jaxserve.models import layers
from jaxserve.runner import ModelRunner


def make_runner(model, cfg, buckets, max_seqs, num_blocks, max_model_len, attention=True):
    original = layers.paged_attention
    if not attention:
        layers.paged_attention = lambda q, k, v, kv_cache, md, **kw: q   # K/V are still written
    try:
        runner = ModelRunner(model, cfg, block_size=16, num_blocks=num_blocks, max_num_batched_tokens=buckets[-1],
                             max_num_seqs=max_seqs, max_model_len=max_model_len, buckets=buckets)
        t0 = time.perf_counter()
        runner.warmup()
        warm = time.perf_counter() - t0
    finally:
        layers.paged_attention = original
    return runner, warm


def timed_steps(runner, scheduler, n):
    times = []
    for _ in range(n):
        so = scheduler.schedule()
        t0 = time.perf_counter()
        ro = runner.execute(so)
        times.append(time.perf_counter() - t0)
        scheduler.update_from_output(so, ro)
    return statistics.median(times)


def bucket_time(runner, sched_cfg, bucket, reps):
    """Median time of steps that each compute `bucket` prompt tokens after >= 256 tokens of context."""
    cfg = dataclasses.replace(sched_cfg, max_num_batched_tokens=bucket)
    reps = max(1, min(reps, (cfg.max_model_len - 256) // bucket - 2))
    s = Scheduler(cfg)
    s.add_request(Request("ctx", [(j * 13) % 4000 + 1 for j in range(256 + bucket * (reps + 1) + 1)],
                          SamplingParams(max_tokens=1)))
    while s.requests["ctx"].num_computed_tokens < 256:
        so = s.schedule()
        s.update_from_output(so, runner.execute(so))
    return timed_steps(runner, s, reps)


def decode_time(runner, sched_cfg, batch, reps):
    s = Scheduler(sched_cfg)
    for i in range(batch):
        s.add_request(Request(f"r{i}", [(i * 7 + j) % 4000 + 1 for j in range(128)],
                              SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in s.requests.values()) or s.num_waiting:
        so = s.schedule()
        s.update_from_output(so, runner.execute(so))
    timed_steps(runner, s, 2)
    return timed_steps(runner, s, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buckets", default="16,32,64,128,256,512")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    buckets = [int(b) for b in args.buckets.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    budget, max_seqs, max_model_len = max(buckets), max(batches), 2048
    num_blocks = max(batches) * 24 + 400

    ckpt = load_checkpoint(None)
    model, cfg = build_model(ckpt, "float32")
    sched_cfg = SchedulerConfig(max_model_len=max_model_len, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                block_size=16, num_blocks=num_blocks)
    print(f"# default model ({ckpt.name}), float32, {jax.devices()[0].device_kind}, "
          f"budget {budget}, max_num_seqs {max_seqs}")
    rows = {}
    for attention in (True, False):
        runner, warm = make_runner(model, cfg, sorted(set(buckets + batches)), max_seqs, num_blocks,
                                   max_model_len, attention)
        print(f"warm-up ({'attention' if attention else 'no attention'}): {warm:.1f} s "
              f"for {len(runner.buckets)} buckets")
        for b in buckets:
            rows.setdefault(("bucket", b), []).append(bucket_time(runner, sched_cfg, b, args.reps))
        for bsz in batches:
            rows.setdefault(("decode", bsz), []).append(decode_time(runner, sched_cfg, bsz, args.reps))
        assert runner.compiles_after_warmup == 0
        del runner
    print("\n| step | tokens | with attention (ms) | without attention (ms) | ratio | tokens/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for (kind, n), (with_attn, without) in rows.items():
        label = "prefill chunk after 256 ctx" if kind == "bucket" else "decode, ctx ~128-140"
        print(f"| {label} | {n} | {with_attn * 1e3:.1f} | {without * 1e3:.1f} | {with_attn / without:.2f} "
              f"| {n / with_attn:.0f} |")


if __name__ == "__main__":
    main()
