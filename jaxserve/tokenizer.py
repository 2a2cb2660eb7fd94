"""Text <-> token ids, and chat messages -> prompt text, for one model.

Wraps a Hugging Face `tokenizers.Tokenizer` (the model's tokenizer.json) and renders the
model's own chat template with jinja2's sandbox the way transformers does. Used on the
engine's front-end thread (requests in, text out); nothing here touches jax.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import tokenizers

if TYPE_CHECKING:
    from checkpoints import Checkpoint

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_content(token: Any) -> str | None:
    """A special token from tokenizer_config: a string or an AddedToken dict {"content": ...}."""
    if isinstance(token, Mapping):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text in some templates): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Plain copies of the messages, keys with None values dropped (as transformers does)."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty; a chat needs at least one message")
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] has no 'role' string (got {role!r})")
        content = message.get("content")
        if "content" not in message and not message.get("tool_calls"):
            raise ValueError(f"messages[{i}] (role {role!r}) has no 'content'")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts, got {type(content).__name__}")
        plain.append({key: value for key, value in message.items() if value is not None})
    return plain


class Tokenizer:
    """A model's tokenizer: encode/decode, special token ids, chat template rendering."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        tokenizer_config: Mapping[str, Any] | None = None,
        *,
        eos_token_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
    ):
        self._tokenizer = tokenizer
        self._config = dict(tokenizer_config or {})
        self.special_tokens = {
            name: content
            for name in _SPECIAL_TOKEN_NAMES
            if (content := _token_content(self._config.get(name))) is not None
        }
        eos = list(eos_token_ids)
        eos_id = self.token_to_id(self.special_tokens.get("eos_token"))
        if eos_id is not None:
            eos.append(eos_id)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))  # ordered, unique
        # The tokenizer's own EOS (None without one). A sequence that ends on one of the other ids
        # (a generation config's extra EOS ids, e.g. Llama 3's <|eom_id|> beside <|eot_id|>) reports
        # that id as its stop_reason, as vLLM treats those ids as stop_token_ids.
        self.eos_token_id: int | None = eos_id
        bos_id = self.token_to_id(self.special_tokens.get("bos_token"))
        self.bos_token_id: int | None = bos_id if bos_id is not None else bos_token_id

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> Tokenizer:
        """The tokenizer of a loaded checkpoint; EOS ids merge generation_config, config and tokenizer_config."""
        try:
            tokenizer = tokenizers.Tokenizer.from_file(ckpt.tokenizer_json)
        except Exception as e:  # tokenizers raises a bare Exception for unreadable files
            raise ValueError(f"{ckpt.tokenizer_json}: cannot load tokenizer: {e}") from e
        eos = _as_id_list(ckpt.generation_config.get("eos_token_id")) + _as_id_list(ckpt.config.get("eos_token_id"))
        return cls(tokenizer, ckpt.tokenizer_config, eos_token_ids=eos, bos_token_id=ckpt.config.get("bos_token_id"))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's embedding may be larger)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._tokenizer

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds what the tokenizer's post-processor adds (e.g. BOS)."""
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a string, got {type(text).__name__}")
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def truncate_left(self, text: str | None, ids: list[int], keep: int) -> list[int]:
        """The last `keep` tokens of a prompt, as a Hugging Face tokenizer truncating on the left
        (vLLM's truncate_prompt_tokens): the special tokens its post-processor added around `text`
        (e.g. BOS) stay, and the text's own tokens give way. Token ids without their text, or
        encoded without specials, keep plainly their last `keep`."""
        if len(ids) <= keep:
            return ids
        if text is not None:
            body = self.encode(text, add_special_tokens=False)
            for start in range(len(ids) - len(body) + 1):
                if ids[start:start + len(body)] == body:
                    prefix, suffix = ids[:start], ids[start + len(body):]
                    room = keep - len(prefix) - len(suffix)
                    if (prefix or suffix) and room >= 1:
                        return prefix + body[-room:] + suffix
                    break
        return ids[-keep:]

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary's strings of `ids` (byte-level ones as stored, e.g. "Ġhello"), as Hugging Face's."""
        return [self._tokenizer.id_to_token(int(i)) for i in ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def chat_template(self) -> str | list[dict[str, str]] | None:
        return self._config.get("chat_template")

    def _template_source(self, tools: list | None) -> str:
        template = self.chat_template
        if template is None:
            raise ValueError(
                "this model has no chat template (none in tokenizer_config.json, chat_template.jinja or "
                "chat_template.json); send a plain prompt to the completions API instead"
            )
        if isinstance(template, str):
            return template
        named = {entry["name"]: entry["template"] for entry in template}
        if tools and "tool_use" in named:
            return named["tool_use"]
        if "default" not in named:
            raise ValueError(f"this model's chat templates {sorted(named)} include no 'default' one")
        return named["default"]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages`, rendered with the model's chat template.

        `continue_final_message`: the text ends where the last message's content does (no end of
        turn after it), so that the model continues that message, as transformers cuts it."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set: continuing "
                             "the last message and opening a new one are two different prompts")
        chat = _validate_messages(messages)
        if continue_final_message:
            chat = _tag_final_message(chat)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)):
            raise ValueError("tools must be a list of JSON-schema dicts")
        try:
            template = _compile_template(self._template_source(tools))
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"this model's chat template is not valid jinja: {e}") from e
        try:
            text = template.render(
                messages=chat,
                tools=tools,
                documents=kwargs.pop("documents", None),
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **kwargs},
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"the chat template rejected these messages: {e}") from e
        return _cut_at_tag(text) if continue_final_message else text


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`chat` with a tag after the final message's text (its content, or its last text part), where
    the rendered text is cut for continue_final_message (transformers' way)."""
    if not chat:
        raise ValueError("continue_final_message needs a message to continue")
    final = dict(chat[-1])
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + _CONTINUE_TAG
    elif isinstance(content, (list, tuple)):
        parts = [dict(p) if isinstance(p, Mapping) else p for p in content]
        at = next((i for i in reversed(range(len(parts))) if isinstance(parts[i], Mapping) and "text" in parts[i]),
                  None)
        if at is None:
            raise ValueError("continue_final_message is set, but the final message has no text to continue")
        parts[at]["text"] = str(parts[at]["text"]) + _CONTINUE_TAG
        final["content"] = parts
    else:
        raise ValueError("continue_final_message is set, but the final message has no content to continue")
    return [*chat[:-1], final]


def _cut_at_tag(text: str) -> str:
    """The rendered chat up to the tag: where the template kept the tag's trailing space, exactly
    there; where it trimmed the end of the message, with the whitespace before the tag trimmed too."""
    at = text.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise ValueError("continue_final_message is set, but the chat template does not render the final "
                         "message's content as it is")
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
