"""The model's generation_config.json as the defaults of the sampling fields a request leaves out
(--generation-config auto, vLLM's default), in the server, the library and a batch job alike."""

import json
import shutil

import httpx
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.batch import run_batch
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.core.sampling_params import sampling_defaults
from tests.conftest import TINY_ENGINE_OPTIONS
from tests.server.conftest import RunningServer

# top_k 1 makes the model's defaults greedy: a request that leaves them out is deterministic.
GENERATION = {"bos_token_id": 1, "eos_token_id": 2, "top_k": 1, "temperature": 0.7, "repetition_penalty": 1.3,
              "max_new_tokens": 5, "top_p": 1.0, "do_sample": True}
DEFAULTS = {"top_k": 1, "temperature": 0.7, "repetition_penalty": 1.3, "max_tokens": 5}
OPTIONS = {**TINY_ENGINE_OPTIONS, "token_buckets": (16, 64)}


def test_the_defaults_are_what_differs_from_hugging_faces():
    assert sampling_defaults(GENERATION) == DEFAULTS     # top_p 1.0 and do_sample are HF's defaults / no field
    assert sampling_defaults({"top_k": 50, "temperature": 1.0, "min_p": 0.05, "top_p": 0.9}) == {"min_p": 0.05,
                                                                                                "top_p": 0.9}
    assert sampling_defaults({"temperature": "hot", "top_k": None, "max_new_tokens": True}) == {}
    assert sampling_defaults(GENERATION, "none") == {}


@pytest.fixture(scope="module")
def model_folder(tiny_models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("generation") / "tiny"
    shutil.copytree(tiny_models["llama"], folder)
    (folder / "generation_config.json").write_text(json.dumps(GENERATION))
    return folder


@pytest.fixture(scope="module")
def llm(model_folder):
    return LLM(str(model_folder), **OPTIONS)


def test_the_library_uses_them_without_sampling_params(llm):
    assert llm.engine.sampling_defaults == DEFAULTS
    defaults = llm.get_default_sampling_params()
    assert (defaults.top_k, defaults.temperature, defaults.repetition_penalty, defaults.max_tokens) == (1, 0.7, 1.3, 5)
    (implicit,), (explicit,) = (llm.generate(["once upon a"], params, use_tqdm=False)
                                for params in (None, SamplingParams(top_k=1, temperature=0.7, repetition_penalty=1.3,
                                                                    max_tokens=5)))
    assert implicit.outputs[0].token_ids == explicit.outputs[0].token_ids
    assert len(implicit.outputs[0].token_ids) == 5 or implicit.outputs[0].finish_reason == "stop"


def test_requests_that_leave_a_field_out_get_the_models_value(llm):
    engine = AsyncEngine(llm.engine)
    server = RunningServer(engine, served_model_name="tiny")
    try:
        def chat(**fields):
            body = {"messages": [{"role": "user", "content": "count with me"}], "ignore_eos": True, **fields}
            reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
            return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"]

        implicit = chat()
        assert implicit[1] == 5                                              # max_new_tokens caps it
        assert implicit == chat(top_k=1, temperature=0.7, repetition_penalty=1.3, max_tokens=5)
        assert chat(max_tokens=9)[1] == 9                                    # the request's own value wins
        # A request's own value replaces the model's: no repetition penalty changes the greedy text.
        greedy = chat(top_k=1, repetition_penalty=1.0, max_tokens=5)
        assert chat(repetition_penalty=1.0) == greedy
        body = {"prompt": "once upon a", "ignore_eos": True}     # completions keep the API's max_tokens, 16
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert reply["usage"]["completion_tokens"] == 16
    finally:
        server.stop()
        engine.shutdown()


def test_a_batch_job_uses_them(llm, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"custom_id": cid, "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "count with me"}], "ignore_eos": True, **extra}}
             for cid, extra in (("implicit", {}), ("explicit", dict(top_k=1, temperature=0.7, repetition_penalty=1.3,
                                                                     max_tokens=5)))]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run_batch(llm.engine, src, dst, use_tqdm=False)
    rows = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, dst.read_text().splitlines())}
    assert rows["implicit"]["choices"][0]["message"] == rows["explicit"]["choices"][0]["message"]
    assert rows["implicit"]["usage"]["completion_tokens"] == 5


def test_generation_config_none_keeps_jaxserves_own(model_folder):
    llm = LLM(str(model_folder), generation_config="none", **OPTIONS)
    assert llm.engine.sampling_defaults == {} and llm.get_default_sampling_params().top_k == SamplingParams().top_k
    with pytest.raises(ValueError, match="generation_config='vllm' must be 'auto'"):
        LLM(str(model_folder), generation_config="vllm", **OPTIONS)
