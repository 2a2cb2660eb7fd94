"""One-shot device check: the kernels, the default model's tokens, serving, the roofline and a tuning sweep.

Entry point: `bash benchmarks/device_check.sh --out DIR` (it makes the venv and installs the
project with its accelerator extra, then runs `device_check.py run`). What flows through:
`run` uses the standard library only (so it reports even when the install failed) and runs
each section below as a subprocess of the venv's python, in its own process group, killed
when the section's time box ends; output goes to OUT/logs/SECTION.log. Each section's
status, numbers and seconds go to OUT/device_check.json (rewritten after every section) and
a summary to OUT/device_check.md, ready for benchmarks/RESULTS.md. A failing section is
recorded and the next one runs; the exit code is 1 when any section failed.

Sections and their time boxes in seconds (one H200 / a CPU rehearsal with --quick). With
the install's 150 s (device_check.sh) the device boxes add up to 480 s, so two runs fit in
a 15-minute device window, the second with --skip-install:

  env            15 /  60  device kind, count and memory; jax versions; the platform asked for
  kernel_tests   70 / 240  tests/kernels/test_pallas_{gpu,tpu}.py compiled for the device
                           (--pallas-on-device), and the reference's own tests at "highest"
                           matmul precision; on a CPU (--interpret) the GPU kernel interpreted
  kernel_bench   35 / 120  benchmarks/kernel_bench.py (GPU only): kernel vs reference, times
  e2e_float32    40 / 180  the default model, greedy, 4 prompts x 32 tokens, float32 at "highest"
                           precision: must equal the CPU tokens in device_check_reference.json
  e2e_bfloat16   35 / 180  the same in bfloat16: agreement per prompt reported (first divergence)
  serve_bench    60 / 240  `jaxserve serve` (default model) and `jaxserve bench serve`
  roofline       35 / 180  benchmarks/roofline.py on a few decode and prefill steps
  tuning_sweep   40 / 120  python -m kernels_pallas.tuning --sweep --quick -> OUT/tuning_sweep.json

--quick shrinks every size (2-core CPU rehearsal: tests/benchmarks/test_device_check.py).

Other commands (each runs under the venv's python):
  python benchmarks/device_check.py env
  python benchmarks/device_check.py greedy --dtype float32 --out FILE [--num-prompts N --max-tokens M]
  python benchmarks/device_check.py serve --out DIR [--quick] [--dtype bfloat16]
The reference tokens were made on a CPU by the command recorded in device_check_reference.json:
  JAX_PLATFORMS=cpu python benchmarks/device_check.py greedy --dtype float32 \\
      --out benchmarks/device_check_reference.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REFERENCE = Path(__file__).with_name("device_check_reference.json")
TOTAL_BUDGET_S = 480             # install + every section, on one H200
REPORT_RESERVE_S = 5             # kept back from the last section for writing the report
# section -> (time box on a GPU / TPU, time box in a --quick CPU rehearsal), seconds
BUDGETS = {
    "env": (15, 60),
    "kernel_tests": (70, 240),
    "kernel_bench": (35, 120),
    "e2e_float32": (40, 180),
    "e2e_bfloat16": (35, 180),
    "serve_bench": (60, 240),
    "roofline": (35, 180),
    "tuning_sweep": (40, 120),
}
QUICK_TOTAL_BUDGET_S = sum(quick for _, quick in BUDGETS.values()) + 60

# The end-to-end check: fixed prompts, greedy, the same engine options on every machine.
PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
]
MAX_TOKENS = 32
QUICK_MAX_TOKENS = 8
E2E_ENGINE = dict(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=128, num_kv_blocks=64,
                  token_buckets=(4, 64))
# JAX's platform names per --platform (cpu listed second: some code may ask for host devices).
JAX_PLATFORMS = {"gpu": "cuda,cpu", "tpu": "tpu,cpu", "cpu": "cpu"}
# Every section compiles into the engine's persistent XLA cache (jaxserve/engine/builder.py), so
# a second run, and the server after the e2e runs, compile less. A cache the caller set is kept.
XLA_CACHE = {"JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(
                 Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxserve" / "xla"),
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": os.environ.get(
                 "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")}


# ---- sections: each returns (status, summary dict) ------------------------------------------------


class Section:
    """Runs one section's commands under its time box, logging to OUT/logs/NAME.log."""

    def __init__(self, name: str, ctx: "Context", timeout: float):
        self.name, self.ctx = name, ctx
        self.deadline = time.monotonic() + timeout
        self.log = ctx.out / "logs" / f"{name}.log"
        self.log.write_text("")
        self.commands: list[str] = []

    def run(self, cmd: list[str], env: dict | None = None) -> int:
        """Run cmd to completion or to the time box (its process group killed: returns 124)."""
        full_env = {**os.environ, "JAX_PLATFORMS": JAX_PLATFORMS[self.ctx.platform], **XLA_CACHE, **(env or {})}
        self.commands.append(" ".join([*(f"{k}={v}" for k, v in (env or {}).items()), *map(shlex.quote, cmd)]))
        with open(self.log, "a") as log:
            log.write(f"$ {self.commands[-1]}\n")
            log.flush()
            proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                return proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                log.write(f"\n[device_check] time box of the section reached: killed\n")
                return 124

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


