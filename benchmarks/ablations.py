"""Ablations, each a ratio from one run: prefix caching on/off on `agent`, chunked prefill on/off
on `long-prompt-burst`.

Each ablation starts `jaxserve serve` (a subprocess, default model unless `--model-path`) once
per configuration, one at a time, runs the same serve_bench workload against it, stops it,
and prints both configurations side by side with their ratio. Configurations:

  prefix caching    on: --enable-prefix-caching (default)   off: --no-enable-prefix-caching
  chunked prefill   on: budget B (--burst-budget), the long prompt (8 x B) sliced into the
                    steps; off: --no-enable-chunked-prefill with the budget raised to fit the
                    long prompt and the streams' decodes in one step (otherwise it never runs).
                    Both leave a sequence slot free for the long prompt. B defaults to 24: on a
                    2-core CPU a step's time grows with its tokens, and 16 decodes + 8 prompt
                    tokens keep a step near 1.5x of the 16 decodes alone (a GPU would use 512+).

    python benchmarks/ablations.py [--only prefix-caching|chunked-prefill] [serve_bench flags...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
from pathlib import Path

import serve_bench
from bench_client import launch_server


def ablation_configs(args) -> dict[str, list[tuple[str, list[str]]]]:
    """{ablation: [(label, `jaxserve serve` flags), (label, flags)]} (the first is the feature on)."""
    model = [args.model_path] if args.model_path else []
    common = [*model, "--max-num-seqs", str(args.max_num_seqs)]
    agent = [*common, "--max-model-len", str(args.agent_max_model_len),
             "--max-num-batched-tokens", str(args.agent_budget), "--token-buckets", args.agent_buckets]
    b = args.burst_budget
    big = b * args.burst_factor + args.burst_streams
    # A free sequence slot for the long prompt; without chunking the budget must cover max_model_len.
    slots = max(args.max_num_seqs, args.burst_streams + 1)
    burst = [*model, "--max-num-seqs", str(slots), "--max-model-len", str(big)]
    return {
        "prefix-caching": [("on", agent), ("off", [*agent, "--no-enable-prefix-caching"])],
        "chunked-prefill": [
            ("on", [*burst, "--max-num-batched-tokens", str(b), "--token-buckets", f"{args.burst_streams},{b}"]),
            ("off", [*burst, "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(big),
                     "--token-buckets", f"{args.burst_streams},{b},{big}"]),
        ],
    }


def run_config(args, workload: str, server_args: list[str], log: Path) -> dict:
    with launch_server(server_args, log) as url:
        bench_args = argparse.Namespace(**vars(args))
        bench_args.base_url, bench_args.workload = url, workload
        out = asyncio.run(serve_bench.benchmark(bench_args))
    out["server_args"] = server_args
    serve_bench.print_result(out)
    return out


def prefix_caching_table(on: dict, off: dict) -> list[str]:
    rows = ["| prefix caching | seconds | prefill tokens computed | ideal | excess / request | hit rate "
            "| median TTFT turn 1 (ms) | median TTFT later turns (ms) | p99 TTFT later turns (ms) "
            "| output tok/s | compiles after warm-up |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, o in (("on", on), ("off", off)):
        rows.append(f"| {label} | {o['duration']:.1f} | {o['prefill_tokens_computed']:.0f} | "
                    f"{o['prefill_tokens_ideal']} | {o['prefill_excess_tokens_per_request']:.1f} | "
                    f"{o['server']['prefix_cache_hit_rate']:.3f} | {o['median_ttft_first_turn_ms']:.0f} | "
                    f"{o['median_ttft_later_turns_ms']:.0f} | {o['p99_ttft_later_turns_ms']:.0f} | "
                    f"{o['output_throughput']:.1f} | {o['server']['compiles_after_warmup']:.0f} |")
    rows.append(f"\nratios off / on: median TTFT of later turns "
                f"{off['median_ttft_later_turns_ms'] / on['median_ttft_later_turns_ms']:.2f}x, "
                f"prefill tokens computed {off['prefill_tokens_computed'] / on['prefill_tokens_computed']:.2f}x, "
                f"duration {off['duration'] / on['duration']:.2f}x")
    return rows


def chunked_prefill_table(on: dict, off: dict) -> list[str]:
    rows = ["| chunked prefill | budget | long prompt | steady ITL median / p99 (ms) "
            "| burst ITL median / p99 / max (ms) | burst p99 / steady p99 | burst p99 / steady median "
            "| long prompt TTFT (ms) | compiles after warm-up |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, o in (("on", on), ("off", off)):
        budget = o["server_args"][o["server_args"].index("--max-num-batched-tokens") + 1]
        rows.append(f"| {label} | {budget} | {o['burst']['long_prompt_len']} | "
                    f"{o['median_steady_itl_ms']:.0f} / {o['p99_steady_itl_ms']:.0f} | "
                    f"{o['median_burst_itl_ms']:.0f} / {o['p99_burst_itl_ms']:.0f} / {o['max_burst_itl_ms']:.0f} | "
                    f"{o['burst_p99_over_steady_p99']:.2f} | {o['burst_p99_over_steady_median']:.2f} | "
                    f"{o['long_prompt_ttft_ms']:.0f} | {o['server']['compiles_after_warmup']:.0f} |")
    rows.append(f"\nratio off / on of burst p99 ITL: {off['p99_burst_itl_ms'] / on['p99_burst_itl_ms']:.2f}x")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = serve_bench.build_parser(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    g = ap.add_argument_group("ablations")
    g.add_argument("--only", choices=("prefix-caching", "chunked-prefill"), default=None)
    g.add_argument("--model-path", default=None, help="model for `jaxserve serve` (default: the default model)")
    g.add_argument("--max-num-seqs", type=int, default=16)
    g.add_argument("--agent-budget", type=int, default=256)
    g.add_argument("--agent-buckets", default="8,32,64,256")
    g.add_argument("--agent-max-model-len", type=int, default=2048)
    g.add_argument("--burst-budget", type=int, default=24, help="token budget B of the chunked server")
    g.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    args = ap.parse_args(argv)
    args.token_budget = args.burst_budget      # the long prompt is burst_factor x B in both configurations
    logging.getLogger("httpx").setLevel(logging.WARNING)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="jaxserve-ablations-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    workloads = {"prefix-caching": "agent", "chunked-prefill": "long-prompt-burst"}
    tables = {"prefix-caching": prefix_caching_table, "chunked-prefill": chunked_prefill_table}
    results, report = {}, []
    for name, configs in ablation_configs(args).items():
        if args.only not in (None, name):
            continue
        outs = {label: run_config(args, workloads[name], flags, log_dir / f"{name}-{label}.log")
                for label, flags in configs}
        results[name] = outs
        try:
            report += [f"\n## {name} on {workloads[name]}", *tables[name](outs["on"], outs["off"])]
        except KeyError as e:   # a run that failed has no such number; its JSON says why
            report += [f"\n## {name}: no table, a run is missing {e} (see the JSON results)"]
    print("\n".join(report))
    path = args.result_file or "ablations.json"
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"results written to {path}; server logs in {log_dir}")
    failed = sum(o["failed"] for outs in results.values() for o in outs.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
