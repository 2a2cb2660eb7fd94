"""Tensor and data parallelism on 8 forced CPU devices, and one engine over two processes.

Each scenario runs `tests/sharding/parallel_worker.py` in a fresh process, because the
device count is fixed when jax starts (XLA_FLAGS=--xla_force_host_platform_device_count).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest

from tests.server.conftest import free_port

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker(*args, devices=8, timeout=600):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    proc = subprocess.run([sys.executable, "-m", "tests.sharding.parallel_worker", *map(str, args)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_tensor_parallel_1_2_4_give_the_same_tokens_and_logits(tiny_models):
    # tiny llama: 4 heads over 2 KV heads, so tp=4 replicates each KV head twice.
    result = worker("tp", tiny_models["llama"], "1,2,4")
    base = result["1"]
    logits1 = np.array(base["logits"])
    scale = float(np.sqrt(np.mean(np.square(logits1))))
    for tp in ("1", "2", "4"):
        r = result[tp]
        assert r["num_devices"] == 8
        assert r["tokens"] == base["tokens"], tp
        # Only the summation order of the row-parallel all-reduces differs: 1e-5 relative, with
        # the same 1e-5 of the logit scale as the floor for logits near zero.
        np.testing.assert_allclose(np.array(r["logits"]), logits1, rtol=1e-5, atol=1e-5 * scale)
        assert r["kv_sharding_is_declared"], tp
        assert r["kv_devices"] == int(tp)
        assert r["kv_shard_shape"][1] == 1 if tp != "1" else r["kv_shard_shape"] == r["kv_shape"]
        assert r["q_kernel_shard_shape"][1] == 4 // int(tp)      # query heads split over tp
        assert r["compiles_after_warmup"] == 0
    assert result["4"]["kv_shape"][1] == 4                         # 2 KV heads, each held twice


def test_the_pallas_kernel_runs_per_device_over_tensor_parallel_heads():
    # Interpret mode on CPU; the worker checks the output against the reference (1e-5 relative).
    result = worker("kernel_tp", 2, devices=2)
    assert result == {s: {"out_devices": 2, "per_device": True} for s in ("mixed", "prefix_hit")}


def test_data_parallel_2_serves_a_mixed_workload_like_1(tiny_models):
    result = worker("dp", tiny_models["llama"])
    one, two = result["1"], result["2"]
    assert two["outputs"] == one["outputs"]                        # per request, every completion
    assert len(one["outputs"]) == 12
    assert two["replica_devices"] == [[0], [1]]
    assert set(two["served_by"].values()) == {0, 1}                # both replicas took work
    assert all(q > 0 for q in two["steps_per_replica"])
    routing = two["prefix_routing"]
    # The replica holding a prefix takes the requests that share it until it is `slack`
    # requests busier than the other; then the least loaded one does.
    assert routing["routed"][:routing["slack"] + 1] == [routing["home"]] * (routing["slack"] + 1)
    assert 1 - routing["home"] in routing["routed"]
    assert two["compiles_after_warmup"] == 0 and two["leaked_routes"] == 0


def test_two_processes_give_the_same_tokens_as_one(tiny_models):
    model = tiny_models["llama"]
    single = worker("tp", model, "1", devices=1)["1"]["tokens"]
    address = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.sharding.parallel_worker", "host", str(model), address,
                               "2", str(i)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    leader = json.loads([line for line in outs[0].splitlines() if line.startswith("RESULT ")][-1][7:])
    assert leader["num_devices"] == 2 and leader["mesh_processes"] == [0, 1]   # one mesh over both processes
    assert leader["tokens"] == single


def test_serve_across_two_processes_then_sigterm_stops_both(tiny_models):
    model = tiny_models["llama"]
    port, address = free_port(), f"127.0.0.1:{free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    common = ["--tensor-parallel-size", "2", "--num-processes", "2", "--coordinator-address", address,
              "--max-num-batched-tokens", "32", "--max-num-seqs", "8", "--num-kv-blocks", "64",
              "--max-model-len", "96", "--token-buckets", "8,32"]
    procs = [subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", str(model), "--port", str(port),
                               "--process-id", str(i), *common], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        deadline = time.monotonic() + 300
        while True:
            assert all(p.poll() is None for p in procs), procs[0].stdout.read() if procs[0].poll() is not None else ""
            assert time.monotonic() < deadline, "the leader did not become healthy"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        done = client.completions.create(model="llama", prompt="Once upon a time", max_tokens=8, temperature=0)
        assert done.usage.completion_tokens == 8
        procs[0].send_signal(15)
        assert [p.wait(timeout=120) for p in procs] == [0, 0]      # the follower leaves when the leader stops
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