class Context:
    def __init__(self, args):
        self.out = Path(args.out).resolve()
        self.platform, self.interpret, self.quick = args.platform, args.interpret, args.quick
        self.python = args.python
        self.this = [self.python, str(Path(__file__).resolve())]

    @property
    def on_device(self) -> bool:
        return self.platform in ("gpu", "tpu")


def _status(rc: int) -> str:
    return "ok" if rc == 0 else "timeout" if rc == 124 else "failed"


def dumps(data) -> str:
    """JSON with one line per list of numbers (token ids stay readable)."""
    text = json.dumps(data, indent=1)
    return re.sub(r"\[\s+([-\d.e, \n]+?)\s+\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]",
                  text) + "\n"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def section_env(s: Section):
    path = s.ctx.out / "env.json"
    rc = s.run([*s.ctx.this, "env", "--out", str(path)])
    info = _read_json(path) or {}
    if rc == 0 and info.get("platform") != s.ctx.platform:
        return "failed", {**info, "error": f"asked for {s.ctx.platform!r}, JAX runs on {info.get('platform')!r}"}
    return _status(rc), info


def _pytest_counts(section: Section, start: int) -> dict:
    """passed / failed / error / skipped counts from `pytest -v` lines logged after byte `start`."""
    text = section.log.read_text(errors="replace")[start:]
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for line in text.splitlines():
        for word in ("PASSED", "FAILED", "ERROR", "SKIPPED"):
            if f" {word}" in line and "::" in line:
                counts[word.lower()] += 1
                break
    return counts


def section_kernel_tests(s: Section):
    py = [s.ctx.python, "-m", "pytest", "-v", "-m", "slow or not slow"]
    if s.ctx.on_device and not s.ctx.interpret:
        kernel = [f"tests/kernels/test_pallas_{s.ctx.platform}.py", "--pallas-on-device"]
    else:   # interpret mode: the GPU kernel's interpreter is the fast one
        kernel = ["tests/kernels/test_pallas_gpu.py"] + (["-k", "base or bf16"] if s.ctx.quick else [])
    runs = {}
    for name, cmd, env in (
            ("pallas", py + kernel, None),
            ("reference", py + ["tests/kernels/test_ragged_paged_attention.py"]
             + (["-k", "default or by_hand"] if s.ctx.quick else []),
             {"JAX_DEFAULT_MATMUL_PRECISION": "highest"})):
        start = len(s.log.read_text(errors="replace"))
        rc = s.run(cmd, env)
        runs[name] = dict(rc=rc, **_pytest_counts(s, start))
        if rc == 124:
            break
    rcs = [r["rc"] for r in runs.values()]
    status = "timeout" if 124 in rcs else "ok" if len(rcs) == 2 and not any(rcs) else "failed"
    return status, dict(mode="interpret" if not (s.ctx.on_device and not s.ctx.interpret) else "device", **runs)


