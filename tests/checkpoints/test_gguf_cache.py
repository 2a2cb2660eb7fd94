"""The GGUF conversion cache: its cheap key (size, mtime, head and tail bytes) and the stored dtypes."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from checkpoints import cache, gguf_file, load_gguf
from checkpoints.cache import content_key
from jaxserve.engine.builder import build_model
from tests.checkpoints.test_gguf import tiny_hf_weights, write_tiny_gguf

MiB = 1 << 20
PAST = 1_600_000_000_123_456_789  # an mtime in ns, well before any file written by the test


def _set_mtime(path, mtime_ns=PAST):
    os.utime(path, ns=(mtime_ns, mtime_ns))


def _rewrite_byte(path, offset):
    """Flip one byte in place, keeping the size, then restore the old mtime."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))
    _set_mtime(path)


# ---------------------------------------------------------------- the key


def test_key_reads_only_the_head_and_tail_of_a_huge_file(tmp_path, monkeypatch):
    path = tmp_path / "huge.gguf"
    with open(path, "wb") as f:  # 64 GiB, sparse: hashing it all would take minutes
        f.write(b"GGUF" + os.urandom(1000))
        f.truncate(64 << 30)
    read = []
    real_open = open

    class CountingFile:
        def __init__(self, f):
            self._f = f

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

        def read(self, n=-1):
            data = self._f.read(n)
            read.append(len(data))
            return data

    monkeypatch.setattr(cache, "open", lambda *a, **k: CountingFile(real_open(*a, **k)), raising=False)
    start = time.perf_counter()
    content_key(path)
    seconds = time.perf_counter() - start
    print(f"\nkey of a 64 GiB file: {seconds * 1000:.1f} ms, {sum(read)} bytes read")
    assert sum(read) == 16 * MiB + 1 * MiB
    assert seconds < 5.0  # a whole-file read of 64 GiB takes well over a minute


def test_key_follows_size_mtime_head_and_tail(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(20 * MiB))
    _set_mtime(path)
    base = content_key(path)
    assert content_key(path) == base

    _set_mtime(path, PAST + 1)  # touched: 1 ns later
    assert content_key(path) != base
    _set_mtime(path)
    assert content_key(path) == base

    with open(path, "ab") as f:  # grown by one byte
        f.write(b"\0")
    _set_mtime(path)
    assert content_key(path) != base
    os.truncate(path, 20 * MiB)
    _set_mtime(path)
    assert content_key(path) == base

    _rewrite_byte(path, 100)  # the header, same size and mtime
    assert content_key(path) != base
    _rewrite_byte(path, 100)
    assert content_key(path) == base
    _rewrite_byte(path, 20 * MiB - 10)  # the last MiB
    assert content_key(path) != base
    _rewrite_byte(path, 20 * MiB - 10)

    # Documented trust: a byte between the first 16 MiB and the last 1 MiB, rewritten in place
    # with size and mtime kept, is not seen.
    _rewrite_byte(path, 17 * MiB)
    assert content_key(path) == base

    monkeypatch.setattr(cache, "CONVERTER_VERSION", cache.CONVERTER_VERSION + 1)
    assert content_key(path) != base


def test_copy_keeping_mtime_shares_the_key_a_plain_copy_does_not(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(3 * MiB))
    _set_mtime(path)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert content_key(shutil.copy2(path, tmp_path / "a" / "m.gguf")) == content_key(path)
    assert content_key(shutil.copy(path, tmp_path / "b" / "m.gguf")) != content_key(path)


def test_touched_gguf_converts_again_copied_one_does_not(tmp_path, monkeypatch):
    cache_dir = tmp_path / "cache"
    path = write_tiny_gguf(tmp_path / "m.gguf", tiny_hf_weights())
    _set_mtime(path)
    first = load_gguf(path, cache_dir=cache_dir)
    (tmp_path / "copy").mkdir()
    copy = shutil.copy2(path, tmp_path / "copy" / "m.gguf")
    conversions = []
    real_convert = gguf_file.convert_gguf
    monkeypatch.setattr(gguf_file, "convert_gguf", lambda *a: conversions.append(a) or real_convert(*a))
    assert load_gguf(copy, cache_dir=cache_dir).path == first.path and conversions == []
    _set_mtime(path, PAST + 10**9)
    assert load_gguf(path, cache_dir=cache_dir).path != first.path and len(conversions) == 1


# ---------------------------------------------------------------- stored dtypes


def _mixed_gguf(tmp_path):
    """A tiny GGUF with F16 q/o projections, BF16 k/v and gate, Q8_0 up, F32 for the rest."""
    weights = tiny_hf_weights(tied=False)
    path = write_tiny_gguf(
        tmp_path / "mixed.gguf",
        weights,
        quantize=("mlp.up_proj",),
        f16=("q_proj", "o_proj"),
        bf16=("k_proj", "v_proj", "gate_proj"),
    )
    return path, weights


def test_stored_dtype_is_the_source_dtype_or_float32_for_quantized(tmp_path):
    path, weights = _mixed_gguf(tmp_path)
    ckpt = load_gguf(path, cache_dir=tmp_path / "c")
    assert set(ckpt.tensors) == set(weights)
    for name, w in weights.items():
        got = ckpt.tensors[name]
        assert got.shape == w.shape, name
        if "q_proj" in name or "o_proj" in name:  # exact, including the un-permuted Q rows
            assert got.dtype == np.float16, name
            np.testing.assert_array_equal(got, w.astype(np.float16), err_msg=name)
        elif "k_proj" in name or "v_proj" in name or "gate_proj" in name:
            assert got.dtype == ml_dtypes.bfloat16, name
            np.testing.assert_array_equal(got.view(np.uint16), w.astype(ml_dtypes.bfloat16).view(np.uint16), name)
        elif "up_proj" in name:  # Q8_0 dequantized
            assert got.dtype == np.float32, name
            assert 0 < np.max(np.abs(got - w)) < 0.05, name
        else:
            assert got.dtype == np.float32, name
            np.testing.assert_array_equal(got, w, err_msg=name)


def test_torch_dtype_names_the_dtype_of_most_weights(tmp_path):
    path = write_tiny_gguf(tmp_path / "f16.gguf", tiny_hf_weights(), quantize=(), f16=("proj", "embed"))
    assert load_gguf(path, cache_dir=tmp_path / "c").config["torch_dtype"] == "float16"
    path = write_tiny_gguf(tmp_path / "q8.gguf", tiny_hf_weights(), quantize=("proj",), f16=("embed",))
    assert load_gguf(path, cache_dir=tmp_path / "c").config["torch_dtype"] == "float32"


def test_float32_engine_params_equal_those_from_a_float32_copy(tmp_path):
    # Before, the cache stored everything as float32; loading the 16-bit copy into a float32
    # engine must give bit-identical params, hence identical outputs.
    path, _ = _mixed_gguf(tmp_path)
    ckpt = load_gguf(path, cache_dir=tmp_path / "c")
    as_float32 = dataclasses.replace(ckpt, tensors={k: np.asarray(v, np.float32) for k, v in ckpt.tensors.items()})
    ours = nnx.state(build_model(ckpt, "float32")[0])
    before = nnx.state(build_model(as_float32, "float32")[0])
    pairs = list(zip(jax.tree.leaves(ours), jax.tree.leaves(before), strict=True))
    assert pairs
    for a, b in pairs:
        assert a.dtype == b.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
