"""Serving benchmark: drive a running `jaxserve serve` through its streaming OpenAI API.

One asyncio client (httpx) sends token-id prompts to /v1/completions with `stream: true`,
arrivals at `--request-rate` (Poisson, or gamma with `--burstiness`; `inf` = all at once)
under `--max-concurrency`, and reports vLLM's serving-benchmark metrics under vLLM's names
(TTFT, TPOT, ITL and end-to-end latency: mean, median, p90, p99, max; request and token
throughput), plus what the server's /metrics counted over the run (prompt tokens computed,
prefix-cache hit rate, compiles after warm-up). Writes everything to a JSON result file.

Workloads (seeded, deterministic; see workloads.py):
  random             input/output lengths from ranges (vLLM's --random-* flags)
  agent              agents sharing a long prefix, several turns each; prefill tokens computed
                     against the ideal, TTFT of the first vs later turns
  long-prompt-burst  N streams decoding, then one prompt of 8x the token budget; the streams'
                     ITL during the burst against their steady ITL

    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000 --workload random
    jaxserve bench serve --workload agent --num-agents 8 --num-turns 4     # the same script
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import sys
import time

import httpx
import numpy as np

from bench_client import (RequestResult, metrics_delta, scrape_metrics, stats_ms, stream_completion, summarize,
                          warmup_request)
from workloads import AgentWorkload, BurstWorkload, agent_workload, long_prompt_burst, random_requests

WORKLOADS = ("random", "agent", "long-prompt-burst")


async def arrivals(n: int, rate: float, burstiness: float, seed: int):
    """Yield 0..n-1, spaced by gamma-distributed gaps of mean 1/rate (burstiness 1 = Poisson)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        yield i
        if rate != float("inf") and i + 1 < n:
            await asyncio.sleep(rng.gamma(burstiness, 1.0 / (rate * burstiness)))


def _limit(max_concurrency: int | None):
    return asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()


# ---- random ---------------------------------------------------------------------------------------


async def run_random(client, url, model, args):
    reqs = random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                           args.random_range_ratio, args.vocab_size, args.seed)
    limit = _limit(args.max_concurrency)

    async def one(req):
        async with limit:
            return await stream_completion(client, url, model, req.prompt, req.max_tokens)
    tasks = [asyncio.create_task(one(reqs[i]))
             async for i in arrivals(len(reqs), args.request_rate, args.burstiness, args.seed)]
    return list(await asyncio.gather(*tasks)), {}, None


# ---- agent ----------------------------------------------------------------------------------------


def make_agent_workload(args) -> AgentWorkload:
    lo, hi = args.agent_user_len
    return agent_workload(args.num_agents, args.num_turns, system_len=args.agent_system_len,
                          tools_len=args.agent_tools_len, repo_len=args.agent_repo_len,
                          task_len=args.agent_task_len, user_len=(lo, hi), output_len=args.agent_output_len,
                          vocab_size=args.vocab_size, block_size=args.block_size, seed=args.seed)


