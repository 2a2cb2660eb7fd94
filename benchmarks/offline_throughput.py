"""Offline throughput of `LLM.generate` on the default model, side by side with transformers'
batched `generate` on the same prompts (same process, same machine, one run).

Workloads (greedy, EOS ignored so every request produces exactly its output tokens):
  random         64 requests, prompts of 64-256 tokens, 128 output tokens (JAX_NOTES' reference)
  shared-prefix  32 requests sharing a 1,024-token prefix plus 32-64 tokens of their own, 64
                 output tokens; transformers recomputes the prefix for every request, jaxserve's
                 prefix cache computes it once

`--breakdown` splits the engine's step time into scheduler, input preparation, dispatch,
device wait (+ sampled tokens back), and the rest (detokenize, outputs).

    python benchmarks/offline_throughput.py [--workload random|shared-prefix] [--no-transformers]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import time

from workloads import offline_random_prompts, shared_prefix_prompts

from jaxserve import LLM, SamplingParams

VOCAB = 49152
WORKLOADS = {
    "random": dict(num_requests=64, output_len=128),
    "shared-prefix": dict(num_requests=32, output_len=64, prefix_len=1024, suffix_range=(32, 64)),
}


def make_prompts(args) -> list[list[int]]:
    if args.workload == "random":
        return offline_random_prompts(args.num_requests, VOCAB)
    w = WORKLOADS["shared-prefix"]
    return shared_prefix_prompts(args.num_requests, w["prefix_len"], w["suffix_range"], VOCAB)


class StepBreakdown:
    """Wall time per phase of the engine step, by wrapping the scheduler's and runner's methods."""

    PHASES = {"scheduler": ("schedule", "update_from_output"), "prepare_inputs": ("_prepare",),
              "dispatch": ("launch",), "device_wait": ("collect",), "execute": ("execute",)}

    def __init__(self, engine) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.steps = 0
        for obj in (engine.scheduler, engine.runner):
            for phase, names in self.PHASES.items():
                for name in names:
                    if hasattr(obj, name):
                        setattr(obj, name, self._timed(phase, getattr(obj, name)))
        engine.step = self._timed("step", engine.step, count=True)

    def _timed(self, phase, fn, count=False):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[phase] += time.perf_counter() - t0
                self.steps += count
        return wrapper

    def report(self) -> dict[str, float]:
        s = dict(self.seconds)
        s["dispatch"] = s.get("dispatch", 0.0) - s.get("prepare_inputs", 0.0)   # launch() calls _prepare()
        if "execute" in s:   # a runner without launch/collect: execute() = prepare + dispatch + wait
            s["device_wait"] = s.pop("execute") - s.get("prepare_inputs", 0.0)
        inner = sum(v for k, v in s.items() if k != "step")
        s["detokenize_and_outputs"] = s.get("step", 0.0) - inner
        return s


def run_jaxserve(args, prompts) -> dict:
    t0 = time.perf_counter()
    max_len = max(map(len, prompts)) + args.output_len
    llm = LLM(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              max_model_len=-(-max_len // 128) * 128, enable_prefix_caching=args.prefix_caching,
              dtype=args.dtype, async_scheduling=args.async_scheduling)
    startup = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    # First-call costs, on a prompt that shares nothing with the workload.
    llm.generate([[7] * 8, [9] * 8], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    engine = llm.engine
    before = engine.stats()
    breakdown = StepBreakdown(engine) if args.breakdown else None
    t0 = time.perf_counter()
    if args.profile_dir:
        import jax
        jax.profiler.start_trace(args.profile_dir)
    outs = llm.generate(prompts, params, use_tqdm=False)
    if args.profile_dir:
        jax.profiler.stop_trace()
    elapsed = time.perf_counter() - t0
    stats = engine.stats()
    out = {"seconds": elapsed, "startup_seconds": startup, "startup_breakdown": engine.startup_seconds,
           "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
           "prompt_tokens_computed": stats["prompt_tokens"] - before["prompt_tokens"],
           "compiles_after_warmup": stats["compiles_after_warmup"], "num_preemptions": stats["num_preemptions"]}
    if breakdown is not None:
        out["breakdown_seconds"] = breakdown.report()
        out["steps"] = breakdown.steps
    print(f"jaxserve: start-up {startup:.1f} s, {out['seconds']:.1f} s for the workload, "
          f"{out['prompt_tokens_computed']} prompt tokens computed, compiles after warm-up "
          f"{out['compiles_after_warmup']}, preemptions {out['num_preemptions']}", flush=True)
    return out


def run_transformers(args, prompts) -> dict:
    import torch
    import transformers

    from checkpoints.default_model import load_default_model
    ckpt = load_default_model()
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), args.transformers_batch):
            batch = prompts[i:i + args.transformers_batch]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.output_len,
                           min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
    return {"seconds": time.perf_counter() - t0, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=tuple(WORKLOADS), default="random")
    ap.add_argument("--num-requests", type=int, default=None, help="default: the workload's")
    ap.add_argument("--output-len", type=int, default=None, help="default: the workload's")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--dtype", default="float32", help="jaxserve's --dtype")
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="jaxserve's --async-scheduling (launch each step before the one before returns)")
    ap.add_argument("--transformers", action=argparse.BooleanOptionalAction, default=True,
                    help="also time transformers' batched generate (side by side, same prompts)")
    ap.add_argument("--transformers-batch", type=int, default=64)
    ap.add_argument("--breakdown", action="store_true", help="time the engine step's phases")
    ap.add_argument("--profile-dir", default=None, help="write a jax.profiler trace of the jaxserve run here")
    ap.add_argument("--result-file", default=None, help="write the numbers as JSON here")
    args = ap.parse_args(argv)
    for key, value in WORKLOADS[args.workload].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    prompts = make_prompts(args)
    total_out = args.num_requests * args.output_len
    prompt_tokens = sum(map(len, prompts))
    result = {"workload": args.workload, "requests": len(prompts), "prompt_tokens": prompt_tokens,
              "output_tokens": total_out, "jaxserve": run_jaxserve(args, prompts)}
    assert result["jaxserve"]["output_tokens"] == total_out
    if args.transformers:
        result["transformers"] = run_transformers(args, prompts)
    print(f"\nworkload {args.workload}: {len(prompts)} requests, {prompt_tokens} prompt tokens, "
          f"{args.output_len} output tokens each")
    print("| engine | requests | prompt tokens | prompt tokens computed | output tokens | seconds | output tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    js = result["jaxserve"]
    print(f"| jaxserve LLM.generate | {len(prompts)} | {prompt_tokens} | {js['prompt_tokens_computed']} | "
          f"{total_out} | {js['seconds']:.1f} | {total_out / js['seconds']:.1f} |")
    if args.transformers:
        hf = result["transformers"]["seconds"]
        batch = min(args.transformers_batch, len(prompts))
        print(f"| transformers generate (batch {batch}) | {len(prompts)} | {prompt_tokens} | "
              f"{prompt_tokens} | {total_out} | {hf:.1f} | {total_out / hf:.1f} |")
        result["ratio"] = hf / js["seconds"]
        print(f"ratio jaxserve / transformers (output tok/s): {result['ratio']:.2f}x")
    if "breakdown_seconds" in js:
        print(f"\nengine step breakdown over {js['steps']} steps (seconds):")
        for phase, sec in js["breakdown_seconds"].items():
            print(f"  {phase:<24}{sec:8.2f}")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
