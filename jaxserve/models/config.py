"""Model hyper-parameters of a Llama-family decoder, read from a Hugging Face config.json.

`ModelConfig.from_hf_config(d)` turns the parsed config.json dict into one frozen,
hashable dataclass (safe to close over in jitted code). Family quirks are resolved here,
once, into plain fields, so the layers never look at the architecture name:
- Qwen2 always has q/k/v biases (and no o_proj bias); Llama and Qwen3 put
  `attention_bias` on q/k/v and o_proj alike.
- Qwen3 normalises q and k per head (`qk_norm`).
- Sliding-window attention is resolved per layer (`layer_sliding_windows`): Mistral uses
  it on every layer; Qwen2/Qwen3 only with `use_sliding_window`, from layer
  `max_window_layers` on (or as `layer_types` says).
- RoPE theta comes from a top-level `rope_theta` (transformers < 5) or from
  `rope_parameters` (transformers 5), scaling from `rope_parameters` or `rope_scaling`.
Invalid or missing fields raise ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

# Rope types whose inverse frequencies `layers.rope_inv_freq` computes.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_QWEN_MODEL_TYPES = ("qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (HF `rope_parameters` minus theta); `default` means none."""

    rope_type: str = "default"                  # "default" | "linear" | "llama3"
    factor: float = 1.0                         # linear and llama3: divide low frequencies by this
    low_freq_factor: float = 1.0                # llama3: wavelengths above orig_max / this are fully scaled
    high_freq_factor: float = 4.0               # llama3: wavelengths below orig_max / this are kept
    original_max_position_embeddings: int = 0   # llama3: the pre-training context length


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder's shape and numerics (frozen, hashable)."""

    architectures: tuple[str, ...]            # HF class names, e.g. ("LlamaForCausalLM",)
    model_type: str                           # HF model_type: "llama", "qwen2", "qwen3", "mistral", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int                    # SwiGLU inner width
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int                  # < num_attention_heads for GQA
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool                 # lm_head reuses embed_tokens
    attention_bias: bool                      # bias on q_proj / k_proj / v_proj
    o_proj_bias: bool                         # bias on o_proj
    mlp_bias: bool                            # bias on gate/up/down (Llama's mlp_bias)
    qk_norm: bool                             # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None                # window in tokens (key pos > query pos - window); None: full
    layer_sliding_windows: tuple[int | None, ...]  # per layer: sliding_window or None (full attention)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]            # config's eos_token_id, always as a tuple
    # Not from config.json: the attention kernel the engine resolved from --attention-backend
    # ("reference" | "cpu" | "pallas_gpu" | "pallas_tpu", see kernels_pallas.dispatch).
    attention_backend: str = "reference"

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def native_rows(self) -> bool:
        """One-row bf16 matmuls may use the native CPU matvec (the "cpu" backend's batch-1 path)."""
        return self.attention_backend == "cpu"

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """Parses a Hugging Face config.json dict; raises ValueError naming a bad field."""
        if not isinstance(d, Mapping):
            raise ValueError(f"config must be a dict, got {type(d).__name__}")
        architectures = d.get("architectures")
        if not architectures or not isinstance(architectures, (list, tuple)):
            raise ValueError(f"config field 'architectures' must be a non-empty list, got {architectures!r}")
        model_type = d.get("model_type", "")
        if not isinstance(model_type, str):
            raise ValueError(f"config field 'model_type' must be a string, got {model_type!r}")

        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"config field 'hidden_act' must be 'silu' (SwiGLU), got {hidden_act!r}")

        hidden_size = _positive_int(d, "hidden_size")
        num_heads = _positive_int(d, "num_attention_heads")
        num_kv_heads = _positive_int(d, "num_key_value_heads", default=num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"config field 'num_key_value_heads' ({num_kv_heads}) must divide "
                f"num_attention_heads ({num_heads})"
            )
        if d.get("head_dim") is None:
            if hidden_size % num_heads:
                raise ValueError(
                    f"config field 'head_dim' is missing and hidden_size ({hidden_size}) is not "
                    f"divisible by num_attention_heads ({num_heads})"
                )
            head_dim = hidden_size // num_heads
        else:
            head_dim = _positive_int(d, "head_dim")
        if head_dim % 2:
            raise ValueError(f"config field 'head_dim' must be even for RoPE, got {head_dim}")
        num_layers = _positive_int(d, "num_hidden_layers")

        rope_theta, rope_scaling = _rope(d)
        sliding_window, layer_windows = _sliding_windows(d, model_type, num_layers)

        if model_type == "qwen2":   # Qwen2 hard-codes q/k/v biases and a bias-free o_proj
            attention_bias, o_proj_bias = True, False
        else:
            attention_bias = o_proj_bias = _bool(d, "attention_bias", False)

        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos_ids):
            raise ValueError(f"config field 'eos_token_id' must be an int or a list of ints, got {eos!r}")
        bos = d.get("bos_token_id")
        if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool)):
            raise ValueError(f"config field 'bos_token_id' must be an int or null, got {bos!r}")

        return cls(
            architectures=tuple(architectures),
            model_type=model_type,
            vocab_size=_positive_int(d, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_positive_int(d, "intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_positive_float(d, "rms_norm_eps", default=1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_positive_int(d, "max_position_embeddings", default=2048),
            tie_word_embeddings=_bool(d, "tie_word_embeddings", False),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=_bool(d, "mlp_bias", False),
            qk_norm=model_type == "qwen3",
            sliding_window=sliding_window,
            layer_sliding_windows=layer_windows,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
        )


_MISSING = object()


def _positive_int(d: Mapping[str, Any], key: str, default: Any = _MISSING) -> int:
    value = d.get(key, default)
    if value is _MISSING:
        raise ValueError(f"config field {key!r} is missing")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config field {key!r} must be a positive int, got {value!r}")
    return value


def _positive_float(d: Mapping[str, Any], key: str, default: Any = _MISSING) -> float:
    value = d.get(key, default)
    if value is _MISSING:
        raise ValueError(f"config field {key!r} is missing")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config field {key!r} must be a positive number, got {value!r}")
    return float(value)


def _bool(d: Mapping[str, Any], key: str, default: bool) -> bool:
    value = d.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"config field {key!r} must be true or false, got {value!r}")
    return value


def _rope(d: Mapping[str, Any]) -> tuple[float, RopeScaling]:
    """Theta and scaling from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling`."""
    params = d.get("rope_parameters")
    if params is not None and not isinstance(params, Mapping):
        raise ValueError(f"config field 'rope_parameters' must be a dict, got {params!r}")
    scaling = d.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, Mapping):
        raise ValueError(f"config field 'rope_scaling' must be a dict or null, got {scaling!r}")
    merged: dict[str, Any] = {**(scaling or {}), **(params or {})}
    if "rope_theta" not in merged:
        merged["rope_theta"] = d.get("rope_theta", 10000.0)
    theta = _positive_float(merged, "rope_theta")
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    field = "rope_parameters" if params is not None else "rope_scaling"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config field {field!r} has unsupported rope_type {rope_type!r}; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, RopeScaling()
    factor = _positive_float(merged, "factor")
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=factor)
    low = _positive_float(merged, "low_freq_factor")
    high = _positive_float(merged, "high_freq_factor")
    if high <= low:
        raise ValueError(
            f"config field {field!r}: high_freq_factor ({high}) must exceed low_freq_factor ({low})"
        )
    original = _positive_int(
        merged, "original_max_position_embeddings", default=d.get("max_position_embeddings", _MISSING)
    )
    return theta, RopeScaling(
        rope_type="llama3",
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=original,
    )


