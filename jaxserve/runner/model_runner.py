"""The model runner: per-request device-side state, the jitted step, warm-up.

Runs on the engine thread. `execute(scheduler_output)` applies the scheduler's diffs to
its request states, prepares padded numpy inputs for the smallest token bucket that
fits, runs the one jitted step `(params, kv_caches, inputs) -> (kv_caches, tokens,
logprobs)` with the KV pool donated (updated in place), and returns the sampled tokens
as plain data. Every bucket is compiled by `warmup()`; `compiles_after_warmup` exposes
any compile after that.

Steps in which some request wants prompt logprobs run a second variant of the step (one
more input, three more outputs: logits at every scheduled position, not only the last of
each sequence). It is compiled per token bucket on first use, outside warm-up, so the
first such request of a bucket waits for one compile; steps without prompt logprobs
never run it and cost what they did.

Disaggregated prefill/decode moves whole KV blocks between engines: `gather_blocks` copies
blocks out of the pool into a host array in the canonical layout [blocks, layers, 2,
kv_heads, block_size, head_dim] (the same on any mesh), `write_blocks` scatters such an
array into the pool (donated). Both are padded to power-of-two block counts, compiled by
`warmup_kv_transfer`.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import functools
import logging
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxserve.core import Logprobs, ModelRunnerOutput, NoTokenAllowedError, SchedulerOutput
from jaxserve.models.config import ModelConfig
from jaxserve.models.layers import Proj, contracted_size, log_softmax, pack_for_tiles, pack_kernel, unpack_kernel
from jaxserve.runner.inputs import (PENDING, PromptLogprobsInputs, RequestState, StepInputs, first_buckets,
                                    later_buckets, num_prompt_logprob_positions, num_seqs_for_bucket, pick_bucket,
                                    prepare_inputs, prepare_prompt_logprobs, rows_without_a_token, token_buckets)
from jaxserve.runner.sampler import fast_top_k, sample
from kernels_pallas import kv_pool_dtype, native_cpu
from sharding import kv_cache_sharding, make_mesh, replicated, shard_params

logger = logging.getLogger(__name__)

_PROMPT_LOGPROBS_ROWS = 256   # positions per chunk of prompt logits: peak memory rows x vocab x 4 bytes
_NO_TOKEN = ("no token can be sampled next: the request's allowed_token_ids, bad words, structured output and "
             "min_tokens (which bans EOS and the stop tokens) together allow none")


def step_fn(graphdef, max_logprobs: int, params, kv_caches: list[jax.Array], inputs: StepInputs,
            prev_tokens: jax.Array, prompt: PromptLogprobsInputs | None = None):
    """One forward + sampling step; pure, so callers may bring their own params.

    `prev_tokens` [P] int32: the sampled tokens of the step before (its first output), whose rows
    `inputs.prev_rows` names for the tokens the host did not know yet (async scheduling); any [P]
    array when none. Returns (kv_caches, token_ids [P] (rows past S are 0), token_logprobs [S],
    top_ids [S, K], top_logprobs [S, K]), and with `prompt` also (prompt_token_logprobs [T],
    prompt_top_ids [T, K], prompt_top_logprobs [T, K]) at every flat position (a separate
    compiled variant). P is the same for every bucket, so any step can feed any other.
    """
    model = nnx.merge(graphdef, params)
    rows = inputs.prev_rows
    input_ids = jnp.where(rows >= 0, prev_tokens[jnp.maximum(rows, 0)], inputs.input_ids)
    hidden, kv_caches = model(input_ids, inputs.positions, kv_caches, inputs.attn)  # [T, hidden]
    logits = model.compute_logits(hidden[inputs.logits_indices], inputs.num_rows)         # [S, V] f32
    num_seqs, vocab = logits.shape
    # Under min_tokens, EOS and stop tokens cannot be sampled.
    banned = jnp.where(inputs.banned_token_ids >= 0, inputs.banned_token_ids, vocab)      # [S, B]
    masked = logits.at[jnp.arange(num_seqs)[:, None], banned].set(-jnp.inf, mode="drop")
    masked = lax.cond(inputs.use_bias, _add_logit_bias, lambda x, *_: x, masked, inputs.bias_token_ids,
                      inputs.bias_values)
    masked = lax.cond(inputs.use_bitmask, _apply_bitmask, lambda x, _: x, masked, inputs.token_bitmask)
    token_ids = sample(masked, inputs.sampling).sampled_token_ids                         # [S]

    def with_logprobs(logits, token_ids):
        logprobs = log_softmax(logits, model.config.attention_backend == "cpu")   # [S, V]: the raw model's, as vLLM
        top_lps, top_ids = lax.top_k(logprobs, max_logprobs)
        return jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)[:, 0], top_ids, top_lps

    def without(logits, token_ids):   # no request asked: no pass over [S, V] (~5 ms at S=64 on a CPU)
        return (jnp.zeros((num_seqs,), jnp.float32), jnp.zeros((num_seqs, max_logprobs), jnp.int32),
                jnp.zeros((num_seqs, max_logprobs), jnp.float32))

    token_logprobs, top_ids, top_lps = lax.cond(inputs.want_logprobs, with_logprobs, without, logits, token_ids)
    token_ids = jnp.zeros_like(prev_tokens).at[:num_seqs].set(token_ids)
    if prompt is None:
        return kv_caches, token_ids, token_logprobs, top_ids, top_lps
    return (kv_caches, token_ids, token_logprobs, top_ids, top_lps,
            *_prompt_logprobs(model, hidden, prompt, max_logprobs))


def _step_from_leaves(graphdef, param_tree, max_logprobs: int, param_leaves, kv_caches, inputs, prev_tokens,
                      prompt=None):
    """`step_fn` with the params passed as their leaves: the compiled step's call flattens a tuple
    of arrays in C++, where an nnx State costs a Python callback per Variable and more checks
    (~2 ms a call for the default model, on the step's critical path)."""
    return step_fn(graphdef, max_logprobs, jax.tree.unflatten(param_tree, param_leaves), kv_caches, inputs,
                   prev_tokens, prompt)


def _add_logit_bias(logits: jax.Array, token_ids: jax.Array, values: jax.Array) -> jax.Array:
    """Each row's logit_bias [S, B] added to its logits (padding ids -1 are dropped); a banned token stays -inf."""
    num_seqs, vocab = logits.shape
    ids = jnp.where(token_ids >= 0, token_ids, vocab)
    return logits.at[jnp.arange(num_seqs)[:, None], ids].add(values, mode="drop")


def _apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf where the structured-output bitmask [S, ceil(V / 32)] has a 0 bit (bit j of word i: token 32 i + j)."""
    num_seqs, vocab = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1                  # [S, W, 32]
    allowed = bits.reshape(num_seqs, -1)[:, :vocab].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def _prompt_logprobs(model, hidden: jax.Array, prompt: PromptLogprobsInputs, k: int):
    """At every flat position t: the raw logprob of next_token_ids[t] [T] and the top k [T, K].

    Computed over chunks of positions so that a large budget times a large vocabulary never
    holds all [T, V] logits at once. The sampling path above is left as it is (same ops on
    the same hidden states), so greedy tokens are those of the plain step.
    """
    num_tokens, width = hidden.shape
    rows = min(_PROMPT_LOGPROBS_ROWS, num_tokens)
    pad = -num_tokens % rows
    h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, rows, width)         # [C, R, hidden]
    nxt = jnp.pad(prompt.next_token_ids, (0, pad)).reshape(-1, rows)          # [C, R]

    def chunk(args):
        h, nxt = args
        lp = log_softmax(model.compute_logits(h), model.config.attention_backend == "cpu")   # [R, V] f32
        token_lp = jnp.take_along_axis(lp, nxt[:, None], axis=-1)[:, 0]       # [R]
        top_lps, top_ids = lax.cond(
            prompt.want_top, lambda lp: fast_top_k(lp, k),
            lambda lp: (jnp.zeros((rows, k), lp.dtype), jnp.zeros((rows, k), jnp.int32)), lp)
        return token_lp, top_ids, top_lps

    token_lp, top_ids, top_lps = lax.map(chunk, (h, nxt))
    return (token_lp.reshape(-1)[:num_tokens], top_ids.reshape(-1, k)[:num_tokens],
            top_lps.reshape(-1, k)[:num_tokens])


def packing_applies(config: ModelConfig, mesh: jax.sharding.Mesh) -> bool:
    """True when a runner on `mesh` may pre-pack projections for the AMX tiles (`pack_for_tiles`): the
    `cpu` attention backend's native matmuls, one device, AMX usable (JAXSERVE_PACKED_WEIGHTS=0: never)."""
    return (os.environ.get("JAXSERVE_PACKED_WEIGHTS", "1") != "0" and config.native_rows and mesh.devices.size == 1
            and mesh.devices.flat[0].platform == "cpu" and native_cpu.gemm_enabled() and native_cpu.gemm_amx())


def _gather_blocks(kv_caches: list[jax.Array], block_ids: jax.Array) -> jax.Array:
    """[P, layers, 2, kv_heads, block_size, head_dim] of the pool's blocks `block_ids` [P]."""
    return jnp.stack([c[:, :, block_ids] for c in kv_caches]).transpose(3, 0, 1, 2, 4, 5)


def _write_blocks(kv_caches: list[jax.Array], block_ids: jax.Array, blocks: jax.Array) -> list[jax.Array]:
    """The pool with `blocks` [P, layers, 2, kv_heads, block_size, head_dim] written at `block_ids` [P]."""
    per_layer = blocks.transpose(1, 2, 3, 0, 4, 5)                  # [layers, 2, kv_heads, P, bs, hd]
    return [c.at[:, :, block_ids].set(per_layer[i]) for i, c in enumerate(kv_caches)]


# A step's fixed cost in prefill tokens on CPU (see ModelRunner.step_fixed_tokens), calibrated on
# the 2-core machine with the default model: ~24 in bfloat16, ~18 in float32 (benchmarks/bucket_cut.py).
STEP_FIXED_TOKENS_CPU = 24


class ModelRunner:
    def __init__(
        self,
        model: nnx.Module,
        config: ModelConfig,
        *,
        block_size: int,
        num_blocks: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        max_logprobs: int = 20,
        eos_token_ids: tuple[int, ...] = (),
        kv_dtype=jnp.float32,
        mesh: jax.sharding.Mesh | None = None,
        buckets: tuple[int, ...] | None = None,
        num_speculative_tokens: int = 0,
        pack_weights: bool = False,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.max_logprobs = max(max_logprobs, 1)
        self.eos_token_ids = tuple(eos_token_ids)
        self.buckets = list(buckets) if buckets else token_buckets(max_num_batched_tokens)
        self.num_speculative_tokens = num_speculative_tokens   # K: steps with drafts sample K + 1 rows a sequence
        self.mesh = mesh or make_mesh()

        self.graphdef, params = nnx.split(model)
        self.params = shard_params(params, self.mesh)      # by sharding.PARAM_RULES (no-op if already placed)
        # {path: (the kernel's own shape, K)} of the projections whose kernels the steps take pre-packed
        self._packed: dict[tuple, tuple[tuple[int, ...], int]] = {}
        if pack_weights and packing_applies(config, self.mesh):
            self._pack(nnx.merge(self.graphdef, self.params))
        kv_sharding = kv_cache_sharding(self.mesh)
        self.kv_dtype = kv_pool_dtype(kv_dtype, config.attention_backend)   # uint16 bits for bf16 on CPU
        self.restore_kv_pool()
        # Pin the returned pool to the pool's own sharding; otherwise XLA may pick another
        # and the next call, seeing a new input sharding, would compile again.
        rep = replicated(self.mesh)
        self._refresh_param_leaves()
        step = functools.partial(_step_from_leaves, self.graphdef, jax.tree.structure(self.params), self.max_logprobs)
        kv_out = [kv_sharding] * config.num_hidden_layers
        self.step = jax.jit(step, donate_argnums=(1,), out_shardings=(kv_out, *[rep] * 4))
        self.prompt_logprobs_step = jax.jit(step, donate_argnums=(1,), out_shardings=(kv_out, *[rep] * 7))
        self._gather = jax.jit(_gather_blocks, out_shardings=rep)
        self._write = jax.jit(_write_blocks, donate_argnums=(0,), out_shardings=kv_out)
        self._kv_transfer_executables: dict[tuple[str, int], jax.stages.Compiled] = {}
        self.states: dict[str, RequestState] = {}
        # Every step returns its sampled tokens padded to one length, so the next step (any bucket)
        # can read the ones the host has not seen yet (async scheduling); without a step in flight,
        # it gets these zeros.
        self.max_rows = max(max(self.rows(b), self.rows(b, speculative=True)) for b in self.buckets)
        self._no_prev_tokens = jax.device_put(np.zeros(self.max_rows, np.int32), rep)
        # (token bucket, sampling rows) -> compiled step; rows are the sequence slots, or with
        # speculative decoding also the larger count a step with drafts needs (`spec_rows`)
        self._executables: dict[tuple[int, int], jax.stages.Compiled] = {}
        # (token bucket, rows) -> compiled prompt-logprobs variant, compiled on first use (not a late
        # compile of the step: it is not part of warm-up, so compiles_after_warmup leaves it out)
        self._prompt_logprobs_executables: dict[tuple[int, int], jax.stages.Compiled] = {}
        # One step's cost beyond its tokens, in prefill tokens, for the scheduler's cut of a chunk
        # to a bucket (`Scheduler._fit_bucket`): on CPU a step streams the weights once (~15-20 ms
        # on the 2-core machine) against ~0.7-1.2 ms a prefill token (benchmarks/RESULTS.md). None
        # on accelerators, not measured there: no chunk is cut. benchmarks/bucket_cut.py sets it.
        self.step_fixed_tokens = STEP_FIXED_TOKENS_CPU if self.mesh.devices.flat[0].platform == "cpu" else None
        self.compiles_after_warmup = 0                           # late compiles (should stay 0)
        self.ready_buckets: tuple[int, ...] = tuple(self.buckets)  # the buckets a step may pick (all once warm)
        self.compiling = False                                   # a compile inside a step is running
        self.last_compile_end = 0.0                              # monotonic end of the last such compile

    # ---- weights and pool between steps (LLMEngine.update_params / sleep / wake_up) -----

    def _pack(self, model: nnx.Module) -> None:
        """Lay the projections out for the AMX tiles (`pack_for_tiles`) in a copy of `model` (the
        caller's model and its arrays stay as they are; a data-parallel engine builds every replica's
        runner from one model), and run the steps with it."""
        t0 = time.perf_counter()
        model = nnx.clone(model)
        count = pack_for_tiles(model)
        if not count:
            return
        self.graphdef, self.params = nnx.split(model)
        for path, node in nnx.iter_graph(model):
            if isinstance(node, Proj) and node.packed:
                self._packed[(*path, "kernel")] = (tuple(node.kernel_shape), contracted_size(node))
        jax.block_until_ready(self.params)
        logger.info("%d projections pre-packed for the AMX tiles in %.2f s", count, time.perf_counter() - t0)

    @property
    def packed_paths(self) -> tuple[tuple, ...]:
        """Param paths whose kernels the steps take pre-packed for the AMX tiles (none: empty)."""
        return tuple(self._packed)

    def _stored_arrays(self) -> dict[tuple, jax.Array]:
        """{param path: array} as the steps take them (pre-packed kernels packed)."""
        return nnx.traversals.flatten_mapping(nnx.to_pure_dict(self.params))

    def param_arrays(self) -> dict[tuple, jax.Array]:
        """{param path: array} of the weights the steps run with, each in the model's own shape (a
        pre-packed kernel is unpacked into a new array)."""
        return {path: (unpack_kernel(a, self._packed[path][0]) if path in self._packed and a is not None else a)
                for path, a in self._stored_arrays().items()}

    def param_specs(self) -> dict[tuple, jax.ShapeDtypeStruct]:
        """{param path: shape, dtype and sharding} of the weights, in the model's own shapes (what an
        update is checked against; nothing is unpacked)."""
        return {path: jax.ShapeDtypeStruct(self._packed[path][0] if path in self._packed else a.shape, a.dtype,
                                           sharding=a.sharding)
                for path, a in self._stored_arrays().items()}

    def replace_params(self, placed: dict[tuple, jax.Array]) -> None:
        """Swap in arrays of the same shapes, dtypes and shardings (checked by the caller), each in the
        model's own shape (pre-packed kernels are packed again): the compiled steps take params as
        an argument, so nothing compiles again."""
        placed = {path: (pack_kernel(a, self._packed[path][1]) if path in self._packed else a)
                  for path, a in placed.items()}
        self._replace_stored(placed)

    def _replace_stored(self, placed: dict[tuple, jax.Array | None]) -> None:
        nnx.replace_by_pure_dict(self.params, nnx.traversals.unflatten_mapping(placed))
        self._refresh_param_leaves()

    def _refresh_param_leaves(self) -> None:
        self._param_leaves = tuple(jax.tree.leaves(self.params))    # what the compiled steps take

    def release_kv_pool(self) -> int:
        """Free the KV pool's device memory; returns its bytes. `restore_kv_pool` brings it back."""
        freed = sum(a.nbytes for a in self.kv_caches)
        for a in self.kv_caches:
            a.delete()
        self.kv_caches = None
        return freed

    def restore_kv_pool(self) -> None:
        """A zeroed KV pool, always of the same shape, dtype and sharding (so the compiled steps fit);
        also how the pool is made at start."""
        shape = (2, self.config.num_key_value_heads, self.num_blocks, self.block_size, self.config.head_dim)
        sharding = kv_cache_sharding(self.mesh)
        self.kv_caches = [jnp.zeros(shape, self.kv_dtype, device=sharding)
                          for _ in range(self.config.num_hidden_layers)]

    def offload_params(self) -> None:
        """Move the weights to host memory (the device arrays are dropped, not deleted: a caller
        sharing them keeps them); `reload_params` puts them back on their shardings."""
        flat = self._stored_arrays()
        self._offloaded = {path: (np.asarray(a), a.sharding) for path, a in flat.items()}
        self._replace_stored({path: None for path in flat})

    def reload_params(self) -> None:
        self._replace_stored({path: jax.device_put(host, sharding)
                              for path, (host, sharding) in self._offloaded.items()})
        self._offloaded = None

    # ---- whole blocks in and out (disaggregated prefill/decode) -------------------------

    @property
    def kv_block_shape(self) -> tuple[int, ...]:
        """One block in the canonical transfer layout: [layers, 2, kv_heads, block_size, head_dim]."""
        c = self.config
        return (c.num_hidden_layers, 2, c.num_key_value_heads, self.block_size, c.head_dim)

    def _block_counts(self) -> list[int]:
        n, counts = 1, []
        while n < self.max_blocks_per_seq:
            counts.append(n)
            n *= 2
        return counts + [n]

    def _kv_transfer_executable(self, kind: str, count: int) -> jax.stages.Compiled:
        exe = self._kv_transfer_executables.get((kind, count))
        if exe is None:
            ids = jax.ShapeDtypeStruct((count,), jnp.int32)
            with jax.set_mesh(self.mesh):
                if kind == "gather":
                    lowered = self._gather.lower(self.kv_caches, ids)
                else:
                    blocks = jax.ShapeDtypeStruct((count, *self.kv_block_shape), self.kv_dtype)
                    lowered = self._write.lower(self.kv_caches, ids, blocks)
            exe = self._kv_transfer_executables[(kind, count)] = lowered.compile()
        return exe

    def warmup_kv_transfer(self, kind: str) -> None:
        """Compile the block gather ("gather", a producer) or write ("write", a consumer) for every
        power-of-two block count up to a whole sequence."""
        for count in self._block_counts():
            self._kv_transfer_executable(kind, count)

    def _padded_ids(self, block_ids: list[int]) -> tuple[np.ndarray, int]:
        count = next(c for c in self._block_counts() if c >= len(block_ids))
        ids = np.zeros(count, np.int32)            # padding reads / writes the null block 0
        ids[:len(block_ids)] = block_ids
        return ids, count

    def gather_blocks(self, block_ids: list[int]) -> np.ndarray:
        """Host copy of the pool's blocks `block_ids` in the canonical layout, in the pool's dtype."""
        ids, count = self._padded_ids(block_ids)
        out = self._kv_transfer_executable("gather", count)(self.kv_caches, ids)
        return np.asarray(jax.device_get(out.addressable_data(0)))[:len(block_ids)]

    def write_blocks(self, block_ids: list[int], blocks: np.ndarray) -> None:
        """Write host blocks [len(block_ids), *kv_block_shape] (the pool's dtype) into the pool."""
        if blocks.shape != (len(block_ids), *self.kv_block_shape):
            raise ValueError(f"KV blocks of shape {blocks.shape} do not fit this pool: expected "
                             f"{(len(block_ids), *self.kv_block_shape)}")
        ids, count = self._padded_ids(block_ids)
        padded = np.zeros((count, *self.kv_block_shape), self.kv_dtype)
        padded[:len(block_ids)] = blocks
        self.kv_caches = self._kv_transfer_executable("write", count)(self.kv_caches, ids, padded)

    # ---- compilation -----------------------------------------------------------------

    def rows(self, bucket: int, speculative: bool = False) -> int:
        """Sampling rows of a step: one per sequence slot; with drafts K + 1 a sequence, at most a token each."""
        seqs = num_seqs_for_bucket(bucket, self.max_num_seqs)
        return min(bucket, seqs * (self.num_speculative_tokens + 1)) if speculative else seqs

    def _variants(self, bucket: int) -> list[tuple[int, int]]:
        """The (bucket, rows) executables warm-up compiles for a token bucket."""
        keys = [(bucket, self.rows(bucket))]
        if self.num_speculative_tokens and self.rows(bucket, True) != keys[0][1]:
            keys.append((bucket, self.rows(bucket, True)))
        return keys

    def _compile(self, key: tuple[int, int], prompt_logprobs: bool = False) -> jax.stages.Compiled:
        bucket, rows = key
        inputs = self._prepare([], bucket, num_rows=rows)
        # Traced under the mesh: attention runs per device over its heads (kernels_pallas.dispatch).
        with jax.set_mesh(self.mesh):
            if prompt_logprobs:
                prompt = PromptLogprobsInputs(next_token_ids=np.zeros(bucket, np.int32), want_top=np.bool_(False))
                lowered = self.prompt_logprobs_step.lower(self._param_leaves, self.kv_caches, inputs,
                                                          self._no_prev_tokens, prompt)
            else:
                lowered = self.step.lower(self._param_leaves, self.kv_caches, inputs, self._no_prev_tokens)
        return lowered.compile()

    def warmup(self, max_workers: int = 2, *, background_after: int = 0) -> None:
        """Compile the step for the token buckets, ahead of time and in parallel (XLA releases the GIL).

        With `background_after` > 0, only `first_buckets(...)` (a few of the buckets up to that
        many tokens: 1 and 16 of 1..16) are compiled before this returns; the rest compile on a
        background thread in `later_buckets` order (those that raise the budget cap first).
        Meanwhile a step pads to the smallest ready bucket
        (`ready_buckets`) and `ready_budget` says the largest (the engine caps its step's token
        budget there), so no step ever waits for a compile.
        """
        now = first_buckets(self.buckets, background_after) if background_after else list(self.buckets)
        keys = [key for bucket in now for key in self._variants(bucket)]
        with concurrent.futures.ThreadPoolExecutor(max_workers) as pool:
            for key, exe in zip(keys, pool.map(self._compile, keys)):
                self._executables[key] = exe
        later = later_buckets(self.buckets, now)
        self._mark_ready(now)
        logger.info("warm-up compiled the step for token buckets %s%s", now,
                    f"; {later} compile in the background" if later else "")
        if later:
            self._stop_background = False
            self._background = threading.Thread(target=self._compile_later, args=(later,), daemon=True,
                                                name="jaxserve-warmup")
            self._background.start()
            # A process that exits while XLA compiles on a daemon thread aborts: stop after the
            # bucket in progress and wait for it.
            atexit.register(self._end_background)

    def _mark_ready(self, ready: list[int]) -> None:
        """Publish the compiled buckets to the step (one assignment: the step thread reads them)."""
        self.ready_buckets = tuple(sorted(ready))

    @property
    def ready_budget(self) -> int | None:
        """While warm-up runs on: the largest bucket ready (the step's budget cap); None once all are."""
        ready = self.ready_buckets
        return None if len(ready) == len(self.buckets) else ready[-1]

    def _end_background(self) -> None:
        self._stop_background = True
        self._background.join()

    def _compile_later(self, buckets: list[int]) -> None:
        t0 = time.perf_counter()
        try:
            for bucket in buckets:
                for key in self._variants(bucket):
                    if self._stop_background:
                        return
                    self._executables[key] = self._compile(key)
                self._mark_ready([*self.ready_buckets, bucket])
        except Exception:  # noqa: BLE001 - the engine keeps serving within the buckets it has
            logger.exception("background compile failed; steps keep to token buckets %s", list(self.ready_buckets))
            return
        logger.info("background warm-up compiled token buckets %s in %.1f s: every bucket is ready", buckets,
                    time.perf_counter() - t0)

    def wait_for_warmup(self, timeout: float | None = None) -> bool:
        """Block until every bucket is compiled; False on timeout."""
        thread = getattr(self, "_background", None)
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def _executable(self, key: tuple[int, int], prompt_logprobs: bool = False) -> jax.stages.Compiled:
        if prompt_logprobs:
            exe = self._prompt_logprobs_executables.get(key)
            if exe is None:
                logger.info("compiling the prompt-logprobs step for bucket %d, %d rows (first use)", *key)
                exe = self._prompt_logprobs_executables[key] = self._compile_now(key, prompt_logprobs=True)
            return exe
        exe = self._executables.get(key)
        if exe is None:
            logger.warning("compiling the step for bucket %d, %d rows after warm-up", *key)
            exe = self._executables[key] = self._compile_now(key)
            self.compiles_after_warmup += 1
        return exe

    def _compile_now(self, key: tuple[int, int], prompt_logprobs: bool = False) -> jax.stages.Compiled:
        """A compile inside a step; `compiling` / `last_compile_end` let a step watchdog not count it."""
        self.compiling = True
        try:
            return self._compile(key, prompt_logprobs=prompt_logprobs)
        finally:
            self.compiling = False
            self.last_compile_end = time.monotonic()

    def _prepare(self, scheduled, bucket: int, grammars: dict | None = None, drafts: dict | None = None,
                 num_rows: int | None = None) -> StepInputs:
        return prepare_inputs(scheduled, num_tokens_bucket=bucket, max_num_seqs=self.max_num_seqs,
                              max_blocks_per_seq=self.max_blocks_per_seq, block_size=self.block_size,
                              max_model_len=self.max_model_len, vocab_size=self.config.vocab_size,
                              grammars=grammars, drafts=drafts, num_rows=num_rows)

    # ---- one step --------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.states[new.req_id] = RequestState(
                req_id=new.req_id, token_ids=new.prompt_token_ids + new.output_token_ids,
                num_prompt_tokens=len(new.prompt_token_ids), block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens, sampling_params=new.sampling_params,
                seed=new.seed, eos_token_ids=self.eos_token_ids)
        for cached in so.scheduled_cached_reqs:
            st = self.states[cached.req_id]
            st.block_ids.extend(cached.new_block_ids)
            assert st.num_computed_tokens == cached.num_computed_tokens, (cached, st.num_computed_tokens)

    def execute(self, so: SchedulerOutput, grammars: dict | None = None) -> ModelRunnerOutput:
        return self.collect(self.launch(so, grammars))

    def launch(self, so: SchedulerOutput, grammars: dict | None = None,
               prev: "_Launched | None" = None) -> "_Launched":
        """Apply the scheduler's diffs and dispatch the step; returns before the device finishes.
        `grammars`: {request id: Grammar} of the structured-output requests that sample this step.
        `prev`: the step still in flight (launched, not collected), whose sampled tokens this one
        takes as inputs on the device where the host does not know them yet (async scheduling).

        The request states move on at launch: each sampling request's next token is a PENDING
        placeholder until `collect` writes it. Data-parallel replicas launch every replica's step
        before collecting any, so the replicas' devices run at the same time.
        """
        self._update_states(so)
        scheduled = [(self.states[req_id], n) for req_id, n in so.num_scheduled_tokens.items()]
        if not scheduled:
            return _Launched(scheduled, None)
        bucket = pick_bucket(so.total_num_scheduled_tokens, self.ready_buckets)
        if len(scheduled) > num_seqs_for_bucket(bucket, self.max_num_seqs):
            raise ValueError(f"{len(scheduled)} sequences exceed max_num_seqs={self.max_num_seqs}")
        drafts = so.scheduled_spec_decode_tokens
        key = (bucket, self.rows(bucket, speculative=bool(drafts)))
        inputs = self._prepare(scheduled, bucket, grammars, drafts, key[1])
        waits = bool((inputs.prev_rows >= 0).any())
        if waits and (prev is None or prev.outs is None):
            raise RuntimeError("a request's last token is still being sampled, but no step in flight was given")
        prev_tokens = prev.outs[0] if waits else self._no_prev_tokens
        prompt = prepare_prompt_logprobs(scheduled, num_tokens_bucket=bucket)
        extra = () if prompt is None else (prompt,)
        try:
            self.kv_caches, *outs = self._executable(key, prompt is not None)(self._param_leaves, self.kv_caches,
                                                                              inputs, prev_tokens, *extra)
        except Exception as e:
            deleted = [path for path, a in self._stored_arrays().items() if isinstance(a, jax.Array) and a.is_deleted()]
            if deleted:
                raise ValueError(f"the engine's weights were deleted or donated after they were given to it "
                                 f"({len(deleted)} arrays, e.g. {'.'.join(map(str, deleted[0]))}): keep the arrays "
                                 "passed to LLM(params=...) / update_params alive, or call update_params with live "
                                 "ones") from e
            logger.error("step failed: bucket=%d seqs=%d prompt_logprobs=%s input shapes=%s", bucket,
                         len(scheduled), prompt is not None, jax.tree.map(np.shape, inputs))
            raise
        # Move the states on: the computed tokens, and a placeholder for each token sampled.
        spans, sampling, row = [], [], 0
        for st, n in scheduled:
            spans.append((st.num_computed_tokens + 1, num_prompt_logprob_positions(st, n)))
            req_drafts = drafts.get(st.req_id, [])
            st.num_computed_tokens += n
            if st.num_computed_tokens >= len(st.token_ids):
                sampling.append(_Sampling(st, row, len(st.token_ids), req_drafts))
                st.token_ids.append(PENDING)
                st.pending_row = row
            row += 1 + len(req_drafts)
        errors = {}
        if inputs.use_bitmask:   # a row its constraints leave no token in would sample an arbitrary one
            dead = rows_without_a_token(inputs.token_bitmask, inputs.banned_token_ids, self.config.vocab_size)
            errors = {s.state.req_id: NoTokenAllowedError(_NO_TOKEN) for s in sampling if dead[s.row]}
        return _Launched(scheduled, outs, sampling, spans, errors)

    def collect(self, launched: "_Launched") -> ModelRunnerOutput:
        """Wait for a launched step and turn its sampled tokens into plain data."""
        scheduled = launched.scheduled
        if launched.outs is None:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        # Outputs are replicated: this process's first copy is the whole value (also when
        # other processes hold the rest of the mesh).
        token_ids, token_lps, top_ids, top_lps, *prompt_outs = jax.device_get(
            [x.addressable_data(0) for x in launched.outs])

        prompt_logprobs = (_prompt_logprobs_per_request(scheduled, launched.prompt_spans, *prompt_outs)
                           if prompt_outs else None)
        new_tokens, logprobs = {}, {}
        for s in launched.sampling:
            st, i = s.state, s.row
            # Rows i.. hold the token sampled after the last real token and after each draft; a draft
            # is kept while it equals the token sampled before it, and the rest are rolled back.
            new = [int(token_ids[i])]
            for draft in s.drafts:
                if draft != new[-1]:
                    break
                new.append(int(token_ids[i + len(new)]))
            st.num_computed_tokens -= len(s.drafts) - (len(new) - 1)
            st.token_ids[s.position:s.position + 1] = new     # with drafts no later step is in flight
            new_tokens[st.req_id] = new
            k = st.sampling_params.logprobs
            if k is not None:
                logprobs[st.req_id] = Logprobs(float(token_lps[i]), top_ids[i, :k].tolist(), top_lps[i, :k].tolist())
        req_ids = [st.req_id for st, _ in scheduled]
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[new_tokens.get(r, []) for r in req_ids],
                                 logprobs=[logprobs.get(r) for r in req_ids], prompt_logprobs=prompt_logprobs,
                                 errors=launched.errors or None)


