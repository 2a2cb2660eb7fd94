"""The native CPU attention kernel alone, per layer: shared pages folded 16 rows at a time or not; AMX tiles or not.

Times `native_cpu.paged_context_native` on the default model's attention shapes (9 q heads,
3 KV heads, head_dim 64, pages of 16; `--head-dim 128`: 8 q heads, 2 KV heads, a softmax scale
that is no power of two, which the tiles apply to the scores) in one process, two settings
alternating call by call
(medians; this machine is noisy): `--compare lanes` (default) the two settings of
`min_lane_fill`, checking that both give the same numbers bit for bit; `--compare amx`
(bfloat16) the vector folds against the AMX tiles, printing the largest difference of the
outputs (the tiles round the softmax weights to bf16). Cases:
- shared: 32 decodes over one 1,024-token prefix, each with 80 tokens of its own (context 1,104);
- decodes: 64 decodes of 256 tokens, no page shared;
- prefill: one 512-token chunk after 256 cached tokens (blocks of 16 queries);
- mixed: the shared case's decodes next to a 128-token prefill.
`--layers N` times N layers' calls in one jitted function, each layer its own pool, and reports a
layer's time: with enough layers the pools come from memory, as in a step (one layer's pool may
stay in a large L3 however `--cold` evicts). `--contiguous` puts each sequence's pages in
consecutive pool blocks (default: scattered at random).

    python benchmarks/native_attention.py [--dtype float32|bfloat16] [--reps 40] [--cold] [--compare lanes|amx]
                                          [--head-dim 64|128] [--layers 1] [--contiguous]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import native_cpu
from kernels_pallas.oracle import make_batch

BS = 16
HEADS = {64: (9, 3), 128: (8, 2)}   # head dim -> (q heads, KV heads)


def make_case(seqs, shared_blocks, dtype, seed, head_dim=64, contiguous=False):
    """seqs: (context, q_len) pairs; the first `shared_blocks` pages of every table are the same
    blocks; `contiguous`: each sequence's pages in consecutive pool blocks (else scattered at
    random). Returns q unscaled (a bf16 model's: bf16 values), the pool, the metadata."""
    QH, KVH = HEADS[head_dim]
    need = [-(-ctx // BS) for ctx, _ in seqs]
    q, kv, tables, ctx, qsl, num_seqs = make_batch(
        seqs, seed=seed, num_tokens=sum(q for _, q in seqs), num_seq_slots=len(seqs), block_size=BS,
        num_blocks=sum(need) + 1, max_blocks=max(need), num_kv_heads=KVH, group=QH // KVH, head_dim=head_dim)
    if contiguous:
        tables = np.array(tables)
        first = 1 + np.concatenate([[0], np.cumsum(need)[:-1]])
        for s, (start, n) in enumerate(zip(first, need)):
            tables[s, :n] = start + np.arange(n)
    tables[1:, :shared_blocks] = tables[0, :shared_blocks]
    pool = jnp.asarray(kv) if dtype == "float32" else jnp.asarray(
        np.asarray(jnp.asarray(kv, jnp.bfloat16)).view(np.uint16))
    if dtype == "bfloat16":
        q = np.asarray(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32))
    return tuple(map(jnp.asarray, (q, pool, tables, ctx, qsl))) + (int(num_seqs),)


def query_args(q, dtype, head_dim, tiles):
    """What the model-facing entry point passes: q times the scale (a bf16 q times a power of two
    is still a bf16: scores from bf16 dot products), or on the tiles q unscaled with the scale
    applied to the scores when it is no power of two."""
    scale = head_dim ** -0.5
    power_of_two = math.frexp(scale)[0] == 0.5
    if dtype == "bfloat16" and tiles and not power_of_two:
        return dict(qs=q, q_bf16=True, score_scale=scale)
    return dict(qs=q * scale, q_bf16=dtype == "bfloat16" and power_of_two)


CASES = {
    "shared": ([(1104, 1)] * 32, 64),
    "decodes": ([(256, 1)] * 64, 0),
    "prefill": ([(768, 512)], 0),
    "mixed": ([(1104, 1)] * 32 + [(128, 128)], 64),
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--min-lane-fill", type=int, default=native_cpu.MIN_LANE_FILL)
    p.add_argument("--compare", choices=["lanes", "amx"], default="lanes")
    p.add_argument("--head-dim", type=int, choices=sorted(HEADS), default=64)
    p.add_argument("--cold", action="store_true",
                   help="read 64 MB before each call (a larger L3 may keep the pool cached: see --layers)")
    p.add_argument("--layers", type=int, default=1,
                   help="time this many layers' calls in one jitted function, each layer its own pool (as a step "
                        "reads them: with enough layers the pools come from memory); times are per layer")
    p.add_argument("--contiguous", action="store_true",
                   help="each sequence's pages in consecutive pool blocks (default: scattered at random)")
    args = p.parse_args()
    if args.layers < 1:
        p.error("--layers takes 1 or more")
    assert native_cpu.available(), "the native kernel does not build here"
    if args.compare == "amx" and not (args.dtype == "bfloat16" and native_cpu.gemm_amx()):
        p.error("--compare amx needs --dtype bfloat16 and a CPU with AMX tiles")
    evict = np.zeros(16 << 20, np.float32)
    settings = ({"min_lane_fill": 0}, {"min_lane_fill": args.min_lane_fill}) if args.compare == "lanes" else (
        {"amx": False}, {"amx": True})
    names = ("lanes off", "lanes on") if args.compare == "lanes" else ("vector", "AMX")
    print(f"native attention, one layer, {args.dtype} pool, head dim {args.head_dim}, {jax.device_count()} device, "
          f"reps {args.reps}, {args.layers} layer(s) a call, pages {'contiguous' if args.contiguous else 'scattered'}")
    print(f"{'case':<8} {names[0] + ' ms':>13} {names[1] + ' ms':>12} {'ratio':>6}  "
          f"{'same bits' if args.compare == 'lanes' else 'max |diff|'}")
    for seed, (name, (seqs, shared)) in enumerate(CASES.items()):
        q, pool, tables, ctx, qsl, num_seqs = make_case(seqs, shared, args.dtype, seed, args.head_dim, args.contiguous)
        pools = [pool] + [make_case(seqs, shared, args.dtype, 1000 * seed + layer, args.head_dim, args.contiguous)[1]
                          for layer in range(1, args.layers)]
        fns, queries = {}, {}
        for i, setting in enumerate(settings):
            call = query_args(q, args.dtype, args.head_dim, setting.get("amx", native_cpu.attention_amx()))
            queries[i] = call.pop("qs")

            def layers(qs, pools, tables, ctx, qsl, kw={**call, **setting}):
                outs, prev = [], None
                for pool in pools:   # each layer after the one before, as in a step
                    q_in = qs if prev is None else qs + 0.0 * prev[0, 0, 0]
                    prev = native_cpu.paged_context_native(
                        q_in, pool, tables, ctx, qsl, num_seqs, bits_dtype=jnp.dtype(args.dtype),
                        max_q_len=qs.shape[0], sliding_window=None, soft_cap=None, **kw)[0]
                    outs.append(prev)
                return outs[0], outs[-1]
            fns[i] = jax.jit(layers)
        outs = {k: jax.block_until_ready(f(queries[k], pools, tables, ctx, qsl)) for k, f in fns.items()}
        if args.compare == "lanes":
            same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(*outs.values()))
        else:
            same = f"{float(np.max(np.abs(np.asarray(outs[0][0]) - np.asarray(outs[1][0])))):.2e}"
        times = {k: [] for k in fns}
        for _ in range(args.reps):
            for k, f in fns.items():
                if args.cold:
                    evict.sum()   # reads 64 MB, more than this CPU's caches hold, as the weights stream
                t = time.perf_counter()
                jax.block_until_ready(f(queries[k], pools, tables, ctx, qsl))
                times[k].append(time.perf_counter() - t)
        off, on = (statistics.median(times[k]) * 1e3 / args.layers for k in fns)
        print(f"{name:<8} {off:>13.3f} {on:>12.3f} {off / on:>6.2f}  {same}")


if __name__ == "__main__":
    main()
