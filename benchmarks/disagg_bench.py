"""Chunked prefill vs disaggregated prefill/decode, at this machine's scale (vLLM's comparison).

Two setups on the same cores, one after the other, each behind `jaxserve router`:
  unified        two `jaxserve serve` instances, one core each (taskset), the router spreading
                 requests over both (no producer: every request runs whole on one instance)
  disaggregated  one producer (`--kv-role producer`) and one consumer (`--kv-role consumer`),
                 one core each: prompts prefill on the producer, the consumer pulls their KV
                 blocks over gRPC on loopback and decodes
The same seeded workload drives both through the router's streaming completions API:
Poisson arrivals of a mix of short prompts (chat turns) and long ones (documents). Reported
per setup and per prompt class: TTFT and ITL p50 / p99, throughput; for the disaggregated
setup also the KV bytes moved per request and the pull bandwidth (the consumer's
jaxserve:kv_transfer_* metrics).

    python benchmarks/disagg_bench.py                          # the default model, ~10 minutes
    python benchmarks/disagg_bench.py --num-requests 60 --request-rate 0.5 --result-file r.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench_client import free_port, launch, parse_metrics, stats_ms, stream_completion, summarize

SETUPS = ("unified", "disaggregated")


def workload(num: int, *, long_fraction: float, short_len: int, long_len: int, short_out: int, long_out: int,
             vocab_size: int, seed: int) -> list[tuple[str, list[int], int]]:
    """(class, prompt token ids, output tokens) per request, seeded; class is "short" or "long"."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        kind = "long" if rng.random() < long_fraction else "short"
        n = long_len if kind == "long" else short_len
        n = int(rng.integers(n // 2, n + 1))
        out.append((kind, rng.integers(100, vocab_size - 100, size=n).tolist(),
                    long_out if kind == "long" else short_out))
    return out


async def drive(url: str, model: str, requests, rate: float, seed: int) -> tuple[list, float]:
    rng = np.random.default_rng(seed + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as client:
        warm = await stream_completion(client, url, model, list(range(200, 216)), 2)
        if not warm.ok:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        tasks, t0 = [], time.perf_counter()
        for kind, prompt, out_len in requests:
            tasks.append(asyncio.create_task(stream_completion(client, url, model, prompt, out_len,
                                                               tags={"class": kind})))
            if rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def scrape(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)


def run_setup(setup: str, args, requests, workdir: Path) -> dict:
    print(f"{setup}:", flush=True)
    common = ["serve", *([args.model] if args.model else []), "--max-num-seqs", str(args.max_num_seqs),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--background-warmup-after", "0",
              *args.serve_arg]
    roles = [None, None] if setup == "unified" else ["producer", "consumer"]
    instances = []
    with contextlib.ExitStack() as stack:
        for i, (role, core) in enumerate(zip(roles, args.cores)):
            http, grpc_port = free_port(), free_port()
            extra = ["--kv-role", role] if role else []
            stack.enter_context(launch(common + ["--port", str(http), "--grpc-port", str(grpc_port), *extra],
                                       f"http://127.0.0.1:{http}", workdir / f"{setup}-{i}.log", args.timeout,
                                       prefix=[] if core is None else ["taskset", "-c", str(core)]))
            instances.append((role, f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc_port}"))
        router_port = free_port()
        flags = []
        for role, _, address in instances:
            flags += ["--prefill" if role == "producer" else "--decode", address]
        router = ["router", *([args.model] if args.model else []), "--port", str(router_port), *flags]
        url = f"http://127.0.0.1:{router_port}"
        stack.enter_context(launch(router, url, workdir / f"{setup}-router.log", args.timeout))
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        before = [scrape(u) for _, u, _ in instances]
        results, duration = asyncio.run(drive(url, model, requests, args.request_rate, args.seed))
        after = [scrape(u) for _, u, _ in instances]
        router_metrics = scrape(url)
    report = {"setup": setup, "all": summarize(results, duration)}
    for kind in ("short", "long"):
        ok = [r for r in results if r.ok and r.tags["class"] == kind]
        report[kind] = {"requests": len(ok), **stats_ms([r.ttft for r in ok], "ttft", (50, 99)),
                        **stats_ms([d for r in ok for d in r.itl], "itl", (50, 99))}
    report["router_paths"] = {k: v for k, v in router_metrics.items() if k.startswith("jaxserve:router_requests")}
    if setup == "disaggregated":
        consumer = {k: after[1].get(k, 0.0) - before[1].get(k, 0.0) for k in after[1]}
        moved = consumer.get("jaxserve:kv_transfer_bytes_total", 0.0)
        pulls = consumer.get("jaxserve:kv_transfer_seconds_count", 0.0)
        seconds = consumer.get("jaxserve:kv_transfer_seconds_sum", 0.0)
        report["kv"] = {"bytes_moved": moved, "pulls": pulls,
                        "bytes_per_request": moved / len(requests),
                        "pull_bandwidth_mb_s": moved / seconds / 1e6 if seconds else None,
                        "mean_pull_ms": 1000 * seconds / pulls if pulls else None}
    return report


def markdown(reports: list[dict]) -> str:
    rows = ["| setup | class | requests | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for r in reports:
        for kind in ("short", "long"):
            c = r[kind]
            rows.append(f"| {r['setup']} | {kind} | {c['requests']} | {c.get('median_ttft_ms', 0):.0f} | "
                        f"{c.get('p99_ttft_ms', 0):.0f} | {c.get('median_itl_ms', 0):.1f} | "
                        f"{c.get('p99_itl_ms', 0):.1f} |")
    for r in reports:
        a = r["all"]
        rows.append(f"\n{r['setup']}: {a['completed']} completed, {a['failed']} failed in {a['duration']:.1f} s, "
                    f"{a['output_throughput']:.1f} output tok/s")
        if "kv" in r:
            kv = r["kv"]
            bw = "n/a" if kv["pull_bandwidth_mb_s"] is None else f"{kv['pull_bandwidth_mb_s']:.0f} MB/s"
            rows.append(f"KV moved: {kv['bytes_moved'] / 1e6:.1f} MB in {kv['pulls']:.0f} pulls, "
                        f"{kv['bytes_per_request'] / 1e6:.2f} MB per request, pull bandwidth {bw}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: the default model)")
    ap.add_argument("--setups", default=",".join(SETUPS), help="comma list of " + ", ".join(SETUPS))
    ap.add_argument("--cores", default="0,1", help="the two cores the instances are pinned to ('none': no taskset)")
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--request-rate", type=float, default=1.0, help="Poisson arrivals per second")
    ap.add_argument("--long-fraction", type=float, default=0.25)
    ap.add_argument("--short-len", type=int, default=64)
    ap.add_argument("--long-len", type=int, default=1024)
    ap.add_argument("--short-output", type=int, default=64)
    ap.add_argument("--long-output", type=int, default=16)
    ap.add_argument("--vocab-size", type=int, default=49152)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--serve-arg", action="append", default=[], help="one more `jaxserve serve` argument (repeat)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds an instance may take to start")
    ap.add_argument("--result-file", default=None)
    args = ap.parse_args(argv)
    args.cores = [None, None] if args.cores == "none" else [int(c) for c in args.cores.split(",")]
    if args.cores[0] is not None and shutil.which("taskset") is None:
        ap.error("taskset is not installed (util-linux); pass --cores none to run unpinned")
    requests = workload(args.num_requests, long_fraction=args.long_fraction, short_len=args.short_len,
                        long_len=args.long_len, short_out=args.short_output, long_out=args.long_output,
                        vocab_size=args.vocab_size, seed=args.seed)
    reports = []
    with tempfile.TemporaryDirectory(prefix="disagg-bench-") as tmp:
        for setup in args.setups.split(","):
            if setup not in SETUPS:
                ap.error(f"unknown setup {setup!r}")
            reports.append(run_setup(setup, args, requests, Path(tmp)))
    print(markdown(reports))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()},
                                                      "reports": reports}, indent=2))
    return 0 if all(r["all"]["failed"] == 0 for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