def section_kernel_bench(s: Section):
    if s.ctx.platform == "tpu":
        return "skipped", {"reason": "kernel_bench.py times the GPU kernel; the TPU kernel's times are in tuning_sweep"}
    if s.ctx.platform == "cpu" and not s.ctx.interpret:
        return "skipped", {"reason": "no GPU: pass --interpret to rehearse it"}
    path = s.ctx.out / "kernel_bench.json"
    cmd = [s.ctx.python, "benchmarks/kernel_bench.py", "--out", str(path)]
    if s.ctx.interpret:
        cmd += ["--interpret", "--small"]
    elif s.ctx.quick:
        cmd += ["--reps", "5", "--copy-gib", "0.5"]
    rc = s.run(cmd)
    data = _read_json(path) or {}
    summary = dict(device=data.get("device"), copy_bandwidth_gbps=data.get("copy_bandwidth_gbps"),
                   correct=all(r.get("ok") for r in data.get("correctness", [])) if data else None,
                   correctness=data.get("correctness", []),
                   timings=[{k: r[k] for k in ("case", "impl", "ms", "kv_gbps", "of_copy_bw")}
                            for r in data.get("timings", [])])
    return _status(rc), summary


def section_e2e(s: Section, dtype: str):
    path = s.ctx.out / f"e2e_{dtype}.json"
    max_tokens = QUICK_MAX_TOKENS if s.ctx.quick else MAX_TOKENS
    # float32 on a GPU / TPU rounds matmul inputs (TF32 / bf16 passes) unless asked not to.
    env = {"JAX_DEFAULT_MATMUL_PRECISION": "highest"} if dtype == "float32" else None
    rc = s.run([*s.ctx.this, "greedy", "--dtype", dtype, "--max-tokens", str(max_tokens), "--out", str(path)], env)
    got, ref = _read_json(path), _read_json(REFERENCE)
    if rc != 0 or got is None:
        return _status(rc or 1), {"error": "no tokens"}
    summary = {k: got.get(k) for k in ("device_kind", "attention_backend", "matmul_precision", "build_s",
                                       "generate_s", "output_tokens_per_s")}
    summary.update(compare_tokens(got, ref))
    if "error" in summary:
        return "failed", summary
    if dtype == "float32" and summary["prompts_equal"] != summary["prompts"]:
        return "mismatch", summary      # float32 at "highest" precision must give the CPU's tokens
    return "ok", summary


def compare_tokens(got: dict, ref: dict | None) -> dict:
    """Per prompt: tokens equal to the reference's, and the index of the first that is not (None: all equal)."""
    if ref is None:
        return {"error": f"no reference tokens at {REFERENCE}"}
    per_prompt = []
    for prompt, tokens in zip(got["prompts"], got["token_ids"]):
        want = ref["token_ids"][ref["prompts"].index(prompt)][:len(tokens)]
        first = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), None)
        per_prompt.append(dict(prompt=prompt, tokens=len(tokens), first_divergence=first,
                               text=got["texts"][got["prompts"].index(prompt)]))
    return dict(prompts=len(per_prompt), prompts_equal=sum(p["first_divergence"] is None for p in per_prompt),
                per_prompt=per_prompt, reference_command=ref.get("command"),
                same_engine_options=got.get("engine_options") == ref.get("engine_options"))


def section_serve_bench(s: Section):
    path = s.ctx.out / "serve_bench.json"
    dtype = "float32" if s.ctx.platform == "cpu" else "bfloat16"
    rc = s.run([*s.ctx.this, "serve", "--out", str(s.ctx.out), "--dtype", dtype] + (["--quick"] if s.ctx.quick else []))
    data = _read_json(path) or {}
    keys = ("completed", "failed", "duration", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
            "median_itl_ms", "server_ready_s", "dtype", "server_args")
    summary = {k: data.get(k) for k in keys}
    summary["compiles_after_warmup"] = data.get("server", {}).get("compiles_after_warmup")
    return _status(rc), summary