async def run_agent(client, url, model, args):
    wl = make_agent_workload(args)
    limit = _limit(args.max_concurrency)
    results: list[RequestResult] = []
    replies: list[tuple[list[str], list[int]]] = []   # (generated tokens' texts, re-tokenized reply)

    async def agent(a: int):
        prompt = wl.first_prompt(a)
        for turn in range(wl.num_turns):
            async with limit:
                res = await stream_completion(client, url, model, prompt, wl.output_len, token_pieces=True,
                                              tags={"agent": a, "turn": turn})
            results.append(res)
            if not res.ok or turn + 1 == wl.num_turns:
                return
            # The reply goes back into the conversation as its text re-tokenized, as an agent's would.
            reply = await _tokenize(client, url, res.text)
            replies.append((res.token_pieces, reply))
            prompt = wl.next_prompt(a, turn + 1, prompt, reply)
    tasks = [asyncio.create_task(agent(a))
             async for a in arrivals(wl.num_agents, args.request_rate, args.burstiness, args.seed)]
    await asyncio.gather(*tasks)

    async def after_run() -> dict:
        # Off the clock: where a re-tokenized reply differs from the generated tokens (compared by
        # each token's text), the rest of it was new to the cache.
        ids = sorted({t for _, reply in replies for t in reply})
        limit16 = asyncio.Semaphore(16)

        async def text_of(t):
            async with limit16:
                return await _detokenize(client, url, [t])
        texts = dict(zip(ids, await asyncio.gather(*(text_of(t) for t in ids))))
        new = [new_reply_tokens(pieces, [texts[t] for t in reply]) for pieces, reply in replies]
        # The workload's ideal counts one token per reply (the last, never fed back).
        return {"prefill_tokens_ideal": wl.ideal_prefill_tokens() + sum(n - 1 for n in new),
                "replies_retokenized_differently": sum(n != 1 for n in new)}

    ok = [r for r in results if r.ok]
    first = [r.ttft for r in ok if r.tags["turn"] == 0]
    later = [r.ttft for r in ok if r.tags["turn"] > 0]
    extra = {
        "agent": {"num_agents": wl.num_agents, "num_turns": wl.num_turns, "shared_prefix_len": len(wl.shared_prefix),
                  "output_len": wl.output_len, "block_size": wl.block_size},
        "prompt_tokens_total": sum(r.prompt_len for r in ok),
        "cached_tokens_reported": sum(r.cached_tokens for r in ok),
        "median_ttft_by_turn_ms": [float(np.median([r.ttft for r in ok if r.tags["turn"] == t]) * 1e3)
                                   for t in range(wl.num_turns)],
    }
    extra.update(stats_ms(first, "ttft_first_turn"))
    extra.update(stats_ms(later, "ttft_later_turns"))
    return results, extra, after_run


async def _tokenize(client, url, text: str) -> list[int]:
    r = await client.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False})
    r.raise_for_status()
    return r.json()["tokens"]


async def _detokenize(client, url, ids: list[int]) -> str:
    r = await client.post(f"{url}/detokenize", json={"tokens": ids})
    r.raise_for_status()
    return r.json()["prompt"]


def new_reply_tokens(generated: list[str], retokenized: list[str]) -> int:
    """Tokens of a re-tokenized reply whose K/V no earlier step computed, from per-token texts.

    Decoding computed K/V for every generated token but the last. Equal texts token by token
    are taken as equal ids.
    """
    j = 0
    while j < min(len(generated), len(retokenized)) and generated[j] == retokenized[j]:
        j += 1
    return len(retokenized) - j + (1 if j == len(generated) else 0)


def agent_prefill_report(out: dict) -> None:
    """Prefill computed (server counter) against the ideal; adds the excess per request in place."""
    ideal, computed = out["prefill_tokens_ideal"], out["server"]["prompt_tokens_computed"]
    out["prefill_tokens_computed"] = computed
    out["prefill_excess_tokens_per_request"] = (computed - ideal) / max(1, out["completed"])


# ---- long-prompt burst ----------------------------------------------------------------------------


def make_burst_workload(args) -> BurstWorkload:
    return long_prompt_burst(args.burst_streams, token_budget=args.token_budget, factor=args.burst_factor,
                             stream_prompt_len=args.burst_stream_prompt_len, steady_tokens=args.burst_steady_tokens,
                             vocab_size=args.vocab_size, seed=args.seed)


async def run_burst(client, url, model, args):
    wl = make_burst_workload(args)
    steady = asyncio.Event()
    live: dict[int, RequestResult] = {}

    def watch(i):
        def on_chunk(r):
            live[i] = r
            if len(live) == len(wl.stream_prompts) and all(len(s.chunk_times) >= wl.steady_tokens
                                                           for s in live.values()):
                steady.set()
        return on_chunk

    async def stream(i):
        r = await stream_completion(client, url, model, wl.stream_prompts[i], wl.stream_max_tokens,
                                    tags={"role": "stream", "stream": i}, on_chunk=watch(i))
        if not r.ok:
            steady.set()   # a failed stream must not leave the benchmark waiting
        return r
    tasks = [asyncio.create_task(stream(i)) for i in range(len(wl.stream_prompts))]
    await steady.wait()
    t_send = time.perf_counter()
    long = await stream_completion(client, url, model, wl.long_prompt, wl.long_max_tokens, tags={"role": "long"})
    results = list(await asyncio.gather(*tasks)) + [long]
    return results, burst_report(results[:-1], long, t_send, wl), None


