"""OpenAI/vLLM API details on the real tiny engine: echo with logprobs has an entry per prompt
token, prompt_logprobs, streaming equals non-streaming, /tokenize renders what chat renders."""

import json

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def test_echo_with_logprobs_has_an_entry_for_every_prompt_token(client, server):
    prompt = [5, 17, 33, 2, 41, 9]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, echo=True, logprobs=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 4 == r.usage.prompt_tokens + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert all(len(t) >= 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # A token-id prompt's echo is its decode with its special tokens (2 here) kept, as vLLM's: the text
    # every text_offset points into.
    assert r.choices[0].text == "".join(lp.tokens)
    assert all(r.choices[0].text[o:o + len(t)] == t for o, t in zip(lp.text_offset, lp.tokens))
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": prompt}).json()["prompt"]
    assert r.choices[0].text.startswith(detok) and "".join(lp.tokens[:len(prompt)]) == detok
    # Echoed prompt tokens hold `logprobs` alternatives (and their own), however many prompt_logprobs asks.
    wide = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, echo=True, logprobs=1, temperature=0,
                                      extra_body={"prompt_logprobs": 5})
    tops = wide.choices[0].logprobs.top_logprobs
    assert tops[0] is None and all(1 <= len(t) <= 2 for t in tops[1:])
    assert 5 <= len(wide.choices[0].prompt_logprobs[1]) <= 6     # the prompt_logprobs field keeps its 5
    # logprobs 1 with prompt_logprobs 2: a prompt token among its own best keeps one alternative (itself).
    near = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, echo=True, logprobs=1,
                                      temperature=0, extra_body={"prompt_logprobs": 2})
    plp = near.choices[0].prompt_logprobs
    for k, top in enumerate(near.choices[0].logprobs.top_logprobs[1:len(prompt)], start=1):
        ranked = sorted(plp[k].items(), key=lambda kv: -kv[1]["logprob"])
        own_best = ranked[0][0] == str(prompt[k])
        assert len(top) == (1 if own_best else 2)
    # logprobs 5 with prompt_logprobs 1: the prompt_logprobs field holds 1 (and the token's own).
    both = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, echo=True, logprobs=5,
                                      temperature=0, extra_body={"prompt_logprobs": 1})
    assert all(1 <= len(e) <= 2 for e in both.choices[0].prompt_logprobs[1:])
    assert max(len(t) for t in both.choices[0].logprobs.top_logprobs[1:len(prompt)]) >= 5
    # The prompt entries are vLLM's prompt_logprobs for the same prompt.
    plain = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1,
                                                             "prompt_logprobs": 2}).json()
    entries = plain["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    for k in range(1, len(prompt)):
        assert entries[k][str(prompt[k])]["logprob"] == pytest.approx(lp.token_logprobs[k], abs=1e-6)
    # Streamed, the same entries arrive (the echo and the prompt's entries first).
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=4, echo=True, logprobs=2,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    streamed = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset


def test_n2_streams_each_choice_finishing_once_with_usage_counted_once(client):
    chunks = list(client.completions.create(model="tiny", prompt=["a b", "c"], n=2, max_tokens=6, temperature=1,
                                            seed=5, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2, 3]
    assert chunks[-1].usage.completion_tokens == 4 * 6


def test_tokenize_chat_renders_what_chat_renders(client, server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    tools = [{"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                               "parameters": {"type": "object",
                                                              "properties": {"q": {"type": "string"}}}}}]
    for extra in ({}, {"tools": tools}, {"add_generation_prompt": False}):
        t = httpx.post(f"{server.url}/tokenize", json={"messages": messages, **extra}).json()
        body = {"model": "tiny", "messages": messages, "max_tokens": 1, **extra}
        if "tools" in extra:
            body["tool_choice"] = "none"
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body).json()
        assert t["count"] == r["usage"]["prompt_tokens"], extra
    bad = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "nonsense": 1})
    assert bad.status_code == 400


def test_tokenize_returns_the_token_strings_when_asked(server):
    # vLLM's return_token_strs (it was a 400: an unknown field): the vocabulary's string of each token.
    for body in ({"prompt": "hello there"}, {"messages": [{"role": "user", "content": "hello there"}]}):
        plain = httpx.post(f"{server.url}/tokenize", json=body).json()
        both = httpx.post(f"{server.url}/tokenize", json={**body, "return_token_strs": True}).json()
        assert "token_strs" not in plain and both["tokens"] == plain["tokens"]
        tok = server.engine.tokenizer
        assert both["token_strs"] == [tok._tokenizer.id_to_token(t) for t in plain["tokens"]]
        assert len(both["token_strs"]) == both["count"] and all(isinstance(x, str) for x in both["token_strs"])


