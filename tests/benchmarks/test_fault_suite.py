"""benchmarks/fault_suite.py, shortened: every row on the tiny model must pass."""

import json

import fault_suite
import pytest


@pytest.mark.slow
def test_every_fault_suite_row_passes_shortened(tiny_models, tmp_path):
    result = tmp_path / "faults.json"
    rc = fault_suite.main(["--model", str(tiny_models["llama"]), "--schemathesis-examples", "25", "--storm", "60",
                           "--pool-requests", "8", "--request-clients", "24", "--soak-s", "20",
                           "--result-file", str(result)])
    rows = json.loads(result.read_text())
    assert set(rows) == set(fault_suite.ROWS)
    assert rc == 0, {name: row for name, row in rows.items() if not row["ok"]}
    assert rows["schemathesis"]["responses"] > 100 and rows["schemathesis"]["5xx"] == 0
    assert rows["pool"]["preemptions"] > 0           # the pool really ran out
    assert rows["step-failure"]["exit_code"] == 1 and rows["hung-step"]["exit_code"] == 1
    assert rows["request-failure"]["marked_failed_alone"] == rows["request-failure"]["marked"] == 8
    assert rows["request-failure"]["failed_alone_by_fault"] == {"output": 4, "grammar": 4}
