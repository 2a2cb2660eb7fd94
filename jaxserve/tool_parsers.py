"""Tool calls in generated chat text (vLLM's `--tool-call-parser`): parsed whole, or as it streams.

The `hermes` format (Hermes 2 Pro, Qwen 2.5/3 and most ChatML tool-use templates) writes
each call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, possibly
several, after optional text. `parse_hermes` turns a finished text into (content, calls);
a `HermesStream` is fed one choice's text deltas and returns content and tool-call
deltas, holding back any text that may be the start of a tag. Both run on the server's
event loop (protocol.chat_response, server.streaming.chat_chunks); plain Python, no jax.

The rules, shared by both ways (vLLM's where it has one):
- content is the text before the first `<tool_call>`; None when blank and calls were found;
- a block is JSON `{"name": str, "arguments": object}`; an unterminated block at the end
  counts when its JSON is whole (the model stopped before `</tool_call>`);
- a malformed first block: no calls, the whole text is content. A malformed later block:
  `parse_hermes` gives the whole text as content (as vLLM), while the stream, which has
  already sent the earlier calls, drops it;
- text between and after blocks is dropped.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable
from typing import Any

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str      # the arguments object as JSON text (OpenAI's shape)
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def json(self) -> dict[str, Any]:
        """The call in an assistant message's `tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class ParsedText:
    content: str | None
    tool_calls: list[ToolCall]


@dataclasses.dataclass
class StreamDelta:
    """What one fed piece of text releases: content text and `delta.tool_calls` entries."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def __add__(self, other: StreamDelta) -> StreamDelta:
        return StreamDelta(self.content + other.content, self.tool_calls + other.tool_calls)

    def json(self) -> dict[str, Any]:
        """The chunk's `delta` (without role): only the keys that carry something."""
        d: dict[str, Any] = {}
        if self.content:
            d["content"] = self.content
        if self.tool_calls:
            d["tool_calls"] = self.tool_calls
        return d


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for a generation that stopped normally after calling; "length" etc. stay."""
    return "tool_calls" if called and reason == "stop" else reason


def parse_call(body: str) -> ToolCall | None:
    """One block's JSON as a call, or None when it is not `{"name": str, "arguments": object}`."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments")
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def hermes_blocks(text: str) -> list[str]:
    """The bodies of the `<tool_call>` blocks in `text`, an unterminated last one included."""
    bodies, pos = [], 0
    while (start := text.find(TOOL_CALL_START, pos)) != -1:
        start += len(TOOL_CALL_START)
        end = text.find(TOOL_CALL_END, start)
        if end == -1:
            bodies.append(text[start:])
            break
        bodies.append(text[start:end])
        pos = end + len(TOOL_CALL_END)
    return bodies


