"""Injected faults: a request's output processing that raises, for one chosen request only."""

from __future__ import annotations

from jaxserve.engine.detokenizer import IncrementalDetokenizer

# A prompt that ends with these ids (the detokenizer keeps the prompt's last 5 ids as context)
# has its output processing raise once it has `after` output tokens.
MARKER = [17, 29, 31, 37, 41]


class InjectedFault(RuntimeError):
    pass


def fail_marked_requests(monkeypatch, after: int = 3) -> None:
    real = IncrementalDetokenizer.update

    def update(self, new_token_ids, check_stop=True):
        if self.tokens[:len(MARKER)] == MARKER and len(self.tokens) - len(MARKER) + len(new_token_ids) >= after:
            raise InjectedFault("injected fault in the detokenizer")
        return real(self, new_token_ids, check_stop)
    monkeypatch.setattr(IncrementalDetokenizer, "update", update)
