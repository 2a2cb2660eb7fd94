"""OpenAI request/response shapes, shared by the HTTP server and the batch job.

Pydantic at the edge only: request bodies are validated here (unknown fields refused,
as OpenAI does), turned into (prompt, SamplingParams) for the engine, and engine
RequestOutputs are turned back into OpenAI JSON (whole responses and stream chunks).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from jaxserve.core import RequestOutputKind, SamplingParams, StructuredOutputsParams
from jaxserve.core.sampling_params import truncated_length
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.tool_parsers import ToolParser, finish_reason, forced_tool_parser, forced_tool_schema


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """How much one request may ask for; each is a `jaxserve serve` flag. Past a limit: a 400.

    OpenAI's API is the anchor (a prompt list of at most 2,048 entries, at most 4 stop
    sequences); the stop limits are more generous because vLLM users pass longer lists.
    """

    max_prompts_per_request: int = 2048      # entries of a completions prompt list
    max_sequences_per_request: int = 2048    # n x prompts
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256         # a stop string's length holds back that much streamed text
    max_stop_token_ids: int = 128
    max_logprobs: int = 20                   # logprobs, top_logprobs and prompt_logprobs (the engine's --max-logprobs)

    def check(self, req: "CompletionRequest | ChatCompletionRequest", num_prompts: int) -> None:
        if num_prompts > self.max_prompts_per_request:
            raise RequestError(f"the request has {num_prompts} prompts; at most {self.max_prompts_per_request} "
                               "are allowed per request (--max-prompts-per-request)", param="prompt")
        if num_prompts * req.n > self.max_sequences_per_request:
            raise RequestError(f"the request asks for {num_prompts} prompts x n={req.n} = {num_prompts * req.n} "
                               f"sequences; at most {self.max_sequences_per_request} are allowed per request "
                               "(--max-sequences-per-request)", param="n")
        stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stop) > self.max_stop_strings:
            raise RequestError(f"stop has {len(stop)} strings; at most {self.max_stop_strings} are allowed "
                               "(--max-stop-strings)", param="stop")
        longest = max((len(x) for x in stop), default=0)
        if longest > self.max_stop_string_chars:
            raise RequestError(f"a stop string has {longest} characters; at most {self.max_stop_string_chars} are "
                               "allowed (--max-stop-string-chars)", param="stop")
        if len(req.stop_token_ids or ()) > self.max_stop_token_ids:
            raise RequestError(f"stop_token_ids has {len(req.stop_token_ids)} ids; at most "
                               f"{self.max_stop_token_ids} are allowed (--max-stop-token-ids)", param="stop_token_ids")
        for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
            value = getattr(req, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > self.max_logprobs:
                raise RequestError(f"{name}={value} exceeds the server's limit of {self.max_logprobs} "
                                   "(--max-logprobs)", param=name)


class RequestError(ValueError):
    """A bad request: carries the HTTP status, OpenAI error type and offending parameter."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.type = status, param, type

    def to_dict(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.status}}


