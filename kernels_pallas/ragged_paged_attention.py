"""Ragged paged attention in pure jnp: the reference the Pallas kernels are tested
against, and the engine's CPU production path.

What flows through: one step's queries of many sequences in one flat array `q`
(decode tokens, whole prefills, prefill chunks continuing earlier context, prefix-cache
hits, all mixed), and a paged KV cache that already holds this step's keys and values
(`write_kv_cache` puts them there). Sequence s reads its keys through
`block_tables[s]`. Both functions run inside the caller's jitted step, on whichever
thread dispatches it; nothing here touches the host.

Work is proportional to the context actually attended, not tokens x max context:
- Short sequences (at most `decode_query_len` queries: decodes) are processed
  `decode_seq_tile` at a time. Each iteration gathers the next `kv_pages_per_chunk`
  pages of every sequence in the group at once and folds them into an online softmax,
  for as many chunks as the longest context in the group needs.
- Long sequences (prefills and prefill chunks) are processed one at a time, in query
  tiles of `query_tile` rows. Each tile loops over KV chunks only from its
  sliding-window start to its causal limit.
Every loop bound is dynamic and every shape static, so nothing recompiles when the
real token or sequence counts change.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
from jax import lax

_F32 = jnp.float32


def check_ragged_paged_attention_inputs(
    q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs, *,
    sm_scale, sliding_window=None, soft_cap=None,
) -> None:
    """Raise ValueError naming the offending argument if shapes or dtypes disagree."""
    if q.ndim != 3 or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be a float [T, num_q_heads, head_dim] array, got {q.dtype}{list(q.shape)}")
    _check_kv_cache(kv_cache)
    _check_bits_dtype("q", q, kv_cache)
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads = kv_cache.shape[1]
    if kv_cache.shape[4] != head_dim:
        raise ValueError(f"kv_cache head_dim {kv_cache.shape[4]} != q head_dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q num_q_heads {num_q_heads} is not a multiple of kv_cache num_kv_heads "
                         f"{num_kv_heads}")
    _check_int32("block_tables", block_tables, ndim=2)
    num_seqs_max = block_tables.shape[0]
    _check_int32("context_lens", context_lens, ndim=1)
    if context_lens.shape != (num_seqs_max,):
        raise ValueError(f"context_lens shape {context_lens.shape} != ({num_seqs_max},) (rows of block_tables)")
    _check_int32("query_start_loc", query_start_loc, ndim=1)
    if query_start_loc.shape != (num_seqs_max + 1,):
        raise ValueError(f"query_start_loc shape {query_start_loc.shape} != ({num_seqs_max + 1},) "
                         "(rows of block_tables + 1)")
    _check_int32("num_seqs", num_seqs, ndim=0)
    if not isinstance(sm_scale, numbers.Real) or isinstance(sm_scale, bool):
        raise ValueError(f"sm_scale must be a Python float (it is static), got {sm_scale!r}")
    if sliding_window is not None and (not isinstance(sliding_window, numbers.Integral) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")
    if soft_cap is not None and (not isinstance(soft_cap, numbers.Real) or isinstance(soft_cap, bool)
                                 or not soft_cap > 0):
        raise ValueError(f"soft_cap must be None or a positive Python float, got {soft_cap!r}")


def _check_kv_cache(kv_cache) -> None:
    if kv_cache.ndim != 5 or kv_cache.shape[0] != 2 or not (
            jnp.issubdtype(kv_cache.dtype, jnp.floating) or kv_cache.dtype == jnp.uint16):
        raise ValueError(
            "kv_cache must be a float (or uint16 bits) [2, num_kv_heads, num_blocks, block_size, head_dim] "
            f"array, got {kv_cache.dtype}{list(kv_cache.shape)}")


def _check_bits_dtype(name, x, kv_cache) -> None:
    """A uint16 pool holds the bits of 16-bit floats: `x` must be that float type."""
    if kv_cache.dtype == jnp.uint16 and not (jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2):
        raise ValueError(f"a uint16 kv_cache holds 16-bit float bits, so {name} must be bfloat16 or float16, "
                         f"got {x.dtype}")


def _check_int32(name, x, *, ndim) -> None:
    if x.ndim != ndim or x.dtype != jnp.int32:
        raise ValueError(f"{name} must be an int32 array of rank {ndim}, got {x.dtype}{list(x.shape)}")


def _bits_to(x, dtype):
    """uint16 bits -> the 16-bit float `dtype` they hold; float arrays pass through."""
    return lax.bitcast_convert_type(x, dtype) if x.dtype == jnp.uint16 else x


def write_kv_cache(kv_cache, k, v, slot_mapping):
    """Write this step's K/V [T, num_kv_heads, head_dim] into their flat slots; in place when donated.

    A uint16 `kv_cache` stores the bits of k/v's 16-bit float type (see `kv_pool_dtype`).
    """
    check_kv_write(kv_cache, k, v, slot_mapping)
    _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    flat = kv_cache.reshape(2, num_kv_heads, num_blocks * block_size, head_dim)
    kv = jnp.stack([k, v]).transpose(0, 2, 1, 3)                          # [2, kv_heads, T, D]
    if kv_cache.dtype == jnp.uint16:
        kv = lax.bitcast_convert_type(kv.astype(k.dtype), jnp.uint16)
    flat = flat.at[:, :, slot_mapping].set(kv.astype(kv_cache.dtype), mode="drop")
    return flat.reshape(kv_cache.shape)


def check_kv_write(kv_cache, k, v, slot_mapping) -> None:
    """`write_kv_cache`'s argument checks (shared with the native CPU write)."""
    _check_kv_cache(kv_cache)
    _check_bits_dtype("k", k, kv_cache)
    _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 3 or x.shape[1:] != (num_kv_heads, head_dim):
            raise ValueError(f"{name} shape {x.shape} != [T, {num_kv_heads}, {head_dim}] (from kv_cache)")
    if k.shape != v.shape:
        raise ValueError(f"k shape {k.shape} != v shape {v.shape}")
    _check_int32("slot_mapping", slot_mapping, ndim=1)
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping length {slot_mapping.shape[0]} != number of tokens {k.shape[0]}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _SeqInfo:
    tables: jax.Array        # [S, padded_blocks] int32 block ids
    context_lens: jax.Array  # [S] int32, 0 for padding sequences
    starts: jax.Array        # [S] int32 first q row
    q_lens: jax.Array        # [S] int32, 0 for padding sequences
    key_limits: jax.Array    # [S] int32: only keys at positions < this are read (0: the sequence is skipped)


