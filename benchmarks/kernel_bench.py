"""Ragged paged attention kernels on a GPU: correctness, then time against the device's copy bandwidth.

One script, three parts:
1. Correctness: the Pallas GPU kernel against the pure-jnp reference on random data
   (bf16 at the timed shapes, float32 on a smaller mixed batch with the reference at
   "highest" matmul precision), and JAX's shipped `ops.gpu.paged_attention` on the
   decode batch as a cross-check.
2. The device's copy bandwidth: a large on-device copy (read + write bytes / time).
3. Median times of decode-only and mixed batches for our kernel, the reference and (decode
   only: it has no prefill) JAX's `paged_attention` on its own layout, which is ours
   per K and V ([KVH, pages, page_size, D]), so it reads the same cache without a copy.
   KV GB/s counts each sequence's context once (K and V of every KV head): the least a
   kernel must read. A memory-bound decode kernel should approach the copy bandwidth.

    python benchmarks/kernel_bench.py --out kernel_bench.json          # on a GPU
    python benchmarks/kernel_bench.py --sweep                          # also try block sizes
    python -m kernels_pallas.tuning --sweep --out sweep.json           # a table for kernels_pallas/tuning.py
    python benchmarks/kernel_bench.py --interpret --small              # CPU: checks the script runs

Default shapes: 64 sequences x 2048 context, 8 KV heads, 32 q heads, head_dim 128,
bf16, page size 16 (tuning.PAGE_SIZE); the mixed batch replaces 2 decodes with prefill
chunks of 512 tokens (a first chunk and one continuing a 2048-token context), padded to
a power-of-two token bucket as the runner pads it.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import tuning
from kernels_pallas.ragged_paged_attention import ragged_paged_attention_reference
from kernels_pallas.ragged_paged_attention_gpu import ragged_paged_attention_gpu


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=tuning.PAGE_SIZE)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--copy-gib", type=float, default=2.0, help="size of the bandwidth probe's array")
    p.add_argument("--small", action="store_true", help="tiny shapes (4 seqs x 64 ctx), for a CPU smoke run")
    p.add_argument("--interpret", action="store_true", help="run the Pallas kernels in interpret mode (CPU)")
    p.add_argument("--sweep", action="store_true", help="also time the GPU kernel over a grid of knobs")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    if args.small:
        args.seqs, args.context, args.kv_heads, args.q_heads, args.head_dim = 4, 64, 2, 8, 64
        args.prefill_chunk, args.reps, args.copy_gib = 16, 2, 0.01
    return args


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def make_batch(seqs, args, *, dtype, seed=0):
    """Inputs for sequences given as (context_len, q_len); pages shuffled over the pool."""
    rng = np.random.default_rng(seed)
    page = args.page_size
    max_blocks = -(-max(ctx for ctx, _ in seqs) // page)
    num_blocks = sum(-(-ctx // page) for ctx, _ in seqs) + 1      # + the null block 0
    free = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(seqs), max_blocks), np.int32)
    used = 0
    for s, (ctx, _) in enumerate(seqs):
        n = -(-ctx // page)
        tables[s, :n] = free[used:used + n]
        used += n
    q_lens = [q for _, q in seqs]
    num_tokens = next_pow2(sum(q_lens))
    k1, k2 = jax.random.split(jax.random.key(seed))
    q = jax.random.normal(k1, (num_tokens, args.q_heads, args.head_dim), dtype)
    cache = jax.random.normal(k2, (2, args.kv_heads, num_blocks, page, args.head_dim), dtype)
    batch = dict(q=q, kv_cache=cache, block_tables=jnp.asarray(tables),
                 context_lens=jnp.asarray([ctx for ctx, _ in seqs], jnp.int32),
                 query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
                 num_seqs=jnp.int32(len(seqs)))
    kv_bytes = sum(ctx for ctx, _ in seqs) * 2 * args.kv_heads * args.head_dim * jnp.dtype(dtype).itemsize
    return batch, kv_bytes


def median_seconds(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))   # compile + warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(args) -> float:
    """Bytes/s of a large on-device copy, counting the read and the write."""
    n = int(args.copy_gib * 2**30) // 4
    x = jnp.ones((n,), jnp.float32)
    copy = jax.jit(lambda x: x * 1.0001)   # not foldable into a no-op
    return 2 * x.nbytes / median_seconds(copy, x, reps=args.reps)


def reference(batch, *, sm_scale):
    with jax.default_matmul_precision("highest"):
        return jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=sm_scale))(**batch)


def jax_paged_attention_fn(batch, args):
    """JAX's shipped GPU paged attention on the decode batch (one query token per sequence)."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    pages = batch["block_tables"].shape[1]
    k_splits = max(s for s in (16, 8, 4, 2, 1) if pages % s == 0)
    fn = jax.jit(functools.partial(paged_attention, k_splits=k_splits, interpret=args.interpret))
    num_seqs = batch["block_tables"].shape[0]
    inputs = (batch["q"][:num_seqs], batch["kv_cache"][0], batch["kv_cache"][1], batch["block_tables"],
              batch["context_lens"])
    return fn, jax.block_until_ready(inputs)


