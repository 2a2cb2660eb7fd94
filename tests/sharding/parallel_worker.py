"""Runs engines on several (forced) CPU devices in a fresh process; prints one JSON line.

The parent test sets XLA_FLAGS=--xla_force_host_platform_device_count=N before this
process imports jax, which the test process itself cannot do (its jax is already up).

  python -m tests.sharding.parallel_worker tp MODEL_DIR 1,2,4
  python -m tests.sharding.parallel_worker dp MODEL_DIR
  python -m tests.sharding.parallel_worker host MODEL_DIR ADDRESS NUM_PROCESSES PROCESS_ID
  python -m tests.sharding.parallel_worker kernel_tp TP
"""

from __future__ import annotations

import json
import sys

import numpy as np

ENGINE = dict(max_num_batched_tokens=32, max_num_seqs=8, block_size=4, num_kv_blocks=128, max_model_len=96,
              token_buckets=(8, 32))
PROMPTS = [[int(t) for t in np.random.default_rng(i).integers(3, 500, size=n)] for i, n in enumerate((5, 23, 40))]


def greedy(max_tokens=16):
    from jaxserve import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompt_logits(engine, prompt):
    """Logits of every prompt position, from one prefill through the engine's own runner."""
    import jax
    from flax import nnx

    from jaxserve import SamplingParams
    from jaxserve.runner.inputs import RequestState

    runner = engine.runner
    state = RequestState(req_id="logits", token_ids=list(prompt), num_prompt_tokens=len(prompt),
                         block_ids=list(range(1, 1 + -(-len(prompt) // runner.block_size))), num_computed_tokens=0,
                         sampling_params=SamplingParams(), seed=0, eos_token_ids=())
    inputs = runner._prepare([(state, len(prompt))], 64)

    @jax.jit
    def forward(params, kv_caches, inputs):
        model = nnx.merge(runner.graphdef, params)
        hidden, _ = model(inputs.input_ids, inputs.positions, kv_caches, inputs.attn)
        return model.compute_logits(hidden)
    return np.asarray(forward(runner.params, runner.kv_caches, inputs))[:len(prompt)]


def run_tp(model_dir, sizes):
    import jax
    from jax.sharding import NamedSharding

    from jaxserve import LLM
    from sharding import KV_CACHE_SPEC

    result = {}
    for tp in sizes:
        llm = LLM(model_dir, tensor_parallel_size=tp, **ENGINE)
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        runner = llm.engine.runner
        kv = runner.kv_caches[0]
        q_kernel = runner.param_arrays()[("layers", 0, "self_attn", "q_proj", "kernel")]   # the model's own shape
        result[tp] = {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "logits": prompt_logits(llm.engine, PROMPTS[2]).tolist(),
            "kv_sharding_is_declared": kv.sharding == NamedSharding(runner.mesh, KV_CACHE_SPEC),
            "kv_devices": len(kv.sharding.device_set),
            "kv_shape": list(kv.shape),
            "kv_shard_shape": list(kv.addressable_shards[0].data.shape),
            "q_kernel_shard_shape": list(q_kernel.addressable_shards[0].data.shape),
            "num_devices": jax.device_count(),
            "compiles_after_warmup": llm.engine.stats()["compiles_after_warmup"],
        }
    return result


def mixed_workload():
    """Greedy and seeded sampling, shared prefixes, n=2, stop tokens: (prompt, params) pairs."""
    from jaxserve import SamplingParams

    rng = np.random.default_rng(7)
    shared = [int(t) for t in rng.integers(3, 500, size=24)]
    items = []
    for i in range(12):
        own = [int(t) for t in rng.integers(3, 500, size=int(rng.integers(1, 20)))]
        prompt = shared + own if i % 3 == 0 else own + shared[:5]
        if i % 2:
            params = SamplingParams(max_tokens=int(rng.integers(4, 20)), temperature=0.0, ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=int(rng.integers(4, 20)), temperature=0.9, top_p=0.9, seed=100 + i,
                                    n=2 if i % 4 == 0 else 1, ignore_eos=True)
        items.append((prompt, params))
    return items


def prefix_routing(engine):
    """Replica indices: a prefix's first request (run to completion), then five sharing it."""
    prefix = list(range(100, 140))
    engine.add_request("first", prefix + [7], greedy(2))
    home = engine.replicas.index(engine._replica_of["first"])
    while engine.has_unfinished_requests():
        engine.step()
    routed = []
    for i in range(5):
        engine.add_request(f"shared{i}", prefix + [11 + i], greedy(2))
        routed.append(engine.replicas.index(engine._replica_of[f"shared{i}"]))
    while engine.has_unfinished_requests():
        engine.step()
    return {"home": home, "routed": routed, "slack": max(1, engine.config.max_num_seqs // 4)}


def run_dp(model_dir):
    from jaxserve import LLM

    result = {}
    for dp in (1, 2):
        llm = LLM(model_dir, data_parallel_size=dp, **ENGINE)
        engine = llm.engine
        items = mixed_workload()
        served_by = {}
        for i, (prompt, params) in enumerate(items):
            engine.add_request(str(i), prompt, params)
            served_by[str(i)] = engine.replicas.index(engine._replica_of[str(i) if params.n == 1 else f"0_{i}"])
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = [o.token_ids for o in out.outputs]
        result[dp] = {
            "prefix_routing": prefix_routing(engine) if dp > 1 else None,
            "outputs": outs,
            "served_by": served_by,
            "replica_devices": [[d.id for d in r.runner.mesh.devices.flat] for r in engine.replicas],
            "steps_per_replica": [r.scheduler.kv.stats.queries for r in engine.replicas],
            "compiles_after_warmup": engine.stats()["compiles_after_warmup"],
            "leaked_routes": len(engine._replica_of),
        }
    return result


def run_host(model_dir, address, num_processes, process_id):
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.config import EngineConfig

    config = EngineConfig(model=model_dir, tensor_parallel_size=num_processes, coordinator_address=address,
                          num_processes=num_processes, process_id=process_id, **ENGINE)
    engine = LLMEngine(config)
    if process_id != 0:
        engine.follow()
        return {"followed": True}
    from jaxserve import LLM
    outs = LLM.from_engine(engine).generate(PROMPTS, greedy(), use_tqdm=False)
    engine.shutdown()
    import jax
    return {"tokens": [o.outputs[0].token_ids for o in outs], "num_devices": jax.device_count(),
            "mesh_processes": sorted({d.process_index for d in engine.runner.mesh.devices.flat})}


def run_kernel_tp(tp):
    """Max |error| of the Pallas GPU kernel (interpret mode) run per device over tp-sharded heads."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from kernels_pallas import ragged_paged_attention
    from sharding import KV_CACHE_SPEC, make_mesh
    from tests.kernels.pallas_cases import batch, check_against_reference

    mesh = make_mesh(tp)
    result = {}
    for scenario in ("mixed", "prefix_hit"):
        q, cache, *rest = batch(scenario, group=3)                      # 2 KV heads x 3 query heads each
        q = jax.device_put(q, NamedSharding(mesh, P(None, "tp", None)))
        cache = jax.device_put(cache, NamedSharding(mesh, KV_CACHE_SPEC))
        fn = jax.jit(lambda *a: ragged_paged_attention(*a, backend="pallas_gpu", sm_scale=0.125, interpret=True))
        with jax.set_mesh(mesh):
            got = fn(q, cache, *rest)
            jaxpr = str(jax.make_jaxpr(fn)(q, cache, *rest))
        check_against_reference(got, scenario, {"group": 3}, sm_scale=0.125)
        result[scenario] = {"out_devices": len(got.sharding.device_set), "per_device": "shard_map" in jaxpr}
    return result


def main(argv):
    mode, model_dir = argv[0], argv[1]
    if mode == "tp":
        result = run_tp(model_dir, [int(x) for x in argv[2].split(",")])
    elif mode == "dp":
        result = run_dp(model_dir)
    elif mode == "kernel_tp":
        result = run_kernel_tp(int(model_dir))
    else:
        result = run_host(model_dir, argv[2], int(argv[3]), int(argv[4]))
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
