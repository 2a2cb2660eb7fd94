"""Arithmetic of the offline step breakdown and of the roofline floors, on stand-ins worked out by hand."""

import re
import time
import types

import pytest
from offline_throughput import StepBreakdown
from roofline import Model


class FakeScheduler:
    def schedule(self):
        time.sleep(0.01)

    def update_from_output(self):
        time.sleep(0.01)


class FakeRunner:
    def _prepare(self):
        time.sleep(0.02)

    def launch(self):
        self._prepare()
        time.sleep(0.01)

    def collect(self, launched):
        time.sleep(0.05)


class FakeEngine:
    def __init__(self):
        self.scheduler, self.runner = FakeScheduler(), FakeRunner()

    def step(self):
        self.scheduler.schedule()
        self.runner.collect(self.runner.launch())
        self.scheduler.update_from_output()
        time.sleep(0.01)                           # detokenize and outputs


def test_step_breakdown_attributes_each_phase():
    engine = FakeEngine()
    bd = StepBreakdown(engine)
    engine.step()
    engine.step()
    r = bd.report()
    assert bd.steps == 2
    assert r["scheduler"] == pytest.approx(0.04, abs=0.015)
    assert r["prepare_inputs"] == pytest.approx(0.04, abs=0.015)
    assert r["dispatch"] == pytest.approx(0.02, abs=0.015)          # launch minus the prepare inside it
    assert r["detokenize_and_outputs"] == pytest.approx(0.02, abs=0.015)
    assert sum(v for k, v in r.items() if k != "step") == pytest.approx(r["step"])


def test_decode_floor_reads_weights_and_every_context_token():
    m = Model.__new__(Model)
    m.config = types.SimpleNamespace(num_attention_heads=2, head_dim=4, num_hidden_layers=3)
    m.embed, m.layer_params = 1000, 9000
    m.weight_bytes, m.kv_bytes_per_token = 40_000, 100
    f = m.step_floor(num_seqs=2, q_tokens=1, context=9, bw=1e-3, rate=1e-3)   # 1e6 B/s, 1e6 FLOP/s
    assert f["memory"] == pytest.approx((40_000 + 2 * 10 * 100) / 1e6)
    flops = 2 * 9000 * 2 + 2 * 1000 * 2 + 2 * (4 * 1 * 10 * 2 * 4 * 3)
    assert f["compute"] == pytest.approx(flops / 1e6)


@pytest.mark.slow
def test_profile_workload_reports_the_cores_share(tmp_path, capsys):
    """benchmarks/profile_workload.py on a small random workload: the cores' share and the caller's CPU."""
    import profile_workload
    assert profile_workload.main(["--num-requests", "4", "--output-len", "4", "--dtype", "float32"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.match(r"4 x 4 tokens, float32: wall ([\d.]+) s, CPU ([\d.]+) s on (\d+) cores \((\d+)% busy\), "
                 r"the calling thread ([\d.]+) s$", line)
    assert m, line
    wall, cpu, cores, busy, thread = float(m[1]), float(m[2]), int(m[3]), int(m[4]), float(m[5])
    assert 0 < wall and 0 < thread <= cpu <= cores * wall * 1.1 and 0 < busy <= 110   # printed rounded