def parse_json_text(raw: bytes | str, what: str = "the request body") -> Any:
    """The JSON value of a request body (a batch file's line); a RequestError naming `what` for
    invalid JSON or UTF-8, a lone surrogate ("\\ud800" is no text: nothing downstream can encode
    it), nesting too deep for the parser, or an integer of over 4300 digits."""
    try:
        value = json.loads(raw)
        json.dumps(value, ensure_ascii=False).encode()
    except RecursionError:
        raise RequestError(f"{what} is nested too deeply") from None
    except ValueError as e:
        raise RequestError(f"{what} is not valid JSON: {e}") from None
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of json (a schema), json_object, regex, choice, grammar (Lark)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | bool | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    n: int = Field(1, ge=1, le=128)    # OpenAI's limit
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    cache_salt: str | None = None
    prompt_logprobs: int | None = None    # vLLM: logprobs of every prompt token (top-N each)
    logit_bias: dict[str, float] | None = None      # OpenAI's: token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None      # vLLM's: only these tokens may be sampled
    bad_words: list[str] | None = None              # vLLM's: words never generated
    truncate_prompt_tokens: int | None = None       # vLLM's: keep the prompt's last k tokens (-1: the context)
    # OpenAI fields accepted so clients that send them get a precise answer, not "extra input".
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None   # vLLM: json, json_object, regex, choice, grammar
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def check_unsupported(self) -> None:
        """Refuse fields the schema accepts but the server does not serve (each request kind adds its own)."""

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's logit_bias with its keys read as token ids (their range and the biases' are SamplingParams')."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 12):    # int() refuses 4,300+ digits
                raise RequestError(f"invalid key in logit_bias: {key!r}; the keys are token ids (non-negative "
                                   "integers)", param="logit_bias")
            bias[int(key)] = value
        return bias

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The request's constraint, from vLLM's structured_outputs or OpenAI's response_format."""
        rf = self.response_format if self.response_format and self.response_format.type != "text" else None
        if self.structured_outputs is not None and rf is not None:
            raise RequestError("give structured_outputs or response_format, not both", param="structured_outputs")
        try:
            if self.structured_outputs is not None:
                so = self.structured_outputs
                schema = so.json_ if so.json_ is None or isinstance(so.json_, str) else json.dumps(so.json_)
                return StructuredOutputsParams(json=schema, json_object=bool(so.json_object), regex=so.regex,
                                               grammar=so.grammar, choice=None if so.choice is None else
                                               tuple(so.choice))
        except ValueError as e:
            raise RequestError(str(e), param="structured_outputs") from e
        if rf is None:
            return None
        if rf.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise RequestError("response_format json_schema needs json_schema.schema", param="response_format")
        return StructuredOutputsParams(json=json.dumps(rf.json_schema.schema_))

    def _sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                         defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:   # vLLM's 400
            raise RequestError("stream_options can only be given when stream is true", param="stream_options")
        kw: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
            elif defaults and name in defaults:   # the model's generation config (--generation-config auto)
                kw[name] = defaults[name]
        structured = self._structured_outputs()     # its own RequestErrors name their param
        bias = self._logit_bias()
        try:
            return SamplingParams(n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                                  ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, max_tokens=max_tokens,
                                  logprobs=logprobs, include_stop_str_in_output=self.include_stop_str_in_output,
                                  skip_special_tokens=self.skip_special_tokens,
                                  prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else
                                  self.prompt_logprobs,
                                  output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
                                  structured_outputs=structured, logit_bias=bias,
                                  allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words, **kw)
        except ValueError as e:
            raise RequestError(str(e), param=str(e).split("=", 1)[0]) from e


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True          # vLLM's: the tokenizer's specials (e.g. BOS) around a text prompt

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.best_of not in (None, self.n):
            raise RequestError("best_of other than n is not supported", param="best_of")
        if self.suffix:
            raise RequestError("suffix is not supported", param="suffix")

    @property
    def prompt_only(self) -> bool:
        """vLLM's `echo` with `max_tokens` 0: the prompt (and its logprobs) alone, nothing generated: how
        scoring clients read a text's logprobs. The engine runs one token, which the response leaves out."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise RequestError("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def sampling_params(self, prompt_len: int, max_model_len: int,
                        defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """`defaults`: the model's sampling defaults for the fields left out (max_tokens has the API's, 16)."""
        # echo with logprobs returns an entry for every prompt token too (the first one null).
        echoed = self.logprobs if self.echo and self.logprobs is not None else None
        if echoed is not None and self.prompt_logprobs is not None:
            echoed = max(echoed, self.prompt_logprobs)
        return self._sampling_params(_max_tokens(1 if self.prompt_only else self.max_tokens, "max_tokens", prompt_len,
                                                 max_model_len), self.logprobs, echoed, defaults)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False     # vLLM's: the model continues the last message (no end of turn)
    echo: bool = False                       # vLLM's: each choice starts with the last message's text (see `echoed`)
    add_special_tokens: bool = False         # vLLM's: the template writes the specials; True adds the tokenizer's too
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def check_tools(self, tool_parser: ToolParser | None) -> None:
        """tool_choice against tools and the server's parser: "none" and "auto" are served, the rest a 400."""
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise RequestError("tool_choice needs tools", param="tool_choice")
        if isinstance(choice, dict):
            name = _named_tool_choice(choice)
            names = [n for t in self.tools if isinstance(t, dict) and isinstance(t.get("function"), dict)
                     and isinstance(n := t["function"].get("name"), str)]
            if name not in names:
                raise RequestError(f"tool_choice names the function {name!r}, which is not among tools "
                                   f"({', '.join(map(repr, names)) or 'none named'})", param="tool_choice")
        elif choice not in (None, "none", "auto", "required"):
            raise RequestError(f"tool_choice {choice!r} is not one of 'none', 'auto', 'required' or "
                               "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
        if self.tools and choice in (None, "auto") and tool_parser is None:
            raise RequestError(
                "tool calling is not enabled on this server: the model's tool calls would not be parsed. "
                "Send tool_choice='none' to render the tools into the prompt without parsing calls, or "
                "start the server with --enable-auto-tool-choice --tool-call-parser hermes.",
                param="tool_choice")

    def parses_tool_calls(self, tool_parser: ToolParser | None) -> bool:
        """Whether the output is parsed for tool calls (see `output_tool_parser`)."""
        return self.output_tool_parser(tool_parser) is not None

    def output_tool_parser(self, tool_parser: ToolParser | None) -> ToolParser | None:
        """What parses the output for calls: the server's parser under tool_choice "auto" (given or by
        default); for "required" or a named function, the parser of the constrained JSON (vLLM's forced
        tool choice, which needs no server flag); None when calls are not parsed."""
        if not self.tools or self.tool_choice == "none":
            return None
        if self.tool_choice == "required" or isinstance(self.tool_choice, dict):
            return forced_tool_parser(self._forced_tool_name())
        return tool_parser

    def _forced_tool_name(self) -> str | None:
        return _named_tool_choice(self.tool_choice) if isinstance(self.tool_choice, dict) else None

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        forced = self.tools and (self.tool_choice == "required" or isinstance(self.tool_choice, dict))
        if not forced:
            return super()._structured_outputs()
        if self.structured_outputs is not None or (self.response_format and self.response_format.type != "text"):
            raise RequestError("a forced tool_choice ('required' or a named function) constrains the output "
                               "itself: drop response_format / structured_outputs", param="tool_choice")
        schema = forced_tool_schema(self.tools, self._forced_tool_name(), parallel=self.parallel_tool_calls is not False)
        return StructuredOutputsParams(json=json.dumps(schema))

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.stream and self.prompt_logprobs is not None:
            raise RequestError("prompt_logprobs is not available with stream=true on chat completions (as in vLLM)",
                               param="prompt_logprobs")

    def render(self, tokenizer) -> str:
        """The prompt text the chat template renders (what /tokenize with these fields counts)."""
        kwargs = dict(self.chat_template_kwargs or {})
        named = {"messages", "add_generation_prompt", "tools", "continue_final_message"} & kwargs.keys()
        if named:    # the request's own fields: set them there (the template's call would get two values)
            raise RequestError(f"chat_template_kwargs may not set {', '.join(sorted(named))}: it is a field of "
                               "the request itself", param="chat_template_kwargs")
        if self.continue_final_message and self.add_generation_prompt:
            raise RequestError("continue_final_message needs add_generation_prompt=false (continuing the last "
                               "message and opening a new one are two different prompts)",
                               param="continue_final_message")
        try:
            return tokenizer.apply_chat_template(self.chat_messages(), add_generation_prompt=self.add_generation_prompt,
                                                 tools=self.tools, continue_final_message=self.continue_final_message,
                                                 **kwargs)
        except RequestError:
            raise
        except (ValueError, TypeError) as e:   # TypeError: chat_template_kwargs clashing with the template's
            raise RequestError(str(e), param="messages") from e

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v):
        if not v:
            raise ValueError("messages must not be empty")
        return v

    def chat_messages(self) -> list[dict[str, Any]]:
        return template_messages([m.model_dump(exclude_none=True) for m in self.messages])

    def echoed(self) -> str:
        """What `echo` puts before each choice's content: the last message's text (its text parts
        joined, as the prompt takes them) when it is an assistant message, the role every response
        has here (the model continued it, e.g. under continue_final_message); else nothing. (vLLM
        answers with the last message's role when add_generation_prompt is off, and so echoes any.)"""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant" or last.content is None:
            return ""
        return last.content if isinstance(last.content, str) else _text_parts(last.content)

    def sampling_params(self, prompt_len: int, max_model_len: int,
                        defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """`defaults`: the model's sampling defaults for the fields left out (max_tokens: at most the
        room left in the context)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        requested = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = _max_tokens(requested, name, prompt_len, max_model_len)
        if requested is None and defaults and "max_tokens" in defaults:
            max_tokens = min(max_tokens, defaults["max_tokens"])
        return self._sampling_params(max_tokens, logprobs, defaults=defaults)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages as chat templates take them: content parts joined into one string (text
    parts only: others are a RequestError), an assistant's tool calls with their arguments as objects."""
    out = []
    for d in messages:
        d = dict(d)
        if isinstance(d.get("content"), list):   # OpenAI content parts: keep the text ones
            d["content"] = _text_parts(d["content"])
        if d.get("role") == "assistant" and d.get("tool_calls"):
            d["content"] = d.get("content") or ""
            d["tool_calls"] = _template_tool_calls(d["tool_calls"], len(out))
        out.append(d)
    return out


def _text_parts(parts: list[dict[str, Any]]) -> str:
    """OpenAI content parts as the prompt takes them: the text parts joined (others are refused)."""
    if any(p.get("type") != "text" for p in parts):
        raise RequestError("only text content parts are supported", param="messages")
    return "".join(p.get("text", "") for p in parts)


def _named_tool_choice(choice: dict) -> str:
    function = choice.get("function")
    if choice.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}",
                           param="tool_choice")
    return function["name"]


