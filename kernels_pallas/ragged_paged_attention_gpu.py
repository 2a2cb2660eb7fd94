"""Ragged paged attention as a Pallas kernel for NVIDIA GPUs (aimed at H100/H200), Triton lowering.

What flows through: the reference's inputs (q [T, H, D], the per-layer KV cache
[2, KVH, num_blocks, page_size, D], block tables, context lens, query start offsets,
num_seqs), inside the caller's jitted step. `work_items` turns the batch into two
fixed-size lists (decode items, prefill tiles); one `pallas_call` per list runs the
kernel below; the outputs are scattered back into q's rows. Same semantics as
`ragged_paged_attention_reference`, which is its oracle (tests run it in interpret mode).

Kernel: one program per (work item, KV head[, KV split]). It loads its q tile (every
query head of that KV head stacked as rows, so GQA reads each K/V page once for the
whole group), then walks its sequence's KV pages `kv_block` keys at a time: page ids
from the block table row, K and V pages gathered straight from the cache (no copy of
the cache), scores and the P.V product on tensor cores with float32 accumulation, an
online softmax in float32, causal / sliding-window / soft-cap masking per block. Only
the blocks a tile can see are visited (from its window start to its causal limit).

Keeping every SM busy: the grid is (items, KV heads, splits). Prefill-heavy batches
have many tiles. Decode-heavy batches have one item per sequence; when
sequences x KV heads is small next to the SM count, each decode item's KV range is
split over `kv_splits` programs (flash-decoding) whose partial softmax states are merged
in jnp afterwards. Grid sizes depend only on shapes; items without work exit at once.

Why Triton lowering rather than Mosaic GPU: this kernel lives on gathers of
non-contiguous pages through a block table, small decode tiles (16 rows) and ragged
bounds. Triton lowers a `ref[page_ids]` gather to plain pointer arithmetic with
software-pipelined loads and accepts 16-row dots; Mosaic GPU wants TMA-shaped copies
and WGMMA tiles of 64 rows, so each 16-token page would be its own TMA transfer and
decode tiles would be 4-8x padded. Testing on CPU decides it too: the interpreter that
models Mosaic GPU's own primitives (TMA copies, barriers; `InterpretGPUParams`) accepts
only whole-array BlockSpecs in jax 0.10 (checked in its source), and the generic
interpreter does not model those primitives, whereas a Triton-style kernel built from
plain loads, dots and BlockSpecs runs as is under `interpret=True`. JAX's own
`ops.gpu.paged_attention` makes the same choice.
What Mosaic GPU would add (TMA multicast, warp specialisation) matters most for long
prefills; that is the thing to revisit once H100 numbers exist.

Status: tested in interpret mode on CPU and cross-lowered for CUDA (both in
tests/kernels/test_pallas_gpu.py). Triton's own compile to PTX and the timings need a
GPU: `python benchmarks/kernel_bench.py` (see benchmarks/RESULTS.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import tuning, work_items
from kernels_pallas.ragged_paged_attention import check_ragged_paged_attention_inputs

_F32 = jnp.float32


def _check_knob(name, value, least=1):
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def _is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def ragged_paged_attention_gpu(
    q,                # [T, num_q_heads, head_dim]
    kv_cache,         # [2, num_kv_heads, num_blocks, page_size, head_dim], holds this step's K/V
    block_tables,     # [S, max_blocks_per_seq] int32
    context_lens,     # [S] int32: cached tokens after this step
    query_start_loc,  # [S + 1] int32
    num_seqs,         # [] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    decode_rows: int | None = None,
    prefill_rows: int | None = None,
    kv_block: int | None = None,
    kv_splits: int | None = None,
    num_warps: tuple[int, int] | None = None,
    num_stages: tuple[int, int] | None = None,
    num_sms: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Causal attention of each sequence's queries over its paged context -> [T, num_q_heads, head_dim].

    Same contract as `ragged_paged_attention_reference` (rows of padding tokens are 0).
    Knobs left as None come from `tuning` for (this GPU's kind, head_dim, dtype): matmul rows
    of decode items / prefill tiles, keys per inner step, (decode, prefill) warps and
    pipeline stages. `kv_splits` (decode items only) defaults to enough programs to fill
    `num_sms` twice (the device's SM count, or an H100's when it cannot be asked).
    `interpret=True` runs the kernel in Pallas' interpreter (CPU tests).
    """
    return _ragged_paged_attention_gpu(
        q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, decode_rows=decode_rows,
        prefill_rows=prefill_rows, kv_block=kv_block, kv_splits=kv_splits, num_warps=num_warps,
        num_stages=num_stages, num_sms=num_sms, interpret=interpret)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "decode_rows", "prefill_rows", "kv_block", "kv_splits",
    "num_warps", "num_stages", "num_sms", "interpret"))
