"""`jaxserve serve` as a real process: SIGTERM mid-stream, and the default model with no model argument."""

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from jaxserve.engine import cpu_malloc

from .conftest import free_port


def start(args, timeout=600):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "server did not become healthy"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)


def test_sigterm_finishes_in_flight_streams_and_exits_cleanly(tiny_models):
    proc, url = start([str(tiny_models["llama"]), "--max-model-len", "128", "--num-kv-blocks", "64",
                       "--max-num-batched-tokens", "16", "--max-num-seqs", "4", "--token-buckets", "4,16"])
    lines, first = [], threading.Event()

    def stream():
        body = {"prompt": "hello", "max_tokens": 60, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    first.set()
    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(60)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.stdout.read()
    t.join(30)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(x[6:]) for x in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"      # finished, not cut
    assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) > 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)
    # On a CPU the engine set malloc to keep the step's buffers in the heap, and said so.
    assert ("malloc serves every allocation from the heap" in proc.stdout.read()) == cpu_malloc.wanted()


@pytest.mark.slow
def test_serves_the_default_model_with_no_model_argument():
    proc, url = start(["--dtype", "float32", "--max-model-len", "512", "--max-num-batched-tokens", "32",
                       "--max-num-seqs", "8"])
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        (model,) = client.models.list().data
        assert model.id == "SmolLM2-135M-Instruct"
        r = client.completions.create(model=model.id, prompt="Once upon a time", max_tokens=12, temperature=0)
        assert r.choices[0].text.startswith(", the city of Nova Haven was a thriving metropolis")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
