"""Structured output through the official openai client: response_format (json_object,
json_schema) and vLLM's structured_outputs (extra_body), streaming and not; bad constraints are
400s naming the problem."""

import json
import re

import jsonschema
import openai
import pytest

from tests.engine.structured_cases import CHOICES, REGEX, SCHEMAS


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate_through_the_openai_client(client, name):
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Give me JSON."}],
                                       response_format=fmt, n=50, max_tokens=100, temperature=1.0, seed=3)
    assert len(r.choices) == 50
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)


def test_streamed_json_joins_to_a_valid_object(client):
    schema = SCHEMAS["nested"]
    chunks = client.completions.create(model="tiny", prompt="JSON:", max_tokens=100, stream=True, temperature=1.0,
                                       seed=5, extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                           "name": "n", "schema": schema}}})
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_vllm_structured_outputs_choice_and_regex(client):
    r = client.completions.create(model="tiny", prompt="pick", max_tokens=20, n=20, temperature=1.0, seed=1,
                                  extra_body={"structured_outputs": {"choice": CHOICES}})
    assert all(c.text in CHOICES for c in r.choices)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "id?"}], max_tokens=20,
                                       n=20, temperature=1.0, seed=2,
                                       extra_body={"structured_outputs": {"regex": REGEX}})
    assert all(re.fullmatch(REGEX, c.message.content) for c in r.choices)


def test_json_object(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=100,
                                       response_format={"type": "json_object"}, temperature=0)
    c = r.choices[0]
    assert c.message.content.startswith("{")
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)


@pytest.mark.parametrize("extra,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nosuch"}}}},
     "invalid JSON schema"),
    ({"structured_outputs": {"regex": "[a-"}}, "invalid regex"),
    ({"structured_outputs": {"grammar": "start: ???"}}, "invalid grammar"),
    ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "exactly one of"),
    ({"response_format": {"type": "json_schema"}}, "needs json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
])
def test_bad_constraints_are_400s_naming_the_problem(client, extra, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=5, extra_body=extra)
    assert message in e.value.message


def test_max_tokens_first_is_length(client):
    r = client.completions.create(model="tiny", prompt="x", max_tokens=3,
                                  extra_body={"structured_outputs": {"regex": "[a-z]{30}"}})
    assert r.choices[0].finish_reason == "length" and re.fullmatch("[a-z]+", r.choices[0].text)