def test_continue_final_message_renders_the_last_message_open(client, server):
    """vLLM's continue_final_message: the prompt ends with the last message's text (no end of turn),
    in /tokenize and in chat alike; with add_generation_prompt left on it is a 400 naming it."""
    messages = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "The answer is"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    t = httpx.post(f"{server.url}/tokenize", json={"messages": messages, **extra}).json()
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": t["tokens"]}).json()["prompt"]
    assert text.endswith("The answer is")
    closed = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert closed["count"] > t["count"]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, extra_body=extra)
    assert r.usage.prompt_tokens == t["count"]
    bad = httpx.post(f"{server.url}/v1/chat/completions",
                     json={"model": "tiny", "messages": messages, "continue_final_message": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"


def test_chat_echo_starts_each_choice_with_the_continued_message(client, server):
    """vLLM's chat `echo`: each choice's content is the last (assistant) message's text and then what
    the model wrote, streamed as a chunk of its own after the roles and before any generated text;
    usage counts only the generated tokens; a last message of another role echoes nothing; a list
    content's text parts are joined as the prompt joins them; a non-boolean echo is a 400."""
    messages = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "The answer is"}]
    body = {"add_generation_prompt": False, "continue_final_message": True, "ignore_eos": True}
    kw = dict(model="tiny", messages=messages, max_tokens=5, n=2, temperature=1, seed=3)
    plain = client.chat.completions.create(**kw, extra_body=body)
    echoed = client.chat.completions.create(**kw, extra_body={**body, "echo": True})
    assert len({c.message.content for c in plain.choices}) == 2   # two different continuations
    assert [c.message.content for c in echoed.choices] == ["The answer is" + c.message.content for c in plain.choices]
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens == 10

    chunks = list(client.chat.completions.create(**kw, stream=True, extra_body={**body, "echo": True}))
    texts, firsts = {0: "", 1: ""}, {}
    for chunk in chunks:
        for c in chunk.choices:
            if c.delta.content:
                firsts.setdefault(c.index, c.delta.content)
                texts[c.index] += c.delta.content
    assert firsts == {0: "The answer is", 1: "The answer is"}
    kinds = [("role" if c.delta.role else "echo" if c.delta.content == "The answer is" else "text")
             for chunk in chunks[:4] for c in chunk.choices]
    assert kinds == ["role", "role", "echo", "echo"]   # every role, then every echo, then the text
    assert [texts[0], texts[1]] == [c.message.content for c in echoed.choices]

    # Continuous usage counts the prompt from the first chunk on (vLLM's role chunks do), echo included.
    counted = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True},
                                                  extra_body={**body, "echo": True,
                                                              "stream_options": {"include_usage": True,
                                                                                 "continuous_usage_stats": True}}))
    prompt_tokens = echoed.usage.prompt_tokens
    assert prompt_tokens > 0 and all(c.usage.prompt_tokens == prompt_tokens for c in counted)
    assert [c.usage.completion_tokens for c in counted[:4]] == [0, 0, 0, 0] and counted[-1].usage.completion_tokens == 10
    assert all(c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens for c in counted)
    per_choice = {}     # each chunk counts its own choice's tokens (vLLM's), the last chunk the total
    for c in counted[:-1]:
        if c.choices and c.choices[0].delta.content and c.choices[0].delta.content != "The answer is":
            assert c.usage.completion_tokens > per_choice.get(c.choices[0].index, 0)
            per_choice[c.choices[0].index] = c.usage.completion_tokens
    assert per_choice == {0: 5, 1: 5}

    parts = [{"type": "text", "text": "The answer"}, {"type": "text", "text": " is"}]
    listed = client.chat.completions.create(**{**kw, "messages": [messages[0], {"role": "assistant", "content": parts}]},
                                            extra_body={**body, "echo": True})
    assert [c.message.content for c in listed.choices] == [c.message.content for c in echoed.choices]

    # A last assistant message under a new generation prompt is echoed too (the response's role);
    # a user's or an empty one is not.
    opened = dict(model="tiny", messages=messages, max_tokens=4, temperature=0)
    assert client.chat.completions.create(**opened, extra_body={"echo": True}).choices[0].message.content == (
        "The answer is" + client.chat.completions.create(**opened).choices[0].message.content)
    for last in (messages[:1], [messages[0], {"role": "assistant", "content": ""}]):
        asked = dict(model="tiny", messages=last, max_tokens=4, temperature=0)
        assert (client.chat.completions.create(**asked, extra_body={"echo": True}).choices[0].message.content
                == client.chat.completions.create(**asked).choices[0].message.content)
    bad = httpx.post(f"{server.url}/v1/chat/completions", json={**asked, "echo": "maybe"})
    assert bad.status_code == 400 and "boolean" in bad.json()["error"]["message"]