def compare(got, want, tol) -> dict:
    """Max abs error and the worst |error| / (tol + tol * |want|): at most 1 means allclose(rtol=atol=tol)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    err = np.abs(got - want)
    worst = float((err / (tol + tol * np.abs(want))).max())
    return dict(max_abs_err=float(err.max()), worst_of_tol=worst, tol=tol, ok=worst <= 1.0)


def check_correctness(args, decode, mixed) -> list[dict]:
    """Our kernel vs the reference (bf16 timed shapes, f32 small mixed batch); JAX's kernel on decode."""
    rows = []
    sm_scale = args.head_dim ** -0.5
    ours = functools.partial(ragged_paged_attention_gpu, sm_scale=sm_scale, interpret=args.interpret)
    small = [(min(args.context, 300), 1), (min(args.context, 200), 37), (17, 17), (1, 1)]
    f32_batch, _ = make_batch(small, args, dtype=jnp.float32, seed=3)
    for name, (batch, _), tol in (("decode bf16", decode, 1e-2), ("mixed bf16", mixed, 1e-2),
                                  ("mixed f32 (small)", (f32_batch, 0), 1e-5)):
        got, want = ours(**batch), reference(batch, sm_scale=sm_scale)
        real = int(batch["query_start_loc"][int(batch["num_seqs"])])
        rows.append(dict(case=name, impl="pallas_gpu (ours)", **compare(got[:real], want[:real], tol)))
    batch = decode[0]
    fn, inputs = jax_paged_attention_fn(batch, args)
    num_seqs = batch["block_tables"].shape[0]
    got, want = fn(*inputs), reference(batch, sm_scale=1.0)[:num_seqs]   # JAX's kernel does not scale
    rows.append(dict(case="decode bf16", impl="jax ops.gpu.paged_attention", **compare(got, want, 1e-2)))
    return rows


def time_cases(args, decode, mixed, bandwidth) -> list[dict]:
    sm_scale = args.head_dim ** -0.5
    rows = []

    def row(case, impl, seconds, kv_bytes, **extra):
        rows.append(dict(case=case, impl=impl, ms=seconds * 1e3, kv_gbps=kv_bytes / seconds / 1e9,
                         of_copy_bw=kv_bytes / seconds / bandwidth, **extra))

    for case, (batch, kv_bytes) in (("decode", decode), ("mixed", mixed)):
        ours = jax.jit(functools.partial(ragged_paged_attention_gpu, sm_scale=sm_scale, interpret=args.interpret))
        row(case, "pallas_gpu (ours)", median_seconds(lambda b: ours(**b), batch, reps=args.reps), kv_bytes)
        ref = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=sm_scale))
        row(case, "reference (jnp)", median_seconds(lambda b: ref(**b), batch, reps=args.reps), kv_bytes)
        if case == "decode":
            fn, inputs = jax_paged_attention_fn(batch, args)
            row(case, "jax ops.gpu.paged_attention", median_seconds(fn, *inputs, reps=args.reps), kv_bytes)
    return rows


