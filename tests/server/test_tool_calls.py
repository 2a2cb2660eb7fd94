"""Tool calling (vLLM's --enable-auto-tool-choice --tool-call-parser hermes): the parser on
texts worked out by hand and on random splits of random texts, then the server on a
scripted engine whose output is a tool call, the 400s, the chat template path, the CLI
flags, and the tiny real model with the parser on."""

import json

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpoints import load_hf_folder
from jaxserve.cli import main as cli_main
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.protocol import ChatCompletionRequest
from jaxserve.tokenizer import Tokenizer
from jaxserve.tool_parsers import (HermesStream, finish_reason, get_tool_parser, hermes_blocks, parse_call,
                                   parse_hermes)

from .conftest import RunningServer
from .scripted import ScriptedEngine

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "current weather",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def block(name, args) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def stream_all(pieces: list[str]) -> tuple[str, list[dict]]:
    """Feed `pieces` to a fresh HermesStream: (all content, all tool-call delta entries)."""
    parser, content, calls = HermesStream(), "", []
    for piece in pieces:
        d = parser.feed(piece)
        content, calls = content + d.content, calls + d.tool_calls
    d = parser.finish()
    return content + d.content, calls + d.tool_calls


# ---- the parser on hand-worked texts ------------------------------------------------------


def test_text_then_one_call():
    text = "Let me check.\n" + block("get_weather", {"city": "Zürich"})
    parsed = parse_hermes(text)
    assert parsed.content == "Let me check.\n"
    (call,) = parsed.tool_calls
    assert call.name == "get_weather" and call.arguments == '{"city": "Zürich"}'   # ensure_ascii=False
    assert call.json() == {"id": call.id, "type": "function",
                           "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
    assert call.id.startswith("call_") and len(call.id) == len("call_") + 24


def test_two_calls_after_blank_text_have_no_content_and_distinct_ids():
    text = "\n " + block("get_weather", {"city": "Oslo"}) + "\n" + block("get_time", {}) + "\n"
    parsed = parse_hermes(text)
    assert parsed.content is None
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", '{"city": "Oslo"}'),
                                                                  ("get_time", "{}")]
    assert parsed.tool_calls[0].id != parsed.tool_calls[1].id


def test_text_without_calls_is_all_content():
    assert parse_hermes("plain <tool answer </tool_call>").content == "plain <tool answer </tool_call>"
    assert parse_hermes("").content == "" and parse_hermes("").tool_calls == []


@pytest.mark.parametrize("body", ['{"name": "f", "arguments": {', '["f"]', '{"arguments": {}}',
                                  '{"name": "", "arguments": {}}', '{"name": "f", "arguments": "{}"}',
                                  '{"name": "f"}', "[" * 5000])
def test_a_malformed_block_leaves_the_whole_text_as_content(body):
    assert parse_call(body) is None
    for text in (f"Hi <tool_call>{body}</tool_call>",
                 block("get_time", {}) + f"<tool_call>{body}</tool_call>"):   # vLLM: one bad block, no calls
        parsed = parse_hermes(text)
        assert parsed.content == text and parsed.tool_calls == []


def test_an_unterminated_block_counts_when_its_json_is_whole():
    parsed = parse_hermes('ok <tool_call>\n{"name": "get_time", "arguments": {}}\n')
    assert parsed.content == "ok " and [c.name for c in parsed.tool_calls] == ["get_time"]
    cut = 'ok <tool_call>\n{"name": "get_time", "argu'
    assert parse_hermes(cut).content == cut and parse_hermes(cut).tool_calls == []


def test_finish_reason_is_tool_calls_only_for_a_normal_stop():
    assert finish_reason("stop", called=True) == "tool_calls"
    assert finish_reason("length", called=True) == "length"
    assert finish_reason("stop", called=False) == "stop"
    assert finish_reason(None, called=True) is None


