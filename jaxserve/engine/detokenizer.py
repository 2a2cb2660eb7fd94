"""Incremental detokenization with stop strings, one instance per generated sequence.

Runs on the engine thread after each step. Text is decoded over a short window of
tokens so that a multi-byte character split across tokens appears only once complete
(never as U+FFFD), and spacing matches a full decode. Stop strings are matched on the
text, across token boundaries; while a sequence runs, the last (longest stop - 1)
characters are held back so a caller never sees the start of a stop string. As in vLLM,
stop strings are looked for only once a sequence has more than `min_tokens` tokens, and
only in the text that arrived since.
"""

from __future__ import annotations

from jaxserve.core import SamplingParams
from jaxserve.tokenizer import Tokenizer

_PROMPT_CONTEXT = 5   # prompt tokens decoded alongside the output, for correct leading spaces


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.tokens = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""

    def update(self, new_token_ids: list[int], check_stop: bool = True) -> str | None:
        """Append tokens; returns the stop string if one was matched (the text is then truncated).

        `check_stop=False` (a sequence still under its min_tokens) appends without matching.
        """
        start = len(self.text)
        for token_id in new_token_ids:
            self.tokens.append(token_id)
            self.text += self._next_piece()
        return self._match_stop(start) if check_stop else None

    def flush(self, check_stop: bool = True) -> str | None:
        """At the end: emit what an incomplete character held back (as U+FFFD)."""
        if self.read_offset < len(self.tokens):
            start = len(self.text)
            self.text += self._next_piece(force=True)
            return self._match_stop(start) if check_stop else None
        return None

    def _match_stop(self, start: int) -> str | None:
        for stop in self.stop:
            idx = self.text.find(stop, max(start - len(stop) + 1, 0))
            if idx != -1:
                self.text = self.text[:idx + len(stop) if self.include_stop else idx]
                return stop
        return None

    def _next_piece(self, force: bool = False) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self.tokens[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special)
        full = decode(self.tokens[self.prefix_offset:], skip_special_tokens=self.skip_special)
        if force or (len(full) > len(prefix) and not full.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return full[len(prefix):]
        return ""  # an incomplete character (or nothing visible) so far: wait for more tokens

    def output_text(self, finished: bool) -> str:
        """Text safe to show: everything once finished, else minus the held-back tail."""
        if finished or not self.hold_back:
            return self.text
        return self.text[:max(len(self.text) - self.hold_back, 0)]
