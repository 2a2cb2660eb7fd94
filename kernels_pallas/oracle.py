"""Random ragged batches and a float64 oracle, for checking attention kernels.

What flows through: plain numpy arrays on the host, built from a list of sequences
given as (context_len, query_len), and the exact attention over them. Used by the
kernel tests and by the engine's start-up self-check (`self_check`); nothing here
touches a device or compiles anything.
"""

from __future__ import annotations

import numpy as np


def make_batch(seqs, *, seed=0, num_tokens=64, num_seq_slots=8, block_size=4, num_blocks=64,
               max_blocks=16, num_kv_heads=2, group=2, head_dim=8):
    """Random q and cache for sequences given as (context_len, q_len); blocks scattered at random.

    Returns the reference's positional inputs (q, kv_cache, block_tables, context_lens,
    query_start_loc, num_seqs) as float32 / int32 numpy arrays. Everything the attention
    must ignore is random too (padding q rows, block 0, the unused tail of each sequence's
    last block), so leaks show up as errors.
    """
    rng = np.random.default_rng(seed)
    assert sum(q for _, q in seqs) <= num_tokens and len(seqs) <= num_seq_slots
    free = list(rng.permutation(np.arange(1, num_blocks)))  # block 0 is the null block
    block_tables = np.zeros((num_seq_slots, max_blocks), np.int32)
    for s, (ctx, _) in enumerate(seqs):
        n = -(-ctx // block_size)
        block_tables[s, :n] = [free.pop() for _ in range(n)]
    context_lens = np.zeros(num_seq_slots, np.int32)
    context_lens[:len(seqs)] = [ctx for ctx, _ in seqs]
    q_lens = [q for _, q in seqs] + [0] * (num_seq_slots - len(seqs))
    query_start_loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((num_tokens, num_kv_heads * group, head_dim), np.float32)
    kv_cache = rng.standard_normal((2, num_kv_heads, num_blocks, block_size, head_dim), np.float32)
    return q, kv_cache, block_tables, context_lens, query_start_loc, np.int32(len(seqs))


def step_kv(args, seed=1):
    """This step's k/v [T, KVH, D] for a batch: each real row's own cache entry; padding rows random garbage.

    The "cpu" backend reads this step's keys from k/v rather than the pool, so they must agree.
    """
    q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs = args
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((2, q.shape[0], kv_cache.shape[1], kv_cache.shape[4]), np.float32) * 50
    block_size = kv_cache.shape[3]
    for s in range(int(num_seqs)):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        for row in range(start, end):
            pos = int(context_lens[s]) - (end - row)
            kv[:, row] = kv_cache[:, :, block_tables[s][pos // block_size], pos % block_size]
    return kv[0], kv[1]


def attention_oracle(q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs, *,
                     sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None) -> np.ndarray:
    """The ragged paged attention contract in float64 numpy, one sequence at a time -> [T, num_q_heads, head_dim].

    Each sequence gathers its whole context through its block table and attends with a
    plain causal (and sliding-window) mask; rows no real sequence owns are 0. `kv_cache`
    must hold floats (not uint16 bits).
    """
    q = np.asarray(q, np.float64)
    cache = np.asarray(kv_cache, np.float64)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = cache.shape[1], cache.shape[3]
    group = num_heads // num_kv_heads
    out = np.zeros_like(q)
    for s in range(int(num_seqs)):
        start, end, ctx = int(query_start_loc[s]), int(query_start_loc[s + 1]), int(context_lens[s])
        if end == start:
            continue
        pos = np.arange(ctx)
        blocks = np.asarray(block_tables[s])[pos // block_size]
        keys = cache[0][:, blocks, pos % block_size]                              # [KVH, ctx, D]
        vals = cache[1][:, blocks, pos % block_size]
        qs = q[start:end].reshape(end - start, num_kv_heads, group, head_dim)     # [n, KVH, group, D]
        scores = sm_scale * np.einsum("nhgd,hkd->nhgk", qs, keys)
        if soft_cap is not None:
            scores = soft_cap * np.tanh(scores / soft_cap)
        q_pos = np.arange(ctx - (end - start), ctx)
        mask = pos[None, :] <= q_pos[:, None]                                     # [n, ctx]
        if sliding_window is not None:
            mask &= pos[None, :] > q_pos[:, None] - sliding_window
        scores = np.where(mask[:, None, None, :], scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        out[start:end] = np.einsum("nhgk,hkd->nhgd", weights, vals).reshape(end - start, num_heads, head_dim)
    return out
