"""The fault suite: real `jaxserve serve` processes put through what breaks servers.

Each row starts its own server process (`jaxserve serve MODEL ...` on a free port) and
ends with a pass/fail and its figures:

- schemathesis: generated bodies (valid and not) for every route of the OpenAPI schema;
  no 5xx, every response as the schema says (status, content type, body);
- disconnect storm: streams cut at random points (before the headers, mid-stream) and
  non-streaming clients that give up; afterwards nothing runs, waits, holds KV blocks or
  stays in the engine's tables;
- pool exhaustion: more long prompts at once than the KV pool holds; every one finishes,
  with the greedy output it has when it runs alone;
- step failure / hung step: a step that raises (or never returns) while clients stream;
  they get an error event, /health turns 503 and the process exits 1 within seconds;
- request failure: processing some requests' outputs raises (those whose prompt ends with
  tests/faults.py's MARKER, streamed and not, n 1-2) while others run beside them: only those
  fail (500 or an error event), the others get all their tokens, the server stays healthy and
  nothing is held;
- soak: clients that come and go at a steady load for --soak-s seconds; errors, the
  server's RSS growth after warm-up and the ITL p99 of each window;
- bad bodies: 10 MB bodies, deep JSON, invalid UTF-8, huge n / logprobs / stop lists.

The model defaults to the tiny random-weight llama of the tests (written to a temp
folder): these rows test the server, not the model. Usage:

    python benchmarks/fault_suite.py [--model DIR] [--soak-s 600] [--schemathesis-examples 600]

`--fault-serve MODE` is internal: it runs `jaxserve serve` with a step that raises
(MODE=raise) or hangs (MODE=hang) once the file named by $JAXSERVE_FAULT_TRIGGER exists, or
(MODE=request) a detokenizer that raises at the third token of a prompt ending with
tests/faults.py's MARKER, and a grammar whose regex holds its GRAMMAR_MARKER that raises
filling the fourth token's bitmask row.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench_client import free_port, wait_until_healthy

ROOT = Path(__file__).resolve().parent.parent
SERVE_ARGS = ["--max-model-len", "256", "--max-num-batched-tokens", "64", "--max-num-seqs", "16",
              "--token-buckets", "4,16,64", "--num-kv-blocks", "256"]


# ---- server processes ----------------------------------------------------------------------


class Server:
    """A `jaxserve serve` process on a free port; `fault` runs it through --fault-serve."""

    def __init__(self, model: str, *extra: str, fault: str | None = None, trigger: Path | None = None,
                 timeout: float = 600) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [model, "--port", str(self.port), *SERVE_ARGS, *extra]
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", *args] if fault is None else \
            [sys.executable, __file__, "--fault-serve", fault, *args]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if trigger is not None:
            env["JAXSERVE_FAULT_TRIGGER"] = str(trigger)
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            wait_until_healthy(self.proc, self.url, timeout, "its output below")
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(f"{e}\n{self.output()}") from None

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-4000:]

    def metrics(self) -> dict[str, float]:
        values = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith("jaxserve:") and not line.startswith("#"):
                name = line.split("{", 1)[0].split(" ", 1)[0]
                values[name[len("jaxserve:"):]] = float(line.rsplit(" ", 1)[1])
        return values

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _tests_importable() -> None:
    """The tests' tiny model and injected faults are the fault suite's too: the checkout's root on
    sys.path (its servers get it as PYTHONPATH)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def tiny_model() -> str:
    _tests_importable()
    from tests.fixtures.tiny_models import write_tiny_model

    return str(write_tiny_model("llama", Path(tempfile.mkdtemp(prefix="jaxserve-fault-")) / "llama"))


