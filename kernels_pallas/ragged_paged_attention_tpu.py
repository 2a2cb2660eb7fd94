"""Ragged paged attention as a Pallas TPU (Mosaic) kernel on jaxserve's own KV layout.

What flows through: the reference's inputs, inside the caller's jitted step, planned
into decode items and prefill tiles by `work_items` exactly as for the GPU kernel; one
`pallas_call` per list; outputs scattered back into q's rows. Same semantics as
`ragged_paged_attention_reference`, its oracle.

Kernel: one grid cell per (work item, KV head). Item metadata and block tables are
scalar-prefetched into SMEM; the q tile (all q heads of the KV head as rows, GQA) comes
in through a BlockSpec; the KV cache stays in HBM and the cell DMAs each KV block's
pages (`kv_block` keys, whole pages, one DMA per page for K and for V) into a
double-buffered VMEM scratch, fetching block b + 1 while computing block b. Online
softmax in float32, causal / sliding-window / soft-cap masks per block, only the blocks
the tile can see.

Why our own kernel and not `jax.experimental.pallas.ops.tpu.ragged_paged_attention`:
that kernel wants K/V interleaved per token as [pages, page_size, 2 * kv_heads, D];
adapting our [2, kv_heads, pages, page_size, D] cache to it would copy the whole cache
every step and layer (or force that layout on the GPU and CPU paths too). Its lowering
also asks for the TPU generation (`get_tpu_info`), so it cannot be cross-lowered on a
CPU-only machine; this kernel can.

What could not be checked without a TPU (say so before relying on it):
- Interpret mode (`interpret=True`, `pltpu.InterpretParams`, which simulates the DMAs
  and semaphores) and cross-lowering to Mosaic MLIR for platform "tpu" are tested on
  CPU (tests/kernels/test_pallas_tpu.py). Mosaic's own compile (vector layouts,
  tiling of the [R, 1] softmax statistics, DMA alignment of pages into the scratch) runs
  only on a TPU, as do timings. Page sizes must be a multiple of the sublane tiling
  (8 rows for 32-bit, 16 for 16-bit dtypes) so each page lands tile-aligned.
- Block tables and item metadata are scalar-prefetched whole into SMEM (as JAX's kernel
  does with its page indices), so S x max_blocks int32 must fit there.
- No cross-cell prefetch: each cell's first KV block is fetched after the cell starts,
  which costs latency on short contexts; a later version can prefetch the next cell's
  first block as JAX's kernel does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import tuning, work_items
from kernels_pallas.ragged_paged_attention import check_ragged_paged_attention_inputs

_F32 = jnp.float32


def _sublanes(dtype) -> int:
    """Rows of one (sublane, lane) tile: 8 for 32-bit dtypes, 16 for 16-bit ones."""
    return 8 * 4 // jnp.dtype(dtype).itemsize


def ragged_paged_attention_tpu(
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
    interpret: bool = False,
) -> jax.Array:
    """Causal attention of each sequence's queries over its paged context -> [T, num_q_heads, head_dim].

    Same contract as `ragged_paged_attention_reference`. Knobs left as None come from
    `tuning` for (this TPU's kind, head_dim, dtype). `interpret=True` runs the kernel in the
    TPU interpreter (CPU tests).
    """
    return _ragged_paged_attention_tpu(
        q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, decode_rows=decode_rows,
        prefill_rows=prefill_rows, kv_block=kv_block, interpret=interpret)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "decode_rows", "prefill_rows", "kv_block", "interpret"))
def _ragged_paged_attention_tpu(q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs, *,
                                sm_scale, sliding_window, soft_cap, decode_rows, prefill_rows, kv_block,
                                interpret):
    check_ragged_paged_attention_inputs(
        q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    sublanes = _sublanes(q.dtype) if q.dtype == kv_cache.dtype else 8
    work_items.check_pallas_inputs(q, kv_cache, kind="Pallas TPU attention", page_size_ok=lambda n: n % sublanes == 0,
                        page_size_rule=f"a multiple of {sublanes} (the sublane tiling of {q.dtype.name})")
    table = tuning.tpu_block_sizes(q.shape[2], q.dtype.name, device_kind=_device_kind())
    decode_rows = table.decode_rows if decode_rows is None else decode_rows
    prefill_rows = table.prefill_rows if prefill_rows is None else prefill_rows
    kv_block = table.kv_block if kv_block is None else kv_block
    for name, knob in (("decode_rows", decode_rows), ("prefill_rows", prefill_rows), ("kv_block", kv_block)):
        if not isinstance(knob, int) or isinstance(knob, bool) or knob < sublanes or knob % sublanes:
            raise ValueError(f"{name} must be a multiple of {sublanes} (sublane tiling), got {knob!r}")

    # Rows stay whole sublane tiles: gp is a power of 2, the row knobs multiples of the tiling.
    def call(items, phase, **layout):
        return _call(items, kv_cache=kv_cache, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                     interpret=interpret, name=phase, **layout)
    return work_items.run_items(q, kv_cache, block_tables, context_lens, query_start_loc, num_seqs,
                                decode_rows=decode_rows, prefill_rows=prefill_rows, kv_block=kv_block, call=call)


def _device_kind() -> str | None:
    """The TPU's kind, which keys the measured tuning tables; None off a TPU (cross-lowering, CPU interpret)."""
    device = jax.devices()[0]
    return device.device_kind if device.platform == "tpu" else None


def _call(items: work_items.WorkItems, *, kv_cache, tables, sm_scale, sliding_window, soft_cap,
          pages_per_block, gp, interpret, name):
    """One pallas_call over `items` -> their outputs [N, KVH, R, D]."""
    num_items, num_kv_heads, rows, head_dim = items.q.shape
    page_size = kv_cache.shape[3]
    block_keys = pages_per_block * page_size
    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        pages_per_block=pages_per_block, tables_width=tables.shape[1], gp=gp)
    tile_spec = pl.BlockSpec((None, None, rows, head_dim), lambda i, h, meta, tables: (i, h, 0, 0))
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,                                     # meta, block tables -> SMEM (1-D: no padding)
            grid=(num_items, num_kv_heads),
            in_specs=[tile_spec, pl.BlockSpec(memory_space=pl.ANY)],   # q tile; KV cache stays in HBM
            out_specs=tile_spec,
            scratch_shapes=[
                pltpu.VMEM((2, block_keys, head_dim), kv_cache.dtype),  # K, double-buffered
                pltpu.VMEM((2, block_keys, head_dim), kv_cache.dtype),  # V
                pltpu.SemaphoreType.DMA((2, 2)),                        # [K or V, buffer]
            ]),
        out_shape=jax.ShapeDtypeStruct(items.q.shape, items.q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=f"ragged_paged_attention_{name}",
    )(items.meta.reshape(-1), tables.reshape(-1), items.q, kv_cache)


