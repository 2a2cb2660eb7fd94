"""Structured output: grammars compiled by llguidance, one matcher per sequence.

`GrammarCompiler.compile(params)` turns a StructuredOutputsParams (JSON schema, any JSON
object, regex, choice, Lark grammar) into a checked grammar, cached by its key; a bad
schema or regex is a ValueError naming the problem. It is thread-safe and meant to run off
the engine thread (AsyncEngine compiles on a worker thread before queueing a request).
Each sequence then gets a `Grammar`: a copy of the cached matcher that the scheduler
advances with every accepted token (jaxserve.core.scheduler) and that fills its row of
the step's allowed-token bitmask ([sequences, ceil(vocab / 32)] int32, bit j of word i =
token 32 i + j) before the step samples. A matcher that raises (filling its row, taking a
token, saying whether it stopped) keeps the exception as `error` instead of raising into the
step: the scheduler then ends that request alone with finish_reason "error", and the engine
goes on.
"""

from __future__ import annotations

import collections
import json
import threading

import numpy as np

from jaxserve.core import StructuredOutputsParams

_CACHE_SIZE = 256
# JSON as models write it ({"a": 1, "b": [2, 3]}): no free whitespace, which a model can loop on
# until max_tokens (and which OpenAI's strict JSON does not produce either).
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def bitmask_width(vocab_size: int) -> int:
    return -(-vocab_size // 32)


class Grammar:
    """One sequence's matcher. Duck-typed by the scheduler: accept_token / is_terminated / error."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.error: Exception | None = None   # what the matcher raised; it is not called again

    def accept_token(self, token_id: int) -> None:
        # A token outside the mask cannot be sampled; one that still fails (the grammar ended and
        # the request ignores EOS) leaves the matcher stopped, which ends the request.
        if self.error is None:
            try:
                self.matcher.consume_token(token_id)
            except Exception as e:  # noqa: BLE001 - one sequence's fault ends its request only
                self.error = e

    def is_terminated(self) -> bool:
        if self.error is None:
            try:
                return self.matcher.is_stopped() or self.matcher.is_error()
            except Exception as e:  # noqa: BLE001 - as in accept_token
                self.error = e
        return True

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Its row of the step's bitmask; after a fault the row allows every token (its token is dropped)."""
        import llguidance.numpy

        if self.error is None:
            try:
                llguidance.numpy.fill_next_token_bitmask(self.matcher, bitmask, row)
                return
            except Exception as e:  # noqa: BLE001 - as above
                self.error = e
        bitmask[row] = -1


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        """`tokenizer`: jaxserve.tokenizer.Tokenizer; `vocab_size`: the model's (the bitmask's width)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._lltokenizer = None
        self._cache: collections.OrderedDict[tuple[str, str], object] = collections.OrderedDict()

    def _ll_tokenizer(self):
        # Built once, on first use (~0.2 s for a 49k vocabulary); the caller holds the lock.
        if self._lltokenizer is None:
            import llguidance

            eos = self.tokenizer.eos_token_ids
            self._lltokenizer = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                       eos_token=eos[0] if eos else None)
        return self._lltokenizer

    def compile(self, params: StructuredOutputsParams) -> object:
        """The checked, compiled matcher for `params` (shared; `grammar()` copies it per sequence)."""
        import llguidance

        key = params.key
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template
            lltok = self._ll_tokenizer()
        grammar = _grammar_text(params)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
        if is_error:
            raise ValueError(f"invalid {_what(params)}: {'; '.join(m.strip() for m in messages) or 'rejected'}")
        template = llguidance.LLMatcher(lltok, grammar)
        if template.is_error():
            raise ValueError(f"invalid {_what(params)}: {template.get_error()}")
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return template

    def grammar(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh matcher for one sequence (compiled on a cache miss)."""
        template = self.compile(params)
        with self._lock:        # deep_copy reads the template, which no sequence advances
            return Grammar(template.deep_copy())


def _grammar_text(params: StructuredOutputsParams) -> str:
    import llguidance

    kind, spec = params.key
    if kind == "json":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid JSON schema: not JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("invalid JSON schema: a schema is a JSON object (or true / false)")
        if schema is False:
            raise ValueError("invalid JSON schema: false matches no value, so nothing could be generated")
        # true is {} (any JSON value) in the object form the layout options need
        return llguidance.LLMatcher.grammar_from_json_schema({} if schema is True else schema, defaults=_JSON_LAYOUT)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_LAYOUT)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in params.choice))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    return llguidance.LLMatcher.grammar_from_lark(spec)


def _what(params: StructuredOutputsParams) -> str:
    kind = params.key[0]
    return {"json": "JSON schema", "json_object": "JSON object grammar", "choice": "choice list",
            "regex": "regex", "grammar": "grammar"}[kind]
