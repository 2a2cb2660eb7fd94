"""Shared test fixtures: tiny random-weight Hugging Face model folders.

`tiny_models["llama"]` (also "llama3", "qwen2", "qwen3", "mistral") is the path of a
folder written on first use and reused for the rest of the session.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.tiny_models import TINY_MODEL_NAMES, write_tiny_model


def pytest_addoption(parser):
    parser.addoption("--pallas-on-device", action="store_true",
                     help="run the Pallas kernel tests compiled for this machine's GPU / TPU instead of in "
                          "interpret mode (benchmarks/device_check.sh passes it)")


class TinyModels:
    """Lazily written tiny model folders under one session temp dir, by name."""

    def __init__(self, root: Path):
        self._root = root
        self._paths: dict[str, Path] = {}

    def __getitem__(self, name: str) -> Path:
        if name not in TINY_MODEL_NAMES:
            raise KeyError(f"unknown tiny model {name!r}; known: {', '.join(TINY_MODEL_NAMES)}")
        if name not in self._paths:
            self._paths[name] = write_tiny_model(name, self._root / name)
        return self._paths[name]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny_models"))


# One tiny-model engine shared by the engine, batch and server tests: building one compiles the
# step for each token bucket, which dominates those tests' run time.
TINY_ENGINE_OPTIONS = dict(dtype="float32", max_num_batched_tokens=64, max_num_seqs=64, num_kv_blocks=512,
                           max_model_len=128, token_buckets=(4, 16, 64))


@pytest.fixture(scope="session")
def tiny_engine(tiny_models):
    from jaxserve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_kwargs(str(tiny_models["llama"]), **TINY_ENGINE_OPTIONS)
    yield engine
    assert not engine.has_unfinished_requests(), "a test left requests in the shared engine"