def section_roofline(s: Section):
    path = s.ctx.out / "roofline.json"
    if s.ctx.quick:
        sizes = ["--decode", "1,4", "--contexts", "64", "--prefill", "32", "--reps", "1"]
    else:
        sizes = ["--decode", "1,32", "--contexts", "1024", "--prefill", "256", "--reps", "3"]
    dtype = "float32" if s.ctx.platform == "cpu" else "bfloat16"
    rc = s.run([s.ctx.python, "benchmarks/roofline.py", *sizes, "--dtype", dtype, "--no-trace",
                "--result-file", str(path)])
    data = _read_json(path) or {}
    steps = [dict(step=r["step"], seqs=r["seqs"], tokens=r["tokens"], context=r["context"], ms=r["seconds"] * 1e3,
                  floor_ms=max(r["memory"], r["compute"]) * 1e3) for r in data.get("steps", [])]
    return _status(rc), dict(dtype=dtype, read_gbps=data.get("bandwidth", {}).get("read_GBps"),
                             matmul_gflops=data.get("matmul", {}).get("GFLOPs"), steps=steps,
                             compiles_after_warmup=data.get("compiles_after_warmup"))


def section_tuning_sweep(s: Section):
    if s.ctx.platform == "cpu" and not s.ctx.interpret:
        return "skipped", {"reason": "no GPU or TPU: pass --interpret to rehearse it"}
    path = s.ctx.out / "tuning_sweep.json"
    cmd = [s.ctx.python, "-m", "kernels_pallas.tuning", "--sweep", "--quick", "--out", str(path)]
    rc = s.run(cmd + (["--interpret"] if s.ctx.interpret else []))
    data = _read_json(path) or {}
    sweep = data.get("sweep", {})
    keys = {key: dict(chosen=r["chosen_candidate"], chosen_ms=r["chosen_total_ms"], default_ms=r["default_total_ms"],
                      candidates=len(r["results"]))
            for key, r in sweep.get("results", {}).items()}
    return _status(rc), dict(backend=sweep.get("backend"), device_kind=sweep.get("device_kind"),
                             interpret=sweep.get("interpret"), table=data.get("tables"), keys=keys)


SECTIONS = {
    "env": section_env,
    "kernel_tests": section_kernel_tests,
    "kernel_bench": section_kernel_bench,
    "e2e_float32": lambda s: section_e2e(s, "float32"),
    "e2e_bfloat16": lambda s: section_e2e(s, "bfloat16"),
    "serve_bench": section_serve_bench,
    "roofline": section_roofline,
    "tuning_sweep": section_tuning_sweep,
}
assert list(SECTIONS) == list(BUDGETS)


# ---- the report -------------------------------------------------------------------------------------


def _fmt(x, spec=".3g") -> str:
    return "-" if x is None else format(x, spec) if isinstance(x, (int, float)) else str(x)