def burst_report(streams: list[RequestResult], long: RequestResult, t_send: float, wl: BurstWorkload) -> dict:
    """Streams' ITL while the long prompt prefills vs their steady ITL before it arrived."""
    ok = [s for s in streams if s.ok]
    if not ok or not long.ok:
        return {"burst_error": long.error or "no stream finished"}
    t_first = long.chunk_times[0]
    # Steady: intervals after every stream's first few tokens and before the long prompt was sent.
    t_warm = max(s.chunk_times[min(3, len(s.chunk_times) - 1)] for s in ok)
    steady = [b - a for s in ok for a, b in zip(s.chunk_times, s.chunk_times[1:]) if a >= t_warm and b <= t_send]
    # Burst: every interval that overlaps [long prompt sent, its first token].
    burst = [b - a for s in ok for a, b in zip(s.chunk_times, s.chunk_times[1:]) if b > t_send and a < t_first]
    short = [s for s in ok if s.chunk_times[-1] < t_first]
    out = {"burst": {"streams": len(streams), "stream_max_tokens": wl.stream_max_tokens,
                     "long_prompt_len": len(wl.long_prompt), "steady_tokens": wl.steady_tokens,
                     "streams_finished_before_burst_ended": len(short)},
           "long_prompt_ttft_ms": (t_first - long.start) * 1e3,
           "burst_window_s": t_first - t_send,
           "num_steady_itls": len(steady), "num_burst_itls": len(burst)}
    out.update(stats_ms(steady, "steady_itl"))
    out.update(stats_ms(burst, "burst_itl"))
    out["burst_p99_over_steady_p99"] = out["p99_burst_itl_ms"] / out["p99_steady_itl_ms"]
    out["burst_p99_over_steady_median"] = out["p99_burst_itl_ms"] / out["median_steady_itl_ms"]
    out["burst_max_over_steady_median"] = out["max_burst_itl_ms"] / out["median_steady_itl_ms"]
    return out


# ---- one run ----------------------------------------------------------------------------------------
# A workload runner returns (results, extra report, None or a coroutine function run off the clock).

RUNNERS = {"random": run_random, "agent": run_agent, "long-prompt-burst": run_burst}