def ragged_paged_attention_reference(
    q,                # [T, num_q_heads, head_dim]
    kv_cache,         # [2, num_kv_heads, num_blocks, block_size, head_dim], holds this step's K/V
    block_tables,     # [S, max_blocks_per_seq] int32
    context_lens,     # [S] int32: cached tokens after this step
    query_start_loc,  # [S + 1] int32
    num_seqs,         # [] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    query_tile: int = 32,
    kv_pages_per_chunk: int = 8,
    decode_query_len: int = 1,
    decode_seq_tile: int = 8,
) -> jax.Array:
    """Causal attention of each sequence's queries over its paged context -> [T, num_q_heads, head_dim].

    Logits are `sm_scale * q.k`, soft-capped to `soft_cap * tanh(logits / soft_cap)` when
    `soft_cap` is given (Gemma-style), then masked causally (and to the last
    `sliding_window` positions when given). Rows not owned by a real sequence are 0. Static knobs: `query_tile` rows per prefill
    tile, `kv_pages_per_chunk` pages per KV chunk, sequences with at most
    `decode_query_len` queries go through the batched decode path (0 turns it off),
    `decode_seq_tile` of them at a time. The defaults were picked with
    benchmarks/attention_reference.py --sweep.
    """
    # Every knob is passed explicitly, so an omitted default and the same value given
    # by name share one compiled program (jax.jit keys its cache on the kwargs given).
    return _ragged_paged_attention(
        q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, query_tile=query_tile,
        kv_pages_per_chunk=kv_pages_per_chunk, decode_query_len=decode_query_len,
        decode_seq_tile=decode_seq_tile)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "query_tile", "kv_pages_per_chunk", "decode_query_len",
    "decode_seq_tile"))