def section_line(name: str, r: dict) -> str:
    """One short human line of a section's numbers, for the Markdown table."""
    m = r.get("summary", {})
    if name == "install":
        return f"`{r.get('command', '')}`"
    if r["status"] == "skipped" or "error" in m and len(m) <= 2:
        return m.get("reason") or m.get("error") or ""
    if name == "env":
        mem = m.get("memory_bytes")
        return (f"{m.get('device_kind')} x{m.get('device_count')} ({m.get('platform')}"
                + (f", {mem / 2**30:.0f} GiB" if mem else "") + f"); jax {m.get('jax')}, flax "
                + f"{m.get('packages', {}).get('flax')}; model {m.get('default_model')}")
    if name == "kernel_tests":
        return "; ".join(f"{k} ({m.get('mode') if k == 'pallas' else 'highest precision'}): "
                         f"{v['passed']} passed, {v['failed']} failed, {v['error']} errors"
                         for k, v in m.items() if isinstance(v, dict))
    if name == "kernel_bench":
        times = "; ".join(f"{t['case']} {t['impl'].split(' (')[0]} {t['ms']:.3g} ms ({t['of_copy_bw']:.0%})"
                          for t in m.get("timings", []))
        return (f"matches the reference: {m.get('correct')}; copy bandwidth "
                f"{_fmt(m.get('copy_bandwidth_gbps'), '.0f')} GB/s; median ms (of copy bandwidth): {times}")
    if name.startswith("e2e_"):
        firsts = [p["first_divergence"] for p in m.get("per_prompt", [])]
        return (f"{m.get('prompts_equal')}/{m.get('prompts')} prompts equal the CPU tokens "
                f"({m['per_prompt'][0]['tokens'] if firsts else 0} each; first divergence per prompt: "
                f"{', '.join(_fmt(f) for f in firsts)}); backend {m.get('attention_backend')}, "
                f"{_fmt(m.get('output_tokens_per_s'), '.0f')} tok/s")
    if name == "serve_bench":
        return (f"{m.get('completed')} done, {m.get('failed')} failed; {_fmt(m.get('output_throughput'), '.0f')} "
                f"output tok/s; TTFT median {_fmt(m.get('median_ttft_ms'), '.0f')} ms; TPOT median "
                f"{_fmt(m.get('median_tpot_ms'), '.1f')} ms; ready after {_fmt(m.get('server_ready_s'), '.0f')} s; "
                f"{_fmt(m.get('compiles_after_warmup'))} compiles after warm-up")
    if name == "roofline":
        steps = ", ".join(f"{x['step']} {x['seqs']}x{x['tokens'] // x['seqs']}@{x['context']} {x['ms']:.3g} ms "
                          f"(floor {x['floor_ms']:.2g})" for x in m.get("steps", []))
        return (f"read {_fmt(m.get('read_gbps'), '.0f')} GB/s, f32 matmul {_fmt(m.get('matmul_gflops'), '.0f')} "
                f"GFLOP/s; {steps}")
    if name == "tuning_sweep":
        return "; ".join(f"{k}: {v['chosen']} {v['chosen_ms']:.3g} ms (default {v['default_ms']:.3g} ms)"
                         for k, v in m.get("keys", {}).items())
    return ""


def markdown(report: dict) -> str:
    env = report["sections"].get("env", {}).get("summary", {})
    lines = [f"Device check: {env.get('device_kind', '?')} ({report['platform']}"
             + (", interpret mode" if report["interpret"] else "") + (", quick sizes" if report["quick"] else "")
             + f"), {report['date']}, jax {env.get('jax', '?')}.",
             f"`{report['command']}`: {report['wall_s']:.0f} s of the {report['budget_s']} s box.", "",
             "| section | status | seconds (box) | result |", "|---|---|---:|---|"]
    for name, r in [("install", report["install"]), *report["sections"].items()]:
        lines.append(f"| {name} | {r['status']} | {_fmt(r.get('seconds'), '.0f')} ({_fmt(r.get('budget_s'))}) | "
                     f"{section_line(name, r)} |")
    for dtype in ("float32", "bfloat16"):
        per = report["sections"].get(f"e2e_{dtype}", {}).get("summary", {}).get("per_prompt", [])
        if per:
            lines += ["", f"Greedy tokens in {dtype} against the CPU float32 reference:", "",
                      "| prompt | tokens | first divergence | text |", "|---|---:|---:|---|"]
            lines += [f"| {p['prompt']} | {p['tokens']} | {_fmt(p['first_divergence'])} | "
                      f"{p['text'].replace('|', '/').replace(chr(10), ' ')[:80]} |" for p in per]
    return "\n".join(lines) + "\n"


def _only(text: str | None) -> set[str] | None:
    """The sections --only names (comma-separated), or None for every one."""
    if not text:
        return None
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = sorted(names - set(SECTIONS))
    if unknown or not names:
        raise SystemExit(f"device_check: --only takes sections among {', '.join(SECTIONS)}, got {text!r}")
    return names


