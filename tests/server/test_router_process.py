"""`jaxserve router` end to end: real producer, consumer and router processes on 127.0.0.1 give
the outputs of one `jaxserve serve`, token for token, over the tiny model.

The instances and the plain server run with the same engine flags (float32, 16-token blocks,
16-token steps), so the consumer, which pulls the prompt's full blocks and computes the rest,
runs the same chunks a single server does. Processes start one after the other (each
compiles its step at start-up, which the machine's cores would otherwise share).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from .conftest import free_port, metric

pytestmark = pytest.mark.slow

ENGINE = ["--dtype", "float32", "--max-model-len", "128", "--num-kv-blocks", "64", "--max-num-batched-tokens", "16",
          "--max-num-seqs", "4", "--token-buckets", "4,16", "--block-size", "16"]
PROMPTS = {
    "shorter than a block": "The moon is bright",
    "short": "Once upon a time, in a small town by the sea, there lived an old fisherman and his daughter.",
    "long": "Every morning they walked down to the harbour, pushed their little boat into the water and sailed out "
            "beyond the rocks. The sun rose over the waves, the gulls cried above them, and the wind carried the "
            "smell of salt and rain. In the evening they came home with their nets full.",
}
SAMPLING = {"greedy": {"temperature": 0}, "seeded": {"temperature": 1.0, "seed": 1234, "top_p": 0.9}}


class Process:
    """A `jaxserve` command on a free port, logging to a file, up once its /health answers 200."""

    def __init__(self, args: list[str], log_path, timeout_s: float = 600) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", *args, "--port", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            assert self.proc.poll() is None, self.log_path.read_text()
            assert time.monotonic() < deadline, f"{args[0]} did not become healthy"
            time.sleep(0.3)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        self.log.close()
        return code


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    """(a plain server, the router, the consumer) over the same tiny model."""
    model, logs = str(tiny_models["llama"]), tmp_path_factory.mktemp("router_logs")
    procs = {"single": Process(["serve", model, *ENGINE], logs / "single.log")}
    grpc = {role: free_port() for role in ("producer", "consumer")}
    for role, port in grpc.items():
        procs[role] = Process(["serve", model, *ENGINE, "--kv-role", role, "--grpc-port", str(port)],
                              logs / f"{role}.log")
    procs["router"] = Process(["router", model, "--prefill", f"127.0.0.1:{grpc['producer']}", "--decode",
                               f"127.0.0.1:{grpc['consumer']}"], logs / "router.log")
    yield procs
    codes = {name: p.stop() for name, p in reversed(procs.items())}
    assert codes == dict.fromkeys(codes, 0), codes


def client(proc: Process) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0)


def model_of(proc: Process) -> str:
    return client(proc).models.list().data[0].id


def completion(proc: Process, prompt: str, **kw):
    return client(proc).completions.create(model=model_of(proc), prompt=prompt, max_tokens=16, logprobs=2,
                                           extra_body={"ignore_eos": True}, **kw)


def path_count(proc: Process, path: str) -> float:
    line = next(x for x in httpx.get(f"{proc.url}/metrics").text.splitlines()
                if x.startswith("jaxserve:router_requests_total{") and f'path="{path}"' in x)
    return float(line.rsplit(" ", 1)[1])


def assert_same(got, want) -> None:
    """Same choices, texts, tokens, finish and logprobs, bit for bit: with 16-token steps and blocks the
    consumer computes the prompt's tail in the very chunk a single server computes last."""
    assert len(got.choices) == len(want.choices)
    for g, w in zip(got.choices, want.choices):
        assert (g.index, g.text, g.finish_reason) == (w.index, w.text, w.finish_reason)
        assert (g.logprobs.tokens, g.logprobs.token_logprobs, g.logprobs.top_logprobs) == \
            (w.logprobs.tokens, w.logprobs.token_logprobs, w.logprobs.top_logprobs)


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_router_outputs_are_those_of_a_single_server(cluster, prompt, sampling):
    path = "decode_only" if prompt == "shorter than a block" else "disaggregated"
    before = path_count(cluster["router"], path)
    want = completion(cluster["single"], PROMPTS[prompt], **SAMPLING[sampling])
    assert_same(completion(cluster["router"], PROMPTS[prompt], **SAMPLING[sampling]), want)
    assert path_count(cluster["router"], path) == before + 1


def test_n2_streaming_and_chat_match_a_single_server(cluster):
    kw = dict(n=2, seed=99, temperature=0.8)
    want = completion(cluster["single"], PROMPTS["long"], **kw)
    assert_same(completion(cluster["router"], PROMPTS["long"], **kw), want)
    chunks = list(completion(cluster["router"], PROMPTS["long"], stream=True, **kw))
    for c in want.choices:
        assert "".join(x.choices[0].text for x in chunks if x.choices and x.choices[0].index == c.index) == c.text
    msgs = [{"role": "user", "content": PROMPTS["short"]}]
    chats = [client(p).chat.completions.create(model=model_of(p), messages=msgs, max_tokens=12, temperature=0,
                                               extra_body={"ignore_eos": True}).choices[0].message.content
             for p in (cluster["single"], cluster["router"])]
    assert chats[0] == chats[1]


def test_the_consumer_computes_only_the_prompt_tail(cluster):
    """The pull is real: of a 2-block-plus prompt, the consumer computes only what follows its full blocks."""
    prompt = ("The daughter asked many questions. Why is the sky blue? Where do the birds go in winter? How deep is "
              "the ocean, and what lives at the bottom of it?")     # in no other test: in no prefix cache
    ids = httpx.post(f"{cluster['router'].url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    before = metric(cluster["consumer"].url, "jaxserve:prompt_tokens_total")
    completion(cluster["router"], prompt)
    computed = metric(cluster["consumer"].url, "jaxserve:prompt_tokens_total") - before
    assert 0 < computed <= 16 < len(ids)
