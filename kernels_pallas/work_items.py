"""What the Pallas kernels share: the flat ragged batch -> fixed-size work lists, and back.

What flows through: the same arrays as `ragged_paged_attention_reference` (q [T, H, D],
block tables, context lens, query start offsets, num_seqs), turned in plain jnp (inside
the caller's jit, before the kernel) into lists of *work items* of a static length, and
the kernels' per-item outputs scattered back into q's rows afterwards. Also the
online-softmax step both kernels run on one block of keys.

A work item is up to `tokens` consecutive query tokens of one sequence, for all q
heads of one KV head (GQA): its q tile is [R, D] with R = tokens * gp rows, row
j * gp + g = token j, q head g of the group (gp is the group size rounded up to a power
of two, padded with zero heads, so tiles have power-of-two shapes). Two lists:
- decode items: one per sequence with 1..`tokens` queries (decodes, short chunks);
  static length S, item s is sequence s.
- prefill tiles: sequences with more queries, cut into tiles of `tokens`; static
  length min(T, T // tokens + number of such sequences that fit in T), computed from
  the shapes. Unused items have count 0 and write nothing that is kept.
The split lets decode-heavy batches run on small tiles (little wasted matmul work) and
prefill-heavy ones on large tiles (each K/V block re-used by many rows), in two kernel
launches whose grids are fixed by the shapes, so nothing recompiles with the real counts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

# Columns of WorkItems.meta.
SEQ, POS, COUNT, CTX = range(4)
PALLAS_DTYPES = ("float32", "bfloat16", "float16")


def check_pallas_inputs(q, kv_cache, *, kind: str, page_size_ok, page_size_rule: str) -> None:
    """What the Pallas kernels check on top of the reference's checks: one float dtype, the page size."""
    if q.dtype != kv_cache.dtype or q.dtype.name not in PALLAS_DTYPES:
        raise ValueError(f"{kind} needs q and kv_cache of one dtype in {PALLAS_DTYPES}, "
                         f"got q {q.dtype.name} and kv_cache {kv_cache.dtype.name}")
    page_size = kv_cache.shape[3]
    if not page_size_ok(page_size):
        raise ValueError(f"{kind}: page size (kv_cache block_size axis) {page_size} must be {page_size_rule}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WorkItems:
    meta: jax.Array   # [N, 4] int32: sequence, position of the first query token, query tokens (0: unused), context len
    q: jax.Array      # [N, KVH, R, D] q tiles in q's dtype; row j * gp + g = token j, q head g; 0 where unused
    rows: jax.Array   # [N, tokens] int32: each item token's row in q; T (out of range, dropped) where unused


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Seqs:
    starts: jax.Array   # [S] int32 first q row
    q_lens: jax.Array   # [S] int32 query tokens this step; 0 for padding sequence slots
    ctx: jax.Array      # [S] int32 context length incl. this step's tokens; 0 for padding slots


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def sequences(context_lens, query_start_loc, num_seqs) -> Seqs:
    """Per-sequence query spans with padding slots (index >= num_seqs) zeroed."""
    real = jnp.arange(context_lens.shape[0]) < num_seqs
    q_lens = jnp.where(real, query_start_loc[1:] - query_start_loc[:-1], 0)
    return Seqs(query_start_loc[:-1], q_lens, jnp.where(real, context_lens, 0))


def tokens_per_item(rows: int, group_padded: int) -> int:
    """Query tokens per item so that tokens * gp ~ rows (at least one token)."""
    return max(1, rows // group_padded)


def num_prefill_items(num_tokens: int, num_seqs: int, *, tokens: int, decode_tokens: int) -> int:
    """Static bound on the prefill tiles of any batch of these shapes.

    A sequence with q > decode_tokens queries needs ceil(q / tokens) <= q / tokens + 1 tiles;
    summed over at most min(S, T // (decode_tokens + 1)) such sequences holding <= T tokens.
    """
    long_seqs = min(num_seqs, num_tokens // (decode_tokens + 1))
    return min(num_tokens, num_tokens // tokens + long_seqs) if long_seqs else 0


def _items(q4, seq, first, count, seqs: Seqs, tokens: int) -> WorkItems:
    """Items from per-item sequence ids, first query offset in the sequence and token count."""
    num_tokens, num_kv_heads, gp, head_dim = q4.shape
    j = jnp.arange(tokens)
    rows = seqs.starts[seq][:, None] + first[:, None] + j                     # [N, tokens]
    rows = jnp.where(j < count[:, None], rows, num_tokens)
    tiles = q4.at[rows].get(mode="fill", fill_value=0)                        # [N, tokens, KVH, gp, D]
    tiles = tiles.transpose(0, 2, 1, 3, 4).reshape(-1, num_kv_heads, tokens * gp, head_dim)
    ctx = seqs.ctx[seq]
    pos = ctx - seqs.q_lens[seq] + first
    meta = jnp.stack([seq, pos, count, jnp.where(count > 0, ctx, 0)], axis=1).astype(jnp.int32)
    return WorkItems(meta, tiles, rows.astype(jnp.int32))


def decode_items(q4, seqs: Seqs, *, tokens: int) -> WorkItems:
    """One item per sequence slot; used by sequences with 1..tokens queries."""
    num_slots = seqs.q_lens.shape[0]
    short = seqs.q_lens <= tokens
    seq = jnp.arange(num_slots, dtype=jnp.int32)
    return _items(q4, seq, jnp.zeros_like(seq), jnp.where(short, seqs.q_lens, 0), seqs, tokens)


def prefill_items(q4, seqs: Seqs, *, tokens: int, decode_tokens: int, num_items: int) -> WorkItems:
    """Tiles of `tokens` queries of every sequence with more than `decode_tokens` queries."""
    long = seqs.q_lens > decode_tokens
    num_tiles = jnp.where(long, (seqs.q_lens + tokens - 1) // tokens, 0)     # [S]
    ends = jnp.cumsum(num_tiles)                                               # [S]
    w = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, w, side="right"), seqs.q_lens.shape[0] - 1).astype(jnp.int32)
    first = (w - (ends[seq] - num_tiles[seq])) * tokens
    count = jnp.where(w < ends[-1], jnp.clip(seqs.q_lens[seq] - first, 0, tokens), 0)
    return _items(q4, seq, first, count, seqs, tokens)


def grouped_queries(q, num_kv_heads: int) -> jax.Array:
    """q [T, H, D] -> [T, KVH, gp, D], the group padded with zero heads to a power of two."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    return jnp.pad(q4, ((0, 0), (0, 0), (0, next_power_of_2(group) - group), (0, 0)))


def scatter_items(out, tiles, rows):
    """Write item outputs [N, KVH, R, D] into out [T, KVH, gp, D] at their rows (unused rows dropped)."""
    num_items, num_kv_heads, _, head_dim = tiles.shape
    tokens, gp = rows.shape[1], out.shape[2]
    tiles = tiles.reshape(num_items, num_kv_heads, tokens, gp, head_dim).transpose(0, 2, 1, 3, 4)
    return out.at[rows].set(tiles.astype(out.dtype), mode="drop")


def ungroup(out, num_heads: int):
    """[T, KVH, gp, D] -> [T, H, D], dropping the padding heads."""
    num_tokens, num_kv_heads, _, head_dim = out.shape
    return out[:, :, :num_heads // num_kv_heads].reshape(num_tokens, num_heads, head_dim)


def run_items(q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs, *, decode_rows: int,
              prefill_rows: int, kv_block: int, call) -> jax.Array:
    """The ragged batch through a kernel in two launches (decode items, then prefill tiles) -> [T, H, D].

    `call(items, phase, *, tables, pages_per_block, gp)` runs the kernel over `items`
    (phase "decode" or "prefill") and returns their outputs [N, KVH, R, D]; `tables` are
    the block tables padded to whole KV blocks of `pages_per_block` pages, so a block's
    page slice never runs off the row.
    """
    num_tokens, num_heads, _ = q.shape
    _, num_kv_heads, _, page_size, _ = kv_cache.shape
    num_slots, max_blocks = block_tables.shape
    layout = dict(pages_per_block=max(1, kv_block // page_size),
                  gp=next_power_of_2(num_heads // num_kv_heads))
    layout["tables"] = jnp.pad(block_tables, ((0, 0), (0, -max_blocks % layout["pages_per_block"])))
    seqs = sequences(context_lens, query_start_loc, num_seqs)
    q4 = grouped_queries(q, num_kv_heads)                                 # [T, KVH, gp, D]
    out = jnp.zeros(q4.shape, q.dtype)

    decode_tokens = tokens_per_item(decode_rows, layout["gp"])
    items = decode_items(q4, seqs, tokens=decode_tokens)
    out = scatter_items(out, call(items, "decode", **layout), items.rows)

    prefill_tokens = tokens_per_item(prefill_rows, layout["gp"])
    num_items = num_prefill_items(num_tokens, num_slots, tokens=prefill_tokens, decode_tokens=decode_tokens)
    if num_items:  # static: 0 when no sequence in T tokens can outgrow a decode item
        items = prefill_items(q4, seqs, tokens=prefill_tokens, decode_tokens=decode_tokens, num_items=num_items)
        out = scatter_items(out, call(items, "prefill", **layout), items.rows)
    return ungroup(out, num_heads)


def combine_splits(acc, m, l):
    """Merge flash-decoding partials acc [K, ...R, D], m / l [K, ...R] (unnormalised) -> [...R, D] f32."""
    m_all = m.max(axis=0)
    shift = jnp.where(m_all == -jnp.inf, 0.0, m_all)
    w = jnp.exp(m - shift)                             # splits that saw no key: exp(-inf) = 0
    l_all = (w * l).sum(axis=0)
    return (w[..., None] * acc).sum(axis=0) / jnp.where(l_all == 0, 1.0, l_all)[..., None]


def key_range(pos, count, ctx, sliding_window):
    """Keys [lo, hi) that an item's queries (positions pos .. pos + count - 1) can attend."""
    hi = jnp.where(count > 0, jnp.minimum(ctx, pos + count), 0)
    lo = 0 if sliding_window is None else jnp.maximum(pos - sliding_window + 1, 0)
    return jnp.minimum(lo, hi), hi


def fold_kv_block(state, s, v, *, key_start, q_pos, ctx, soft_cap, sliding_window, pv_dot):
    """One online-softmax step inside a kernel, all in float32 except the P.V dot's inputs.

    state: (m [R, 1], l [R, 1], acc [R, D]); s [R, K] scaled logits of K keys starting at
    position `key_start`; v [K, D]; q_pos [R, 1] query positions; ctx the context length.
    Keys past the context get V = 0 so stale cache contents (even NaN) cannot leak
    through a zero weight.
    """
    m, l, acc = state
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    key_pos = key_start + lax.broadcasted_iota(jnp.int32, (1, s.shape[1]), 1)   # [1, K]
    mask = key_pos <= q_pos
    if sliding_window is not None:
        mask &= key_pos > q_pos - sliding_window
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)     # rows with no key yet: keep exp finite
    p = jnp.exp(s - shift)                                # masked -> 0
    alpha = jnp.exp(m - shift)
    key_ok = (key_start + lax.broadcasted_iota(jnp.int32, (v.shape[0], 1), 0)) < ctx
    v = jnp.where(key_ok, v, jnp.zeros_like(v))
    acc = alpha * acc + pv_dot(p.astype(v.dtype), v)
    return m_new, alpha * l + p.sum(axis=1, keepdims=True), acc