def run(args) -> int:
    _only(args.only)      # a bad name stops here, before any section runs
    ctx = Context(args)
    (ctx.out / "logs").mkdir(parents=True, exist_ok=True)
    started = args.started or time.time()
    total = QUICK_TOTAL_BUDGET_S if args.quick else TOTAL_BUDGET_S
    deadline = time.monotonic() + total - (time.time() - started)
    install = _read_json(Path(args.install_json)) if args.install_json else None
    report = dict(platform=args.platform, interpret=args.interpret, quick=args.quick, command=args.command,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), budget_s=total,
                  wall_s=0.0, install=install or dict(status="skipped", seconds=0, budget_s=0), sections={})
    only = _only(args.only)
    for name, fn in SECTIONS.items():
        budget = BUDGETS[name][1 if args.quick else 0]
        timeout = min(budget, deadline - time.monotonic() - REPORT_RESERVE_S)
        t0 = time.monotonic()
        if only is not None and name not in only:
            status, summary = "skipped", {"reason": f"not asked for (--only {args.only})"}
        elif timeout < 5:
            status, summary = "skipped", {"reason": f"no time left in the {total} s box"}
        else:
            section = Section(name, ctx, timeout)
            print(f"[device_check] {name} (box {timeout:.0f} s) ...", flush=True)
            try:
                status, summary = fn(section)
            except Exception as e:  # noqa: BLE001 - a broken section is a result; the next one runs
                status, summary = "error", {"error": f"{type(e).__name__}: {e}"}
        result = dict(status=status, seconds=round(time.monotonic() - t0, 1), budget_s=budget, summary=summary)
        if status not in ("skipped",):
            result.update(log=f"logs/{name}.log", commands=section.commands)
            if status != "ok":
                result["log_tail"] = section.tail()
        report["sections"][name] = result
        report["wall_s"] = round(time.time() - started, 1)
        print(f"[device_check] {name}: {status} in {result['seconds']:.0f} s  {section_line(name, result)}",
              flush=True)
        (ctx.out / "device_check.json").write_text(json.dumps(report, indent=1) + "\n")
    (ctx.out / "device_check.md").write_text(markdown(report))
    print(f"[device_check] wrote {ctx.out / 'device_check.json'} and device_check.md "
          f"({report['wall_s']:.0f} s of {total} s)")
    bad = [n for n, r in [("install", report["install"]), *report["sections"].items()]
           if r["status"] not in ("ok", "skipped")]
    if bad:
        print(f"[device_check] not ok: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


# ---- commands the sections run under the venv's python ----------------------------------------------


# Versions the env section records: JAX's, and the packages a machine without a package index
# takes from its image or from the bundle (benchmarks/device_bundle.py).
PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "libtpu", "flax", "orbax-checkpoint", "numpy",
            "ml_dtypes", "tokenizers", "safetensors", "gguf", "fastapi", "pydantic", "uvicorn", "grpcio", "protobuf",
            "llguidance", "msgspec", "pytest", "hypothesis")


def _versions(names) -> dict:
    import importlib.metadata
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def env_info(args) -> int:
    import jax
    import jaxlib

    devices = jax.devices()
    stats = devices[0].memory_stats() or {}
    info = dict(platform=devices[0].platform, device_kind=devices[0].device_kind, device_count=len(devices),
                memory_bytes=stats.get("bytes_limit"), jax=jax.__version__, jaxlib=jaxlib.__version__,
                python=sys.version.split()[0], python_path=sys.executable, cpu_count=os.cpu_count(),
                packages=_versions(PACKAGES))
    try:    # where the default model comes from (a bundle's site folder under --offline)
        from checkpoints.default_model import default_model_path
        info["default_model"] = str(default_model_path())
    except Exception as e:  # noqa: BLE001 - recorded, not fatal: the sections that need it say so
        info["default_model"] = f"missing: {e}"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = smi.stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        pass
    Path(args.out).write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info))
    return 0