def test_stream_holds_back_a_possible_tag_and_sends_each_call_when_it_closes():
    p = HermesStream()
    assert p.feed("Sure <tool").json() == {"content": "Sure "}
    assert p.feed("_call>\n{\"name\": \"get_time\", ").json() == {}
    d = p.feed('"arguments": {}}\n</tool_call>\n<tool_')
    (entry,) = d.tool_calls
    assert d.content == "" and entry["index"] == 0 and entry["function"] == {"name": "get_time", "arguments": "{}"}
    assert entry["type"] == "function" and entry["id"].startswith("call_")
    d = p.feed('call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call> trailing')
    assert [e["index"] for e in d.tool_calls] == [1] and d.content == ""
    assert p.finish().json() == {} and p.num_calls == 2


def test_stream_releases_a_lone_angle_bracket_and_held_text_at_the_end():
    p = HermesStream()
    assert p.feed("a <").content == "a "
    assert p.feed(" b <tool_c").content == "< b "
    assert p.finish().content == "<tool_c"


def test_stream_of_a_malformed_first_block_is_all_content():
    text = "  <tool_call>{oops}</tool_call> then <tool_call>" + block("get_time", {})[len("<tool_call>"):]
    assert stream_all(list(text)) == (text, [])


# ---- the stream against the whole-text parse on random texts split at random points --------

_name = st.sampled_from(["get_weather", "get_time", "f"])
_args = st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=6), st.booleans(),
                                                       st.lists(st.integers(), max_size=3)), max_size=3)
_valid = st.builds(block, _name, _args)
_malformed = st.sampled_from(["<tool_call>{nope}</tool_call>", '<tool_call>{"name": "f"}</tool_call>',
                              "<tool_call>\n", '<tool_call>{"name": "f", "arguments": {'])
_noise = st.text(alphabet="ab <>/_tolcaé\n{}\"", max_size=12)
_piece = st.one_of(_noise, _valid, _malformed, st.sampled_from(["<tool_c", "</tool_call>", "<tool_call>", " "]))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(_piece, max_size=6), data=st.data())
def test_streaming_any_split_gives_the_whole_text_parse(pieces, data):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    splits = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    content, deltas = stream_all(splits)
    assert [d["index"] for d in deltas] == list(range(len(deltas)))
    streamed = [(d["function"]["name"], d["function"]["arguments"]) for d in deltas]
    calls = [parse_call(b) for b in hermes_blocks(text)]
    parsed = parse_hermes(text)
    if calls and calls[0] is not None and None in calls:
        # The one documented difference: the stream has sent the calls before a malformed later
        # block and drops that block; the whole-text parse gives no calls (as vLLM).
        assert parsed.content == text and parsed.tool_calls == []
        assert streamed == [(c.name, c.arguments) for c in calls if c is not None]
        prefix = text[:text.index("<tool_call>")]
        assert content == (prefix if prefix.strip() else "")
    else:
        assert content == (parsed.content or "")
        assert streamed == [(c.name, c.arguments) for c in parsed.tool_calls]


# ---- the server, on an engine scripted to call a tool ----------------------------------------

CALL_TEXT = "Let me look.\n" + block("get_weather", {"city": "Zürich"})
END = "<|im_end|>"   # a special token: the text has it only because tool parsing keeps special tokens


@pytest.fixture(scope="module")
def tok(tiny_models):
    return Tokenizer.from_checkpoint(load_hf_folder(tiny_models["llama"]))


@pytest.fixture(scope="module")
def scripted(tok):
    """Completion 0 writes CALL_TEXT, completion 1 plain text, then the end-of-turn token."""
    texts = [CALL_TEXT + END, "No tool needed." + END]

    def script(prompt_ids, i):
        return tok.encode(texts[i % 2], add_special_tokens=False)
    srv = RunningServer(AsyncEngine(ScriptedEngine(tok, script, max_model_len=1024)), served_model_name="scripted",
                        tool_parser="hermes")
    plain = RunningServer(AsyncEngine(ScriptedEngine(tok, script, max_model_len=1024)), served_model_name="scripted")
    yield srv, plain
    srv.stop()
    plain.stop()


def chat(srv, **kw):
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x")
    kw.setdefault("messages", [{"role": "user", "content": "weather in Zürich?"}])
    return client.chat.completions.create(model="scripted", stop=[END], **kw)


