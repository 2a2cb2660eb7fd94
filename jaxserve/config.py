"""Engine options: one frozen dataclass whose fields are the CLI flags in snake_case.

Built once from keyword arguments (`LLM(model=..., max_num_seqs=8)`) or CLI flags, then
resolved against the model (context length, KV pool size) by the engine at start-up.
"""

from __future__ import annotations

import dataclasses

from jaxserve.core.kv_transfer import KV_ROLES, LOAD_FAILURE_POLICIES
from jaxserve.core.speculative import SpeculativeConfig

DTYPES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = ("auto", *DTYPES)     # "auto": resolved per device at start-up (jaxserve.engine.devices)
ATTENTION_BACKENDS = ("auto", "reference", "cpu", "pallas_gpu", "pallas_tpu")
GENERATION_CONFIGS = ("auto", "none")   # where a request's unset sampling fields come from (EngineConfig)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str | None = None                  # HF folder, .gguf file, or None for the default model
    served_model_name: str | None = None      # name in the API (default: the model's own name)
    dtype: str = "auto"                       # compute and KV dtype; "auto": bfloat16 on GPU/TPU and on CPUs
                                              # with bf16 dot instructions, else float32
    max_model_len: int | None = None          # default: the model's max_position_embeddings, capped at 4096
    max_num_batched_tokens: int = 512         # token budget of one step
    max_num_seqs: int = 64                    # running requests at most
    block_size: int = 16                      # tokens per KV block
    num_kv_blocks: int | None = None          # KV pool size in blocks (overrides kv_cache_memory_gb)
    kv_cache_memory_gb: float | None = None   # KV pool budget when num_kv_blocks is not given (default: from
                                              # gpu_memory_utilization on GPU/TPU, 1 GiB on CPU)
    gpu_memory_utilization: float = 0.9       # GPU/TPU: the fraction of device memory for weights,
                                              # activations and the KV pool (vLLM's meaning)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0     # cap on one request's prefill chunk (0: none)
    scheduling_policy: str = "fcfs"           # "fcfs" or "priority"
    async_scheduling: bool = True             # schedule and launch step N + 1 while step N runs (its sampled
                                              # tokens stay on the device); where a request needs its last token
                                              # on the host first (grammars, penalties, drafts), steps run one by one
    max_logprobs: int = 20                    # largest `logprobs` a request may ask for
    generation_config: str = "auto"           # "auto": the model's generation_config.json sets the defaults of
                                              # the sampling fields a request leaves out (vLLM's default);
                                              # "none": jaxserve's own (temperature 1, no filters)
    token_buckets: tuple[int, ...] | None = None  # token counts the step is compiled for (default: powers
                                              # of two up to the budget); fewer buckets = faster warm-up
    background_warmup_after: int = 0         # compile the buckets above this many tokens after start-up, in
                                              # the background (0: all before); the budget is capped meanwhile
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    attention_backend: str = "auto"           # "auto" picks by platform ("cpu" on CPUs); "reference": the oracle
    attention_self_check: bool = True         # a Pallas backend must match the oracle at start-up (kernels_pallas.
                                              # self_check); False skips it (e.g. to debug a kernel)
    seed: int = 0                             # seeds parameter init for random models; not sampling
    compilation_cache_dir: str | None = None  # persistent XLA cache (default: under the user's cache dir)
    # Disaggregated prefill/decode (jaxserve.core.kv_transfer): a producer exports the KV blocks of its
    # prefills, a consumer pulls them; None: an ordinary instance.
    kv_role: str | None = None                # "producer" | "consumer" | None
    kv_lease_seconds: float = 30.0            # producer: how long an export waits for its pull
    kv_load_failure_policy: str = "recompute" # consumer: a failed pull "recompute"s the prompt or "fail"s it
    # n-gram speculative decoding (vLLM's --speculative-config: a dict or its JSON text; held parsed,
    # as a jaxserve.core.speculative.SpeculativeConfig); None: off.
    speculative_config: SpeculativeConfig | dict | str | None = None
    # Multi-host: one engine over the devices of `num_processes` processes (jax.distributed);
    # process 0 schedules and serves, the others follow its steps.
    coordinator_address: str | None = None    # "host:port" of process 0's coordinator
    num_processes: int = 1
    process_id: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {DTYPE_CHOICES}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} must be one of {ATTENTION_BACKENDS}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "tensor_parallel_size",
                     "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len={self.max_model_len!r} must be an integer >= 2")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2):
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks!r} must be an integer >= 2")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb={self.kv_cache_memory_gb!r} must be > 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1]")
        if self.token_buckets is not None:
            object.__setattr__(self, "token_buckets", tuple(self.token_buckets))
            b = self.token_buckets
            if not b or any(not isinstance(x, int) or x < 1 for x in b) or list(b) != sorted(set(b)) \
                    or b[-1] != self.max_num_batched_tokens:
                raise ValueError(f"token_buckets={b!r} must be increasing positive integers ending at "
                                 f"max_num_batched_tokens={self.max_num_batched_tokens}")
        if not isinstance(self.num_processes, int) or self.num_processes < 1:
            raise ValueError(f"num_processes={self.num_processes!r} must be a positive integer")
        if not isinstance(self.process_id, int) or not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id={self.process_id!r} must be in [0, num_processes={self.num_processes})")
        if self.num_processes > 1 and not self.coordinator_address:
            raise ValueError(f"num_processes={self.num_processes} needs coordinator_address (process 0's host:port)")
        if self.num_processes > 1 and self.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size={self.data_parallel_size} with num_processes={self.num_processes}: "
                             "a multi-process engine runs one replica spanning every process's devices")
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(f"generation_config={self.generation_config!r} must be 'auto' (the model's sampling "
                             "defaults) or 'none' (jaxserve's)")
        if not isinstance(self.background_warmup_after, int) or self.background_warmup_after < 0:
            raise ValueError(f"background_warmup_after={self.background_warmup_after!r} must be an integer >= 0")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.kv_role not in (None, *KV_ROLES):
            raise ValueError(f"kv_role={self.kv_role!r} must be one of {KV_ROLES} or None")
        if not self.kv_lease_seconds > 0:
            raise ValueError(f"kv_lease_seconds={self.kv_lease_seconds!r} must be > 0")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy={self.kv_load_failure_policy!r} must be one of "
                             f"{LOAD_FAILURE_POLICIES}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs={self.max_logprobs!r} must be an integer >= 0")

    @classmethod
    def from_kwargs(cls, model=None, **kwargs) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(names - {'model'}))}")
        return cls(model=None if model is None else str(model), **kwargs)
