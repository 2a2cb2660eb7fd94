"""kernels_pallas.tuning: measured tables by device kind over the defaults, the file format, merging,
and the sweep's output (run in interpret mode on tiny shapes, where its times mean nothing)."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import pytest

from kernels_pallas import tuning, tuning_sweep
from kernels_pallas.ragged_paged_attention_gpu import ragged_paged_attention_gpu
from tests.kernels.pallas_cases import batch

H200 = "NVIDIA H200"
TABLES = {H200: {"pallas_gpu": {"128/bfloat16": {"kv_block": 128, "decode_stages": 4}}},
          "TPU v5 lite": {"pallas_tpu": {"128/bfloat16": {"prefill_rows": 256}}}}


def write(path, tables, **extra):
    path.write_text(json.dumps({"format": tuning.TABLE_FORMAT, "tables": tables, **extra}))
    return path


@pytest.mark.parametrize("backend, head_dim, dtype, kind, changed", [
    ("pallas_gpu", 128, "bfloat16", H200, {"kv_block": 128, "decode_stages": 4}),   # measured fields only
    ("pallas_gpu", 128, "float32", H200, {}),            # a key the device's table lacks: the defaults
    ("pallas_gpu", 64, "bfloat16", H200, {}),
    ("pallas_gpu", 128, "bfloat16", "NVIDIA H100 80GB HBM3", {}),   # a kind with no table
    ("pallas_gpu", 128, "bfloat16", None, {}),           # no device (cross-lowering, interpret mode)
    ("pallas_tpu", 128, "bfloat16", "TPU v5 lite", {"prefill_rows": 256}),
    ("pallas_tpu", 128, "bfloat16", H200, {}),           # the GPU's table is not the TPU kernel's
])
def test_measured_entry_over_the_defaults(backend, head_dim, dtype, kind, changed):
    default = tuning.default_block_sizes(backend, head_dim, dtype)
    got = tuning.block_sizes(backend, head_dim, dtype, kind, tables=TABLES)
    assert got == dataclasses.replace(default, **changed)


def test_defaults_are_the_tables_that_were_there():
    assert tuning.gpu_block_sizes(128, "bfloat16") == tuning.GPU_TUNING[(128, "bfloat16")]
    assert tuning.tpu_block_sizes(64, "float32") == tuning.TPU_TUNING[(64, "float32")]
    assert tuning.gpu_block_sizes(128, "bfloat16").kv_block == 64
    assert tuning.gpu_block_sizes(64, "float32").kv_block == 32


def test_unknown_head_dim_and_unknown_measured_field_raise_value_error():
    with pytest.raises(ValueError, match="no Pallas GPU tuning for head_dim=96, dtype=bfloat16"):
        tuning.block_sizes("pallas_gpu", 96, "bfloat16", H200, tables=TABLES)
    bad = {H200: {"pallas_gpu": {"128/bfloat16": {"kv_blok": 32}}}}
    with pytest.raises(ValueError, match=r"'NVIDIA H200' pallas_gpu 128/bfloat16 has unknown field\(s\) \['kv_blok'\]"):
        tuning.block_sizes("pallas_gpu", 128, "bfloat16", H200, tables=bad)


def test_shipped_table_file_is_valid():
    assert tuning.MEASURED_TABLES.is_file()
    assert tuning.read_tables(tuning.MEASURED_TABLES) == tuning.measured_tables()


@pytest.mark.parametrize("content, message", [
    ({"tables": {}}, "not a tuning file of format 1"),
    ({"format": 1, "tables": {H200: {"pallas_cuda": {}}}}, "has backend 'pallas_cuda'"),
    ({"format": 1, "tables": {H200: {"pallas_gpu": {"128/bfloat16": {"rows": 16}}}}}, r"\['rows'\]"),
    ({"format": 1, "tables": {H200: {"pallas_gpu": {"128/bfloat16": {"kv_block": "64"}}}}}, r"\['kv_block'\]"),
])
def test_read_tables_rejects_malformed_files(tmp_path, content, message):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message):
        tuning.read_tables(path)


def test_merge_adds_and_replaces_entries_and_refuses_interpret_sweeps(tmp_path):
    into = write(tmp_path / "measured.json", {H200: {"pallas_gpu": {"64/bfloat16": {"kv_block": 32},
                                                                     "128/bfloat16": {"kv_block": 32}}}})
    sweep = write(tmp_path / "sweep.json", {H200: {"pallas_gpu": {"128/bfloat16": {"kv_block": 128}}}},
                  sweep={"interpret": False, "date": "2026-01-01", "jax_version": "0.10.2", "shapes": {}})
    tuning.merge_tables(sweep, into)
    merged = tuning.read_tables(into)
    assert merged[H200]["pallas_gpu"] == {"64/bfloat16": {"kv_block": 32}, "128/bfloat16": {"kv_block": 128}}
    assert json.loads(into.read_text())["sources"][H200]["pallas_gpu"]["date"] == "2026-01-01"

    interpreted = write(tmp_path / "cpu.json", {"cpu": {"pallas_gpu": {}}}, sweep={"interpret": True})
    with pytest.raises(ValueError, match="interpret mode"):
        tuning.merge_tables(interpreted, into)


def test_kernel_reads_the_table_of_its_device_kind(monkeypatch):
    """A measured entry for this device kind reaches the kernel: an invalid one is refused by its checks."""
    import kernels_pallas.ragged_paged_attention_gpu as gpu

    monkeypatch.setattr(gpu, "_device_kind", lambda: "Fake GPU")
    table = {"Fake GPU": {"pallas_gpu": {"64/float32": {"kv_block": 24}}}}
    monkeypatch.setattr(tuning, "measured_tables", lambda: table)
    args = batch("padding")
    # sm_scale is static: an unusual value makes a fresh trace, which reads the table.
    with pytest.raises(ValueError, match="kv_block must be a power of 2 >= 16 .* got 24"):
        ragged_paged_attention_gpu(*args, sm_scale=0.1234567, interpret=True)
    monkeypatch.setattr(gpu, "_device_kind", lambda: "Another GPU")
    assert ragged_paged_attention_gpu(*args, sm_scale=0.7654321, interpret=True).shape == args[0].shape


def test_sweep_writes_a_table_the_lookup_reads(tmp_path, monkeypatch):
    monkeypatch.setitem(tuning_sweep.TINY_CANDIDATES, "pallas_gpu", {"kv_block": (16,)})
    out = tmp_path / "sweep.json"
    assert tuning.main(["--sweep", "--interpret", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    tables = tuning.read_tables(out)
    assert list(tables) == ["cpu"] and list(tables["cpu"]) == ["pallas_gpu"]
    entry = tables["cpu"]["pallas_gpu"]["64/float32"]
    sweep = data["sweep"]
    assert sweep["interpret"] is True and sweep["backend"] == "pallas_gpu" and sweep["sizes"] == "tiny"
    result = sweep["results"]["64/float32"]
    assert [r["candidate"] for r in result["results"]] == ["default", "kv_block=16"]
    for row in result["results"]:
        assert row["ok"] and row["decode_ms"] > 0 and row["mixed_ms"] > 0
        assert row["total_ms"] == pytest.approx(row["decode_ms"] + row["mixed_ms"])
        assert row["max_abs_diff"] < 1e-4        # block sizes change the rounding order only
    chosen = min(result["results"], key=lambda r: r["total_ms"])
    assert result["chosen_candidate"] == chosen["candidate"]
    # The table names only what differs from the defaults, and the lookup turns it back into the winner.
    assert entry == ({} if chosen["candidate"] == "default" else {"kv_block": 16})
    got = tuning.block_sizes("pallas_gpu", 64, "float32", "cpu", tables=tables)
    assert dataclasses.asdict(got) == chosen["fields"]
    with pytest.raises(ValueError, match="interpret mode"):
        tuning.merge_tables(out, tmp_path / "measured.json")


def test_sweep_refuses_a_cpu_without_interpret(tmp_path):
    with pytest.raises(SystemExit, match="no GPU or TPU here"):
        tuning.main(["--sweep", "--out", str(tmp_path / "x.json")])


def test_sweep_candidates_change_one_field_at_a_time():
    default = tuning.default_block_sizes("pallas_gpu", 128, "bfloat16")
    cands = tuning_sweep.candidates(default, {"kv_block": (32, 64, 128), "decode_warps": (4, 8)})
    assert [label for label, _ in cands] == ["default", "kv_block=32", "kv_block=128", "decode_warps=8"]
    for label, sizes in cands[1:]:
        field, value = label.split("=")
        assert sizes == dataclasses.replace(default, **{field: int(value)})


def test_batch_shapes_pad_tokens_to_a_power_of_two():
    b = tuning_sweep.make_batch([(40, 1), (16, 16), (33, 5)], kv_heads=2, group=3, head_dim=64, page_size=16,
                                dtype=jnp.bfloat16, seed=0)
    assert b["q"].shape == (32, 6, 64) and b["q"].dtype == jnp.bfloat16
    assert b["kv_cache"].shape == (2, 2, 3 + 1 + 3 + 1, 16, 64)     # pages of each sequence + the null block
    assert b["query_start_loc"].tolist() == [0, 1, 17, 22] and b["context_lens"].tolist() == [40, 16, 33]
    used = b["block_tables"][b["block_tables"] > 0].tolist()
    assert sorted(used) == list(range(1, 8))                        # every page once, block 0 never