def test_a_tool_call_comes_back_parsed(scripted):
    srv, _ = scripted
    r = chat(srv, tools=[WEATHER, TIME])
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look.\n"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Zürich"}


def test_a_streamed_tool_call_reassembles_per_choice(scripted):
    srv, _ = scripted
    chunks = list(chat(srv, tools=[WEATHER], tool_choice="auto", n=2, stream=True))
    content, calls, finishes = {0: "", 1: ""}, {0: {}, 1: {}}, {0: [], 1: []}
    for c in chunks:
        (choice,) = c.choices
        content[choice.index] += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            entry = calls[choice.index].setdefault(tc.index, {"name": "", "arguments": "", "id": tc.id})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert content == {0: "Let me look.\n", 1: "No tool needed."}
    assert finishes == {0: ["tool_calls"], 1: ["stop"]}
    (call,) = calls[0].values()
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Zürich"}
    assert calls[1] == {}
    # Never a held-back piece of the tag in the content.
    assert not any("<" in (c.choices[0].delta.content or "") for c in chunks)


def test_a_call_cut_by_length_is_content_with_finish_length(scripted, tok):
    srv, _ = scripted
    n = len(tok.encode("Let me look.\n<tool_call>\n{", add_special_tokens=False))
    for stream in (False, True):
        r = chat(srv, tools=[WEATHER], max_tokens=n, stream=stream)
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert not any(c.choices[0].delta.tool_calls for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = r.choices[0].message.content, r.choices[0].finish_reason
            assert r.choices[0].message.tool_calls is None
        assert reason == "length" and text == tok.decode(tok.encode(CALL_TEXT, add_special_tokens=False)[:n])


def test_tool_choice_none_renders_tools_and_parses_nothing(scripted):
    srv, plain = scripted
    for s in (srv, plain):
        r = chat(s, tools=[WEATHER], tool_choice="none")
        # Not parsed; special tokens skipped as usual, so the end-of-turn stop never matches.
        assert r.choices[0].message.content == CALL_TEXT and r.choices[0].message.tool_calls is None
        assert r.choices[0].finish_reason == "length"


def test_without_tools_nothing_is_parsed(scripted):
    srv, _ = scripted
    r = chat(srv)
    assert r.choices[0].message.content == CALL_TEXT and r.choices[0].message.tool_calls is None


def _error(srv, body) -> dict:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **body}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tool_choice" and err["code"] == 400
    return err


def test_tool_choices_the_server_cannot_honour_are_400s(scripted):
    srv, plain = scripted
    for choice in (None, "auto"):
        body = {"tools": [WEATHER]} | ({"tool_choice": choice} if choice else {})
        assert "start the server with --enable-auto-tool-choice --tool-call-parser hermes" in \
            _error(plain, body)["message"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for s in (srv, plain):
        conflict = _error(s, {"tools": [WEATHER], "tool_choice": named, "response_format": {"type": "json_object"}})
        assert "drop response_format" in conflict["message"]
        unknown = _error(s, {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}})
        assert "'nope'" in unknown["message"] and "'get_weather'" in unknown["message"]
        assert "needs tools" in _error(s, {"tool_choice": "auto"})["message"]
        assert "'sometimes'" in _error(s, {"tools": [WEATHER], "tool_choice": "sometimes"})["message"]
        assert "{'type': 'function'" in _error(s, {"tools": [WEATHER], "tool_choice": {"type": "x"}})["message"]