def _template_tool_calls(calls: Any, i: int) -> list[dict]:
    """An assistant message's tool_calls as chat templates expect them (as vLLM): arguments as a dict."""
    if not isinstance(calls, list):
        raise RequestError(f"messages[{i}].tool_calls must be a list", param="messages")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise RequestError(f"messages[{i}].tool_calls[{j}] has no 'function' object", param="messages")
        args = function.get("arguments")
        if isinstance(args, str) and args:
            try:
                args = json.loads(args)
            except ValueError:
                raise RequestError(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON",
                                   param="messages") from None
        out.append({**call, "function": {**function, "arguments": args or {}}})
    return out


def _max_tokens(requested: int | None, name: str, prompt_len: int, max_model_len: int) -> int:
    room = max_model_len - prompt_len
    if room < 1:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{prompt_len} tokens, which leaves no room for a completion. Please reduce the length of the prompt.",
            param="prompt")
    if requested is None:
        return room
    if requested < 1:
        raise RequestError(f"{name}={requested} must be at least 1", param=name)
    if requested > room:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the completion). "
            "Please reduce the length of the prompt or completion.", param=name)
    return requested


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body; errors name the offending parameter."""
    try:
        return model.model_validate(body)
    except RecursionError:
        raise RequestError("the request body is nested too deeply") from None
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        param = str(err["loc"][0]) if err["loc"] else None
        raise RequestError(f"{where}: {err['msg']}" if where else err["msg"], param=param) from None


# ---- responses ---------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


_LEADING_NAME = re.compile(r"([a-z_]+)(?:=|\s)")


def param_of(message: str) -> str | None:
    """The request field an engine check's message starts with ("logprobs=30 exceeds ...", "stop_token_ids has
    ..."), "prompt" for the prompt's own checks, else None: the `param` of its 400."""
    if message.startswith(("prompt token id", "the prompt is empty")):
        return "prompt"
    m = _LEADING_NAME.match(message)
    return m[1] if m and m[1] in (CompletionRequest.model_fields.keys() | ChatCompletionRequest.model_fields.keys()) \
        else None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _top(lps: dict[int, float], token_id: int, top_n: int | None) -> dict[int, float]:
    """The token's own entry and the best `top_n` (all with None): an echoed prompt token's logprobs
    come from `max(logprobs, prompt_logprobs)`, but its top_logprobs hold `logprobs` as a generated
    token's do."""
    if top_n is None or len(lps) <= top_n:
        return lps
    keep = {t for t, _ in sorted(lps.items(), key=lambda kv: -kv[1])[:top_n]} | {token_id}
    return {t: lp for t, lp in lps.items() if t in keep}


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float] | None],
                        text_offset: int = 0, top_n: int | None = None) -> dict:
    """OpenAI completions logprobs of some tokens; a None entry (the first prompt token) stays null."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for token_id, lps in zip(token_ids, logprobs):
        piece = tokenizer.decode([token_id], skip_special_tokens=False)
        tokens.append(piece)
        token_lps.append(None if lps is None else lps[token_id])
        tops.append(None if lps is None else
                    {tokenizer.decode([t], skip_special_tokens=False): lp
                     for t, lp in _top(lps, token_id, top_n).items()})
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def end_offset(logprobs: dict | None) -> int:
    """The text_offset after these entries: offsets count the characters of the `tokens` before."""
    if not logprobs or not logprobs["tokens"]:
        return 0
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


def join_logprobs(a: dict, b: dict) -> dict:
    return {key: a[key] + b[key] for key in a}


def prompt_logprobs_json(tokenizer, logprobs: list[dict[int, float] | None] | None, token_ids: list[int] | None = None,
                         top_n: int | None = None) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token null (the first) or {token id: {logprob, decoded_token}};
    with `top_n`, each token's own entry and the best top_n (the engine ran max(logprobs, prompt_logprobs))."""
    if logprobs is None:
        return None
    ids = token_ids if token_ids is not None and top_n is not None else [None] * len(logprobs)
    return [None if lps is None else
            {str(t): {"logprob": lp, "decoded_token": tokenizer.decode([t], skip_special_tokens=False)}
             for t, lp in (lps if tid is None else _top(lps, tid, top_n)).items()} for tid, lps in zip(ids, logprobs)]


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]], top_n: int) -> dict:
    content = []
    for token_id, lps in zip(token_ids, logprobs):
        piece = tokenizer.decode([token_id], skip_special_tokens=False)
        top = sorted(lps.items(), key=lambda kv: -kv[1])[:top_n]
        content.append({
            "token": piece, "logprob": lps[token_id], "bytes": list(piece.encode()),
            "top_logprobs": [{"token": (s := tokenizer.decode([t], skip_special_tokens=False)), "logprob": lp,
                              "bytes": list(s.encode())} for t, lp in top]})
    return {"content": content}