def _prompt_logprobs_per_request(scheduled, spans, token_lps, top_ids,
                                 top_lps) -> list[tuple[int, list[Logprobs]] | None]:
    """Each request's rows of the flat prompt-logprobs outputs: (index of the first prompt token
    covered, its entries) or None. `spans`: per request, that index and its number of positions,
    taken at launch."""
    out, t = [], 0
    for (st, n), (first, m) in zip(scheduled, spans):
        if m:
            k = st.sampling_params.prompt_logprobs
            rows = zip(token_lps[t:t + m].tolist(), top_ids[t:t + m, :k].tolist(), top_lps[t:t + m, :k].tolist())
            out.append((first, [Logprobs(lp, ids, lps) for lp, ids, lps in rows]))
        else:
            out.append(None)
        t += n
    return out


@dataclasses.dataclass
class _Sampling:
    """A request that samples in a launched step: its first row, and where its PENDING token sits."""

    state: RequestState
    row: int
    position: int                      # index of the placeholder in state.token_ids
    drafts: list[int]                  # speculative drafts after its last token (rows row + 1 ..)


@dataclasses.dataclass
class _Launched:
    scheduled: list[tuple[RequestState, int]]
    outs: list[jax.Array] | None     # token_ids [max_rows], token_logprobs, top_ids, top_logprobs[, the prompt
                                     # three] (on device)
    sampling: list[_Sampling] = dataclasses.field(default_factory=list)
    # per scheduled request: (first prompt token whose logprob the step computes, how many)
    prompt_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    errors: dict[str, Exception] = dataclasses.field(default_factory=dict)   # requests left no token to sample