def _sliding_windows(
    d: Mapping[str, Any], model_type: str, num_layers: int
) -> tuple[int | None, tuple[int | None, ...]]:
    """The sliding window and, per layer, the window it uses (None: full attention)."""
    window = d.get("sliding_window")
    uses_window = model_type == "mistral" or (
        model_type in _QWEN_MODEL_TYPES and _bool(d, "use_sliding_window", False)
    )
    if window is None or not uses_window:   # Llama has no window; Qwen's is off unless enabled
        return None, (None,) * num_layers
    window = _positive_int(d, "sliding_window")
    if model_type == "mistral":   # HF Mistral applies its window on every layer
        return window, (window,) * num_layers
    layer_types = d.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, (list, tuple)) or len(layer_types) != num_layers or not all(
            t in ("full_attention", "sliding_attention") for t in layer_types
        ):
            raise ValueError(
                f"config field 'layer_types' must list 'full_attention' or 'sliding_attention' "
                f"for each of the {num_layers} layers, got {layer_types!r}"
            )
        sliding = [t == "sliding_attention" for t in layer_types]
    else:
        first = d.get("max_window_layers", 28)
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise ValueError(f"config field 'max_window_layers' must be a non-negative int, got {first!r}")
        sliding = [i >= first for i in range(num_layers)]
    return window, tuple(window if s else None for s in sliding)