HISTORY = [{"role": "user", "content": "weather in Oslo?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]

# A Hermes/Qwen-style template: tool calls rendered from `arguments | tojson`, tool results in a tag.
HERMES_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>{% else %}{{ m.content }}{% endif %}"
    "{% for tc in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tool_call_history_renders_through_the_chat_template(tok):
    hermes = Tokenizer(tok.backend, {"chat_template": HERMES_TEMPLATE})
    text = ChatCompletionRequest(messages=HISTORY, tools=[WEATHER]).render(hermes)
    # Arguments reach the template as a dict (as vLLM passes them), so tojson does not double-encode.
    assert ('<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '</tool_call><|im_end|>') in text
    assert "<|im_start|>tool\n<tool_response>sunny, 21 C</tool_response><|im_end|>" in text
    # The tiny model's plain ChatML template renders them too (the assistant turn empty).
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\nsunny, 21 C<|im_end|>" in \
        ChatCompletionRequest(messages=HISTORY).render(tok)


def test_tool_call_history_through_the_server(scripted):
    srv, _ = scripted
    r = chat(srv, messages=HISTORY, tools=[WEATHER])
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    counted = httpx.post(f"{srv.url}/tokenize", json={"messages": HISTORY, "tools": [WEATHER]}, timeout=30)
    assert counted.status_code == 200 and counted.json()["count"] == r.usage.prompt_tokens
    bad = [*HISTORY[:1], {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                               "function": {"name": "f", "arguments": "{x"}}]}]
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": bad, "tools": [WEATHER]}, timeout=30)
    assert r.status_code == 400 and "messages[1].tool_calls[0].function.arguments" in r.json()["error"]["message"]


# ---- flags -------------------------------------------------------------------------------------


def test_cli_refuses_auto_tool_choice_without_a_parser(capsys):
    assert cli_main(["serve", "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser (one of: hermes)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "pythonic"])
    with pytest.raises(ValueError, match="unknown tool call parser 'pythonic'"):
        get_tool_parser("pythonic")


# ---- the tiny real model with the parser on ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny_tools_server(tiny_llm_engine):
    srv = RunningServer(AsyncEngine(tiny_llm_engine), served_model_name="tiny", tool_parser="hermes")
    yield srv
    srv.stop()


def test_real_model_with_tools_streams_what_it_answers_whole(tiny_tools_server):
    client = openai.OpenAI(base_url=f"{tiny_tools_server.url}/v1", api_key="x")
    kw = dict(model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER], max_tokens=12,
              temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert full.finish_reason == "length" and full.message.tool_calls is None   # random tokens: no call
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.message.content
    assert chunks[-1].choices[0].finish_reason == "length"


# ---- forced tool choice ("required", a named function): constrained output, no server flag ------

STRICT_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tiny_client(tiny_llm_engine):
    srv = RunningServer(AsyncEngine(tiny_llm_engine), served_model_name="tiny")    # no tool parser flags
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x")
    srv.stop()


def test_a_named_tool_choice_always_calls_that_function_with_valid_arguments(tiny_client):
    import jsonschema
    kw = dict(model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[STRICT_WEATHER, TIME],
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60, temperature=1.0)
    r = tiny_client.chat.completions.create(n=20, seed=4, **kw)
    for c in r.choices:
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather" and c.finish_reason == "stop" and not c.message.content
        jsonschema.validate(json.loads(call.function.arguments), STRICT_WEATHER["function"]["parameters"])
    chunks = list(tiny_client.chat.completions.create(stream=True, seed=4, **kw))
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [tc.function.arguments for tc in calls] == [r.choices[0].message.tool_calls[0].function.arguments]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_required_tool_choice_makes_at_least_one_call_among_the_tools(tiny_client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "go"}], tools=[STRICT_WEATHER, TIME],
              tool_choice="required", n=20, seed=9, max_tokens=100, temperature=1.0)
    # With parallel calls a random model may keep adding calls until max_tokens: what completes is calls.
    r = tiny_client.chat.completions.create(**kw)
    done = [c for c in r.choices if c.finish_reason == "tool_calls"]
    assert done and all(len(c.message.tool_calls) >= 1 for c in done)
    assert all(c.finish_reason == "length" and c.message.content.startswith("[") for c in r.choices
               if c not in done)
    r = tiny_client.chat.completions.create(parallel_tool_calls=False, **kw)
    names = set()
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c.message.content
        for call in c.message.tool_calls:
            assert call.function.name in ("get_weather", "get_time") and isinstance(
                json.loads(call.function.arguments), dict)
            names.add(call.function.name)
    assert names == {"get_weather", "get_time"}     # the choice among tools is the model's