def _ragged_paged_attention_gpu(q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs, *,
                                sm_scale, sliding_window, soft_cap, decode_rows, prefill_rows, kv_block,
                                kv_splits, num_warps, num_stages, num_sms, interpret):
    check_ragged_paged_attention_inputs(
        q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    work_items.check_pallas_inputs(q, kv_cache, kind="Pallas GPU attention", page_size_ok=_is_power_of_2,
                        page_size_rule="a power of 2 (Triton loads have power-of-2 shapes)")
    head_dim, num_kv_heads = q.shape[2], kv_cache.shape[1]
    if not _is_power_of_2(head_dim) or head_dim < 16:
        raise ValueError(f"Pallas GPU attention: head_dim {head_dim} must be a power of 2 >= 16")
    table = tuning.gpu_block_sizes(head_dim, q.dtype.name, device_kind=_device_kind())
    decode_rows = table.decode_rows if decode_rows is None else decode_rows
    prefill_rows = table.prefill_rows if prefill_rows is None else prefill_rows
    kv_block = table.kv_block if kv_block is None else kv_block
    warps = (table.decode_warps, table.prefill_warps) if num_warps is None else num_warps
    stages = (table.decode_stages, table.prefill_stages) if num_stages is None else num_stages
    for name, knob in (("decode_rows", decode_rows), ("prefill_rows", prefill_rows), ("kv_block", kv_block)):
        if not isinstance(knob, int) or not _is_power_of_2(knob) or knob < 16:
            raise ValueError(f"{name} must be a power of 2 >= 16 (the smallest Triton dot), got {knob!r}")
    for name, pair in (("num_warps", warps), ("num_stages", stages)):
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise ValueError(f"{name} must be a (decode, prefill) pair of ints, got {pair!r}")
        for knob in pair:
            _check_knob(name, knob)

    num_slots = block_tables.shape[0]
    if kv_splits is None:
        sms = num_sms or _device_sms()
        kv_splits = min(table.max_kv_splits, max(1, -(-2 * sms // (num_slots * num_kv_heads))))
    _check_knob("kv_splits", kv_splits)

    def call(items, phase, **layout):
        i = 0 if phase == "decode" else 1
        return _call(items, kv_cache=kv_cache, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                     num_splits=kv_splits if phase == "decode" else 1, num_warps=warps[i], num_stages=stages[i],
                     interpret=interpret, name=phase, **layout)
    return work_items.run_items(q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs,
                                decode_rows=decode_rows, prefill_rows=prefill_rows, kv_block=kv_block, call=call)


def _device_kind() -> str | None:
    """The GPU's kind, which keys the measured tuning tables; None off a GPU (cross-lowering, CPU interpret)."""
    device = jax.devices()[0]
    return device.device_kind if device.platform == "gpu" else None


def _device_sms() -> int:
    """SM count of the GPU this runs on; an H100's when there is none (cross-lowering, interpret mode)."""
    device = jax.devices()[0]
    return (getattr(device, "core_count", None) if device.platform == "gpu" else None) or tuning.H100_NUM_SMS


def _call(items: work_items.WorkItems, *, kv_cache, tables, sm_scale, sliding_window, soft_cap,
          pages_per_block, gp, num_splits, num_warps, num_stages, interpret, name):
    """One pallas_call over `items` -> their outputs [N, KVH, R, D] (merged over KV splits)."""
    num_items, num_kv_heads, rows, head_dim = items.q.shape
    _, _, num_blocks, page_size, _ = kv_cache.shape
    partial = num_splits > 1
    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        pages_per_block=pages_per_block, gp=gp, num_splits=num_splits, partial=partial)
    page_spec = lambda kv: pl.BlockSpec((None, None, num_blocks, page_size, head_dim),  # noqa: E731
                                        lambda i, h, s: (kv, h, 0, 0, 0))
    tile_spec = pl.BlockSpec((None, None, None, rows, head_dim), lambda i, h, s: (s, i, h, 0, 0))
    stat_spec = pl.BlockSpec((None, None, None, rows), lambda i, h, s: (s, i, h, 0))
    tile_shape = (num_splits, num_items, num_kv_heads, rows, head_dim)
    stat = jax.ShapeDtypeStruct(tile_shape[:-1], _F32)
    outs = pl.pallas_call(
        kernel,
        grid=(num_items, num_kv_heads, num_splits),
        in_specs=[
            pl.BlockSpec((None, 4), lambda i, h, s: (i, 0)),                          # meta
            pl.BlockSpec(tables.shape, lambda i, h, s: (0, 0)),                       # block tables
            pl.BlockSpec((None, None, rows, head_dim), lambda i, h, s: (i, h, 0, 0)),  # q tile
            page_spec(0),                                                             # K pages of head h
            page_spec(1),                                                             # V pages of head h
        ],
        # Split items write unnormalised partial states (acc, max, sum); whole ones their output.
        out_specs=[tile_spec, stat_spec, stat_spec] if partial else [tile_spec],
        out_shape=([jax.ShapeDtypeStruct(tile_shape, _F32), stat, stat] if partial
                   else [jax.ShapeDtypeStruct(tile_shape, items.q.dtype)]),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_{name}",
    )(items.meta, tables, items.q, kv_cache, kv_cache)
    return work_items.combine_splits(*outs) if partial else outs[0][0]


def _kernel(meta_ref, tables_ref, q_ref, k_ref, v_ref, o_ref, *stat_refs, sm_scale, sliding_window,
            soft_cap, pages_per_block, gp, num_splits, partial):
    """One (item, KV head, split): online softmax of the item's q tile over its KV blocks."""
    rows, head_dim = q_ref.shape
    num_blocks, page_size, _ = k_ref.shape
    block_keys = pages_per_block * page_size
    seq, pos, count, ctx = (meta_ref[c] for c in range(4))
    lo, hi = work_items.key_range(pos, count, ctx, sliding_window)
    first, end = lax.div(lo, block_keys), pl.cdiv(hi, block_keys)
    per_split = pl.cdiv(end - first, num_splits)
    first = first + pl.program_id(2) * per_split
    end = jnp.minimum(end, first + per_split)

    q = q_ref[...]                                                     # [R, D]
    q_pos = pos + lax.div(lax.broadcasted_iota(jnp.int32, (rows, 1), 0), gp)  # [R, 1]
    dot = functools.partial(lax.dot_general, preferred_element_type=_F32,
                            precision=lax.Precision.HIGHEST if q.dtype == _F32 else None)

    def body(b, state):
        pages = tables_ref[seq, pl.ds(b * pages_per_block, pages_per_block)]
        pages = jnp.clip(pages, 0, num_blocks - 1)                     # stale table entries stay in bounds
        k = k_ref[pages].reshape(block_keys, head_dim)                # [K, D] gathered pages
        v = v_ref[pages].reshape(block_keys, head_dim)
        s = dot(q, k, (((1,), (1,)), ((), ()))) * sm_scale            # [R, K] f32
        return work_items.fold_kv_block(
            state, s, v, key_start=b * block_keys, q_pos=q_pos, ctx=ctx, soft_cap=soft_cap,
            sliding_window=sliding_window, pv_dot=lambda p, v: dot(p, v, (((1,), (0,)), ((), ()))))

    state = (jnp.full((rows, 1), -jnp.inf, _F32), jnp.zeros((rows, 1), _F32), jnp.zeros((rows, head_dim), _F32))
    m, l, acc = lax.fori_loop(first, jnp.maximum(first, end), body, state)
    if partial:
        m_ref, l_ref = stat_refs
        o_ref[...] = acc
        m_ref[...] = m.reshape(rows)
        l_ref[...] = l.reshape(rows)
    else:
        o_ref[...] = (acc / jnp.where(l == 0, 1.0, l)).astype(o_ref.dtype)