def prompt_only_finish(reason: str | None) -> str | None:
    """An echo with max_tokens 0 ends at its length (the one token run for it, however it ended), unless it
    was aborted or failed."""
    return "length" if reason in ("length", "stop") else reason


def echo_text(out: RequestOutput, tokenizer) -> str:
    """The prompt as given, or its tokens' text with special tokens kept (as vLLM's: the text the
    logprobs' text_offset counts)."""
    return (out.prompt if out.prompt is not None
            else tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False))


def completion_response(req: CompletionRequest, outputs: list[RequestOutput], model: str, tokenizer) -> dict:
    choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
    for i, out in enumerate(outputs):
        prompt_tokens += len(out.prompt_token_ids)
        cached += out.num_cached_tokens
        prefix = echo_text(out, tokenizer) if req.echo else ""
        for c in out.outputs:
            token_ids, text = ([], "") if req.prompt_only else (c.token_ids, c.text)
            completion_tokens += len(token_ids)
            lp = None
            if req.logprobs is not None:
                lp = (completion_logprobs(tokenizer, out.prompt_token_ids, out.prompt_logprobs, top_n=req.logprobs)
                      if req.echo else None)
                new = completion_logprobs(tokenizer, token_ids, c.logprobs or [], end_offset(lp))
                lp = new if lp is None else join_logprobs(lp, new)
            choice = {"index": i * req.n + c.index, "text": prefix + text, "logprobs": lp,
                      "finish_reason": prompt_only_finish(c.finish_reason) if req.prompt_only else c.finish_reason,
                      "stop_reason": None if req.prompt_only else c.stop_reason}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(tokenizer, out.prompt_logprobs, out.prompt_token_ids,
                                                                 req.prompt_logprobs)
            choices.append(choice)
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached)}


