"""Async scheduling on and off, side by side in one engine (alternating runs of one workload).

The engine's `async_scheduling` switch is flipped between runs of the same `LLM.generate`, so
both modes share the process, the compiled steps and the machine's state of the moment. Each
run starts from an empty prefix cache. Prints each run's seconds and the medians' ratio.

    python benchmarks/async_scheduling.py --workload batch1 --dtype float32 [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from workloads import offline_random_prompts, shared_prefix_prompts

from jaxserve import LLM, SamplingParams

VOCAB = 49152
WORKLOADS = {   # the peer benchmark's workloads (benchmarks/peers_vllm.py)
    "random": dict(requests=64, output_len=128),
    "shared-prefix": dict(requests=32, output_len=64),
    "batch1": dict(requests=8, output_len=128),
}


def prompts_of(workload: str) -> list[list[int]]:
    if workload == "shared-prefix":
        return shared_prefix_prompts(32, 1024, (32, 64), VOCAB)
    return offline_random_prompts(64, VOCAB)[:WORKLOADS[workload]["requests"]]


def run(llm: LLM, prompts, params, one_at_a_time: bool) -> tuple[float, list]:
    for replica in llm.engine.replicas:
        replica.scheduler.reset_prefix_cache()
    t0 = time.perf_counter()
    if one_at_a_time:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=tuple(WORKLOADS), default="random")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    w = WORKLOADS[args.workload]
    prompts = prompts_of(args.workload)
    max_len = -(-(max(map(len, prompts)) + w["output_len"]) // 128) * 128
    llm = LLM(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=max_len, dtype=args.dtype)
    params = SamplingParams(max_tokens=w["output_len"], temperature=0.0, ignore_eos=True)
    llm.generate([[7] * 8], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    tokens = {}
    for r in range(args.rounds):
        for mode in ((False, True) if r % 2 == 0 else (True, False)):
            llm.engine.async_scheduling = mode
            s, toks = run(llm, prompts, params, args.workload == "batch1")
            seconds[mode].append(s)
            tokens.setdefault(mode, toks)
            print(f"round {r}: async scheduling {'on ' if mode else 'off'} {s:.2f} s", flush=True)
    on, off = statistics.median(seconds[True]), statistics.median(seconds[False])
    same = tokens[True] == tokens[False]
    print(f"{args.workload} {args.dtype}: off {off:.2f} s, on {on:.2f} s (medians of {args.rounds}), "
          f"on / off {on / off:.3f}, same tokens: {same}; compiles after warm-up "
          f"{llm.engine.stats()['compiles_after_warmup']}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
