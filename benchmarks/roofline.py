"""Roofline of the engine's step on this machine: measured memory bandwidth and matmul rate, and the
engine's decode and prefill steps against the floors they set.

- Bandwidth: the best of an XLA reduction and a numpy reduction over a 512 MiB float32 array.
- Matmul rate: the best float32 GEMM rate of XLA (and, for reference, torch) at the model's shapes.
- Decode step (B sequences, context C each): floor = max(bytes read / bandwidth, FLOPs / rate),
  bytes = every weight once (the tied lm head reads the whole embedding) + B x C x KV bytes per token.
- Prefill step (T tokens of one sequence): floor = 2 x non-embedding params x T / matmul rate
  (+ the lm head for the sampled row, + attention FLOPs).
- Offline workloads (offline_throughput.py): the same floors summed over their steps.

Engine steps are timed on the engine's own runner with synthetic scheduler outputs (K/V
contents do not change the time), so long contexts cost no prefill. One more run of each
step is traced with `jax.profiler` and its device time split by kind (trace_summary.py):
attention loops, matmuls, KV cache writes, the rest.

    python benchmarks/roofline.py [--decode 1,8,32,64] [--contexts 128,1024] [--prefill 64,256,512] [--no-trace]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from trace_summary import summarize_trace

from jaxserve.core import SamplingParams
from jaxserve.core.outputs import NewRequestData, SchedulerOutput
from jaxserve.engine.llm_engine import LLMEngine


def best_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_bandwidth(nbytes: int = 512 * 2**20, reps: int = 5) -> dict[str, float]:
    """Read bandwidth in GB/s (1e9 bytes/s)."""
    n = nbytes // 4
    x = jnp.ones(n, jnp.float32)
    total = jax.jit(jnp.sum)
    xla = nbytes / best_time(lambda: total(x).block_until_ready(), reps) / 1e9
    a = np.ones(n, np.float32)
    numpy = nbytes / best_time(lambda: a.sum(), reps) / 1e9
    del x, a
    return {"xla_read_GBps": xla, "numpy_read_GBps": numpy, "read_GBps": max(xla, numpy)}


def measure_matmul(shapes, reps: int = 5) -> dict[str, float]:
    """Float32 GEMM rate in GFLOP/s per (M, K, N), for XLA and torch."""
    out = {}
    dot = jax.jit(jnp.dot)
    for m, k, n in shapes:
        a, b = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
        out[f"xla_{m}x{k}x{n}_GFLOPs"] = 2 * m * k * n / best_time(lambda: dot(a, b).block_until_ready(), reps) / 1e9
    try:
        import torch
        for m, k, n in shapes:
            a, b = torch.ones(m, k), torch.ones(k, n)
            out[f"torch_{m}x{k}x{n}_GFLOPs"] = 2 * m * k * n / best_time(lambda: a @ b, reps) / 1e9
    except ImportError:
        pass
    out["GFLOPs"] = max(v for k, v in out.items() if k.startswith("xla_"))
    return out


class Model:
    """The numbers of the model that set its floors."""

    def __init__(self, engine: LLMEngine) -> None:
        c = engine.model_config
        self.config = c
        total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(engine.runner.params))
        self.embed = c.vocab_size * c.hidden_size
        self.params = total
        self.layer_params = total - self.embed          # what every token multiplies through
        itemsize = jnp.dtype(engine.config.dtype).itemsize
        self.weight_bytes = total * itemsize
        self.kv_bytes_per_token = 2 * c.num_key_value_heads * c.head_dim * itemsize * c.num_hidden_layers

    def attention_flops(self, q_tokens: int, context: int) -> float:
        c = self.config
        return 4.0 * q_tokens * context * c.num_attention_heads * c.head_dim * c.num_hidden_layers

    def step_floor(self, num_seqs: int, q_tokens: int, context: int, bw: float, rate: float) -> dict[str, float]:
        """Seconds: (memory, compute) floors of one step of num_seqs sequences, q_tokens each after context."""
        t = num_seqs * q_tokens
        flops = 2.0 * self.layer_params * t + 2.0 * self.embed * num_seqs \
            + num_seqs * self.attention_flops(q_tokens, context + q_tokens)
        read = self.weight_bytes + num_seqs * (context + q_tokens) * self.kv_bytes_per_token
        return {"memory": read / (bw * 1e9), "compute": flops / (rate * 1e9)}


def synthetic_step_time(engine: LLMEngine, num_seqs: int, q_tokens: int, context: int, reps: int,
                        trace_dir: Path | None = None, shared: int = 0) -> tuple[float, dict[str, float]]:
    """Median seconds of runner.execute() for num_seqs sequences computing q_tokens each after `context`,
    the first `shared` tokens' blocks (whole blocks) the same for all (a cached prefix), and (with
    `trace_dir`) where one more step's device time went, by kind (trace_summary.py)."""
    runner, bs = engine.runner, engine.scheduler.config.block_size
    blocks_per_seq = -(-(context + q_tokens) // bs)
    common = min(shared, context) // bs
    if common + num_seqs * (blocks_per_seq - common) >= runner.num_blocks:
        raise ValueError(f"{num_seqs} x {blocks_per_seq} blocks exceed the pool of {runner.num_blocks}")
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    previous: set[str] = set()
    times, kinds = [], {}
    for rep in range(reps + 1 + (trace_dir is not None)):
        tracing = trace_dir is not None and rep == reps + 1
        if tracing:
            jax.profiler.start_trace(str(trace_dir), create_perfetto_trace=True)
        ids = [f"r{rep}-{i}" for i in range(num_seqs)]
        new = [NewRequestData(req_id=r, prompt_token_ids=[(7 * i + j) % 4000 + 100 for j in range(context + q_tokens)],
                              output_token_ids=[], sampling_params=params, seed=0,
                              block_ids=list(range(1, 1 + common)) + [
                                  1 + common + i * (blocks_per_seq - common) + b for b in range(blocks_per_seq - common)],
                              num_computed_tokens=context) for i, r in enumerate(ids)]
        so = SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=[],
                             num_scheduled_tokens={r: q_tokens for r in ids},
                             total_num_scheduled_tokens=num_seqs * q_tokens, preempted_req_ids=set(),
                             finished_req_ids=previous)
        t0 = time.perf_counter()
        runner.execute(so)
        if tracing:
            jax.profiler.stop_trace()
            kinds = summarize_trace(trace_dir)
        elif rep:
            times.append(time.perf_counter() - t0)
        previous = set(ids)
    runner.states.clear()
    return statistics.median(times), kinds


