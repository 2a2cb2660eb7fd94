"""Start-up: checkpoint -> tokenizer, model, KV pool size, scheduler and runner.

Runs once on the caller's thread when an engine is created. Heavy work lives here so
that the step loop does none of it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from checkpoints import Checkpoint, load_checkpoint, restore_orbax_params
from jaxserve.config import EngineConfig
from jaxserve.core import Scheduler, SchedulerConfig
from jaxserve.core.sampling_params import sampling_defaults
from jaxserve.engine import cpu_malloc
from jaxserve.engine.devices import activation_bytes, kv_pool_bytes, resolve_dtype
from jaxserve.engine.weights import checked_update, flat_params, path_name
from jaxserve.models import ModelConfig, get_model_class, load_weights
from jaxserve.runner import ModelRunner
from jaxserve.tokenizer import Tokenizer
from kernels_pallas import native_cpu
from kernels_pallas import resolve_attention_backend as backend_for_platform
from kernels_pallas.self_check import STARTUP_CHECKED, KernelSelfCheckError, self_check
from sharding.distributed import initialize as initialize_distributed
from sharding import (check_tensor_parallel, kv_head_replicas, make_mesh, param_shardings, replica_meshes,
                      replicate_kv_heads)

logger = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
DEFAULT_MAX_MODEL_LEN = 4096   # cap on the model's own context when --max-model-len is not given


@dataclasses.dataclass
class Replica:
    """One data-parallel replica: its own scheduler and KV pool, its runner on its own devices."""

    scheduler: Scheduler
    runner: ModelRunner


@dataclasses.dataclass
class EngineParts:
    config: EngineConfig
    checkpoint_name: str
    model_config: ModelConfig
    tokenizer: Tokenizer
    replicas: list[Replica]           # data-parallel replicas (one unless data_parallel_size > 1)
    startup_seconds: dict[str, float]
    checkpoint_model_config: ModelConfig   # before KV heads were repeated (what callers' params match)
    kv_head_replicas: int                  # copies of each KV head (tensor parallelism beyond the KV heads)
    sampling_defaults: dict = dataclasses.field(default_factory=dict)   # see sampling_defaults()

    @property
    def scheduler(self) -> Scheduler:   # the first replica's
        return self.replicas[0].scheduler

    @property
    def runner(self) -> ModelRunner:
        return self.replicas[0].runner


def _few_buckets(buckets: list[int]) -> str:
    """Every third bucket and the largest: a shorter list to suggest in the start-up log."""
    few = sorted(set(buckets[::3]) | {buckets[-1]})
    return ",".join(str(b) for b in few)


def enable_compilation_cache(path: str | None) -> None:
    """Persistent XLA cache so a second start compiles far less (JAX_NOTES: ~2.5x)."""
    if jax.config.jax_compilation_cache_dir:
        return  # the user (or an earlier engine) already chose one
    cache = Path(path) if path else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxserve" / "xla"
    cache.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def build_model(checkpoint: Checkpoint, dtype: str, seed: int = 0, *, mesh: jax.sharding.Mesh | None = None,
                attention_backend: str = "reference", params: Any = None):
    """(model, model_config): filled from `params` when given (a caller's weights: see
    jaxserve.engine.weights; cast to `dtype`, left on their devices), else from the checkpoint's
    tensors, or restored from its Orbax params straight into their shardings on `mesh`
    (sharding.PARAM_RULES). Its attention layers call the (already resolved) `attention_backend`."""
    model_config = dataclasses.replace(ModelConfig.from_hf_config(checkpoint.config),
                                       attention_backend=attention_backend)
    # Built abstractly (no random init of weights that are about to be replaced), then filled.
    model = _abstract_model(model_config, dtype, seed)
    if params is not None:
        graphdef, abstract = nnx.split(model)
        shapes = nnx.traversals.flatten_mapping(nnx.to_pure_dict(abstract))
        given = flat_params(params, model_config)
        missing = [path_name(p) for p in shapes if p not in given]
        if missing:
            raise ValueError(f"params lack {len(missing)} of the model's params: {', '.join(missing[:5])}")
        filled = checked_update({p: _Placed(a) for p, a in shapes.items()}, given, cast=True)
        nnx.replace_by_pure_dict(abstract, nnx.traversals.unflatten_mapping(filled))
        model = nnx.merge(graphdef, abstract)
    elif checkpoint.params_path:
        graphdef, abstract = nnx.split(model)
        target = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                              abstract, param_shardings(abstract, mesh or make_mesh()))
        nnx.replace_by_pure_dict(abstract, restore_orbax_params(checkpoint.params_path, nnx.to_pure_dict(target)))
        model = nnx.merge(graphdef, abstract)
    else:
        load_weights(model, checkpoint.tensors)
    unfilled = [jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model))
                if not isinstance(leaf, jax.Array)]
    if unfilled:
        raise ValueError(f"the checkpoint left params unset: {', '.join(unfilled[:5])}")
    return model, model_config


class _Placed:
    """An abstract param as checked_update sees it: shape, dtype, and no sharding to move to."""

    def __init__(self, abstract) -> None:
        self.shape, self.dtype, self.sharding = abstract.shape, abstract.dtype, None


class _ShapeOnlyKeys:
    """The `rngs` of an abstract build: `params()` (all the layers ask of it) is one fixed key.

    Shapes are all eval_shape keeps, so the keys never matter. An `nnx.Rngs` counts its draws in
    a Variable, and under a trace each count update makes jax format an error message over the
    whole trace so far (flax compares the shardings of the old and new count): 0.6 of the default
    model's 1.0 s build, on every start.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def params(self) -> jax.Array:
        return jax.random.key(self.seed)