def parse_hermes(text: str) -> ParsedText:
    """A finished generation's content and calls."""
    calls = [parse_call(b) for b in hermes_blocks(text)]
    if not calls or any(c is None for c in calls):
        return ParsedText(text, [])
    content = text[:text.find(TOOL_CALL_START)]
    return ParsedText(content if content.strip() else None, calls)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag` (0 if none)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesStream:
    """The incremental parser of one choice: `feed` each text delta, then `finish` once."""

    # States: before the first call (content flows), inside a block, after a call (text dropped),
    # and plain (the first block was malformed: everything is content).
    TEXT, BLOCK, AFTER, PLAIN = range(4)

    def __init__(self) -> None:
        self.state = self.TEXT
        self.buf = ""            # text not yet released or dropped
        self.blank = ""          # whitespace before the first block: content only if that block fails
        self.started = False     # non-blank content has been released
        self.num_calls = 0

    def feed(self, text: str) -> StreamDelta:
        self.buf += text
        out = StreamDelta()
        while True:
            if self.state == self.PLAIN:
                out.content += self.buf
                self.buf = ""
                return out
            if self.state == self.BLOCK:
                end = self.buf.find(TOOL_CALL_END)
                if end == -1:
                    return out
                out += self._close(self.buf[:end])
                self.buf = self.buf[end + len(TOOL_CALL_END):]
                continue
            start = self.buf.find(TOOL_CALL_START)
            if start == -1:
                keep = len(self.buf) - _partial_tag(self.buf, TOOL_CALL_START)
                head, self.buf = self.buf[:keep], self.buf[keep:]
                if self.state == self.TEXT:
                    if not self.started and not head.strip():
                        self.buf = head + self.buf       # all blank so far: wait for the first block or text
                    else:
                        out.content += head
                        self.started = True
                return out
            head, self.buf = self.buf[:start], self.buf[start + len(TOOL_CALL_START):]
            if self.state == self.TEXT:
                if self.started or head.strip():
                    out.content += head
                    self.started = True
                else:
                    self.blank = head
            self.state = self.BLOCK

    def finish(self) -> StreamDelta:
        """The end of the text: release what was held back."""
        out = StreamDelta()
        if self.state == self.BLOCK:
            out = self._close(self.buf, terminated=False)
        elif self.state != self.AFTER:
            out.content = self.buf
        self.buf = ""
        return out

    def _close(self, body: str, terminated: bool = True) -> StreamDelta:
        call = parse_call(body)
        if call is not None:
            self.state, self.blank = self.AFTER, ""
            self.num_calls += 1
            return StreamDelta(tool_calls=[{"index": self.num_calls - 1, **call.json()}])
        if self.num_calls:                  # calls already sent: a later malformed block is dropped
            self.state = self.AFTER
            return StreamDelta()
        self.state = self.PLAIN
        raw = self.blank + TOOL_CALL_START + body + (TOOL_CALL_END if terminated else "")
        self.blank = ""
        return StreamDelta(content=raw)


@dataclasses.dataclass(frozen=True)
class ToolParser:
    """A `--tool-call-parser`: how finished text is parsed and how a streamed one is."""

    name: str
    parse: Callable[[str], ParsedText]
    stream: Callable[[], HermesStream]
    calls_finish: bool = True    # a call makes finish_reason "tool_calls" (a named tool_choice keeps "stop")


TOOL_PARSERS: dict[str, ToolParser] = {"hermes": ToolParser("hermes", parse_hermes, HermesStream)}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]


# ---- tool_choice "required" or a named function: the output is constrained, not parsed -----------


def forced_tool_schema(tools: list[dict], name: str | None, parallel: bool = True) -> dict:
    """The JSON schema a forced tool choice constrains the output to (vLLM's): a named function's
    arguments object, or for "required" (`name` None) a non-empty array of {"name", "parameters"},
    of one call at most unless `parallel` (OpenAI's parallel_tool_calls)."""
    def params(tool: dict) -> dict:
        p = tool["function"].get("parameters")
        return p if isinstance(p, dict) else {"type": "object"}
    functions = [t for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    if name is not None:
        return params(next(t for t in functions if t["function"].get("name") == name))
    return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"enum": [t["function"]["name"]]}, "parameters": params(t)},
         "required": ["name", "parameters"], "additionalProperties": False} for t in functions]}}


def forced_tool_parser(name: str | None) -> ToolParser:
    """The parser of a forced tool choice's output: the named function's arguments, or the "required"
    array of calls. Text that does not parse (a generation cut by max_tokens) stays content."""
    def parse(text: str) -> ParsedText:
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):
            return ParsedText(text, [])
        if name is not None:
            return ParsedText(None, [ToolCall(name, text)]) if isinstance(obj, dict) else ParsedText(text, [])
        if not isinstance(obj, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in obj):
            return ParsedText(text, [])
        return ParsedText(None, [ToolCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
                                 for c in obj])
    return ToolParser("forced", parse, lambda: WholeStream(parse), calls_finish=name is None)


class WholeStream:
    """A stream parser that holds everything back and parses the whole text at the end (the forced
    choices' JSON is only a call once complete)."""

    def __init__(self, parse: Callable[[str], ParsedText]) -> None:
        self.parse, self.text, self.num_calls = parse, "", 0

    def feed(self, text: str) -> StreamDelta:
        self.text += text
        return StreamDelta()

    def finish(self) -> StreamDelta:
        parsed = self.parse(self.text)
        self.num_calls = len(parsed.tool_calls)
        return StreamDelta(parsed.content or "",
                           [{"index": i, **call.json()} for i, call in enumerate(parsed.tool_calls)])