def xla_costs(engine: LLMEngine) -> dict[int, dict[str, float]]:
    """XLA's own FLOP and bytes-accessed estimates of the compiled step, per token bucket."""
    out = {}
    runner = engine.runner
    for (bucket, rows), exe in sorted(getattr(runner, "_executables", {}).items()):
        if rows != runner.rows(bucket):
            continue      # the speculative-decoding variant of a bucket
        cost = exe.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        if cost:
            out[bucket] = {"flops": float(cost.get("flops", float("nan"))),
                           "bytes_accessed": float(cost.get("bytes accessed", float("nan")))}
    return out


def workload_floors(model: Model, bw: float, rate: float) -> dict[str, float]:
    """Floors (seconds) of offline_throughput.py's two workloads, step by step."""
    from workloads import offline_random_prompts, shared_prefix_prompts

    def decode_floor(contexts: list[int], steps: int) -> float:
        total = 0.0
        for s in range(steps):
            ctx = [c + s for c in contexts]
            read = model.weight_bytes + sum(ctx) * model.kv_bytes_per_token
            flops = sum(2.0 * (model.layer_params + model.embed) + model.attention_flops(1, c) for c in ctx)
            total += max(read / (bw * 1e9), flops / (rate * 1e9))
        return total

    def prefill_floor(tokens: int, attention: float) -> float:
        return (2.0 * model.layer_params * tokens + attention) / (rate * 1e9)

    out = {}
    prompts = offline_random_prompts(64, model.config.vocab_size)
    att = sum(model.attention_flops(len(p), len(p)) / 2 for p in prompts)          # causal: half the square
    out["random_prefill_s"] = prefill_floor(sum(map(len, prompts)), att)
    out["random_decode_s"] = decode_floor([len(p) for p in prompts], 128)
    shared = shared_prefix_prompts(32, 1024, (32, 64), model.config.vocab_size)
    own = sum(len(p) - 1024 for p in shared)
    att = model.attention_flops(1024, 1024) / 2 + sum(model.attention_flops(len(p) - 1024, len(p)) for p in shared)
    out["shared_prefix_prefill_s"] = prefill_floor(1024 + own, att)
    out["shared_prefix_decode_s"] = decode_floor([len(p) for p in shared], 64)
    out["shared_prefix_recomputed_prefill_s"] = prefill_floor(
        sum(map(len, shared)), sum(model.attention_flops(len(p), len(p)) / 2 for p in shared))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode", default="1,8,32,64", help="decode batch sizes")
    ap.add_argument("--contexts", default="128,1024", help="context lengths of the decode steps")
    ap.add_argument("--prefill", default="64,256,512", help="prefill chunk sizes (one sequence, after 256 tokens)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="float32", help="the engine's --dtype")
    ap.add_argument("--result-file", default=None)
    ap.add_argument("--trace-dir", default=None, help="where the per-step jax.profiler traces go (default: a temp dir)")
    ap.add_argument("--no-trace", action="store_true",
                    help="skip the traced step per row (no device-time split; faster, and no profiler needed)")
    args = ap.parse_args(argv)
    batches = [int(x) for x in args.decode.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    chunks = [int(x) for x in args.prefill.split(",")]
    bw = measure_bandwidth()
    mm = measure_matmul([(64, 576, 1536), (512, 576, 1536), (2048, 2048, 2048)])
    print(f"memory bandwidth (read): XLA {bw['xla_read_GBps']:.1f} GB/s, numpy {bw['numpy_read_GBps']:.1f} GB/s")
    print("float32 matmul: " + ", ".join(f"{k.removesuffix('_GFLOPs')} {v:.0f}" for k, v in mm.items()
                                         if k != "GFLOPs") + " GFLOP/s")
    budget = max(chunks + batches)
    max_len = max(contexts) + 512 + 16
    num_blocks = max(b * -(-(c + 1) // 16) for b in batches for c in contexts) + 64
    num_blocks = max(num_blocks, -(-(256 + max(chunks)) // 16) + 64)
    buckets = tuple(sorted(set(batches + chunks + [budget])))
    engine = LLMEngine.from_kwargs(None, max_num_batched_tokens=budget, max_num_seqs=max(batches),
                                   max_model_len=max_len, num_kv_blocks=num_blocks, token_buckets=buckets,
                                   dtype=args.dtype)
    model = Model(engine)
    rate, read_bw = mm["GFLOPs"], bw["read_GBps"]
    print(f"model: {model.params / 1e6:.1f} M params ({model.layer_params / 1e6:.1f} M outside the embedding), "
          f"weights {model.weight_bytes / 1e6:.0f} MB, KV {model.kv_bytes_per_token / 1e3:.1f} kB per token")
    rows = []
    trace_root = Path(args.trace_dir or tempfile.mkdtemp(prefix="jaxserve-roofline-trace-"))
    print("\n| step | tokens | context | measured (ms) | memory floor (ms) | compute floor (ms) "
          "| floor / measured | bandwidth used (GB/s) | attention / matmul / KV write / other (trace) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")

    def row(kind, seqs, q, c):
        trace = None if args.no_trace else trace_root / f"{kind}-{seqs}x{q}-{c}"
        t, kinds = synthetic_step_time(engine, seqs, q, c, args.reps, trace)
        f = model.step_floor(seqs, q, c, read_bw, rate)
        rows.append({"step": kind, "seqs": seqs, "tokens": seqs * q, "context": c, "seconds": t, **f,
                     "trace_seconds": kinds})
        read = model.weight_bytes + seqs * (c + q) * model.kv_bytes_per_token
        ops = sum(v for k, v in kinds.items() if k != "steps wall") or float("nan")
        split = " / ".join(f"{kinds.get(k, 0.0) / ops:.0%}" for k in ("attention loops", "matmul",
                                                                      "KV cache write", "other"))
        print(f"| {kind} | {seqs * q} | {c} | {t * 1e3:.1f} | {f['memory'] * 1e3:.1f} | {f['compute'] * 1e3:.1f} "
              f"| {max(f.values()) / t:.2f} | {read / t / 1e9:.1f} | {split} |", flush=True)
    for c in contexts:
        for b in batches:
            row("decode", b, 1, c)
    for q in chunks:
        row("prefill", 1, q, 256)
    costs = xla_costs(engine)
    if costs:
        # (Its bytes-accessed estimate, kept in the JSON, counts the whole donated KV pool as read
        # and written every step, so it is not the step's memory traffic.)
        print("\nXLA's cost analysis of the compiled step (whole bucket, every sequence slot):")
        print("| bucket | XLA GFLOP | 2 x non-embedding params x tokens (GFLOP) |")
        print("|---:|---:|---:|")
        for bucket, c in costs.items():
            print(f"| {bucket} | {c['flops'] / 1e9:.2f} | {2 * model.layer_params * bucket / 1e9:.2f} |")
    floors = workload_floors(model, read_bw, rate)
    print("\noffline workload floors (s): " + ", ".join(f"{k} {v:.1f}" for k, v in floors.items()))
    print(f"  random (64 x 128 out): {floors['random_prefill_s'] + floors['random_decode_s']:.1f} s = "
          f"{64 * 128 / (floors['random_prefill_s'] + floors['random_decode_s']):.0f} output tok/s")
    print(f"  shared-prefix (32 x 64 out, prefix once): "
          f"{floors['shared_prefix_prefill_s'] + floors['shared_prefix_decode_s']:.1f} s")
    print(f"compiles after warm-up: {engine.runner.compiles_after_warmup}")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"bandwidth": bw, "matmul": mm, "steps": rows, "workload_floors": floors, "xla_costs": costs,
                       "compiles_after_warmup": engine.runner.compiles_after_warmup}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