def _kernel(meta_ref, tables_ref, q_ref, kv_hbm, o_ref, k_buf, v_buf, sems, *, sm_scale, sliding_window,
            soft_cap, pages_per_block, tables_width, gp):
    """One (item, KV head): online softmax of the q tile over its KV blocks, DMA'd one block ahead."""
    rows, head_dim = q_ref.shape
    _, _, num_blocks, page_size, _ = kv_hbm.shape
    block_keys = pages_per_block * page_size
    item, head = pl.program_id(0), pl.program_id(1)
    seq, pos, count, ctx = (meta_ref[item * 4 + c] for c in range(4))
    lo, hi = work_items.key_range(pos, count, ctx, sliding_window)
    first, end = lax.div(lo, block_keys), pl.cdiv(hi, block_keys)

    def copies(b, slot):
        """The DMAs of KV block b into buffer `slot`: one per page, for K and for V."""
        out = []
        for p in range(pages_per_block):
            page = jnp.clip(tables_ref[seq * tables_width + b * pages_per_block + p], 0, num_blocks - 1)
            for kv, buf in ((0, k_buf), (1, v_buf)):
                out.append(pltpu.make_async_copy(
                    kv_hbm.at[kv, head, page], buf.at[slot, pl.ds(p * page_size, page_size)], sems.at[kv, slot]))
        return out

    @pl.when(first < end)
    def _():
        for c in copies(first, 0):
            c.start()

    q = q_ref[...]                                                     # [R, D]
    q_pos = pos + lax.div(lax.broadcasted_iota(jnp.int32, (rows, 1), 0), gp)  # [R, 1]
    dot = functools.partial(lax.dot_general, preferred_element_type=_F32,
                            precision=lax.Precision.HIGHEST if q.dtype == _F32 else None)

    def body(b, state):
        slot = lax.rem(b - first, 2)

        @pl.when(b + 1 < end)
        def _():
            for c in copies(b + 1, 1 - slot):
                c.start()

        for c in copies(b, slot):
            c.wait()
        k, v = k_buf[slot], v_buf[slot]                                # [K, D] each
        s = dot(q, k, (((1,), (1,)), ((), ()))) * sm_scale            # [R, K] f32
        return work_items.fold_kv_block(
            state, s, v, key_start=b * block_keys, q_pos=q_pos, ctx=ctx, soft_cap=soft_cap,
            sliding_window=sliding_window, pv_dot=lambda p, v: dot(p, v, (((1,), (0,)), ((), ()))))

    state = (jnp.full((rows, 1), -jnp.inf, _F32), jnp.zeros((rows, 1), _F32), jnp.zeros((rows, head_dim), _F32))
    _, l, acc = lax.fori_loop(first, jnp.maximum(first, end), body, state)
    o_ref[...] = (acc / jnp.where(l == 0, 1.0, l)).astype(o_ref.dtype)
