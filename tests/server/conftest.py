"""A real jaxserve server on a free loopback port, over the tiny model."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import uvicorn

from checkpoints import load_hf_folder
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.tokenizer import Tokenizer
from server import create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(self, engine: AsyncEngine, **app_kwargs) -> None:
        self.port = free_port()
        self.engine = engine
        self.app = create_app(engine, **app_kwargs)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


# The scripted engine's tests (tests/server/scripted.py) generate words of this sentence.
SENTENCE = " one two three four five six seven eight nine ten eleven twelve"


@pytest.fixture(scope="module")
def tok(tiny_models):
    """The tiny model's real tokenizer."""
    return Tokenizer.from_checkpoint(load_hf_folder(tiny_models["llama"]))


@pytest.fixture(scope="module")
def words(tok):
    return tok.encode(SENTENCE, add_special_tokens=False)


@pytest.fixture(scope="session")
def tiny_llm_engine(tiny_engine):
    return tiny_engine


@pytest.fixture(scope="module")
def server(tiny_llm_engine):
    srv = RunningServer(AsyncEngine(tiny_llm_engine, max_num_queued_requests=200), served_model_name="tiny",
                        max_request_body_bytes=64 * 1024)
    yield srv
    srv.stop()


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)
