"""Where the device time of the jitted step goes, from a `jax.profiler` trace.

Reads the Perfetto/Chrome trace that `jax.profiler.start_trace(dir, create_perfetto_trace=True)`
writes, keeps the XLA:CPU thunks that run directly under a step's outermost
`ThunkExecutor::Execute` (nested loop bodies are inside their loop's time), and sums their
time by kind:

  attention loops   `while` thunks and loop-body executes (XLA:CPU runs the bodies of the
                    pure-jnp ragged paged attention's loops over KV chunks as nested
                    `ThunkExecutor::Execute`s, often on the other thread than their `while`)
  matmul            XNNPACK fusions and dots (projections, MLP, lm head)
  KV cache write    scatters
  other             norms, RoPE, gathers, copies, sampling, ...

    python benchmarks/trace_summary.py TRACE_DIR
"""

from __future__ import annotations

import collections
import gzip
import json
import sys
from pathlib import Path

KINDS = (("attention loops", ("while", "ThunkExecutor::Execute")), ("matmul", ("ynn_fusion", "dot", "xnn_fusion", "onednn")),
         ("KV cache write", ("wrapped_scatter", "scatter")))


def kind_of(name: str) -> str:
    for kind, prefixes in KINDS:
        if name.startswith(prefixes):
            return kind
    return "other"


def summarize_trace(path: str | Path, by_name: dict[str, float] | None = None) -> dict[str, float]:
    """{kind: seconds} over every step in the trace (plus "steps wall" = the outermost executes' time).

    `by_name`, if given, is filled with the seconds of each top-level thunk name.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(path.rglob("perfetto_trace.json.gz"))
        if not files:
            raise FileNotFoundError(f"no perfetto_trace.json.gz under {path}")
        path = files[-1]
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith(("end: ", "$")):
            by_thread[(e["pid"], e["tid"])].append(e)
    seconds: dict[str, float] = collections.defaultdict(float)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list[tuple[float, str]] = []           # (end time, name) of the enclosing events
        for e in evs:
            start, end = e["ts"], e["ts"] + e.get("dur", 0)
            while stack and stack[-1][0] <= start:
                stack.pop()
            executes = sum(n == "ThunkExecutor::Execute" for _, n in stack)
            if e["name"] == "ThunkExecutor::Execute" and executes == 0:
                seconds["steps wall"] += e.get("dur", 0) / 1e6          # a step's outermost execute
            elif executes == 1 and stack[-1][1] == "ThunkExecutor::Execute":
                seconds[kind_of(e["name"])] += e.get("dur", 0) / 1e6    # a thunk directly under it
                if by_name is not None:
                    by_name[e["name"]] = by_name.get(e["name"], 0.0) + e.get("dur", 0) / 1e6
            stack.append((end, e["name"]))
    return dict(seconds)


def print_summary(seconds: dict[str, float]) -> None:
    ops = sum(v for k, v in seconds.items() if k != "steps wall")
    print("| kind | seconds | share of op time |")
    print("|---|---:|---:|")
    for kind in ("attention loops", "matmul", "KV cache write", "other"):
        v = seconds.get(kind, 0.0)
        print(f"| {kind} | {v:.2f} | {v / ops:.0%} |" if ops else f"| {kind} | 0 | - |")
    print(f"steps (outermost executes) {seconds.get('steps wall', 0.0):.2f} s, top-level ops {ops:.2f} s")


if __name__ == "__main__":
    names: dict[str, float] = {}
    print_summary(summarize_trace(sys.argv[1], names))
    print("top thunks:", ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in sorted(names.items(), key=lambda x: -x[1])[:12]))
