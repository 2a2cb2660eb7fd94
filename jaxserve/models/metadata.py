"""Per-step attention metadata: the part of a step's device inputs the model reads.

Built on the host by the runner (jaxserve.runner.inputs) as padded numpy arrays, passed
to the jitted step as a pytree, and read by every attention layer. All shapes are fixed
per token bucket, so a new step never recompiles.
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: jax.Array     # [T] int32: flat KV slot (block_id * block_size + offset) each token writes; padding -> 0 (null block)
    block_tables: jax.Array     # [S, max_blocks_per_seq] int32: KV block ids of each sequence; padding -> 0
    context_lens: jax.Array     # [S] int32: tokens of the sequence in the cache after this step (earlier + this step's)
    query_start_loc: jax.Array  # [S + 1] int32: sequence s owns flat tokens [query_start_loc[s], query_start_loc[s + 1])
    num_seqs: jax.Array         # [] int32: real sequences; rows past it are padding (query length 0, context 0)
