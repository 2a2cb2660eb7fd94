"""disagg_bench end to end on the tiny model: both setups (five processes each time), so the
script that compares chunked prefill with disaggregated prefill/decode cannot rot."""

import json
import shutil

import disagg_bench
import pytest

TINY = ["--vocab-size", "512", "--num-requests", "10", "--request-rate", "8", "--long-fraction", "0.5",
        "--long-len", "100", "--short-len", "20", "--short-output", "6", "--long-output", "3", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "64", "--serve-arg=--max-model-len=128", "--serve-arg=--num-kv-blocks=256",
        "--serve-arg=--dtype=float32", "--serve-arg=--token-buckets=16,64"]


@pytest.mark.slow
def test_both_setups_serve_the_workload_and_the_kv_moves(tiny_models, tmp_path):
    cores = ["--cores", "0,1"] if shutil.which("taskset") else ["--cores", "none"]
    path = tmp_path / "r.json"
    rc = disagg_bench.main(["--model", str(tiny_models["llama"]), *cores, *TINY, "--result-file", str(path)])
    unified, disaggregated = json.loads(path.read_text())["reports"]
    assert rc == 0 and unified["all"]["completed"] == disaggregated["all"]["completed"] == 10
    assert unified["router_paths"]["jaxserve:router_requests_total"] == 10 + 1   # and the warm-up request
    assert "kv" not in unified
    kv = disaggregated["kv"]
    # Every prompt with a full block before its last token ships it: bytes and pulls are real.
    assert kv["pulls"] >= 5 and kv["bytes_per_request"] > 0 and kv["pull_bandwidth_mb_s"] > 0
    for report in (unified, disaggregated):
        assert report["long"]["requests"] + report["short"]["requests"] == 10
        assert report["long"]["median_ttft_ms"] > 0 and report["short"]["p99_itl_ms"] > 0


def test_the_workload_is_seeded_and_mixed():
    a = disagg_bench.workload(40, long_fraction=0.25, short_len=64, long_len=1024, short_out=64, long_out=16,
                              vocab_size=49152, seed=0)
    assert a == disagg_bench.workload(40, long_fraction=0.25, short_len=64, long_len=1024, short_out=64,
                                      long_out=16, vocab_size=49152, seed=0)
    kinds = [k for k, _, _ in a]
    assert 0 < kinds.count("long") < 40
    assert all(512 <= len(p) <= 1024 and out == 16 for k, p, out in a if k == "long")
    assert all(32 <= len(p) <= 64 and out == 64 for k, p, out in a if k == "short")
