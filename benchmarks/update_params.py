"""`update_params` against building a new engine, and sleep / wake_up, on the default model.

Builds one engine (`LLM()` with the given dtype and token buckets), then times, median of
`--repeats`, interleaved: `update_params` with a full set of new weights (the engine's
own arrays x 1.01, already on device), `sleep()` + `wake_up()`, and building a fresh
engine from the same weights (`LLM(params=...)`, which warms up; XLA's persistent cache
is warm after the first). `update_params` is timed until the engine's new arrays are ready (a
bfloat16 engine on an AMX CPU packs its projections again for the tiles). Prints the seconds and
the ratio.

    python benchmarks/update_params.py [--repeats 3] [--token-buckets 16,128] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
from flax import nnx

from jaxserve import LLM, SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--token-buckets", default="16,128")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    options = dict(dtype=args.dtype, max_num_batched_tokens=128, max_num_seqs=16, max_model_len=512, num_kv_blocks=512,
                   token_buckets=tuple(int(x) for x in args.token_buckets.split(",")))
    t0 = time.perf_counter()
    llm = LLM(**options)
    print(f"first build {time.perf_counter() - t0:.1f} s", flush=True)
    prompt, params = [[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    base = llm.engine.runner.param_arrays()
    nbytes = sum(a.nbytes for a in base.values())
    times = {"update_params": [], "sleep+wake_up": [], "new engine": []}
    for repeat in range(args.repeats):
        new = jax.block_until_ready({k: (v * (1.01 + repeat / 100)).astype(v.dtype) for k, v in base.items()})
        t = time.perf_counter()
        llm.update_params(nnx.traversals.unflatten_mapping(new))
        jax.block_until_ready(llm.engine.runner.params)
        times["update_params"].append(time.perf_counter() - t)
        llm.generate(prompt, params, use_tqdm=False)
        t = time.perf_counter()
        llm.sleep()
        llm.wake_up()
        times["sleep+wake_up"].append(time.perf_counter() - t)
        t = time.perf_counter()
        fresh = LLM(params=nnx.traversals.unflatten_mapping(new), **options)
        times["new engine"].append(time.perf_counter() - t)
        assert fresh.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == \
            llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        del fresh
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"default model, {args.dtype}, {nbytes / 2**20:.0f} MiB of weights ({len(llm.engine.runner.packed_paths)} "
          f"projections pre-packed), KV pool {options['num_kv_blocks']} blocks; "
          f"median of {args.repeats}:")
    for k, v in med.items():
        print(f"  {k:14s} {v * 1000:9.1f} ms")
    print(f"  new engine / update_params: {med['new engine'] / med['update_params']:.0f}x; "
          f"compiles after warm-up: {llm.engine.runner.compiles_after_warmup}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
