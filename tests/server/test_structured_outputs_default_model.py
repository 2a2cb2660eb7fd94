"""Structured output on the default model (SmolLM2-135M-Instruct) through the official openai
client: 50 generations under each schema validate, choice and regex always match."""

import json
import re

import jsonschema
import openai
import pytest

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.llm_engine import LLMEngine
from tests.engine.structured_cases import CHOICES, REGEX, SCHEMAS

from .conftest import RunningServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client():
    engine = LLMEngine.from_kwargs(None, dtype="float32", max_num_batched_tokens=64, max_num_seqs=64,
                                   max_model_len=512, token_buckets=(1, 4, 16, 64))
    srv = RunningServer(AsyncEngine(engine), served_model_name="smollm2")
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
    srv.stop()
    assert engine.stats()["compiles_after_warmup"] == 0


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_50_generations_per_schema_validate(client, name):
    schema = SCHEMAS[name]
    r = client.chat.completions.create(
        model="smollm2", n=50, max_tokens=120, temperature=1.0, seed=11,
        messages=[{"role": "user", "content": f"Reply with JSON matching this schema: {json.dumps(schema)}"}],
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)


def test_choice_and_regex_always_match(client):
    r = client.chat.completions.create(model="smollm2", n=50, max_tokens=10, temperature=1.0, seed=12,
                                       messages=[{"role": "user", "content": "Should we go? Answer."}],
                                       extra_body={"structured_outputs": {"choice": CHOICES}})
    assert all(c.message.content in CHOICES for c in r.choices)
    r = client.completions.create(model="smollm2", prompt="Ticket id:", n=50, max_tokens=20, temperature=1.0,
                                  seed=13, extra_body={"structured_outputs": {"regex": REGEX}})
    assert all(re.fullmatch(REGEX, c.text) for c in r.choices)
