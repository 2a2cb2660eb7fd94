"""Micro-benchmark: the pure-jnp ragged paged attention reference against a naive one.

The naive implementation gathers every query token's max-context K/V (what JAX_NOTES
measured as dominating a step); the reference does work proportional to the context
actually attended. Default shapes are the default model's (SmolLM2-135M: 3 KV heads,
9 query heads, head_dim 64), block_size 16, block tables covering 2048 tokens, float32.
Token counts are padded to a power of two, sequence slots to `--seq-slots`, as the
runner pads them.

    python benchmarks/attention_reference.py            # the table
    python benchmarks/attention_reference.py --sweep    # also try the reference's knobs
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.oracle import make_batch
from kernels_pallas.ragged_paged_attention import ragged_paged_attention_reference

BLOCK_SIZE, NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM, MAX_CONTEXT = 16, 3, 9, 64, 2048
MAX_BLOCKS = MAX_CONTEXT // BLOCK_SIZE


@jax.jit
def naive_attention(q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs, sm_scale):
    """Per-token gather of the whole block table's K/V: work ~ tokens x max context."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[3]
    token = jnp.arange(num_tokens)
    seq = jnp.searchsorted(query_start_loc, token, side="right") - 1          # [T]
    real = (seq < num_seqs) & (token < query_start_loc[jnp.minimum(seq + 1, num_seqs)])
    seq = jnp.clip(seq, 0, block_tables.shape[0] - 1)
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    pos = context_lens[seq] - q_len + token - query_start_loc[seq]           # [T]
    kv = kv_cache[:, :, block_tables[seq]]                                    # [2, KVH, T, MB, BS, D]
    kv = kv.reshape(2, num_kv_heads, num_tokens, -1, head_dim)
    qg = q.reshape(num_tokens, num_kv_heads, -1, head_dim)
    scores = jnp.einsum("thgd,htkd->thgk", qg, kv[0]) * sm_scale
    mask = jnp.arange(kv.shape[3])[None, :] <= pos[:, None]                  # [T, K]
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, -jnp.inf), axis=-1)
    out = jnp.einsum("thgk,htkd->thgd", probs, kv[1]).reshape(q.shape)
    return jnp.where(real[:, None, None], out, 0)


def next_pow2(n):
    return 1 << max(0, (n - 1).bit_length())


def make_inputs(seqs, *, seq_slots, seed=0):
    """Inputs for sequences given as (context_len, q_len), blocks shuffled over the pool."""
    blocks_needed = sum(-(-ctx // BLOCK_SIZE) for ctx, _ in seqs)
    batch = make_batch(seqs, seed=seed, num_tokens=next_pow2(sum(q for _, q in seqs)), num_seq_slots=seq_slots,
                       block_size=BLOCK_SIZE, num_blocks=blocks_needed + 1, max_blocks=MAX_BLOCKS,
                       num_kv_heads=NUM_KV_HEADS, group=NUM_Q_HEADS // NUM_KV_HEADS, head_dim=HEAD_DIM)
    return tuple(map(jnp.asarray, batch))


def time_calls(fns, args, *, repeats, clock, warmup=2):
    """Median ms per call of each fn(*args), after `warmup` calls (the first compiles).

    The functions take turns, so a change in the machine's load hits them all alike.
    """
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            jax.block_until_ready(fn(*args))
            times[name].append(clock() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


CASES = {
    "decode 1 x ctx 128": [(128, 1)],        # with --seq-slots 1: a batch-1 decode step
    "decode 1 x ctx 1024": [(1024, 1)],
    "decode 32 x ctx 256": [(256, 1)] * 32,
    "decode 32 x ctx 1024": [(1024, 1)] * 32,
    "decode 64 x ctx 256": [(256, 1)] * 64,
    "decode 64 x ctx 1024": [(1024, 1)] * 64,
    "prefill 256 (new) + 16 dec ctx 1024": [(256, 256)] + [(1024, 1)] * 16,
    "prefill 256 (ctx 1024) + 16 dec ctx 1024": [(1024, 256)] + [(1024, 1)] * 16,
    "8 chunks of 24 (ctx 512) + 32 dec ctx 512": [(512, 24)] * 8 + [(512, 1)] * 32,
}

SWEEP = [  # --sweep: the design alternatives and knob settings tried
    "decode_query_len=0,query_tile=1",  # design B: one sequence at a time, decodes untiled
    "decode_query_len=0",               # design B with the default prefill tile
    "kv_pages_per_chunk=4", "kv_pages_per_chunk=16", "kv_pages_per_chunk=32",
    "decode_seq_tile=4", "decode_seq_tile=16",
    "query_tile=16", "query_tile=64", "query_tile=128",
]


def parse_knobs(text):
    """'a=1,b=2' -> {'a': 1, 'b': 2} (int knobs of the reference)."""
    return {k: int(v) for k, v in (item.split("=") for item in text.split(",") if item)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per measurement (median)")
    parser.add_argument("--seq-slots", type=int, default=64, help="sequence slots the batch is padded to")
    parser.add_argument("--no-naive", action="store_true", help="skip the naive implementation")
    parser.add_argument("--sweep", action="store_true", help="also time the knob variants in SWEEP")
    parser.add_argument("--variant", action="append", default=[], metavar="K=V[,K=V]",
                        help="also time the reference with these knobs (repeatable)")
    parser.add_argument("--cases", nargs="*", default=list(CASES), help="subset of case names")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall time, or this process's CPU time (steadier on a shared machine)")
    args = parser.parse_args()
    sm_scale = HEAD_DIM ** -0.5
    clock = time.perf_counter if args.clock == "wall" else time.process_time

    variants = {"reference": {}}
    for text in args.variant + (SWEEP if args.sweep else []):
        variants[text] = parse_knobs(text)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; median of {args.repeats}, "
          f"ms of {args.clock} time per call")
    for i, name in enumerate(variants):
        if i:
            print(f"  v{i}: {name}")
    header = f"{'case':42s} {'tokens':>6s} {'reference':>9s}"
    header += "".join(f" {f'v{i}':>7s}" for i in range(1, len(variants)))
    print(header + ("" if args.no_naive else f" {'naive':>9s} {'speedup':>8s}"))
    for name in args.cases:
        inputs = make_inputs(CASES[name], seq_slots=max(args.seq_slots, len(CASES[name])))
        fns = {v: jax.jit(lambda *a, kn=knobs: ragged_paged_attention_reference(*a, sm_scale=sm_scale, **kn))
               for v, knobs in variants.items()}
        ms = time_calls(fns, inputs, repeats=args.repeats, clock=clock)
        row = f"{name:42s} {inputs[0].shape[0]:6d} {ms['reference']:9.2f}"
        row += "".join(f" {ms[v]:7.2f}" for v in list(variants)[1:])
        if not args.no_naive:
            naive = {"naive": lambda *a: naive_attention(*a, sm_scale)}
            naive_ms = time_calls(naive, inputs, repeats=max(3, args.repeats // 3), clock=clock)["naive"]
            row += f" {naive_ms:9.1f} {naive_ms / ms['reference']:7.1f}x"
        print(row, flush=True)


if __name__ == "__main__":
    main()
