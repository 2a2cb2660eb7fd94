"""Injected faults: a request's output processing that raises, for one chosen request only."""

from __future__ import annotations

from jaxserve.engine.detokenizer import IncrementalDetokenizer

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
