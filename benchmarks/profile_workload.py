"""Where the offline random workload's CPU goes: utilization of the cores, the engine thread's share,
and (with `--perf FILE`) a `perf record` of every thread over the workload for `perf report`.

An `LLM` on the default model is warmed on a few prompts first, so the profile holds steps only.

    python benchmarks/profile_workload.py --dtype bfloat16 [--perf /tmp/w.data]
    perf report -i /tmp/w.data --no-children --sort sym      # by function, every thread
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import offline_random_prompts  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--perf", default=None, help="write a perf record of every thread over the workload here")
    ap.add_argument("--perf-hz", type=int, default=1000)
    args = ap.parse_args(argv)

    from jaxserve import LLM, SamplingParams

    llm = LLM(max_num_batched_tokens=512, max_num_seqs=64, dtype=args.dtype)
    vocab = llm.engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": p} for p in offline_random_prompts(args.num_requests, vocab)]
    llm.generate(prompts[:8], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)

    perf = None
    if args.perf:
        if shutil.which("perf") is None:
            raise SystemExit("profile_workload: --perf needs `perf` on PATH")
        perf = subprocess.Popen(["perf", "record", "-F", str(args.perf_hz), "-p", str(os.getpid()), "-o", args.perf],
                                stderr=subprocess.DEVNULL)
        time.sleep(1.0)   # perf attaches
    cores = len(os.sched_getaffinity(0))
    before, thread0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time(), time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True), use_tqdm=False)
    wall, thread = time.perf_counter() - t0, time.thread_time() - thread0
    after = resource.getrusage(resource.RUSAGE_SELF)
    if perf is not None:
        perf.send_signal(signal.SIGINT)
        perf.wait()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"{args.num_requests} x {args.output_len} tokens, {args.dtype}: wall {wall:.2f} s, CPU {cpu:.2f} s on "
          f"{cores} cores ({cpu / (cores * wall):.0%} busy), the calling thread {thread:.2f} s")
    if perf is not None:
        if perf.returncode not in (0, -signal.SIGINT) or not Path(args.perf).is_file():
            raise SystemExit(f"profile_workload: perf record failed (exit {perf.returncode}); is perf allowed here "
                             "(kernel.perf_event_paranoid)?")
        print(f"perf data in {args.perf}: perf report -i {args.perf} --no-children --sort sym")
    return 0


if __name__ == "__main__":
    sys.exit(main())