def idle_figures(server: Server, timeout: float = 30.0) -> dict[str, float]:
    """Wait until nothing runs or waits; the gauges a leak would show."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        busy = m["num_requests_running"] + m["num_requests_waiting"] + m["num_requests_in_flight"] + \
            m["num_requests_unfinished"]
        if busy == 0 or time.monotonic() > deadline:
            return {"running": m["num_requests_running"], "waiting": m["num_requests_waiting"],
                    "in_flight": m["num_requests_in_flight"], "engine_entries": m["num_requests_unfinished"],
                    "kv_blocks_in_use": m["kv_cache_total_blocks"] - m["kv_cache_free_blocks"]}
        time.sleep(0.1)


# ---- rows ----------------------------------------------------------------------------------


def row_schemathesis(model: str, examples: int, seed: int) -> dict:
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.checks import (content_type_conformance, not_a_server_error, response_headers_conformance,
                                     response_schema_conformance, status_code_conformance)

    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
              response_headers_conformance]
    with Server(model, "--enable-docs", "--max-sequences-per-request", "32") as server:
        schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
        counts = {"responses": 0, "5xx": 0, "violations": 0, "by_status": {}, "no_cases": []}
        failures: list[str] = []
        for result in schema.get_all_operations():
            operation = result.ok()
            for mode in ("positive", "negative"):
                strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

                @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
                          phases=[Phase.generate], suppress_health_check=list(HealthCheck))
                @given(case=strategy)
                def run(case):
                    response = case.call(base_url=server.url, timeout=60)
                    counts["responses"] += 1
                    key = str(response.status_code)
                    counts["by_status"][key] = counts["by_status"].get(key, 0) + 1
                    counts["5xx"] += response.status_code >= 500
                    try:
                        case.validate_response(response, checks=checks)
                    except (Exception, BaseExceptionGroup) as e:  # noqa: BLE001 - counted and reported
                        counts["violations"] += 1
                        if len(failures) < 5:
                            failures.append(f"{operation.label} ({mode}): {str(e)[:300]}")
                random.seed(seed)
                try:
                    run()
                except Unsatisfiable:
                    counts["no_cases"].append(f"{operation.label} ({mode})")  # e.g. nothing invalid about GET
        idle = idle_figures(server)
    return {**counts, "failures": failures, "idle": idle,
            "ok": counts["5xx"] == 0 and counts["violations"] == 0 and counts["responses"] > 0
            and not any(idle.values())}


async def _cut(url: str, rng: random.Random, how: str) -> str:
    body = {"prompt": [rng.randrange(3, 500) for _ in range(rng.randrange(4, 60))], "max_tokens": 150,
            "ignore_eos": True, "n": rng.choice([1, 1, 2]), "stream": how != "non-streaming"}
    data = json.dumps(body).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n")
    host, port = url.rsplit("//", 1)[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head + data)
    await writer.drain()
    if how == "mid-stream":
        chunks, wanted = 0, rng.randrange(1, 40)
        while chunks < wanted:
            line = await reader.readline()
            if not line:
                break
            chunks += line.startswith(b"data: ")
    elif how == "non-streaming":
        await asyncio.sleep(rng.uniform(0.05, 1.0))
    else:   # before the headers: close at once (a reset, as a crashed client)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    writer.close()
    return how


def row_disconnect_storm(model: str, num: int, seed: int) -> dict:
    rng = random.Random(seed)
    with Server(model, "--max-num-queued-requests", "64") as server:
        before = server.metrics()

        async def storm():
            kinds = [rng.choice(["before-headers", "mid-stream", "non-streaming"]) for _ in range(num)]
            sem = asyncio.Semaphore(32)

            async def one(kind):
                async with sem:
                    return await _cut(server.url, rng, kind)
            return await asyncio.gather(*(one(k) for k in kinds), return_exceptions=True)
        t0 = time.monotonic()
        results = asyncio.run(storm())
        errors = [repr(r) for r in results if isinstance(r, BaseException)]
        idle = idle_figures(server)
        # The queue limit was not eaten by the clients that left.
        after = httpx.post(f"{server.url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=60)
        generated = server.metrics()["generation_tokens_total"] - before["generation_tokens_total"]
    kinds = {k: sum(1 for r in results if r == k) for k in ("before-headers", "mid-stream", "non-streaming")}
    return {"streams": num, "kinds": kinds, "client_errors": errors[:5], "seconds": round(time.monotonic() - t0, 1),
            "tokens_generated": generated, "max_possible_tokens": num * 2 * 150, "idle": idle,
            "request_after": after.status_code, "ok": not any(idle.values()) and after.status_code == 200}


def row_pool_exhaustion(model: str, num: int) -> dict:
    # 40 blocks of 16 tokens: 640 tokens of KV; `num` prompts of 100 + 60 tokens need 160 each.
    prompts = [[(7 * i + k) % 400 + 3 for k in range(100)] for i in range(num)]

    def complete(server, prompt):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 60, "temperature": 0,
                                                               "ignore_eos": True}, timeout=600)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]
    with Server(model, "--num-kv-blocks", "41", "--no-enable-prefix-caching") as server:
        async def together():
            async with httpx.AsyncClient(timeout=600) as client:
                rs = await asyncio.gather(*(client.post(f"{server.url}/v1/completions", json={
                    "prompt": p, "max_tokens": 60, "temperature": 0, "ignore_eos": True}) for p in prompts))
            return [r.json()["choices"][0]["text"] if r.status_code == 200 else f"HTTP {r.status_code}" for r in rs]
        t0 = time.monotonic()
        concurrent = asyncio.run(together())
        seconds = time.monotonic() - t0
        preemptions = server.metrics()["num_preemptions_total"]
        alone = [complete(server, p) for p in prompts]
        idle = idle_figures(server)
    same = sum(a == b for a, b in zip(concurrent, alone))
    return {"requests": num, "kv_tokens": 640, "tokens_needed": num * 160, "preemptions": preemptions,
            "identical_to_alone": same, "seconds": round(seconds, 1), "idle": idle,
            "ok": same == num and not any(idle.values())}


def row_step_fault(model: str, mode: str) -> dict:
    trigger = Path(tempfile.mkdtemp(prefix="jaxserve-fault-")) / "trigger"
    extra = ["--step-timeout-s", "3"] if mode == "hang" else []
    server = Server(model, *extra, fault=mode, trigger=trigger)
    events: list[list[str]] = [[] for _ in range(4)]

    async def stream(i):
        async with httpx.AsyncClient(timeout=120) as client:
            async with client.stream("POST", f"{server.url}/v1/completions", json={
                    "prompt": [5 + i, 6, 7], "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events[i].append(line[6:])
                        if len(events[i]) == 3 and i == 0:
                            trigger.touch()     # the next step fails (or hangs)

    async def main():
        return await asyncio.gather(*(stream(i) for i in range(4)), return_exceptions=True)
    t0 = time.monotonic()
    results = asyncio.run(main())
    failed_at = trigger.stat().st_mtime if trigger.exists() else None
    health = None
    try:
        health = httpx.get(f"{server.url}/health", timeout=2).status_code
    except httpx.HTTPError:
        health = "gone"
    try:
        code = server.proc.wait(60)
    except subprocess.TimeoutExpired:
        code = None
    exit_s = time.time() - failed_at if failed_at else None
    server.stop()
    ended_well = [bool(e) and e[-1] == "[DONE]" and "error" in json.loads(e[-2]) for e in events]
    return {"mode": mode, "clients": len(events), "client_exceptions": [repr(r) for r in results if r][:3],
            "clients_with_error_event_and_done": sum(ended_well), "health_after": health, "exit_code": code,
            "seconds_to_exit": None if exit_s is None else round(exit_s, 1),
            "seconds": round(time.monotonic() - t0, 1),
            "ok": all(ended_well) and code == 1 and health in (503, "gone")}


def row_request_fault(model: str, num: int, seed: int) -> dict:
    """`num` clients at once, a third of them marked (half of those in their output processing, half
    in their grammar); streamed or not, n 1 or 2."""
    _tests_importable()
    from tests.faults import GRAMMAR_MARKER, MARKER

    rng = random.Random(seed)
    plans = [dict(marked=i % 3 == 0, fault="output" if i % 6 == 0 else "grammar", stream=rng.random() < 0.5,
                  n=rng.choice([1, 2])) for i in range(num)]
    with Server(model, fault="request") as server:
        async def one(client, i, plan):
            ids = [rng.randrange(3, 200) for _ in range(rng.randrange(4, 30))]
            body = {"prompt": ids, "max_tokens": 40, "ignore_eos": True, "n": plan["n"], "stream": plan["stream"]}
            if plan["marked"] and plan["fault"] == "output":
                body["prompt"] = ids + MARKER
            elif plan["marked"]:
                body["structured_outputs"] = {"regex": f"({GRAMMAR_MARKER})?[a-z ]{{60,80}}"}
            if plan["stream"]:
                body["stream_options"] = {"include_usage": True}
            if not plan["stream"]:
                r = await client.post(f"{server.url}/v1/completions", json=body)
                usage = r.json().get("usage", {}) if r.status_code == 200 else {}
                return r.status_code == 500 if plan["marked"] else \
                    r.status_code == 200 and usage.get("completion_tokens") == 40 * plan["n"]
            events = []
            async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
            if plan["marked"]:
                return events[-1:] == ["[DONE]"] and "error" in json.loads(events[-2])
            chunks = [json.loads(e) for e in events[:-1]]
            usage = chunks[-1].get("usage") or {} if chunks else {}
            return events[-1:] == ["[DONE]"] and not any("error" in c for c in chunks) and \
                usage.get("completion_tokens") == 40 * plan["n"]

        async def main():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(one(client, i, p) for i, p in enumerate(plans)))
        t0 = time.monotonic()
        results = asyncio.run(main())
        seconds = time.monotonic() - t0
        try:
            health = httpx.get(f"{server.url}/health", timeout=10).status_code
            after = httpx.post(f"{server.url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 4},
                               timeout=60).status_code
            idle = idle_figures(server)
        except httpx.HTTPError:     # the server went down with the failure
            health = after = "gone"
            idle = {"server": "gone"}
    marked = sum(p["marked"] for p in plans)
    as_expected_marked = sum(ok for ok, p in zip(results, plans) if p["marked"])
    as_expected_other = sum(ok for ok, p in zip(results, plans) if not p["marked"])
    by_fault = {f: sum(ok for ok, p in zip(results, plans) if p["marked"] and p["fault"] == f)
                for f in ("output", "grammar")}
    return {"clients": num, "marked": marked, "marked_failed_alone": as_expected_marked,
            "failed_alone_by_fault": by_fault,
            "others_served_whole": as_expected_other, "health_after": health, "request_after": after,
            "seconds": round(seconds, 1), "idle": idle,
            "ok": all(results) and health == 200 and after == 200 and not any(idle.values())}


def row_soak(model: str, seconds: float, seed: int) -> dict:
    rng = random.Random(seed)
    with Server(model, "--max-num-queued-requests", "128") as server:
        windows: list[dict] = []
        errors: list[str] = []
        window_s = max(5.0, seconds / 10)

        async def client(stop_at, itls, counter):
            async with httpx.AsyncClient(timeout=120) as http:
                while time.monotonic() < stop_at:
                    body = {"prompt": [rng.randrange(3, 500) for _ in range(rng.randrange(4, 80))],
                            "max_tokens": rng.randrange(4, 64), "ignore_eos": True, "stream": True,
                            "n": rng.choice([1, 1, 1, 2])}
                    leave_after = rng.choice([None, None, None, rng.randrange(1, 8)])
                    try:
                        async with http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                            if r.status_code != 200:
                                errors.append(f"HTTP {r.status_code}")
                                continue
                            last, chunks = None, 0
                            async for line in r.aiter_lines():
                                if not line.startswith("data: "):
                                    continue
                                now = time.monotonic()
                                if line == "data: [DONE]":
                                    break
                                if '"error"' in line:
                                    errors.append(line[:200])
                                if last is not None and body["n"] == 1:
                                    itls.append(now - last)
                                last, chunks = now, chunks + 1
                                if leave_after is not None and chunks >= leave_after:
                                    break      # a client that goes away mid-stream
                        counter[0] += 1
                    except httpx.HTTPError as e:
                        errors.append(repr(e))
                    await asyncio.sleep(rng.uniform(0, 0.2))

        async def window(duration):
            itls, counter = [], [0]
            stop_at = time.monotonic() + duration
            await asyncio.gather(*(client(stop_at, itls, counter) for _ in range(8)))
            return itls, counter[0]
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            itls, done = asyncio.run(window(min(window_s, t_end - time.monotonic())))
            windows.append({"requests": done, "itl_p99_ms": round(1000 * _p99(itls), 1) if itls else None,
                            "rss_mib": round(server.rss_bytes() / 2**20, 1)})
        idle = idle_figures(server)
    rss = [w["rss_mib"] for w in windows]
    warm = rss[min(1, len(rss) - 1)]
    growth = (rss[-1] - warm) / warm
    p99s = [w["itl_p99_ms"] for w in windows if w["itl_p99_ms"] is not None]
    return {"seconds": seconds, "windows": windows, "errors": len(errors), "error_samples": errors[:5],
            "rss_growth_after_warmup": round(growth, 4), "itl_p99_ms_first_last": [p99s[0], p99s[-1]] if p99s else None,
            "itl_p99_ms_median": statistics.median(p99s) if p99s else None, "idle": idle,
            "ok": not errors and growth < 0.05 and not any(idle.values())}


def _p99(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def row_bad_bodies(model: str) -> dict:
    deep = "[" * 200_000 + "]" * 200_000
    cases = {
        "10 MB body": b'{"prompt": "' + b"x" * 10_000_000 + b'"}',
        "deep JSON": b'{"prompt": "x", "metadata": {"a": ' + deep.encode()[:100_000] + deep.encode()[-100_000:] + b"}}",
        "invalid UTF-8": b'{"prompt": "\xff\xfe\xfd"}',
        "huge n": json.dumps({"prompt": "x", "n": 10**12}).encode(),
        "n x prompts": json.dumps({"prompt": [[1]] * 2048, "n": 128}).encode(),
        "huge logprobs": json.dumps({"prompt": "x", "logprobs": 10**9}).encode(),
        "huge prompt_logprobs": json.dumps({"prompt": "x", "prompt_logprobs": 10**9}).encode(),
        "10k stop strings": json.dumps({"prompt": "x", "stop": ["s"] * 10_000}).encode(),
        "1 MB stop string": json.dumps({"prompt": "x", "stop": "s" * 1_000_000}).encode(),
        "100k stop token ids": json.dumps({"prompt": "x", "stop_token_ids": [1] * 100_000}).encode(),
        "100k logit_bias tokens": json.dumps({"prompt": "x",
                                              "logit_bias": {str(t): 1 for t in range(100_000)}}).encode(),
        "100k prompts": json.dumps({"prompt": ["a"] * 100_000}).encode(),
    }
    statuses = {}
    with Server(model) as server:
        for name, data in cases.items():
            r = httpx.post(f"{server.url}/v1/completions", content=data,
                           headers={"content-type": "application/json"}, timeout=60)
            statuses[name] = r.status_code
        idle = idle_figures(server)
    return {"statuses": statuses, "idle": idle,
            "ok": all(s in (400, 413) for s in statuses.values()) and not any(idle.values())}


ROWS = ("schemathesis", "disconnects", "pool", "step-failure", "hung-step", "request-failure", "soak", "bad-bodies")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder or GGUF (default: the tests' tiny llama)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {', '.join(ROWS)}")
    ap.add_argument("--schemathesis-examples", type=int, default=300,
                    help="generated bodies per route and mode (valid / not)")
    ap.add_argument("--storm", type=int, default=200, help="clients in the disconnect storm")
    ap.add_argument("--pool-requests", type=int, default=12)
    ap.add_argument("--request-clients", type=int, default=48, help="clients in the request-failure row")
    ap.add_argument("--soak-s", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-file", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        ap.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    model = args.model or tiny_model()
    results = {}
    for name in rows:
        t0 = time.monotonic()
        if name == "schemathesis":
            out = row_schemathesis(model, args.schemathesis_examples, args.seed)
        elif name == "disconnects":
            out = row_disconnect_storm(model, args.storm, args.seed)
        elif name == "pool":
            out = row_pool_exhaustion(model, args.pool_requests)
        elif name == "step-failure":
            out = row_step_fault(model, "raise")
        elif name == "hung-step":
            out = row_step_fault(model, "hang")
        elif name == "request-failure":
            out = row_request_fault(model, args.request_clients, args.seed)
        elif name == "soak":
            out = row_soak(model, args.soak_s, args.seed)
        else:
            out = row_bad_bodies(model)
        out["row_seconds"] = round(time.monotonic() - t0, 1)
        results[name] = out
        print(f"{name:13s} {'PASS' if out['ok'] else 'FAIL'}  {json.dumps(out)[:600]}", flush=True)
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results.values()) else 1


def fault_serve(mode: str, serve_args: list[str]) -> int:
    """`jaxserve serve` whose next step raises (or hangs) once $JAXSERVE_FAULT_TRIGGER exists, or
    (mode "request") whose output processing raises for prompts that end with tests/faults.py's MARKER
    and whose grammar raises for a regex that holds its GRAMMAR_MARKER."""
    from jaxserve.cli import main as cli_main
    from jaxserve.engine.detokenizer import IncrementalDetokenizer
    from jaxserve.engine.structured_output import GrammarCompiler
    from jaxserve.runner.model_runner import ModelRunner

    if mode == "request":
        _tests_importable()
        from tests.faults import raising_for_marked, raising_grammar_for_marked

        IncrementalDetokenizer.update = raising_for_marked(IncrementalDetokenizer.update, after=3)
        GrammarCompiler.grammar = raising_grammar_for_marked(GrammarCompiler.grammar, "fill", after=3)
        return cli_main(["serve", *serve_args])
    trigger = Path(os.environ["JAXSERVE_FAULT_TRIGGER"])
    real_launch = ModelRunner.launch

    def launch(self, so, grammars=None, prev=None):
        if trigger.exists():
            if mode == "raise":
                raise RuntimeError("injected step failure")
            time.sleep(3600)
        return real_launch(self, so, grammars, prev)
    ModelRunner.launch = launch
    return cli_main(["serve", *serve_args])


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--fault-serve":
        sys.exit(fault_serve(sys.argv[2], sys.argv[3:]))
    sys.exit(main())
