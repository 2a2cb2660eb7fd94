"""Sampling parameters of one request, with vLLM's names, defaults and checks.

Plain data built on the caller's thread (HTTP handler, batch reader or user code) and
read by the scheduler (stop checks) and the runner (on-device sampling).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

_GREEDY_EPS = 1e-5  # temperatures below this are treated as greedy, as in vLLM
MAX_LOGIT_BIAS = 300   # tokens one request may bias (OpenAI's limit; the step carries this many per row)
MAX_BAD_WORDS = 128    # bad words (or token sequences) of one request
MAX_BAD_WORD_CHARS = 256   # characters of one bad word


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request carries (vLLM's names)."""

    CUMULATIVE = 0   # everything so far, every step (LLM.generate, AsyncEngine.generate by default)
    DELTA = 1        # only what is new since the last output; a finished sequence is reported once
    FINAL_ONLY = 2   # one output, when the request has finished


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's names): exactly one of a JSON schema (`json`, a
    dict or its JSON text), any JSON object (`json_object`), a regular expression, a list of
    choices, or a Lark grammar. Compiled (and checked) by jaxserve.engine.structured_output."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, json_object, regex, choice or grammar, "
                             f"got {given or 'none'}")
        _check(self.json is None or isinstance(self.json, (str, dict)), "structured_outputs.json", self.json,
               "must be a JSON schema (an object or its JSON text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value != ""), f"structured_outputs.{name}", value,
                   "must be a non-empty string")
        _check(self.choice is None or (len(self.choice) > 0 and all(isinstance(c, str) and c for c in self.choice)),
               "structured_outputs.choice", self.choice, "must be a non-empty list of non-empty strings")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec) naming the grammar; equal keys compile to the same grammar."""
        if self.json is not None:
            spec = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            return "json", spec
        if self.json_object:
            return "json_object", ""
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        return ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar)


@dataclasses.dataclass
class SamplingParams:
    n: int = 1                                 # completions to return for the prompt
    presence_penalty: float = 0.0              # subtracted once from every token already generated
    frequency_penalty: float = 0.0             # subtracted per occurrence of a generated token
    repetition_penalty: float = 1.0            # >1 discourages tokens seen in prompt or output
    temperature: float = 1.0                   # 0 means greedy
    top_p: float = 1.0                         # nucleus mass kept, in (0, 1]
    top_k: int = 0                             # 0 or -1 disables
    min_p: float = 0.0                         # drop tokens below min_p * p(max)
    seed: int | None = None                    # per-request RNG seed; results independent of the batch
    stop: str | list[str] | None = None        # stop strings (matched in the detokenized text)
    stop_token_ids: list[int] | None = None    # token ids that end the request
    ignore_eos: bool = False                   # keep going past EOS
    max_tokens: int | None = 16                # None: until the context is full
    min_tokens: int = 0                        # no EOS / stop token before this many tokens
    logprobs: int | None = None                # top-N logprobs per generated token
    prompt_logprobs: int | None = None         # logprob of each prompt token + its top-N (0: only its own)
    include_stop_str_in_output: bool = False   # keep the matched stop string in the text
    skip_special_tokens: bool = True           # drop special tokens from the text
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE   # what each output carries
    structured_outputs: StructuredOutputsParams | None = None       # constrain the text (JSON, regex, ...)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled (None: every token)
    bad_words: list[str] | None = None          # words never generated (vLLM's; as tokens with and without a space)
    # Token sequences never generated: a sequence's last token is banned where the output ends with the
    # rest. The engine fills it from bad_words; it may also be given directly.
    bad_words_token_ids: list[list[int]] | None = None
    truncate_prompt_tokens: int | None = None   # keep only the prompt's last k tokens (-1: max_model_len)

    def __post_init__(self) -> None:
        _check(self.logit_bias is None or isinstance(self.logit_bias, dict), "logit_bias", self.logit_bias,
               "must be a dict of token id -> bias")
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        if self.bad_words is not None:
            _check(isinstance(self.bad_words, (list, tuple)), "bad_words", self.bad_words, "must be a list of strings")
            self.bad_words = list(self.bad_words) or None
        if self.bad_words_token_ids is not None:
            _check(isinstance(self.bad_words_token_ids, (list, tuple))
                   and all(isinstance(w, (list, tuple)) for w in self.bad_words_token_ids),
                   "bad_words_token_ids", self.bad_words_token_ids, "must be a list of token id lists")
            self.bad_words_token_ids = [list(w) for w in self.bad_words_token_ids] or None
        if self.allowed_token_ids is not None:
            _check(isinstance(self.allowed_token_ids, (list, tuple)) and len(self.allowed_token_ids) > 0,
                   "allowed_token_ids", self.allowed_token_ids, "must be a non-empty list of token ids (or None)")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if abs(self.temperature) < _GREEDY_EPS and self.temperature >= 0:
            # Greedy: top-p/top-k/min-p have no effect, as in vLLM.
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "must be an integer >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_num(value) and -2.0 <= value <= 2.0, name, value, "must be in [-2, 2]")
        _check(_is_num(self.repetition_penalty) and self.repetition_penalty > 0,
               "repetition_penalty", self.repetition_penalty, "must be > 0")
        _check(_is_num(self.temperature) and self.temperature >= 0,
               "temperature", self.temperature, "must be >= 0")
        _check(_is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k,
               "must be -1 or 0 (disabled) or a positive integer")
        _check(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        _check(self.seed is None or _is_int(self.seed), "seed", self.seed, "must be an integer or None")
        _check(self.seed is None or -2**63 <= self.seed < 2**63, "seed", self.seed,
               "must fit in 64 bits (as vLLM's: -2**63 to 2**63 - 1)")
        _check_truncate(self.truncate_prompt_tokens)     # the context length is the engine's to check
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "must be an integer >= 1 or None")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", self.min_tokens,
               "must be an integer >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"must be <= max_tokens={self.max_tokens}")
        _check(self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
               "logprobs", self.logprobs, "must be an integer >= 0 or None")
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
               "prompt_logprobs", self.prompt_logprobs, "must be an integer >= 0 or None")
        _check(isinstance(self.output_kind, RequestOutputKind), "output_kind", self.output_kind,
               "must be a RequestOutputKind")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", self.structured_outputs, "must be a StructuredOutputsParams")
        for s in self.stop:
            _check(isinstance(s, str) and s != "", "stop", self.stop, "must hold non-empty strings")
        for t in self.stop_token_ids:
            _check(_is_int(t) and t >= 0, "stop_token_ids", self.stop_token_ids,
                   "must hold non-negative integers")
        for w in self.bad_words or ():
            _check(isinstance(w, str) and w.strip() != "", "bad_words", self.bad_words, "must hold non-blank strings")
            _check(len(w) <= MAX_BAD_WORD_CHARS, "bad_words", f"<a word of {len(w)} characters>",
                   f"must hold words of at most {MAX_BAD_WORD_CHARS} characters")
        _check(len(self.bad_words or ()) <= MAX_BAD_WORDS, "bad_words", f"<{len(self.bad_words or ())} words>",
               f"may hold at most {MAX_BAD_WORDS} words")
        _check(len(self.bad_words_token_ids or ()) <= 2 * MAX_BAD_WORDS, "bad_words_token_ids",
               f"<{len(self.bad_words_token_ids or ())} sequences>", f"may hold at most {2 * MAX_BAD_WORDS} sequences")
        for w in self.bad_words_token_ids or ():
            _check(len(w) > 0 and all(_is_int(t) and t >= 0 for t in w), "bad_words_token_ids", w,
                   "must hold non-empty lists of non-negative token ids")
        ids = self.allowed_token_ids or ()    # up to the whole vocabulary: checked in two C-speed passes
        if ids and not (all(type(t) is int for t in ids) and min(ids) >= 0):
            for t in ids:
                _check(_is_int(t) and t >= 0, "allowed_token_ids", f"[... {t!r} ...]",
                       "must hold non-negative integers")
        if self.logit_bias:
            _check(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias", f"<{len(self.logit_bias)} tokens>",
                   f"may bias at most {MAX_LOGIT_BIAS} tokens")
            for t, b in self.logit_bias.items():
                _check(_is_int(t) and t >= 0, "logit_bias", {t: b}, "must map non-negative integer token ids")
                _check(_is_num(b) and -100.0 <= b <= 100.0, "logit_bias", {t: b}, "must map to biases in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Presence, frequency or repetition penalty on: sampling reads the tokens so far."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def reads_output_tokens(self) -> bool:
        """Sampling reads the tokens generated so far on the host (penalties, a bad word of two
        tokens or more): steps run one by one and there are no drafts while such a request runs."""
        return self.uses_penalties or any(len(w) > 1 for w in self.bad_words_token_ids or ())

    def clone(self, **changes: Any) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


def truncated_length(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """How many of a prompt's last tokens truncate_prompt_tokens keeps (None: all of them)."""
    if truncate_prompt_tokens is None:
        return None
    _check_truncate(truncate_prompt_tokens)
    _check(truncate_prompt_tokens <= max_model_len, "truncate_prompt_tokens", truncate_prompt_tokens,
           f"must be at most the model's context length ({max_model_len})")
    return max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens


def _check_truncate(value: Any) -> None:
    _check(value is None or (_is_int(value) and (value >= 1 or value == -1)), "truncate_prompt_tokens", value,
           "must be an integer >= 1, or -1 (the model's context length), or None")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _check(ok: bool, field: str, value: Any, rule: str) -> None:
    if not ok:
        raise ValueError(f"{field}={value!r} is invalid: {field} {rule}")


# What the model's generation_config.json may set for the requests that leave the field out, as
# vLLM takes it: the values that differ from Hugging Face's GenerationConfig defaults (written there
# only because a tool saved them all), max_new_tokens as max_tokens.
_GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0,
                        "max_new_tokens": None}


def sampling_defaults(generation_config: dict, mode: str = "auto") -> dict:
    """The sampling defaults of a model's generation config (`mode` "auto"), or none ("none")."""
    if mode == "none":
        return {}
    out = {}
    for key, hf_default in _GENERATION_DEFAULTS.items():
        value = generation_config.get(key)
        if value is None or value == hf_default or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out["max_tokens" if key == "max_new_tokens" else key] = int(value) if key in ("top_k", "max_new_tokens") \
            else float(value)
    return out