def sweep(args, decode, mixed, bandwidth) -> list[dict]:
    """Our kernel over a grid of block sizes / warps / stages / splits (decode and mixed)."""
    sm_scale = args.head_dim ** -0.5
    rows = []
    grid = [dict(kv_block=kb, num_warps=(w, 4), num_stages=(st, 2), kv_splits=ks)
            for kb in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4) for ks in (1, 2, 4)]
    grid += [dict(prefill_rows=pr, kv_block=kb, num_warps=(4, w), num_stages=(3, st))
             for pr in (32, 64, 128) for kb in (32, 64) for w in (4, 8) for st in (2, 3)]
    for knobs in grid:
        case, (batch, kv_bytes) = ("mixed", mixed) if "prefill_rows" in knobs else ("decode", decode)
        fn = jax.jit(functools.partial(ragged_paged_attention_gpu, sm_scale=sm_scale, interpret=args.interpret,
                                       **knobs))
        try:
            seconds = median_seconds(lambda b: fn(**b), batch, reps=args.reps)
        except Exception as e:  # noqa: BLE001 - a knob set that does not compile is a result too
            rows.append(dict(case=case, knobs=str(knobs), error=f"{type(e).__name__}: {e}"[:200]))
            continue
        rows.append(dict(case=case, knobs=str(knobs), ms=seconds * 1e3, kv_gbps=kv_bytes / seconds / 1e9,
                         of_copy_bw=kv_bytes / seconds / bandwidth))
    return rows


def main():
    args = parse_args()
    device = jax.devices()[0]
    if device.platform != "gpu" and not args.interpret:
        raise SystemExit(f"no GPU here ({device.platform}): run on a GPU, or pass --interpret --small")
    dtype = jnp.bfloat16
    decode_seqs = [(args.context, 1)] * args.seqs
    mixed_seqs = [(args.context, 1)] * (args.seqs - 2) + [(args.prefill_chunk, args.prefill_chunk),
                                                          (args.context, args.prefill_chunk)]
    decode = make_batch(decode_seqs, args, dtype=dtype, seed=1)
    mixed = make_batch(mixed_seqs, args, dtype=dtype, seed=2)

    correctness = check_correctness(args, decode, mixed)
    bandwidth = copy_bandwidth(args)
    timings = time_cases(args, decode, mixed, bandwidth)
    swept = sweep(args, decode, mixed, bandwidth) if args.sweep else []

    print(f"device: {device.device_kind} ({device.platform}); copy bandwidth {bandwidth / 1e9:.0f} GB/s"
          + ("; INTERPRET MODE: times are meaningless" if args.interpret else ""))
    print(f"shapes: {args.seqs} seqs x {args.context} ctx, {args.kv_heads} KV / {args.q_heads} q heads, "
          f"head_dim {args.head_dim}, page {args.page_size}, bf16; mixed: 2 prefill chunks of "
          f"{args.prefill_chunk}\n")
    print("| check vs reference | impl | max abs err | worst err / allowed | rtol = atol | ok |\n"
          "|---|---|---:|---:|---:|---|")
    for r in correctness:
        print(f"| {r['case']} | {r['impl']} | {r['max_abs_err']:.2e} | {r['worst_of_tol']:.2f} | {r['tol']:g} | "
              f"{'yes' if r['ok'] else 'NO'} |")
    print("\n| batch | impl | median ms | KV GB/s | of copy bandwidth |\n|---|---|---:|---:|---:|")
    for r in timings:
        print(f"| {r['case']} | {r['impl']} | {r['ms']:.3f} | {r['kv_gbps']:.3g} | {r['of_copy_bw']:.1%} |")
    if swept:
        print("\n| batch | knobs | median ms | KV GB/s | of copy bandwidth |\n|---|---|---:|---:|---:|")
        for r in sorted(swept, key=lambda r: (r["case"], r.get("ms", float("inf")))):
            if "error" in r:
                print(f"| {r['case']} | {r['knobs']} | {r['error']} | | |")
            else:
                print(f"| {r['case']} | {r['knobs']} | {r['ms']:.3f} | {r['kv_gbps']:.3g} | {r['of_copy_bw']:.1%} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=device.device_kind, platform=device.platform, interpret=args.interpret,
                           copy_bandwidth_gbps=bandwidth / 1e9, shapes=vars(args), correctness=correctness,
                           timings=timings, sweep=swept), f, indent=2)
    if not all(r["ok"] for r in correctness):
        raise SystemExit("correctness check failed")


if __name__ == "__main__":
    main()
