"""examples/rl_loop.py end to end: the reward rises, nothing recompiles, the engine shares the arrays."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_rl_loop_learns_with_the_engine_serving_the_trainers_arrays():
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "rl_loop.py"), "--steps", "30"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    last = run.stdout.strip().splitlines()[-1]
    first, final = (float(x) for x in last.split("reward ", 1)[1].split(" (")[0].split(" -> "))
    mean_last3 = float(last.split("mean of the last 3: ")[1].split(")")[0])
    assert mean_last3 > first + 0.2, last
    assert "engine compiles after warm-up: 0" in last and "engine shares the trainer's arrays: True" in last
