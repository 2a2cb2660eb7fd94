"""Start-up from an Orbax checkpoint against loading the default model from its GGUF file.

Times what differs between the sources: checkpoint -> params on the device, ready for
the runner (the step compile that follows is the same for all). Sources:
  gguf-cold   the GGUF dequantized and converted to a safetensors folder (first start)
  gguf-warm   that converted folder, read and re-laid-out (every later start)
  orbax       `jaxserve convert` output, restored straight into the params' shardings
Each warm source is timed --reps times, alternating, in this one process; medians. The
abstract model build (nnx.eval_shape, the same for every source) is timed on its own too.

  python benchmarks/checkpoint_startup.py [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax

from checkpoints import default_model_path, load_checkpoint
from jaxserve.convert import convert_to_orbax
from jaxserve.engine.builder import _abstract_model, build_model
from jaxserve.models import ModelConfig


def time_load(source, cache_dir=None) -> float:
    t0 = time.perf_counter()
    model, _ = build_model(load_checkpoint(source, cache_dir=cache_dir), "float32")
    jax.block_until_ready(jax.tree.leaves(model))
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    gguf = default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        cold = time_load(gguf, cache_dir=Path(tmp) / "models")            # converts into an empty cache
        t0 = time.perf_counter()
        orbax_dir = convert_to_orbax(gguf, Path(tmp) / "orbax")
        convert_s = time.perf_counter() - t0
        warm, orbax, shape = [], [], []
        config = ModelConfig.from_hf_config(load_checkpoint(orbax_dir).config)
        for _ in range(args.reps):
            warm.append(time_load(gguf, cache_dir=Path(tmp) / "models"))
            orbax.append(time_load(orbax_dir))
            t0 = time.perf_counter()
            _abstract_model(config, "float32", 0)
            shape.append(time.perf_counter() - t0)
    w, o, a = statistics.median(warm), statistics.median(orbax), statistics.median(shape)
    print(f"| source | load to device (s) |\n|---|---|\n| gguf-cold (convert + load) | {cold:.2f} |\n"
          f"| gguf-warm (converted folder), median of {args.reps} | {w:.2f} |\n"
          f"| orbax, median of {args.reps} | {o:.2f} |\n\n"
          f"orbax vs gguf-warm: {w / o:.2f}x faster; vs gguf-cold: {cold / o:.1f}x; "
          f"`jaxserve convert` took {convert_s:.1f} s once.\nOf each load, {a:.2f} s (median) is tracing the "
          f"abstract model (nnx.eval_shape), common to all sources; without it orbax {o - a:.2f} s vs gguf-warm "
          f"{w - a:.2f} s ({(w - a) / (o - a):.2f}x)")


if __name__ == "__main__":
    main()
