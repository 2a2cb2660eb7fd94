"""The server driven by the official `openai` client (sync and async, streaming and not)."""

import asyncio

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def test_models(client):
    (m,) = client.models.list().data
    assert m.id == "tiny"


def test_completion_and_usage(client):
    r = client.completions.create(model="tiny", prompt="hello world", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens > 0
    again = client.completions.create(model="tiny", prompt="hello world", max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == r.choices[0].text


def test_token_id_prompts_list_of_prompts_and_echo(client):
    r = client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=2, echo=True,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    r = client.completions.create(model="tiny", prompt="abc def", max_tokens=2, echo=True,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text.startswith("abc def")


def test_streaming_completion_matches_non_streaming(client):
    kw = dict(model="tiny", prompt="the cat", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streaming_and_not(client):
    msgs = [{"role": "user", "content": "hi there"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert full.usage.completion_tokens == 8


def test_n2_stop_seed_logprobs(client):
    r = client.completions.create(model="tiny", prompt="x", max_tokens=6, n=2, seed=7, temperature=1.0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    assert len(r.choices) == 2 and all(len(c.logprobs.tokens) == 6 for c in r.choices)
    # top_logprobs maps token text -> logprob (OpenAI's shape): the top 2 plus the sampled token, fewer when
    # byte tokens decode to the same text.
    assert all(1 <= len(t) <= 3 for t in r.choices[0].logprobs.top_logprobs)
    assert all(lp <= 0 for lp in r.choices[0].logprobs.token_logprobs)
    r2 = client.completions.create(model="tiny", prompt="x", max_tokens=6, n=2, seed=7, temperature=1.0,
                                   logprobs=2, extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [c.text for c in r2.choices]
    free = client.completions.create(model="tiny", prompt="once", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[5:8]
    stopped = client.completions.create(model="tiny", prompt="once", max_tokens=20, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True}).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == free[:free.index(stop)]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=3,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 for c in content)


def test_async_client_concurrent_streams(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")

        async def one(i):
            text = ""
            stream = await client.completions.create(model="tiny", prompt=f"item {i}", max_tokens=8,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            async for c in stream:
                text += c.choices[0].text
            return text
        results = await asyncio.gather(*(one(i) for i in range(16)))
        single = await client.completions.create(model="tiny", prompt="item 3", max_tokens=8, temperature=0,
                                                 extra_body={"ignore_eos": True})
        await client.close()
        return results, single.choices[0].text
    results, single = asyncio.run(main())
    assert results[3] == single and all(results)


def test_logit_bias_raises_bans_and_is_per_request(client, server):
    """OpenAI's logit_bias through the official client: +100 makes a token every choice, -100 on each
    of the greedy text's tokens changes the text, and a request without one keeps its own text."""
    kw = dict(model="tiny", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    tokenized = httpx.post(f"{server.url}/tokenize", json={"prompt": " cat", "add_special_tokens": False}).json()
    word = tokenized["tokens"][0]
    forced = httpx.post(f"{server.url}/detokenize", json={"tokens": [word] * 5}).json()["prompt"]
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], logit_bias={str(word): 100},
                                          **kw)
    assert chat.choices[0].message.content == forced
    plain = client.completions.create(prompt=[5, 6, 7], **kw).choices[0].text
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": plain, "add_special_tokens": False}).json()["tokens"]
    banned = client.completions.create(prompt=[5, 6, 7], logit_bias={str(t): -100 for t in ids}, stream=True, **kw)
    text = "".join(c.choices[0].text for c in banned)
    assert text and text != plain
    assert client.completions.create(prompt=[5, 6, 7], **kw).choices[0].text == plain


def test_truncate_prompt_tokens_keeps_the_last_tokens_and_echo_shows_them(client, server):
    ids = list(range(40, 70))
    kw = dict(model="tiny", max_tokens=4, temperature=0, echo=True, extra_body={"ignore_eos": True})
    cut = client.completions.create(prompt=ids, **{**kw, "extra_body": {"ignore_eos": True,
                                                                           "truncate_prompt_tokens": 5}})
    short = client.completions.create(prompt=ids[-5:], **kw)
    assert cut.usage.prompt_tokens == 5 and cut.choices[0].text == short.choices[0].text
    text = client.completions.create(prompt="the cat sat on the mat", **{**kw, "extra_body": {
        "ignore_eos": True, "truncate_prompt_tokens": 2}})
    assert text.usage.prompt_tokens == 2 and not text.choices[0].text.startswith("the cat")
