"""benchmarks/device_check.sh: its token comparison, report and time boxes, and (slow) the whole check
rehearsed on this CPU in interpret mode with quick sizes."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import device_check
import pytest

SCRIPT = Path(device_check.__file__).with_name("device_check.sh")
REPO = SCRIPT.parents[1]


def test_compare_tokens_gives_the_first_divergence_per_prompt():
    ref = {"prompts": ["a", "b", "c"], "token_ids": [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]], "command": "cmd",
           "engine_options": {"x": 1}}
    got = {"prompts": ["c", "a", "b"], "token_ids": [[9, 9, 9], [1, 2, 0], [7, 6, 7]], "texts": ["C", "A", "B"],
           "engine_options": {"x": 1}}
    out = device_check.compare_tokens(got, ref)
    assert [(p["prompt"], p["tokens"], p["first_divergence"]) for p in out["per_prompt"]] == [
        ("c", 3, None), ("a", 3, 2), ("b", 3, 0)]
    assert out["prompts"] == 3 and out["prompts_equal"] == 1 and out["same_engine_options"]
    assert device_check.compare_tokens(got, None) == {"error": f"no reference tokens at {device_check.REFERENCE}"}


def test_reference_file_matches_the_check_it_serves():
    ref = json.loads(device_check.REFERENCE.read_text())
    assert ref["prompts"] == device_check.PROMPTS and ref["max_tokens"] == device_check.MAX_TOKENS
    assert all(len(t) == device_check.MAX_TOKENS for t in ref["token_ids"])
    assert ref["engine_options"] == {k: list(v) if isinstance(v, tuple) else v
                                     for k, v in device_check.E2E_ENGINE.items()}
    assert ref["platform"] == "cpu" and ref["dtype"] == "float32"
    assert ref["command"].startswith("JAX_PLATFORMS=cpu python benchmarks/device_check.py greedy --dtype float32")
    # JAX_NOTES: greedy "Once upon a time" on the default model (transformers agrees).
    assert ref["texts"][0].startswith(", the city of Nova Haven was a thriving metropolis")


def test_a_section_past_its_time_box_is_killed_with_its_children(tmp_path):
    args = argparse.Namespace(out=str(tmp_path), platform="cpu", interpret=False, quick=True, python=sys.executable)
    (tmp_path / "logs").mkdir()
    section = device_check.Section("slow", device_check.Context(args), timeout=1.0)
    pid_file = tmp_path / "child.pid"
    t0 = time.monotonic()
    rc = section.run(["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"])
    assert rc == 124 and time.monotonic() - t0 < 15
    assert "time box of the section reached" in section.tail()
    child = int(pid_file.read_text())
    for _ in range(50):                         # the backgrounded child went with its process group
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return True


def test_time_boxes_add_up_to_eight_minutes():
    install = int(re.search(r"^INSTALL_BUDGET_S=(\d+)$", SCRIPT.read_text(), re.M).group(1))
    assert install + sum(device for device, _ in device_check.BUDGETS.values()) == device_check.TOTAL_BUDGET_S == 480
    assert list(device_check.BUDGETS) == list(device_check.SECTIONS)


@pytest.mark.parametrize("args, message", [
    ([], "--out DIR is required"),
    (["--out", "x", "--bogus"], "unknown argument --bogus"),
    (["--out", "x", "--platform", "ipu"], "--platform must be gpu, tpu or cpu"),
])
def test_script_refuses_bad_arguments(args, message, tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr


def test_markdown_has_a_row_per_section_and_the_prompt_tables():
    e2e = {"prompts": 1, "prompts_equal": 0, "attention_backend": "pallas_gpu", "output_tokens_per_s": 900.0,
           "per_prompt": [{"prompt": "Once", "tokens": 32, "first_divergence": 17, "text": "a | b\nc"}]}
    sections = {name: {"status": "skipped", "seconds": 0, "budget_s": 1, "summary": {"reason": "why"}}
                for name in device_check.SECTIONS}
    sections["e2e_bfloat16"] = {"status": "ok", "seconds": 12.3, "budget_s": 35, "summary": e2e}
    report = dict(platform="gpu", interpret=False, quick=False, command="bash benchmarks/device_check.sh --out /tmp/dc",
                  date="2026-01-01", budget_s=480, wall_s=300.0, sections=sections,
                  install={"status": "ok", "seconds": 90, "budget_s": 150, "command": "pip install -e '.[cuda,test]'"})
    text = device_check.markdown(report)
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| section")]
    assert [r.split(" | ")[0][2:] for r in rows[:9]] == ["install", *device_check.SECTIONS]
    assert "| e2e_bfloat16 | ok | 12 (35) | 0/1 prompts equal the CPU tokens (32 each; first divergence per " \
           "prompt: 17); backend pallas_gpu, 900 tok/s |" in text
    assert "| Once | 32 | 17 | a / b c |" in text      # pipes and newlines cannot break the table
    assert "| install | ok | 90 (150) | `pip install -e '.[cuda,test]'` |" in text


@pytest.mark.slow
def test_cpu_rehearsal_end_to_end(tmp_path):
    """The whole check on this CPU (interpret mode, quick sizes): every section ok, the tokens equal."""
    venv = Path(sys.executable).parents[1]
    out = tmp_path / "dc"
    proc = subprocess.run(["bash", str(SCRIPT), "--platform", "cpu", "--interpret", "--quick", "--venv", str(venv),
                           "--skip-install", "--out", str(out)], capture_output=True, text=True, cwd=REPO, timeout=1500)
    report = json.loads((out / "device_check.json").read_text())
    statuses = {name: r["status"] for name, r in report["sections"].items()}
    assert proc.returncode == 0, (statuses, proc.stdout[-3000:], proc.stderr[-3000:])
    assert list(report["sections"]) == list(device_check.SECTIONS)
    assert set(statuses.values()) == {"ok"} and report["install"]["status"] == "skipped"
    assert report["wall_s"] < report["budget_s"]
    s = {name: r["summary"] for name, r in report["sections"].items()}

    assert s["env"]["platform"] == "cpu"
    for run in ("pallas", "reference"):
        assert s["kernel_tests"][run]["passed"] > 0 and s["kernel_tests"][run]["failed"] == 0
    assert s["kernel_bench"]["correct"] is True and s["kernel_bench"]["timings"]
    e2e = s["e2e_float32"]     # the CPU's float32 tokens are the reference's, token for token
    assert e2e["prompts"] == e2e["prompts_equal"] == len(device_check.PROMPTS) and e2e["same_engine_options"]
    assert all(p["tokens"] == device_check.QUICK_MAX_TOKENS and p["first_divergence"] is None
               for p in e2e["per_prompt"])
    assert s["e2e_bfloat16"]["prompts"] == len(device_check.PROMPTS)
    assert s["serve_bench"]["completed"] == 4 and s["serve_bench"]["failed"] == 0
    assert s["serve_bench"]["compiles_after_warmup"] == 0
    assert [x["step"] for x in s["roofline"]["steps"]] == ["decode", "decode", "prefill"]
    assert s["tuning_sweep"]["interpret"] is True and "64/float32" in s["tuning_sweep"]["keys"]
    for name in ("kernel_bench", "e2e_float32", "serve_bench", "roofline", "tuning_sweep"):
        assert (out / report["sections"][name]["log"]).is_file()

    md = (out / "device_check.md").read_text()
    for name in ["install", *device_check.SECTIONS]:
        assert f"| {name} | " in md
