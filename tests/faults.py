"""Injected faults for chosen requests only: their output processing, or their grammar, raises."""

from __future__ import annotations

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.structured_output import GrammarCompiler

# A prompt that ends with these ids (the detokenizer keeps the prompt's last 5 ids as context)
# has its output processing raise once it has `after` output tokens.
MARKER = [17, 29, 31, 37, 41]


class InjectedFault(RuntimeError):
    pass


def raising_for_marked(update, after: int):
    """IncrementalDetokenizer.update, raising InjectedFault for a marked prompt's sequence once it
    has `after` output tokens (the fault suite's server patches the class with it too)."""
    def patched(self, new_token_ids, check_stop=True):
        if self.tokens[:len(MARKER)] == MARKER and len(self.tokens) - len(MARKER) + len(new_token_ids) >= after:
            raise InjectedFault("injected fault in the detokenizer")
        return update(self, new_token_ids, check_stop)
    return patched


def fail_marked_requests(monkeypatch, after: int = 3) -> None:
    monkeypatch.setattr(IncrementalDetokenizer, "update", raising_for_marked(IncrementalDetokenizer.update, after))


# A request whose structured_outputs regex holds this text gets a matcher that raises.
GRAMMAR_MARKER = "faulty"


class _RaisingMatcher:
    """A sequence's llguidance matcher that raises InjectedFault once it has taken `after` tokens:
    filling the step's bitmask row (`where` "fill"), taking the next token ("consume") or saying
    whether it has stopped ("stopped")."""

    def __init__(self, matcher, where: str, after: int) -> None:
        self.matcher, self.where, self.after, self.taken = matcher, where, after, 0

    def unsafe_compute_mask_ptr(self, *args):
        if self.where == "fill" and self.taken >= self.after:
            raise InjectedFault("injected fault filling the bitmask")
        return self.matcher.unsafe_compute_mask_ptr(*args)

    def is_stopped(self):
        if self.where == "stopped" and self.taken >= self.after:
            raise InjectedFault("injected fault asking whether the grammar stopped")
        return self.matcher.is_stopped()

    def consume_token(self, token_id):
        if self.where == "consume" and self.taken >= self.after:
            raise InjectedFault("injected fault taking a token")
        self.taken += 1
        return self.matcher.consume_token(token_id)

    def __getattr__(self, name):
        return getattr(self.matcher, name)


def raising_grammar_for_marked(grammar, where: str, after: int):
    """GrammarCompiler.grammar, giving a marked regex's sequences a matcher that raises (the fault
    suite's server patches the class with it too)."""
    def patched(self, params):
        g = grammar(self, params)
        if params.regex is not None and GRAMMAR_MARKER in params.regex:
            g.matcher = _RaisingMatcher(g.matcher, where, after)
        return g
    return patched


def fail_marked_grammars(monkeypatch, where: str, after: int = 3) -> None:
    monkeypatch.setattr(GrammarCompiler, "grammar", raising_grammar_for_marked(GrammarCompiler.grammar, where, after))