def chat_response(req: ChatCompletionRequest, out: RequestOutput, model: str, tokenizer,
                  tool_parser: ToolParser | None = None) -> dict:
    choices = []
    parser = req.output_tool_parser(tool_parser)
    echoed = req.echoed()
    for c in out.outputs:
        message, reason = {"role": "assistant", "content": c.text}, c.finish_reason
        if parser is not None:
            parsed = parser.parse(c.text)
            if parsed.tool_calls:
                message = {"role": "assistant", "content": parsed.content,
                           "tool_calls": [call.json() for call in parsed.tool_calls]}
                reason = finish_reason(reason, called=parser.calls_finish)
        if echoed:
            message["content"] = echoed + (message["content"] or "")
        choices.append({
            "index": c.index, "message": message,
            "logprobs": chat_logprobs(tokenizer, c.token_ids, c.logprobs, req.top_logprobs or 0)
            if req.logprobs else None,
            "finish_reason": reason, "stop_reason": c.stop_reason})
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    response = {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": choices,
                "usage": usage(len(out.prompt_token_ids), completion_tokens, out.num_cached_tokens)}
    if req.prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs_json(tokenizer, out.prompt_logprobs)
    return response


Endpoint = Literal["/v1/completions", "/v1/chat/completions"]
ENDPOINTS: dict[str, type[BaseModel]] = {"/v1/completions": CompletionRequest,
                                         "/v1/chat/completions": ChatCompletionRequest}


