"""Load test of `jaxserve serve` on loopback: C concurrent streaming clients for a bounded time.

Starts the server as a subprocess (or targets --url), runs `--concurrency` clients that
each send streaming /v1/completions requests back to back until `--duration` seconds
have passed, then reports errors (must be 0), request count, output tokens/s and
percentiles of time to first token, inter-token latency and end-to-end latency. The
server is stopped with SIGTERM and must exit cleanly.

    python benchmarks/serve_load.py [--concurrency 128] [--duration 60] [-- server flags...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np

WORDS = "the a of to and in is it that for on with as was by at be this from or an have not are but".split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def client(url, deadline, rng, args, results, errors):
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as http:
        while time.monotonic() < deadline:
            prompt = " ".join(rng.choice(WORDS, size=int(rng.integers(args.min_prompt_words, args.max_prompt_words))))
            body = {"prompt": prompt, "max_tokens": args.max_tokens, "stream": True, "temperature": 0.7,
                    "ignore_eos": True}
            t0 = time.monotonic()
            times = []
            try:
                async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        errors.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                        continue
                    done = False
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            break
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            errors.append(str(chunk["error"]))
                            break
                        times.append(time.monotonic())
                    if not done:
                        errors.append("stream ended without [DONE]")
                        continue
            except httpx.HTTPError as e:
                errors.append(repr(e))
                continue
            results.append((t0, times))


def pct(values, q):
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


async def run_load(url, args):
    deadline = time.monotonic() + args.duration
    results, errors = [], []
    t0 = time.monotonic()
    await asyncio.gather(*(client(url, deadline, np.random.default_rng(i), args, results, errors)
                           for i in range(args.concurrency)))
    wall = time.monotonic() - t0
    ttft = [ts[0] - t for t, ts in results if ts]
    itl = [b - a for _, ts in results for a, b in zip(ts, ts[1:])]
    e2e = [ts[-1] - t for t, ts in results if ts]
    tokens = sum(len(ts) for _, ts in results)
    print(f"concurrency {args.concurrency}, {wall:.1f} s wall (load for {args.duration} s, then drain)")
    print(f"requests completed {len(results)}, errors {len(errors)}, output chunks {tokens}, "
          f"{tokens / wall:.1f} tok/s")
    print("| metric | p50 ms | p90 ms | p99 ms |")
    print("|---|---:|---:|---:|")
    for name, vals in (("time to first token", ttft), ("inter-token latency", itl), ("end-to-end", e2e)):
        print(f"| {name} | {pct(vals, 50):.0f} | {pct(vals, 90):.0f} | {pct(vals, 99):.0f} |")
    for e in errors[:5]:
        print("error:", e)
    return len(errors)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="target a running server instead of starting one")
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--min-prompt-words", type=int, default=16)
    ap.add_argument("--max-prompt-words", type=int, default=96)
    ap.add_argument("server_args", nargs="*", help="flags for `jaxserve serve` (after --)")
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        port = free_port()
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port), *args.server_args]
        print("starting:", " ".join(cmd[2:]))
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open("serve_load_server.log", "w"))
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode}; see serve_load_server.log")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        print(f"server ready after {time.monotonic() - t0:.1f} s")
    try:
        num_errors = asyncio.run(run_load(url, args))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=120)
            print(f"server exit code after SIGTERM: {rc}")
            os.remove("serve_load_server.log") if rc == 0 else None
    return 1 if num_errors else 0


if __name__ == "__main__":
    sys.exit(main())
