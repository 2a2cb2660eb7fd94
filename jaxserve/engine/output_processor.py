"""From the scheduler's per-step token diffs to the RequestOutputs callers see.

The OutputProcessor owns everything between EngineCoreOutput and RequestOutput, on the
engine thread: incremental detokenization, stop strings (with min_tokens), logprob
dicts, timing, and the parent/children of an `n > 1` request (n core requests that
share the prompt). Each request's SamplingParams.output_kind says what its outputs
carry:

- CUMULATIVE: every sequence's whole text, tokens and logprobs so far, at every step;
- DELTA: only what is new since the last output, and only the sequences with news; a
  finished sequence is reported exactly once, in the step it finished;
- FINAL_ONLY: one output per request, when its last sequence has finished.

DELTA and FINAL_ONLY cost O(new tokens) per step; CUMULATIVE copies the lists (its
callers may keep every output).

A failure while one request's output is processed (a detokenizer or a stop-string bug, say)
fails that request alone: its final output carries `error` (the exception's type; the
traceback goes to the log under its id), its unfinished sequences end with finish_reason
"error", and `process` returns its core ids for the engine to finish. The other requests of
the step, and the engine, carry on.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

from jaxserve.core import EngineCoreOutput, NoTokenAllowedError, RequestOutputKind, SamplingParams
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, logprobs_dict

logger = logging.getLogger(__name__)
_OUTPUT_FAILED = "processing the request's output"


@dataclasses.dataclass
class _Sequence:
    """One of a request's n completions, and how much of it was already handed out."""

    index: int
    core_id: str
    detok: IncrementalDetokenizer
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0       # DELTA: tokens (and logprobs) already in an output
    sent_text: int = 0         # DELTA: characters already in an output
    sent_finish: bool = False  # DELTA: the finish was reported
    num_prompt_logprobs: int = 0   # prompt positions this sequence's core request has reported

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[_Sequence]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    sent_prompt_logprobs: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}
        self._by_core_id: dict[str, tuple[_RequestState, _Sequence]] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def request_ids(self) -> list[str]:
        return list(self._requests)

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            core_ids: list[str], arrival_time: float) -> None:
        """Track a request whose n core requests (`core_ids`, in completion order) were scheduled."""
        state = _RequestState(request_id, prompt, prompt_token_ids, params, [], RequestMetrics(arrival_time),
                              prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        for i, core_id in enumerate(core_ids):
            seq = _Sequence(i, core_id, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                            logprobs=[] if params.logprobs is not None else None,
                            cumulative_logprob=0.0 if params.logprobs is not None else None)
            state.seqs.append(seq)
            self._by_core_id[core_id] = (state, seq)
        self._requests[request_id] = state

    def core_ids(self, request_id: str) -> list[str]:
        state = self._requests.get(request_id)
        return [] if state is None else [s.core_id for s in state.seqs]

    def request_of(self, core_id: str) -> _RequestState | None:
        entry = self._by_core_id.get(core_id)
        return None if entry is None else entry[0]

    def process(self, core_outputs: Iterable[EngineCoreOutput],
                now: float) -> tuple[list[RequestOutput], list[str], list[str]]:
        """Apply one step's diffs. Returns (the outputs due, core ids that a stop string finished,
        core ids of the requests that failed here).

        The caller must finish both lists of core ids in the scheduler: they are done here (a
        failed request's final output, with `error`, is among the outputs).
        """
        changed: dict[str, _RequestState] = {}
        failed: dict[str, tuple[_RequestState, Exception, str]] = {}
        stopped: list[str] = []
        for co in core_outputs:
            entry = self._by_core_id.get(co.req_id)
            if entry is None:
                continue
            state, seq = entry
            if state.request_id in failed:
                continue
            try:
                if self._apply(state, seq, co, now):
                    stopped.append(seq.core_id)
            except Exception as e:  # noqa: BLE001 - one request's failure ends that request only
                failed[state.request_id] = state, e, _OUTPUT_FAILED
                continue
            if co.error is not None:    # the scheduler ended the sequence: its grammar raised, or no token was left
                failed[state.request_id] = state, co.error, "the request's structured output (its grammar)"
                continue
            changed[state.request_id] = state
        outputs = []
        for state in changed.values():
            if state.request_id in failed:
                continue
            try:
                out = self._output(state)
            except Exception as e:  # noqa: BLE001 - as above
                failed[state.request_id] = state, e, _OUTPUT_FAILED
                continue
            if state.finished:
                self._forget(state, now)
            if out is not None:
                outputs.append(out)
        failed_ids = []
        for state, error, what in failed.values():
            outputs.append(self._fail(state, error, what, now))
            failed_ids += [seq.core_id for seq in state.seqs]
        if failed_ids:
            gone = set(failed_ids)
            stopped = [core_id for core_id in stopped if core_id not in gone]
        return outputs, stopped, failed_ids

    def _fail(self, state: _RequestState, error: Exception, what: str, now: float) -> RequestOutput:
        """End a request whose output processing or grammar (`what` says which) raised, or whose
        constraints left no token (NoTokenAllowedError: the request's fault, its message shown); its
        final output says so and carries what it had (whole, or what was not yet handed out for
        DELTA), read without calling into the detokenizer again."""
        if isinstance(error, NoTokenAllowedError):    # the request's own doing: its message says why
            message, status = str(error), 400
            logger.info("request %s ends: %s", state.request_id, error)
        else:
            message, status = f"{what} failed ({type(error).__name__}; details in the log)", 500
            logger.error("%s failed in request %s; that request ends with an error", what, state.request_id,
                         exc_info=error)
        for seq in state.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "error"
        self._forget(state, now)
        delta = state.params.output_kind == RequestOutputKind.DELTA
        completions = []
        for seq in state.seqs:
            if delta and seq.sent_finish:
                continue
            start_tokens, start_text = (seq.sent_tokens, seq.sent_text) if delta else (0, 0)
            completions.append(CompletionOutput(
                index=seq.index, text=seq.detok.text[start_text:], token_ids=seq.token_ids[start_tokens:],
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=None if seq.logprobs is None else seq.logprobs[start_tokens:],
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        prompt_logprobs = state.prompt_logprobs
        if prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs[state.sent_prompt_logprobs if delta else 0:]
        return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                             prompt_token_ids=state.prompt_token_ids, outputs=completions, finished=True,
                             num_cached_tokens=state.num_cached_tokens, metrics=state.metrics,
                             prompt_logprobs=prompt_logprobs,
                             error=message, error_status=status)

    def abort(self, request_id: str, now: float) -> RequestOutput | None:
        """Finish a request as aborted; returns its last output (None if unknown or nothing is due)."""
        state = self._requests.get(request_id)
        if state is None:
            return None
        for seq in state.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        out = self._output(state)
        self._forget(state, now)
        return out

    def _forget(self, state: _RequestState, now: float) -> None:
        state.metrics.finished_time = now
        self._requests.pop(state.request_id, None)
        for seq in state.seqs:
            if self._by_core_id.get(seq.core_id, (None, None))[1] is seq:
                del self._by_core_id[seq.core_id]

    # ---- one core output ---------------------------------------------------------------

    def _apply(self, state: _RequestState, seq: _Sequence, co: EngineCoreOutput, now: float) -> bool:
        """Fold one diff into the sequence; True if a stop string ended it (the scheduler does not know)."""
        m = state.metrics
        if co.new_token_ids:
            if m.first_token_time is None:
                m.first_token_time = now
            if m.last_token_time != now:     # once per step, however many siblings got a token
                m.token_times.append(now)
            m.last_token_time = now
        if seq.index == 0:   # the sibling scheduled first: the others reuse the blocks it computes, which
            state.num_cached_tokens = co.num_cached_tokens   # is no cache hit for the request (vLLM: one child's)
        if state.prompt_logprobs is not None and co.new_prompt_logprobs:
            # Each of the n siblings computes the prompt; the first to reach a position provides it.
            prompt = state.prompt_token_ids
            for i, lp in enumerate(co.new_prompt_logprobs, seq.num_prompt_logprobs + 1):
                if i == len(state.prompt_logprobs):
                    state.prompt_logprobs.append(logprobs_dict(prompt[i], lp))
            seq.num_prompt_logprobs += len(co.new_prompt_logprobs)
        new_ids = co.new_token_ids
        # EOS or a stop token id ending the step: its text is not part of the output (as vLLM).
        untold = co.finish_reason == "stop" and not state.params.include_stop_str_in_output and bool(new_ids) and \
            (co.stop_reason is not None or new_ids[-1] in self.tokenizer.eos_token_ids)
        # Several tokens in one step (accepted drafts) are matched against the stop strings one at a
        # time, as plain decoding would: the first token whose text completes one ends the sequence,
        # and the tokens after it are dropped.
        pieces = [[t] for t in new_ids] if state.params.stop and len(new_ids) > 1 else [new_ids]
        stop, first = None, 0     # first: the piece's first token's index in new_ids
        for i, piece in enumerate(pieces):
            seq.token_ids += piece
            if seq.logprobs is not None:
                for token_id, lp in zip(piece, co.new_logprobs[first:first + len(piece)]):
                    seq.logprobs.append(logprobs_dict(token_id, lp))
                    seq.cumulative_logprob += lp.token_logprob
            first += len(piece)
            text_ids = piece[:-1] if untold and i == len(pieces) - 1 else piece
            stop = seq.detok.update(text_ids, len(seq.token_ids) > state.params.min_tokens)
            if stop is not None:
                break
        check_stop = len(seq.token_ids) > state.params.min_tokens
        if co.finished and stop is None:
            stop = seq.detok.flush(check_stop)
        if stop is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop
            return not co.finished
        if co.finished:
            seq.finish_reason, seq.stop_reason = co.finish_reason, co.stop_reason
        return False

    # ---- outputs -----------------------------------------------------------------------

    def _output(self, state: _RequestState) -> RequestOutput | None:
        kind = state.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not state.finished:
            return None
        if kind == RequestOutputKind.DELTA:
            completions = [c for c in (self._delta(s) for s in state.seqs) if c is not None]
            prompt_logprobs = None
            if state.prompt_logprobs is not None:
                prompt_logprobs = state.prompt_logprobs[state.sent_prompt_logprobs:]
                state.sent_prompt_logprobs = len(state.prompt_logprobs)
            if not completions and not prompt_logprobs:
                return None
        else:
            completions = [self._whole(s) for s in state.seqs]
            prompt_logprobs = None if state.prompt_logprobs is None else list(state.prompt_logprobs)
        return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                             prompt_token_ids=state.prompt_token_ids, outputs=completions,
                             finished=state.finished, num_cached_tokens=state.num_cached_tokens,
                             metrics=state.metrics, prompt_logprobs=prompt_logprobs)

    @staticmethod
    def _whole(seq: _Sequence) -> CompletionOutput:
        return CompletionOutput(index=seq.index, text=seq.detok.output_text(seq.finished),
                                token_ids=list(seq.token_ids), cumulative_logprob=seq.cumulative_logprob,
                                logprobs=None if seq.logprobs is None else list(seq.logprobs),
                                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)

    @staticmethod
    def _delta(seq: _Sequence) -> CompletionOutput | None:
        """What is new in a sequence since its last output; None if nothing is."""
        if seq.sent_finish:
            return None
        text = seq.detok.output_text(seq.finished)
        new_text, new_tokens = text[seq.sent_text:], seq.token_ids[seq.sent_tokens:]
        if not new_text and not new_tokens and not seq.finished:
            return None
        logprobs = None if seq.logprobs is None else seq.logprobs[seq.sent_tokens:]
        seq.sent_text, seq.sent_tokens, seq.sent_finish = len(text), len(seq.token_ids), seq.finished
        return CompletionOutput(index=seq.index, text=new_text, token_ids=new_tokens,
                                cumulative_logprob=seq.cumulative_logprob, logprobs=logprobs,
                                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)