def prepare(req: CompletionRequest | ChatCompletionRequest, tokenizer, max_model_len: int,
            limits: RequestLimits = RequestLimits(), tool_parser: ToolParser | None = None,
            defaults: Mapping[str, Any] | None = None) -> list[tuple[dict, SamplingParams]]:
    """Engine inputs of a validated request: one (prompt dict, params) per prompt.

    `tool_parser`: the server's --tool-call-parser, when --enable-auto-tool-choice is on.
    `defaults`: the engine's `sampling_defaults` (the model's generation config), for the fields the
    request leaves out.
    """
    req.check_unsupported()
    if isinstance(req, ChatCompletionRequest):
        req.check_tools(tool_parser)
        limits.check(req, 1)
        text = req.render(tokenizer)
        pairs = [(text, tokenizer.encode(text, add_special_tokens=req.add_special_tokens))]
    else:
        prompts = req.prompts()
        limits.check(req, len(prompts))      # before tokenizing any of them
        pairs = []
        for p in prompts:
            if isinstance(p, str):
                pairs.append((p, tokenizer.encode(p, add_special_tokens=req.add_special_tokens)))
            elif isinstance(p, list) and all(isinstance(t, int) for t in p):
                pairs.append((None, p))
            else:
                raise RequestError("prompt must be a string, a list of strings or token ids", param="prompt")
    try:
        keep = truncated_length(req.truncate_prompt_tokens, max_model_len)
    except ValueError as e:
        raise RequestError(str(e), param="truncate_prompt_tokens") from e
    items = []
    for text, ids in pairs:
        if not ids:
            raise RequestError("prompt must not be empty", param="prompt")
        if keep is not None and len(ids) > keep:
            # The text no longer matches: echo decodes the ids kept.
            text, ids = None, tokenizer.truncate_left(text, ids, keep)
        params = req.sampling_params(len(ids), max_model_len, defaults)
        if isinstance(req, ChatCompletionRequest) and req.parses_tool_calls(tool_parser):
            # Some models' tool-call tags are special tokens: keep them in the text (as vLLM does).
            params = params.clone(skip_special_tokens=False)
        items.append(({"prompt": text, "prompt_token_ids": ids}, params))
    return items