def test_stream_options_need_stream_and_seeds_are_64_bit(client, server):
    """vLLM's checks: stream_options without stream is a 400, a seed past int64 is a 400; seeds that differ
    only above bit 31 sample differently (they were masked to the same 32 bits)."""
    from jaxserve.runner.inputs import seed32
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a b", "max_tokens": 2,
                                                         "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    for seed in (2**63, -2**63 - 1):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a b", "max_tokens": 2, "seed": seed})
        assert r.status_code == 400 and "64 bits" in r.json()["error"]["message"], r.json()
    texts = [client.completions.create(model="tiny", prompt="a b", max_tokens=8, temperature=1, seed=s,
                                       extra_body={"ignore_eos": True}).choices[0].text
             for s in (5, 5 + 2**32, 5, 2**63 - 1)]
    assert texts[0] == texts[2] and texts[1] != texts[0] and texts[3] not in (texts[0], texts[1])
    top = client.completions.create(model="tiny", prompt="a b", max_tokens=8, temperature=1, seed=2**63 - 1, n=2,
                                    extra_body={"ignore_eos": True})     # the sibling's seed wraps to -2**63
    assert top.choices[0].text == texts[3] and top.choices[1].text != texts[3]
    assert [seed32(s) for s in (0, 5, 2**32 - 1, -1, -5)] == [0, 5, 2**32 - 1, 2**32 - 1, 2**32 - 5]   # as before
    far = [5 + 2**32, 4 + 2**32, -5 - 2**40, -1 - 2**32, 2**63 - 1, -2**63]
    assert len({seed32(s) for s in far} | {seed32(s) for s in (4, 5, -5, -1)}) == len(far) + 4


def test_echo_with_max_tokens_0_returns_the_prompt_alone(client, server):
    """vLLM's scoring request: echo and max_tokens 0 give the prompt and its logprobs, nothing generated
    (finish_reason "length", no completion tokens), streamed or not; without echo max_tokens 0 is a 400."""
    prompt = "the quick brown fox"
    r = client.completions.create(model="tiny", prompt=[prompt, "a b"], max_tokens=0, echo=True, logprobs=1,
                                  n=2, temperature=1, seed=1)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == r.usage.total_tokens
    for c in r.choices:
        lp = c.logprobs
        assert c.finish_reason == "length" and c.text == "".join(lp.tokens) and lp.token_logprobs[0] is None
    assert [c.text for c in r.choices] == [prompt, prompt, "a b", "a b"]
    assert r.usage.prompt_tokens == len(r.choices[0].logprobs.tokens) + len(r.choices[2].logprobs.tokens)   # once a prompt
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                            stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts == [prompt] and [c.choices[0].finish_reason for c in chunks if c.choices] == ["length"]
    assert [t for c in chunks if c.choices for t in c.choices[0].logprobs.tokens] == r.choices[0].logprobs.tokens
    assert chunks[-1].usage.completion_tokens == 0
    bad = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_add_special_tokens_reaches_the_tokenizer_as_vllm_defaults_it():
    """Completions add the tokenizer's specials to a text prompt unless told not to; chat does not unless
    told to (its template writes them). The tiny tokenizer adds none, so a recording one stands in."""
    from jaxserve.protocol import ChatCompletionRequest, CompletionRequest, prepare

    class Recording:
        eos_token_ids = (2,)

        def __init__(self):
            self.calls = []

        def encode(self, text, add_special_tokens=True):
            self.calls.append(add_special_tokens)
            return ([1] if add_special_tokens else []) + [7] * len(text.split())

        def apply_chat_template(self, messages, **kw):
            return " ".join(m["content"] for m in messages)

    tok = Recording()
    for body, want in (({}, True), ({"add_special_tokens": False}, False)):
        (prompt, _), = prepare(CompletionRequest(prompt="a b", max_tokens=1, **body), tok, 64)
        assert prompt["prompt_token_ids"] == ([1] if want else []) + [7, 7] and tok.calls[-1] is want
    messages = [{"role": "user", "content": "hi there"}]
    for body, want in (({}, False), ({"add_special_tokens": True}, True)):
        prepare(ChatCompletionRequest(messages=messages, max_tokens=1, **body), tok, 64)
        assert tok.calls[-1] is want


