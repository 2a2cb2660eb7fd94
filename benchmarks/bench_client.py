"""The measuring side of the serving benchmarks: one streamed request, /metrics, summaries, a server process.

Runs on the benchmark's asyncio event loop (one process, separate from the server).
`stream_completion` sends one streaming /v1/completions request with a token-id prompt
and records when each SSE chunk arrived; `summarize` turns a run's results into vLLM's
benchmark metrics (same names, so results compare directly); `scrape_metrics` reads the
server's Prometheus counters; `launch_server` starts `jaxserve serve` as a subprocess.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np


@dataclasses.dataclass
class RequestResult:
    prompt_len: int
    max_tokens: int
    start: float = 0.0                 # perf_counter() when the request was sent
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # arrival of each chunk with a choice
    text: str = ""
    token_pieces: list[str] = dataclasses.field(default_factory=list)  # each token's text (with logprobs=0)
    output_tokens: int = 0             # usage.completion_tokens (chunks counted if the server sent no usage)
    cached_tokens: int = 0             # usage.prompt_tokens_details.cached_tokens
    error: str | None = None
    tags: dict = dataclasses.field(default_factory=dict)   # workload labels (agent, turn, role)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def latency(self) -> float:
        return self.chunk_times[-1] - self.start

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        """(latency - ttft) / (output tokens - 1), as vLLM's benchmark defines it."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def stream_completion(client: httpx.AsyncClient, base_url: str, model: str, prompt: list[int],
                            max_tokens: int, *, on_chunk=None, tags: dict | None = None,
                            temperature: float = 0.0, token_pieces: bool = False) -> RequestResult:
    """One streaming completion (EOS ignored, so exactly `max_tokens` tokens); never raises for HTTP errors.

    `token_pieces` asks for logprobs=0, whose `tokens` give each generated token's own text.
    """
    result = RequestResult(len(prompt), max_tokens, tags=dict(tags or {}))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if token_pieces:
        body["logprobs"] = 0
    result.start = time.perf_counter()
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return result
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    break
                if chunk.get("choices"):
                    result.chunk_times.append(now)
                    choice = chunk["choices"][0]
                    result.text += choice.get("text") or ""
                    if choice.get("logprobs"):
                        result.token_pieces += choice["logprobs"]["tokens"]
                    if on_chunk is not None:
                        on_chunk(result)
                elif chunk.get("usage"):
                    usage = chunk["usage"]
                    result.output_tokens = usage.get("completion_tokens") or 0
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            if not done and result.error is None:
                result.error = "stream ended without [DONE]"
    except httpx.HTTPError as e:
        result.error = repr(e)
    if not result.output_tokens:
        result.output_tokens = len(result.chunk_times)
    return result


async def warmup_request(client: httpx.AsyncClient, base_url: str, model: str, vocab_size: int) -> None:
    """One short request before measuring (as vLLM's benchmark does), on a prompt no workload shares."""
    rng = np.random.default_rng(12345)
    prompt = rng.integers(100, vocab_size - 100, size=16).tolist()
    r = await stream_completion(client, base_url, model, prompt, 2)
    if not r.ok:
        raise RuntimeError(f"the warm-up request failed: {r.error}")


# ---- summaries ------------------------------------------------------------------------------------


def stats_ms(values_s: list[float], name: str, percentiles=(50, 90, 99)) -> dict[str, float]:
    """mean/median/std/pXX/max of seconds, in ms, under vLLM's key names (mean_ttft_ms, p99_ttft_ms, ...)."""
    v = np.asarray(values_s, dtype=float) * 1e3
    if v.size == 0:
        v = np.asarray([np.nan])
    out = {f"mean_{name}_ms": float(np.mean(v)), f"median_{name}_ms": float(np.median(v)),
           f"std_{name}_ms": float(np.std(v))}
    for p in percentiles:
        out[f"p{p}_{name}_ms"] = float(np.percentile(v, p))
    out[f"max_{name}_ms"] = float(np.max(v))
    return out


def summarize(results: list[RequestResult], duration: float) -> dict:
    """vLLM's serving-benchmark metrics over the successful requests of one run."""
    ok = [r for r in results if r.ok]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
    }
    out.update(stats_ms([r.ttft for r in ok], "ttft"))
    out.update(stats_ms([t for r in ok if (t := r.tpot) is not None], "tpot"))
    out.update(stats_ms([d for r in ok for d in r.itl], "itl"))
    out.update(stats_ms([r.latency for r in ok], "e2el"))
    out["errors"] = [r.error for r in results if r.error][:20]
    return out


# ---- the server's /metrics ------------------------------------------------------------------------


async def scrape_metrics(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    """{metric name: value summed over label sets} of the server's Prometheus text (histograms skipped)."""
    r = await client.get(f"{base_url}/metrics")
    r.raise_for_status()
    return parse_metrics(r.text)


def parse_metrics(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        if name.endswith(("_bucket", "_created")):
            continue
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    """Engine counters over one run: prompt tokens computed, prefix-cache hit rate, compiles after warm-up."""
    def d(name):
        return after.get(name, 0.0) - before.get(name, 0.0)
    queries, hits = d("jaxserve:prefix_cache_queries_total"), d("jaxserve:prefix_cache_hits_total")
    return {
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "prompt_tokens_computed": d("jaxserve:prompt_tokens_total"),
        "generation_tokens": d("jaxserve:generation_tokens_total"),
        "num_preemptions": d("jaxserve:num_preemptions_total"),
        "compiles_after_warmup": after.get("jaxserve:compiles_after_warmup", float("nan")),
    }


# ---- a server process -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(proc: subprocess.Popen, url: str, timeout: float, where: str) -> float:
    """Poll `url`/health until 200; raises if `proc` exits first or `timeout` passes. Returns the seconds."""
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready; see {where}")
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"server not ready after {timeout:.0f} s; see {where}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.3)


@contextlib.contextmanager
def launch(args: list[str], url: str, log_path: str | Path, timeout: float = 1200.0, prefix: list[str] = ()):
    """`jaxserve ARGS` (after `prefix`, e.g. taskset) until the block ends: waits for `url`/health, then
    SIGTERMs it and warns on a non-zero exit."""
    cmd = [*prefix, sys.executable, "-m", "jaxserve.cli", *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            seconds = wait_until_healthy(proc, url, timeout, str(log_path))
            print(f"ready after {seconds:.1f} s: jaxserve {' '.join(args)}", flush=True)
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    rc = proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    rc = proc.wait()
                if rc != 0:
                    print(f"warning: exit code {rc}; see {log_path}", file=sys.stderr)


@contextlib.contextmanager
def launch_server(server_args: list[str], log_path: str | Path, timeout: float = 1200.0):
    """`jaxserve serve ARGS` on a free loopback port; yields its base URL, then SIGTERMs it (exit code checked)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with launch(["serve", "--port", str(port), *server_args], url, log_path, timeout):
        yield url