def greedy(args) -> int:
    """The default model, greedy, the fixed prompts: token ids and texts as JSON (the reference's format)."""
    import jax

    from jaxserve import LLM, SamplingParams

    prompts = PROMPTS[:args.num_prompts]
    t0 = time.perf_counter()
    llm = LLM(None, dtype=args.dtype, **E2E_ENGINE)
    build = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    env = " ".join(f"{k}={os.environ[k]}" for k in ("JAX_PLATFORMS", "JAX_DEFAULT_MATMUL_PRECISION")
                   if k in os.environ)
    out = dict(command=f"{env} python benchmarks/device_check.py " + " ".join(map(shlex.quote, sys.argv[1:])),
               dtype=args.dtype, platform=jax.devices()[0].platform, device_kind=jax.devices()[0].device_kind,
               jax_version=jax.__version__, matmul_precision=jax.config.jax_default_matmul_precision,
               attention_backend=getattr(llm.engine.runner.config, "attention_backend", None),
               engine_options={k: list(v) if isinstance(v, tuple) else v for k, v in E2E_ENGINE.items()},
               max_tokens=args.max_tokens, prompts=prompts,
               token_ids=[list(o.outputs[0].token_ids) for o in outs], texts=[o.outputs[0].text for o in outs],
               build_s=round(build, 2), generate_s=round(seconds, 3),
               output_tokens_per_s=round(sum(len(o.outputs[0].token_ids) for o in outs) / seconds, 1))
    Path(args.out).write_text(dumps(out))
    for p, text in zip(prompts, out["texts"]):
        print(f"{p!r} -> {text!r}")
    return 0


def serve(args) -> int:
    """`jaxserve serve` with the default model on a free port, then `jaxserve bench serve` against it."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_client import launch_server

    out = Path(args.out)
    if args.quick:
        server = ["--max-num-batched-tokens", "64", "--max-num-seqs", "8", "--token-buckets", "16,64",
                  "--num-kv-blocks", "256", "--max-model-len", "256"]
        bench = ["--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "8"]
    else:
        server = ["--max-num-batched-tokens", "512", "--max-num-seqs", "64", "--token-buckets", "64,512",
                  "--num-kv-blocks", "8192", "--max-model-len", "1024"]
        bench = ["--num-prompts", "32", "--random-input-len", "128", "--random-output-len", "64"]
    server = ["--dtype", args.dtype, *server]
    result = out / "serve_bench.json"
    t0 = time.monotonic()
    with launch_server(server, out / "logs" / "serve_bench.server.log", timeout=3600) as url:
        ready = time.monotonic() - t0
        rc = subprocess.call([sys.executable, "-m", "jaxserve.cli", "bench", "serve", "--base-url", url,
                              "--result-file", str(result), *bench])
    data = _read_json(result) or {}
    data.update(server_ready_s=round(ready, 1), dtype=args.dtype, server_args=" ".join(server),
                bench_args=" ".join(bench))
    result.write_text(json.dumps(data, indent=1) + "\n")
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command_name", required=True)
    r = sub.add_parser("run", help="every section, with the report (device_check.sh calls this)")
    r.add_argument("--out", required=True)
    r.add_argument("--platform", choices=tuple(JAX_PLATFORMS), required=True)
    r.add_argument("--interpret", action="store_true", help="Pallas kernels in interpret mode (CPU rehearsal)")
    r.add_argument("--quick", action="store_true", help="small sizes everywhere (the CPU rehearsal's test)")
    r.add_argument("--python", default=sys.executable, help="the venv's python, which runs the sections")
    r.add_argument("--install-json", default=None, help="the install step's record (device_check.sh writes it)")
    r.add_argument("--started", type=float, default=None, help="epoch seconds the whole check started")
    r.add_argument("--command", default="python benchmarks/device_check.py run", help="for the report")
    r.add_argument("--only", default=None, help="comma-separated sections to run (the others are skipped)")
    e = sub.add_parser("env", help="device and versions as JSON")
    e.add_argument("--out", required=True)
    g = sub.add_parser("greedy", help="the default model's greedy tokens for the fixed prompts")
    g.add_argument("--dtype", default="float32")
    g.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    g.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    g.add_argument("--out", required=True)
    v = sub.add_parser("serve", help="a server with the default model and `jaxserve bench serve` against it")
    v.add_argument("--out", required=True, help="folder for serve_bench.json and the server's log")
    v.add_argument("--dtype", default="bfloat16")
    v.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    return {"run": run, "env": env_info, "greedy": greedy, "serve": serve}[args.command_name](args)


if __name__ == "__main__":
    sys.exit(main())