def test_add_special_tokens_is_accepted_on_every_route_that_tokenizes(server):
    for path, body in (("/v1/completions", {"prompt": "a b", "max_tokens": 1, "add_special_tokens": False}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                 "add_special_tokens": True}),
                       ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True}),
                       ("/tokenize", {"prompt": "a b", "add_special_tokens": False})):
        r = httpx.post(f"{server.url}{path}", json=body)
        assert r.status_code == 200, (path, r.text)


@pytest.mark.parametrize("body, param", [
    ({"prompt": [600, 1]}, "prompt"),                                   # past the tiny vocabulary (512)
    ({"prompt": "a", "logit_bias": {"600": 1}}, "logit_bias"),
    ({"prompt": "a", "stop_token_ids": [600]}, "stop_token_ids"),
    ({"prompt": "a", "allowed_token_ids": [600]}, "allowed_token_ids"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "logprobs": 10**6}, "logprobs"),
])
def test_the_engines_400s_name_their_parameter(server, body, param):
    r = httpx.post(f"{server.url}/v1/completions", json={"max_tokens": 1, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()


def test_top_keeps_the_token_and_the_best_n():
    from jaxserve.protocol import _top
    assert _top({10: -0.1, 11: -2.0}, 10, 1) == {10: -0.1}                  # its own is the best: one entry
    assert _top({10: -3.0, 11: -0.1, 12: -2.0}, 10, 1) == {10: -3.0, 11: -0.1}
    assert _top({10: -3.0, 11: -0.1, 12: -2.0}, 10, 2) == {10: -3.0, 11: -0.1, 12: -2.0}
    assert _top({10: -3.0, 11: -0.1}, 10, None) == {10: -3.0, 11: -0.1}


def test_chat_template_kwargs_may_not_set_the_requests_own_fields(server):
    for name in ("add_generation_prompt", "messages", "tools", "continue_final_message"):
        for path, extra in (("/v1/chat/completions", {"max_tokens": 1}), ("/tokenize", {})):
            r = httpx.post(f"{server.url}{path}", json={"messages": [{"role": "user", "content": "hi"}], **extra,
                                                        "chat_template_kwargs": {name: False}})
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == "chat_template_kwargs", (path, name, error)
            assert name in error["message"] and "Tokenizer" not in error["message"]
    ok = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 1, "chat_template_kwargs": {"x": 1}})
    assert ok.status_code == 200


def test_a_json_schema_of_true_means_any_json_and_false_is_refused(server):
    """JSON Schema's boolean schemas: true accepts any value (as {}), false none (llguidance's layout
    options need an object schema: true was a 400 quoting llguidance)."""
    def ask(schema):
        return httpx.post(f"{server.url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    ok = ask(True)
    assert ok.status_code == 200, ok.text
    r = ask(False)
    assert r.status_code == 400 and "false matches no value" in r.json()["error"]["message"]


def test_an_extra_eos_id_of_the_generation_config_is_reported_as_stop_reason(server, tiny_llm_engine, monkeypatch):
    """A model whose generation config lists EOS ids beside its tokenizer's own (Llama 3's <|eom_id|>
    and <|eot_id|>): ending on another id reports it as stop_reason, as vLLM does (it moves those ids
    into stop_token_ids), so a client can tell them apart; the tokenizer's own EOS reports none. Its
    text is left out either way."""
    tok = tiny_llm_engine.tokenizer
    monkeypatch.setattr(tok, "eos_token_ids", (2, 0))    # as the generation config [2, 0] makes them
    assert tok.eos_token_id == 2
    for token, stop_reason in (("0", 0), ("2", None)):
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 5, "logit_bias": {token: 100}}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        choice = r["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"], choice["text"]) == ("stop", stop_reason, "")
        assert r["usage"]["completion_tokens"] == 1
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60, json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                "logit_bias": {token: 100}, "stream": True}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        ends = [(c["choices"][0]["finish_reason"], c["choices"][0].get("stop_reason")) for c in chunks
                if c["choices"] and c["choices"][0]["finish_reason"]]
        assert ends == [("stop", stop_reason)]


def test_n_siblings_do_not_count_each_others_blocks_as_cached_tokens(server):
    """With n > 1 the siblings share the prompt's blocks, computed once by the first: a cold prompt
    reports 0 cached tokens (its siblings' reuse is no cache hit), a warm one what the cache held."""
    prompt = [300 + (7 * i) % 200 for i in range(45)]   # new to this module's engine: a cold prefix cache
    cached = []
    for _ in range(2):
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompt, "n": 3, "max_tokens": 2}).json()
        cached.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == 0 and cached[1] >= 16, cached