def _ragged_paged_attention(q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs, *,
                            sm_scale, sliding_window, soft_cap, query_tile, kv_pages_per_chunk, decode_query_len,
                            decode_seq_tile):
    check_ragged_paged_attention_inputs(
        q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    for name, knob, least in (("query_tile", query_tile, 1), ("kv_pages_per_chunk", kv_pages_per_chunk, 1),
                              ("decode_query_len", decode_query_len, 0),
                              ("decode_seq_tile", decode_seq_tile, 1)):
        if not isinstance(knob, int) or knob < least:
            raise ValueError(f"{name} must be an int >= {least}, got {knob!r}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[1]
    num_seq_slots = block_tables.shape[0]
    chunk = kv_pages_per_chunk

    real = jnp.arange(num_seq_slots) < num_seqs
    context_lens = jnp.where(real, context_lens, 0)
    q_lens = jnp.where(real, query_start_loc[1:] - query_start_loc[:-1], 0)
    qs = _scaled_queries(q, num_kv_heads, sm_scale, pad=query_tile)
    out, _ = paged_context_attention(
        qs, kv_cache, block_tables, context_lens, query_start_loc[:-1], q_lens, context_lens,
        bits_dtype=q.dtype, sliding_window=sliding_window, soft_cap=soft_cap, query_tile=query_tile,
        kv_pages_per_chunk=chunk, decode_query_len=decode_query_len, decode_seq_tile=decode_seq_tile)
    return out[:num_tokens].reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def _scaled_queries(q, num_kv_heads, sm_scale, *, pad):
    """[T, QH, D] -> scaled float32 [T + pad, KVH, group, D], GQA-split, padded so tile slices never clamp."""
    num_tokens, num_q_heads, head_dim = q.shape
    qs = (q.astype(_F32) * sm_scale).reshape(num_tokens, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    return jnp.pad(qs, ((0, pad), (0, 0), (0, 0), (0, 0)))


def paged_context_attention(qs, kv_cache, block_tables, context_lens, starts, q_lens, key_limits, *,
                            bits_dtype, sliding_window, soft_cap, query_tile, kv_pages_per_chunk,
                            decode_query_len, decode_seq_tile):
    """Each sequence's queries over its paged keys at positions < `key_limits` (and causal).

    `qs` [T + query_tile, KVH, group, D] scaled float32 queries; per sequence slot [S]:
    `context_lens` (its queries are the last `q_lens` positions of that context), `starts`
    (first row in `qs`), `key_limits`. Sequences with no query or no key are skipped.
    Returns (out, lse): the normalised attention [T + query_tile, KVH, group, D] and its
    log-sum-exp [T + query_tile, KVH, group] (-inf, with out 0, where a row read no key),
    so a caller can merge it with attention over other keys.
    """
    num_seq_slots, max_blocks = block_tables.shape
    chunk = kv_pages_per_chunk
    # Pad block tables to whole chunks so a chunk's slice never clamps (padding -> null block 0).
    padded_blocks = -(-max_blocks // chunk) * chunk  # static
    tables = jnp.pad(block_tables, ((0, 0), (0, padded_blocks - max_blocks)))
    seqs = _SeqInfo(tables, context_lens, starts, q_lens, key_limits)
    out = (jnp.zeros_like(qs), jnp.full(qs.shape[:-1], -jnp.inf, _F32))
    # One stable sort lists the short sequences first, then the long ones.
    active = (q_lens > 0) & (key_limits > 0)
    is_short = active & (q_lens <= decode_query_len)
    is_long = active & (q_lens > decode_query_len)
    order = jnp.argsort(jnp.where(is_short, 0, jnp.where(is_long, 1, 2)), stable=True).astype(jnp.int32)
    num_short, num_long = is_short.sum(dtype=jnp.int32), is_long.sum(dtype=jnp.int32)
    knobs = dict(sliding_window=sliding_window, soft_cap=soft_cap, chunk=chunk, bits_dtype=bits_dtype)
    if decode_query_len > 0:
        # A group never has more rows than there are sequence slots: padding rows of a group
        # still gather pages (of the null block), so at batch 1 a group of 8 did 8x the work.
        out = _short_sequences(qs, out, kv_cache, seqs, order, num_short, rows=decode_query_len,
                               seq_tile=min(decode_seq_tile, num_seq_slots), **knobs)
    return _long_sequences(qs, out, kv_cache, seqs, order, num_short, num_long,
                           query_tile=query_tile, **knobs)


def _cdiv(a, b):
    """Ceil division of non-negative ints (lax.div truncates, which is floor here)."""
    return lax.div(a + (b - 1), jnp.asarray(b, jnp.int32))


def _first_key(first_pos, sliding_window):
    """Earliest key position a query at `first_pos` (or later) can attend."""
    return jnp.zeros_like(first_pos) if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)


def _key_mask(key_pos, q_pos, sliding_window):
    """[..., R, K] causal (and sliding-window) mask from key [..., K] and query [..., R] positions."""
    mask = key_pos[..., None, :] <= q_pos[..., :, None]
    if sliding_window is not None:
        mask &= key_pos[..., None, :] > q_pos[..., :, None] - sliding_window
    return mask


def _softmax_update(state, scores, mask, v, pv_eq, soft_cap):
    """One online-softmax step: fold (soft-capped, then masked) `scores` [..., R, K] and `v` into (max, sum, acc)."""
    m, l, acc = state
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(mask, scores, -jnp.inf)
    m_new = jnp.maximum(m, scores.max(-1))
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with no key yet: keep exp finite
    p = jnp.exp(scores - shift[..., None])             # masked -> exp(-inf) = 0
    alpha = jnp.exp(m - shift)
    acc = alpha[..., None] * acc + jnp.einsum(pv_eq, p, v)
    return m_new, alpha * l + p.sum(-1), acc


def _finish(m, l, acc):
    """(normalised output, log-sum-exp) of an online-softmax state; rows with no key: (0, -inf)."""
    lse = jnp.where(l == 0, -jnp.inf, m + jnp.log(jnp.where(l == 0, 1.0, l)))
    return acc / jnp.where(l == 0, 1.0, l)[..., None], lse


def _page_rows(kv_cache, blocks):
    """Rows of the K and V pages of `blocks` [..., P] in the cache viewed as one page per row.

    Returns [2, kv_heads, ..., P] int32. Callers compute these once per sequence (or
    group) outside the KV-chunk loop and slice them per chunk: when XLA can fuse the
    index computation into the gather, it redoes it for every element copied
    (measured ~8x slower gathers).
    """
    _, num_kv_heads, num_blocks, _, _ = kv_cache.shape
    heads = jnp.arange(num_kv_heads).reshape(-1, *(1,) * blocks.ndim) * num_blocks
    k_rows = heads + jnp.clip(blocks, 0, num_blocks - 1)
    return jnp.stack([k_rows, k_rows + num_kv_heads * num_blocks])


def _gather_pages(kv_cache, rows, key_ok, bits_dtype):
    """K and V of the pages at `rows` [2, kv_heads, ..., C], each [kv_heads, ..., C * block_size, D] f32.

    Keys outside the context (`key_ok` false) get V = 0, so stale garbage in a page
    (even NaN) cannot leak through a zero softmax weight. A uint16 cache is read as
    `bits_dtype` (the queries' 16-bit float type) after the gather, on the gathered rows only.
    """
    two, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    # Gathering whole rows of one (K or V, head, block) page each yields K and V
    # directly in [KVH, ..., keys, D] order; gathering along axis 2 of the 5-D cache
    # made XLA's CPU gather ~2x slower plus a transposing copy.
    pages = kv_cache.reshape(two * num_kv_heads * num_blocks, block_size * head_dim)

    def gather(rows):  # -> [KVH, ..., C * BS, D]
        out = _bits_to(jnp.take(pages, rows.reshape(-1), axis=0, mode="clip"), bits_dtype)
        return out.reshape(*rows.shape[:-1], -1, head_dim).astype(_F32)

    return gather(rows[0]), jnp.where(key_ok[..., None], gather(rows[1]), 0.0)


def _short_sequences(qs, out, kv_cache, seqs, order, count, *, rows, seq_tile, sliding_window, soft_cap, chunk,
                     bits_dtype):
    """Sequences with 1..`rows` queries, `seq_tile` at a time, batched over the group."""
    _, num_kv_heads, group, head_dim = qs.shape
    block_size = kv_cache.shape[3]
    chunk_tokens = chunk * block_size
    num_slots = order.shape[0]
    order = jnp.pad(order, (0, -(-num_slots // seq_tile) * seq_tile - num_slots))  # whole groups
    num_rows = rows * group
    dropped = qs.shape[0]  # an out-of-range row: writes there are dropped

    def group_body(g, out):
        seq = lax.dynamic_slice_in_dim(order, g * seq_tile, seq_tile)  # [G]
        valid = g * seq_tile + jnp.arange(seq_tile) < count
        ctx = jnp.where(valid, seqs.context_lens[seq], 0)
        q_len = jnp.where(valid, seqs.q_lens[seq], 0)
        limit = jnp.where(valid, seqs.key_limits[seq], 0)
        j = jnp.arange(rows)
        row = seqs.starts[seq][:, None] + j                        # [G, rows]
        row = jnp.where(j < q_len[:, None], row, dropped)
        pos = ctx[:, None] - q_len[:, None] + j                    # [G, rows]
        q_pos = jnp.repeat(pos, group, axis=1)                     # [G, R] in (row, group) order
        qg = qs.at[row].get(mode="fill", fill_value=0)             # [G, rows, KVH, group, D]
        qg = qg.transpose(2, 0, 1, 3, 4).reshape(num_kv_heads, seq_tile, num_rows, head_dim)
        first_chunk = lax.div(_first_key(ctx - q_len, sliding_window), chunk_tokens)
        num_chunks = jnp.where(valid, _cdiv(limit, chunk_tokens) - first_chunk, 0)
        tables = seqs.tables[seq]                                  # [G, padded_blocks]
        if sliding_window is not None:  # start each sequence's table at its first chunk
            page = first_chunk[:, None] * chunk + jnp.arange(tables.shape[1])
            tables = jnp.take_along_axis(tables, jnp.minimum(page, tables.shape[1] - 1), axis=1)
        page_rows = _page_rows(kv_cache, tables)                   # [2, KVH, G, padded_blocks]

        def chunk_body(i, state):
            c = first_chunk + i                                    # [G]
            rows = lax.dynamic_slice_in_dim(page_rows, i * chunk, chunk, axis=3)  # [2, KVH, G, C]
            key_pos = c[:, None] * chunk_tokens + jnp.arange(chunk_tokens)  # [G, CT]
            k, v = _gather_pages(kv_cache, rows, key_pos < limit[:, None], bits_dtype)  # [KVH, G, CT, D]
            scores = jnp.einsum("hgrd,hgkd->hgrk", qg, k)
            mask = _key_mask(key_pos, q_pos, sliding_window) & (key_pos < limit[:, None])[:, None, :]  # [G, R, CT]
            return _softmax_update(state, scores, mask, v, "hgrk,hgkd->hgrd", soft_cap)

        state = (jnp.full((num_kv_heads, seq_tile, num_rows), -jnp.inf, _F32),
                 jnp.zeros((num_kv_heads, seq_tile, num_rows), _F32),
                 jnp.zeros_like(qg))
        res, lse = _finish(*lax.fori_loop(0, num_chunks.max(), chunk_body, state))
        res = res.reshape(num_kv_heads, seq_tile, rows, group, head_dim).transpose(1, 2, 0, 3, 4)
        lse = lse.reshape(num_kv_heads, seq_tile, rows, group).transpose(1, 2, 0, 3)
        return out[0].at[row].set(res, mode="drop"), out[1].at[row].set(lse, mode="drop")

    return lax.fori_loop(0, _cdiv(count, seq_tile), group_body, out)


def _put_rows(out, x, row0, row_ok):
    """out with rows row0.. replaced by x where row_ok (other rows belong to other sequences)."""
    old = lax.dynamic_slice_in_dim(out, row0, x.shape[0])
    mask = row_ok.reshape(-1, *(1,) * (x.ndim - 1))
    return lax.dynamic_update_slice_in_dim(out, jnp.where(mask, x, old), row0, axis=0)


def _long_sequences(qs, out, kv_cache, seqs, order, first, count, *, query_tile, sliding_window, soft_cap,
                    chunk, bits_dtype):
    """Sequences with more queries than the decode path takes, one at a time, in query tiles."""
    _, num_kv_heads, group, head_dim = qs.shape
    block_size = kv_cache.shape[3]
    chunk_tokens = chunk * block_size
    num_rows = query_tile * group

    def seq_body(n, out):
        s = order[first + n]
        start, q_len, ctx, limit = seqs.starts[s], seqs.q_lens[s], seqs.context_lens[s], seqs.key_limits[s]
        page_rows = _page_rows(kv_cache, seqs.tables[s])                        # [2, KVH, padded_blocks]

        def tile_body(t, out):
            row0 = start + t * query_tile
            j = t * query_tile + jnp.arange(query_tile)
            row_ok = j < q_len
            q_pos = jnp.repeat(ctx - q_len + j, group)                          # [R]
            qt = lax.dynamic_slice_in_dim(qs, row0, query_tile)                 # [Tq, KVH, group, D]
            qt = qt.transpose(1, 0, 2, 3).reshape(num_kv_heads, num_rows, head_dim)
            first_pos = ctx - q_len + t * query_tile
            first_chunk = lax.div(_first_key(first_pos, sliding_window), chunk_tokens)
            end = ctx - q_len + jnp.minimum((t + 1) * query_tile, q_len)       # causal limit of the tile
            end = jnp.minimum(end, limit)
            num_chunks = _cdiv(end, chunk_tokens) - first_chunk

            def chunk_body(i, state):
                c = first_chunk + i
                rows = lax.dynamic_slice_in_dim(page_rows, c * chunk, chunk, axis=2)  # [2, KVH, C]
                key_pos = c * chunk_tokens + jnp.arange(chunk_tokens)           # [CT]
                k, v = _gather_pages(kv_cache, rows, key_pos < limit, bits_dtype)           # [KVH, CT, D]
                scores = jnp.einsum("hrd,hkd->hrk", qt, k)
                mask = _key_mask(key_pos, q_pos, sliding_window) & (key_pos < limit)  # [R, CT]
                return _softmax_update(state, scores, mask, v, "hrk,hkd->hrd", soft_cap)

            state = (jnp.full((num_kv_heads, num_rows), -jnp.inf, _F32),
                     jnp.zeros((num_kv_heads, num_rows), _F32), jnp.zeros_like(qt))
            res, lse = _finish(*lax.fori_loop(0, num_chunks, chunk_body, state))
            res = res.reshape(num_kv_heads, query_tile, group, head_dim).transpose(1, 0, 2, 3)
            lse = lse.reshape(num_kv_heads, query_tile, group).transpose(1, 0, 2)
            return tuple(_put_rows(o, x, row0, row_ok) for o, x in zip(out, (res, lse)))

        return lax.fori_loop(0, _cdiv(q_len, query_tile), tile_body, out)

    return lax.fori_loop(0, count, seq_body, out)