def _abstract_model(model_config: ModelConfig, dtype: str, seed: int):
    cls = get_model_class(model_config)
    jdtype = _DTYPES[dtype]
    return nnx.eval_shape(lambda: cls(model_config, dtype=jdtype, param_dtype=jdtype, rngs=_ShapeOnlyKeys(seed)))


def with_replicated_kv_heads(model, model_config: ModelConfig, replicas: int, dtype: str):
    """The model with every KV head repeated `replicas` times (tensor parallelism beyond the KV heads)."""
    if replicas == 1:
        return model, model_config
    wide_config = dataclasses.replace(model_config, num_key_value_heads=model_config.num_key_value_heads * replicas)
    graphdef, state = nnx.split(_abstract_model(wide_config, dtype, 0))
    nnx.replace_by_pure_dict(state, replicate_kv_heads(nnx.to_pure_dict(nnx.state(model)), replicas))
    return nnx.merge(graphdef, state), wide_config


def kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: str) -> int:
    itemsize = jnp.dtype(_DTYPES[dtype]).itemsize
    return (2 * model_config.num_key_value_heads * block_size * model_config.head_dim * itemsize
            * model_config.num_hidden_layers)


def resolve_attention_backend(config: EngineConfig, platform: str | None = None) -> str:
    """--attention-backend on this machine: "auto" picks by `platform` (default: that of jax.devices()[0];
    GPU -> pallas_gpu, TPU -> pallas_tpu, else reference); a Pallas backend without its device fails here.
    With tensor parallelism every backend runs per device over its heads (kernels_pallas.dispatch).
    A Pallas backend must then pass kernels_pallas.self_check on the device: on a failure "auto" falls back
    to the reference (with a warning) and an explicit backend fails here, naming the case."""
    platform = platform or jax.devices()[0].platform
    backend = backend_for_platform(config.attention_backend, platform)
    if config.attention_self_check and backend in STARTUP_CHECKED:
        try:
            self_check(backend, dtype=resolve_dtype(config.dtype, platform), page_size=config.block_size)
        except KernelSelfCheckError as e:
            if config.attention_backend != "auto":
                raise ValueError(f"attention_backend={backend!r} failed its start-up self-check, case {e.case!r}: "
                                 f"{e.detail}; choose another --attention-backend (or skip the check with "
                                 "--no-attention-self-check)") from e
            logger.warning("%s; attention backend auto falls back to 'reference'", e)
            backend = "reference"
    logger.info("attention backend: %s", backend)
    return backend