async def benchmark(args) -> dict:
    """Run the chosen workload against args.base_url; returns the result dict (also what is saved)."""
    url = args.base_url.rstrip("/")
    timeout = httpx.Timeout(args.request_timeout)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = args.model or (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        await warmup_request(client, url, model, args.vocab_size)
        before = await scrape_metrics(client, url)
        t0 = time.perf_counter()
        results, extra, after_run = await RUNNERS[args.workload](client, url, model, args)
        duration = time.perf_counter() - t0
        after = await scrape_metrics(client, url)
        if after_run is not None:
            extra.update(await after_run())
    out = {"date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "jaxserve", "model_id": model,
           "base_url": url, "workload": args.workload, "request_rate": args.request_rate,
           "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": args.seed}
    out.update(summarize(results, duration))
    out["server"] = metrics_delta(before, after)
    out.update(extra)
    if args.workload == "agent":
        agent_prefill_report(out)
    ok = [r for r in results if r.ok]
    out["input_lens"] = [r.prompt_len for r in ok]
    out["output_lens"] = [r.output_tokens for r in ok]
    out["ttfts"] = [r.ttft for r in ok]
    out["itls"] = [r.itl for r in ok]
    return out


def print_result(out: dict) -> None:
    print(f"{'=' * 14} Serving Benchmark Result ({out['workload']}) {'=' * 14}")
    rows = [("Successful requests", out["completed"]), ("Failed requests", out["failed"]),
            ("Benchmark duration (s)", out["duration"]), ("Total input tokens", out["total_input_tokens"]),
            ("Total generated tokens", out["total_output_tokens"]),
            ("Request throughput (req/s)", out["request_throughput"]),
            ("Output token throughput (tok/s)", out["output_throughput"]),
            ("Total token throughput (tok/s)", out["total_token_throughput"])]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99", "max"):
            rows.append((f"{stat} {metric.upper()} (ms)", out[f"{stat}_{metric}_ms"]))
    s = out["server"]
    rows += [("Prompt tokens computed (server)", s["prompt_tokens_computed"]),
             ("Prefix cache hit rate (server)", s["prefix_cache_hit_rate"]),
             ("Preemptions (server)", s["num_preemptions"]),
             ("Compiles after warm-up (server)", s["compiles_after_warmup"])]
    if out["workload"] == "agent":
        rows += [("Prefill tokens ideal", out["prefill_tokens_ideal"]),
                 ("Prefill excess tokens / request", out["prefill_excess_tokens_per_request"]),
                 ("Prompt tokens sent", out["prompt_tokens_total"]),
                 ("median TTFT first turn (ms)", out["median_ttft_first_turn_ms"]),
                 ("median TTFT later turns (ms)", out["median_ttft_later_turns_ms"]),
                 ("p99 TTFT later turns (ms)", out["p99_ttft_later_turns_ms"]),
                 ("Replies re-tokenized differently", out["replies_retokenized_differently"])]
    if out["workload"] == "long-prompt-burst" and "burst_error" not in out:
        rows += [(f"{stat} {w} ITL (ms)", out[f"{stat}_{w}_itl_ms"])
                 for w in ("steady", "burst") for stat in ("median", "p99", "max")]
        rows += [("burst p99 / steady p99", out["burst_p99_over_steady_p99"]),
                 ("burst p99 / steady median", out["burst_p99_over_steady_median"]),
                 ("long prompt TTFT (ms)", out["long_prompt_ttft_ms"]),
                 ("streams done before the long prompt's first token",
                  out["burst"]["streams_finished_before_burst_ended"])]
    for name, value in rows:
        print(f"{name:<42}{value:>14.2f}" if isinstance(value, float) else f"{name:<42}{value:>14}")
    for e in out["errors"][:5]:
        print("error:", e)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    ap = parser or argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="model name in the API (default: the server's first)")
    ap.add_argument("--workload", choices=WORKLOADS, default="random")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=49152, help="token ids are drawn below this (default model's)")
    ap.add_argument("--request-rate", type=float, default=float("inf"),
                    help="requests (agents, for --workload agent) per second; inf sends all at once")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1 = Poisson)")
    ap.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    ap.add_argument("--request-timeout", type=float, default=1800.0)
    ap.add_argument("--result-file", default=None, help="JSON result path (default: serve-bench-WORKLOAD-DATE.json)")
    r = ap.add_argument_group("random workload")
    r.add_argument("--num-prompts", type=int, default=64)
    r.add_argument("--random-input-len", type=int, default=128)
    r.add_argument("--random-output-len", type=int, default=64)
    r.add_argument("--random-range-ratio", type=float, default=0.5)
    a = ap.add_argument_group("agent workload")
    a.add_argument("--num-agents", type=int, default=8)
    a.add_argument("--num-turns", type=int, default=4)
    a.add_argument("--agent-system-len", type=int, default=256)
    a.add_argument("--agent-tools-len", type=int, default=256)
    a.add_argument("--agent-repo-len", type=int, default=512)
    a.add_argument("--agent-task-len", type=int, default=64)
    a.add_argument("--agent-user-len", type=_pair, default=(32, 64), help="LO,HI tokens of each later user message")
    a.add_argument("--agent-output-len", type=int, default=32)
    a.add_argument("--block-size", type=int, default=16, help="the server's KV block size (for the report)")
    b = ap.add_argument_group("long-prompt-burst workload")
    b.add_argument("--token-budget", type=int, default=512, help="the server's --max-num-batched-tokens")
    b.add_argument("--burst-factor", type=int, default=8, help="long prompt = factor x token budget")
    b.add_argument("--burst-streams", type=int, default=16)
    b.add_argument("--burst-stream-prompt-len", type=int, default=32)
    b.add_argument("--burst-steady-tokens", type=int, default=24)
    return ap


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)   # one INFO line per request otherwise
    out = asyncio.run(benchmark(args))
    print_result(out)
    path = args.result_file or f"serve-bench-{args.workload}-{out['date']}.json"
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"result written to {path}")
    return 1 if out["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
