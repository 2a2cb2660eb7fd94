"""Time until `jaxserve serve` (the default model) answers: cold (empty caches) and warm.

Starts real server processes and measures from spawn to the first 200 on /health, with
the engine's own phase times from its log ("start-up {...}"). Two settings, run one after
the other in this session: `--background-warmup-after 0` (every token bucket compiled
before serving, as before) and the default (buckets 1 and 16 first, the rest in
the background). Cold = a fresh cache directory (GGUF conversion + every XLA compile);
warm = the same directory again (converted model and XLA's persistent cache reused).

    python benchmarks/startup.py [--extra "--max-num-batched-tokens 512"]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench_client import free_port

ROOT = Path(__file__).resolve().parent.parent


def start(cache: Path, args: list[str]) -> dict:
    port = free_port()
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    log = tempfile.TemporaryFile(mode="w+")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port), *args],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"server exited {proc.returncode}:\n{log.read()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        ready = time.perf_counter() - t0
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Hello", "max_tokens": 4},
                       timeout=300)
        r.raise_for_status()
        first_request = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(120)
    log.seek(0)
    text = log.read()
    phases = {}
    for line in text.splitlines():
        if "start-up {" in line:
            phases = ast.literal_eval(line[line.index("start-up {") + len("start-up "):].strip())
    return {"ready_s": round(ready, 1), "first_request_done_s": round(first_request, 1), "phases": phases,
            "exit_code": proc.returncode}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extra", default="", help="more `jaxserve serve` flags, as one string")
    ap.add_argument("--result-file", default=None)
    args = ap.parse_args(argv)
    extra = shlex.split(args.extra)
    settings = {"all buckets first": ["--background-warmup-after", "0"], "background (default)": []}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in settings.items():
            cache = Path(tmp) / name.split()[0]
            for temperature in ("cold", "warm"):
                out = start(cache, [*flags, *extra])
                results[f"{name}, {temperature}"] = out
                print(f"{name:22s} {temperature}: ready {out['ready_s']:6.1f} s, first request done "
                      f"{out['first_request_done_s']:6.1f} s, phases {out['phases']}", flush=True)
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