def build_engine_parts(config: EngineConfig, params: Any = None) -> EngineParts:
    """Everything an engine needs; `params` (a caller's weights) replace the checkpoint's, whose
    config and tokenizer are still used."""
    times = {}
    t0 = time.perf_counter()
    if config.num_processes > 1:   # before anything touches a device
        initialize_distributed(config.coordinator_address, config.num_processes, config.process_id)
    if jax.devices()[0].platform == "cpu":
        native_cpu.build_in_background()   # compiles while the checkpoint loads
        cpu_malloc.keep_buffers_in_heap()
    if config.dtype == "auto":   # first: the backend's self-check runs in the dtype the engine will use
        config = dataclasses.replace(config, dtype=resolve_dtype("auto", jax.devices()[0].platform))
        logger.info("dtype auto: %s on %s", config.dtype, jax.devices()[0].device_kind)
    attention_backend = resolve_attention_backend(config)
    enable_compilation_cache(config.compilation_cache_dir)
    checkpoint = load_checkpoint(config.model)
    tokenizer = Tokenizer.from_checkpoint(checkpoint)
    times["load_checkpoint"] = time.perf_counter() - t0

    # Every check that needs only the config runs before the (seconds-long) model build.
    model_config = ModelConfig.from_hf_config(checkpoint.config)
    mesh = make_mesh(config.tensor_parallel_size, config.data_parallel_size)
    check_tensor_parallel(model_config.num_attention_heads, model_config.num_key_value_heads,
                          model_config.intermediate_size, config.tensor_parallel_size, len(jax.devices()))
    kv_replicas = kv_head_replicas(model_config.num_key_value_heads, config.tensor_parallel_size)
    max_model_len = config.max_model_len or min(model_config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    if max_model_len > model_config.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                         f"{model_config.max_position_embeddings}")
    if config.max_num_seqs > config.max_num_batched_tokens:
        raise ValueError(f"max_num_seqs={config.max_num_seqs} exceeds max_num_batched_tokens="
                         f"{config.max_num_batched_tokens}: every running request needs a token each step")
    if config.max_logprobs > model_config.vocab_size:
        raise ValueError(f"max_logprobs={config.max_logprobs} exceeds the vocabulary ({model_config.vocab_size})")
    t0 = time.perf_counter()
    meshes = replica_meshes(mesh)
    model, checkpoint_model_config = build_model(checkpoint, config.dtype, config.seed, mesh=meshes[0],
                                                  attention_backend=attention_backend, params=params)
    model, model_config = with_replicated_kv_heads(model, checkpoint_model_config, kv_replicas, config.dtype)
    times["build_model"] = time.perf_counter() - t0

    # The pool is sized once the weights are on the device, so that its memory report counts them.
    num_blocks, how = config.num_kv_blocks, f"--num-kv-blocks {config.num_kv_blocks}"
    if num_blocks is None:
        activations = activation_bytes(
            max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
            hidden_size=model_config.hidden_size, intermediate_size=model_config.intermediate_size,
            vocab_size=model_config.vocab_size, itemsize=jnp.dtype(_DTYPES[config.dtype]).itemsize)
        stats = meshes[0].devices.flat[0].memory_stats()
        budget, how = kv_pool_bytes(stats, gpu_memory_utilization=config.gpu_memory_utilization,
                                    activations=activations, kv_cache_memory_gb=config.kv_cache_memory_gb)
        if config.kv_cache_memory_gb is None and stats:
            budget *= config.tensor_parallel_size   # a device's budget, and each of tp holds a share of the pool
        num_blocks = max(2, budget // kv_bytes_per_block(model_config, config.block_size, config.dtype))
    capacity = (num_blocks - 1) * config.block_size
    if capacity < max_model_len:
        if config.max_model_len is not None:
            raise ValueError(f"the KV pool holds {capacity} tokens ({num_blocks - 1} blocks of {config.block_size}), "
                             f"less than max_model_len={max_model_len}: raise --num-kv-blocks / "
                             "--kv-cache-memory-gb / --gpu-memory-utilization or lower --max-model-len")
        logger.warning("KV pool holds %d tokens: max_model_len lowered from %d", capacity, max_model_len)
        max_model_len = capacity
    logger.info("KV pool: %d blocks of %d tokens = %d tokens (%s); at most %d requests of max_model_len %d at once",
                num_blocks - 1, config.block_size, capacity, how, capacity // max_model_len, max_model_len)
    scheduler_config = SchedulerConfig(
        max_model_len=max_model_len, max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs, block_size=config.block_size, num_blocks=num_blocks,
        enable_prefix_caching=config.enable_prefix_caching, enable_chunked_prefill=config.enable_chunked_prefill,
        long_prefill_token_threshold=config.long_prefill_token_threshold, policy=config.scheduling_policy,
        speculative=config.speculative_config)

    t0 = time.perf_counter()
    runners = []
    for replica_mesh in meshes:
        runners.append(ModelRunner(
            model, model_config, block_size=config.block_size, num_blocks=num_blocks,
            max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
            max_model_len=max_model_len, max_logprobs=config.max_logprobs, eos_token_ids=tokenizer.eos_token_ids,
            kv_dtype=_DTYPES[config.dtype], mesh=replica_mesh, buckets=config.token_buckets,
            num_speculative_tokens=config.speculative_config.num_speculative_tokens if config.speculative_config
            else 0,
            pack_weights=params is None))   # a caller's arrays are served as they are (shared, e.g. a trainer's)
    del model   # a runner that packed its weights holds its own copies: the model's go before warm-up
    replicas = []
    for runner in runners:
        # A multi-process engine's followers compile what the leader's steps need: all of it, up front.
        runner.warmup(background_after=config.background_warmup_after if config.num_processes == 1 else 0)
        replicas.append(Replica(Scheduler(scheduler_config), runner))
    times["warmup"] = time.perf_counter() - t0
    if times["warmup"] > 60 and config.token_buckets is None:
        logger.warning("warm-up compiled %d token buckets in %.0f s; fewer buckets start faster at the cost of "
                       "padding, e.g. --token-buckets %s", len(replicas[0].runner.buckets), times["warmup"],
                       _few_buckets(replicas[0].runner.buckets))
    if jax.devices()[0].platform == "cpu" and native_cpu.available() and native_cpu.gemm_available():
        amx = ("bfloat16 on AMX tiles, float32 on AMX tiles as three bfloat16 parts (6 products)"
               if native_cpu.f32_tiles() else "bfloat16 on AMX tiles, float32 on AVX-512")
        logger.info("native matmuls of 2+ rows: %s", amx if native_cpu.gemm_amx() else "AVX-512 (bfloat16 with AVX-512 BF16)")
    logger.info("engine ready: %s, %d replica(s) x tp %d, %d KV blocks of %d each, max_model_len %d, start-up %s",
                checkpoint.name, len(replicas), config.tensor_parallel_size, num_blocks, config.block_size,
                max_model_len, {k: round(v, 2) for k, v in times.items()})
    defaults = sampling_defaults(checkpoint.generation_config, config.generation_config)
    if defaults:
        logger.info("sampling defaults from the model's generation config, for requests that leave them out: %s "
                    "(--generation-config none keeps jaxserve's)", defaults)
    return EngineParts(config=config, checkpoint_name=checkpoint.name, model_config=model_config,
                       tokenizer=tokenizer, replicas=replicas, startup_seconds=times,
                       checkpoint_model_config=checkpoint_model_config, kv_head_replicas=kv_replicas,
                       sampling_defaults=defaults)
