"""serve_bench end to end against a real server over the tiny model (vocab 512, budget 64, blocks of 16)."""

import json

import pytest
import serve_bench

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.cli import main as cli_main
from tests.server.conftest import RunningServer

TINY = ["--vocab-size", "512", "--seed", "1"]


@pytest.fixture(scope="module")
def server(tiny_engine):
    srv = RunningServer(AsyncEngine(tiny_engine), served_model_name="tiny")
    yield srv
    srv.stop()


def run(server, tmp_path, *args):
    path = tmp_path / "result.json"
    rc = serve_bench.main(["--base-url", server.url, "--result-file", str(path), *TINY, *args])
    return rc, json.loads(path.read_text())


def test_random_workload_reports_vllm_metrics_and_server_counters(server, tmp_path):
    rc, out = run(server, tmp_path, "--workload", "random", "--num-prompts", "6", "--random-input-len", "20",
                  "--random-output-len", "5", "--random-range-ratio", "0.2", "--request-rate", "50",
                  "--max-concurrency", "4")
    assert rc == 0 and out["completed"] == 6 and out["failed"] == 0 and out["model_id"] == "tiny"
    assert out["total_output_tokens"] == sum(out["output_lens"]) and all(4 <= n <= 6 for n in out["output_lens"])
    assert out["server"]["generation_tokens"] == out["total_output_tokens"]
    assert out["server"]["compiles_after_warmup"] == 0
    for key in ("mean_ttft_ms", "p99_itl_ms", "median_tpot_ms", "max_e2el_ms", "output_throughput"):
        assert out[key] > 0, key
    assert all(len(itl) == n - 1 for itl, n in zip(out["itls"], out["output_lens"]))


def test_agent_workload_computes_the_shared_prefix_once(server, tmp_path):
    rc, out = run(server, tmp_path, "--workload", "agent", "--num-agents", "3", "--num-turns", "3",
                  "--agent-system-len", "16", "--agent-tools-len", "16", "--agent-repo-len", "16",
                  "--agent-task-len", "8", "--agent-user-len", "4,8", "--agent-output-len", "4")
    assert rc == 0 and out["completed"] == 9
    assert len(out["median_ttft_by_turn_ms"]) == 3
    # Everything past the ideal is at most the partial last block of each request's cached prefix.
    assert 0 <= out["prefill_excess_tokens_per_request"] <= 16
    assert out["prefill_tokens_computed"] < out["prompt_tokens_total"] / 2
    assert out["server"]["prefix_cache_hit_rate"] > 0.5


def test_long_prompt_burst_measures_stream_itl_around_the_burst(server, tmp_path):
    rc, out = run(server, tmp_path, "--workload", "long-prompt-burst", "--token-budget", "12",
                  "--burst-streams", "3", "--burst-stream-prompt-len", "8", "--burst-steady-tokens", "6")
    assert rc == 0 and out["failed"] == 0 and out["completed"] == 4
    assert out["burst"]["long_prompt_len"] == 96
    assert out["num_steady_itls"] > 0 and out["num_burst_itls"] >= 3
    assert out["long_prompt_ttft_ms"] > 0 and out["burst_p99_over_steady_p99"] > 0


def test_cli_runs_the_script(server, tmp_path, capsys):
    path = tmp_path / "cli.json"
    rc = cli_main(["bench", "serve", "--base-url", server.url, "--result-file", str(path), *TINY,
                   "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "3"])
    assert rc == 0 and json.loads(path.read_text())["completed"] == 2
    assert "Serving Benchmark Result" in capsys.readouterr().out
