"""Host time of one scheduler step (schedule() + update_from_output()).

Decode: N running requests each decoding one token per step. Chunked prefill: one long
prompt sliced under the token budget. The runner is replaced by a prebuilt output, so
only the scheduler's own work is timed.

    python benchmarks/scheduler_overhead.py
"""

from __future__ import annotations

import argparse
import statistics
import time

from jaxserve.core import ModelRunnerOutput, Request, SamplingParams, Scheduler, SchedulerConfig


def fake_output(out):
    req_ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[7] for _ in req_ids])


def bench_decode(n: int, steps: int, prompt_len: int = 128) -> float:
    cfg = SchedulerConfig(max_model_len=4096, max_num_batched_tokens=max(n, 512), max_num_seqs=n,
                          block_size=16, num_blocks=n * 200 + 8)
    s = Scheduler(cfg)
    for i in range(n):
        s.add_request(Request(f"r{i}", [i % 100 + 1] * 3 + list(range(prompt_len - 3)),
                              SamplingParams(max_tokens=3000, ignore_eos=True)))
    while s.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running):
        out = s.schedule()
        s.update_from_output(out, fake_output(out))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = s.schedule()
        ro = fake_output(out)
        t1 = time.perf_counter()
        s.update_from_output(out, ro)
        t2 = time.perf_counter()
        assert len(out.num_scheduled_tokens) == n
        times.append((t1 - t0) + (t2 - t1))
    return statistics.median(times)


def bench_chunked(prompt_len: int, budget: int) -> tuple[float, float, int]:
    cfg = SchedulerConfig(max_model_len=prompt_len + 16, max_num_batched_tokens=budget, max_num_seqs=8,
                          block_size=16, num_blocks=prompt_len // 16 + 64)
    s = Scheduler(cfg)
    t_add = time.perf_counter()
    s.add_request(Request("long", list(range(prompt_len)), SamplingParams(max_tokens=1)))
    t_add = time.perf_counter() - t_add
    times = []
    while s.has_unfinished_requests():
        t0 = time.perf_counter()
        out = s.schedule()
        s.update_from_output(out, fake_output(out))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), sum(times) + t_add, len(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    print("decode: running requests -> median host ms per step (schedule + update)")
    print("| running decodes | ms / step | us / request |")
    print("|---:|---:|---:|")
    for n in (1, 64, 256, 1024):
        ms = bench_decode(n, args.steps) * 1e3
        print(f"| {n} | {ms:.3f} | {ms * 1e3 / n:.2f} |")
    print("\nchunked prefill: one prompt under a 512-token budget")
    print("| prompt tokens | steps | median ms / step | total ms (add + all steps) | us / prompt token |")
    print("|---:|---:|---:|---:|---:|")
    for length in (2048, 8192, 32768):
        med, total, steps = bench_chunked(length, 512)
        print(f"| {length} | {steps} | {med * 1e3:.3f} | {total * 1e3:.2f} | {total * 1e6 / length:.2f} |")


if __name__ == "__main__":
    main()
