"""`jaxserve run-batch`: an OpenAI Batch file through one engine, continuously batched.

Runs on the caller's thread, one loop: read input lines lazily and add them to the engine
while fewer than `max_in_flight` engine requests (one per prompt; default 4x the engine's
sequence capacity) are queued or running, step the engine, append and flush each result
line as its request finishes, refill. Memory does not grow with the file beyond one
custom_id per line (the ids seen, to catch duplicates and to resume). The scheduling
policy orders the requests in flight, not the whole file.

Every non-blank input line gets exactly one output line, in the order they finish:
- done: `"response": {"status_code": 200, "request_id", "body"}`, `"error": null`;
- refused (bad url, body, params or model): the HTTP error as its response, status 400/404;
- failed on its own in the engine (processing its output raised): status 500, its other
  prompts aborted, and the job goes on (like the others, this line counts as answered: a
  rerun does not retry it);
- not identifiable (not valid JSON, not an object, custom_id missing or not a string, or a
  custom_id an earlier line already used): `"response": null`, `"error": {"code",
  "message", "line", "line_key"}`, and the first line with a custom_id is the one that runs.

Resume: a rerun with the same output file skips every line already answered there, so an
interrupted job keeps what it finished and a finished one writes nothing new. A line is
known by its custom_id, or, when it has no usable one, by its line key
`line-<N>-<first 12 hex of sha256(line)>` (N counts from 1; the line without its
surrounding whitespace), which its error line records; so a rerun over the same file writes
each error line once, and editing or moving such a line gives it a new key and a new
error line. A torn last output line (a write cut off) is truncated before resuming.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, TextIO

from tqdm.auto import tqdm

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.outputs import RequestOutput
from jaxserve.protocol import (ENDPOINTS, ChatCompletionRequest, RequestError, RequestLimits, chat_response,
                               completion_response, param_of, parse, parse_json_text, prepare)
from jaxserve.tool_parsers import ToolParser, get_tool_parser

IN_FLIGHT_PER_SEQ = 4   # default max_in_flight per running-sequence slot: the waiting queue refills them


@dataclasses.dataclass
class BatchSummary:
    total: int = 0        # non-empty input lines
    skipped: int = 0      # already in the output file
    succeeded: int = 0
    failed: int = 0


@dataclasses.dataclass
class _Line:
    custom_id: str
    request: object                      # the validated CompletionRequest / ChatCompletionRequest
    request_id: str                      # the response's request_id; engine ids are "<it>-<j>"
    items: list                          # engine inputs: one (prompt, SamplingParams) per prompt
    outputs: dict[str, RequestOutput] = dataclasses.field(default_factory=dict)   # finished, by engine id


def default_max_in_flight(engine: LLMEngine) -> int:
    return IN_FLIGHT_PER_SEQ * engine.config.max_num_seqs * engine.config.data_parallel_size


def run_batch(engine: LLMEngine, input_path: str | os.PathLike, output_path: str | os.PathLike, *,
              served_model_name: str | None = None, max_in_flight: int | None = None,
              use_tqdm: bool | None = None, tool_parser: str | None = None) -> BatchSummary:
    """Answer every line of `input_path` into `output_path` (appended); see the module docstring.

    max_in_flight: engine requests queued or running at once (default: default_max_in_flight).
    use_tqdm: a progress bar on stderr; None shows it when stderr is a terminal.
    tool_parser: parse the tool calls of chat lines with tools and tool_choice "auto" (a
    jaxserve.tool_parsers name: `jaxserve serve`'s --tool-call-parser with --enable-auto-tool-choice).
    """
    tools = get_tool_parser(tool_parser) if tool_parser is not None else None
    max_in_flight = default_max_in_flight(engine) if max_in_flight is None else max_in_flight
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
    if use_tqdm is None:
        use_tqdm = _isatty(sys.stderr)
    output = Path(output_path)
    try:
        source = open(input_path, "rb")
    except OSError as e:
        raise ValueError(f"cannot read the batch input file {input_path}: {e.strerror}") from e
    output.parent.mkdir(parents=True, exist_ok=True)
    with source, open(output, "a+b") as out_file:
        done_ids, done_keys = _answered(out_file)
        total = _count_lines(input_path) if use_tqdm else None
        with tqdm(total=total, desc="Batch", unit="req", disable=not use_tqdm, file=sys.stderr,
                  dynamic_ncols=True) as bar:
            job = _Job(engine, out_file, served_model_name or engine.model_name, max_in_flight,
                       done_ids, done_keys, bar, tools)
            job.run(enumerate(source, 1))
    return job.summary


class _Job:
    """One run's state: what is answered, what is in flight, and the progress bar."""

    def __init__(self, engine: LLMEngine, out_file: BinaryIO, model: str, max_in_flight: int,
                 done_ids: set[str], done_keys: set[str], bar: tqdm, tools: ToolParser | None) -> None:
        self.engine, self.out_file, self.model, self.max_in_flight = engine, out_file, model, max_in_flight
        self.tools = tools
        self.done_ids, self.done_keys = done_ids, done_keys   # answered in the output file already
        self.bar = bar
        self.summary = BatchSummary()
        self.seen: set[str] = set()            # custom_ids of this file's lines so far
        self.pending: dict[str, _Line] = {}    # engine request id in flight -> its line
        self.held: _Line | None = None         # prepared, waiting for room in flight
        self.generated = 0                     # completion tokens of the lines finished this run
        self.start = time.monotonic()

    def run(self, lines: Iterator[tuple[int, bytes]]) -> None:
        more = True
        try:
            while True:
                if more:
                    more = self._fill(lines)
                if not self.pending:
                    return
                for out in self.engine.step():
                    self._collect(out)
        except BaseException:
            # Interrupted: what was written stays, a rerun does the rest; the engine is left clean.
            self.engine.abort_request(list(self.pending))
            raise

    def _fill(self, lines: Iterator[tuple[int, bytes]]) -> bool:
        """Add lines while there is room in flight; False once the input is used up."""
        while True:
            if self.held is None:
                for lineno, raw in lines:
                    self.held = self._read(lineno, raw)
                    if self.held is not None:
                        break
                else:
                    return False
            # A line of more prompts than the bound runs alone rather than never.
            if self.pending and len(self.pending) + len(self.held.items) > self.max_in_flight:
                return True
            line, self.held = self.held, None
            self._add(line)

    def _read(self, lineno: int, raw: bytes) -> _Line | None:
        """The line prepared to run, or None when it is blank, answered already, or answered now by an error."""
        if not raw.strip():
            self._untotal()
            return None
        self.summary.total += 1
        try:
            obj = parse_json_text(raw, f"line {lineno}")
        except RequestError as e:   # also not UTF-8, a lone surrogate, too deep
            return self._unidentified(lineno, raw, "invalid_json", str(e))
        if not isinstance(obj, dict):
            return self._unidentified(lineno, raw, "invalid_line", f"line {lineno} is not a JSON object")
        custom_id = obj.get("custom_id")
        if custom_id is None:
            return self._unidentified(lineno, raw, "missing_custom_id", f"line {lineno} has no custom_id")
        if not isinstance(custom_id, str):
            return self._unidentified(lineno, raw, "invalid_custom_id",
                                      f"line {lineno}: custom_id must be a string, got {custom_id!r}")
        if custom_id in self.seen:
            return self._unidentified(lineno, raw, "duplicate_custom_id",
                                      f"line {lineno}: custom_id {custom_id!r} is used by an earlier line",
                                      custom_id=custom_id)
        self.seen.add(custom_id)
        if custom_id in self.done_ids:
            self._skip()
            return None
        try:
            return _prepare(self.engine, obj, custom_id, lineno, self.model, self.tools)
        except RequestError as e:
            self._refused(custom_id, None, e)
            return None

    def _unidentified(self, lineno: int, raw: bytes, code: str, message: str, custom_id: str | None = None) -> None:
        key = f"line-{lineno}-{hashlib.sha256(raw.strip()).hexdigest()[:12]}"
        if key in self.done_keys:
            self._skip()
            return None
        self.summary.failed += 1
        self._write(_row(custom_id, error={"code": code, "message": message, "line": lineno, "line_key": key}))
        return None

    def _add(self, line: _Line) -> None:
        ids = []
        try:
            for j, (prompt, params) in enumerate(line.items):
                ids.append(f"{line.request_id}-{j}")
                self.engine.add_request(ids[-1], prompt, params, priority=line.request.priority,
                                        cache_salt=line.request.cache_salt)
        except ValueError as e:   # limits only the engine knows (logprobs, vocabulary)
            self.engine.abort_request(ids[:-1])
            self._refused(line.custom_id, line.request_id, RequestError(str(e), param=param_of(str(e))))
            return
        self.pending.update((eid, line) for eid in ids)

    def _collect(self, out: RequestOutput) -> None:
        line = self.pending.get(out.request_id)
        if line is None or not out.finished:
            return
        del self.pending[out.request_id]
        if out.error is not None:   # the line fails whole: its other prompts stop here
            others = [eid for eid, other in self.pending.items() if other is line]
            for eid in others:
                del self.pending[eid]
            self.engine.abort_request(others)
            status = out.error_status or 500
            self._refused(line.custom_id, line.request_id, RequestError(
                out.error, status=status, type="invalid_request_error" if status == 400 else "internal_error"))
            return
        line.outputs[out.request_id] = out
        if len(line.outputs) < len(line.items):
            return
        self.summary.succeeded += 1
        self.generated += sum(len(c.token_ids) for o in line.outputs.values() for c in o.outputs)
        body = _body(line, self.model, self.engine.tokenizer, self.tools)
        self._write(_row(line.custom_id, line.request_id, 200, body=body))

    def _refused(self, custom_id: str, request_id: str | None, error: RequestError) -> None:
        self.summary.failed += 1
        self._write(_row(custom_id, request_id, error.status, body=error.to_dict()))

    def _write(self, row: dict) -> None:
        self.out_file.write(json.dumps(row, ensure_ascii=False).encode() + b"\n")
        self.out_file.flush()
        elapsed = max(time.monotonic() - self.start, 1e-9)
        postfix = {"failed": self.summary.failed, "tok/s": f"{self.generated / elapsed:.1f}"}
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def _skip(self) -> None:
        self.summary.skipped += 1
        self._untotal()

    def _untotal(self) -> None:
        """The bar counts the rows this run writes: blank and answered lines leave its total."""
        if self.bar.total is not None:
            self.bar.total -= 1


def _answered(out_file: BinaryIO) -> tuple[set[str], set[str]]:
    """(custom_ids, line keys) already answered in the output; a torn last line is cut off."""
    ids, keys = set(), set()
    out_file.seek(0)
    end = 0
    for raw in out_file:
        if not raw.endswith(b"\n"):
            out_file.truncate(end)
            break
        end += len(raw)
        try:
            row = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(row, dict):
            continue
        error = row.get("error")
        if isinstance(error, dict) and isinstance(error.get("line_key"), str):
            keys.add(error["line_key"])
        elif isinstance(row.get("custom_id"), str):
            ids.add(row["custom_id"])
    return ids, keys


def _count_lines(path: str | os.PathLike) -> int | None:
    """Lines of a regular file, counted by bytes (cheap); None for a pipe and the like."""
    if not os.path.isfile(path):
        return None
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):   # no isatty, or closed
        return False


def _row(custom_id: str | None, request_id: str | None = None, status: int | None = None, body: dict | None = None,
         error: dict | None = None) -> dict:
    response = None if status is None else {"status_code": status, "request_id": request_id, "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}


def _prepare(engine: LLMEngine, obj: dict, custom_id: str, lineno: int, model: str,
             tools: ToolParser | None = None) -> _Line:
    """Validate and tokenize one line's request; RequestError names what is wrong."""
    if obj.get("method", "POST") != "POST":
        raise RequestError(f"method {obj.get('method')!r} is not supported; use POST", param="method")
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise RequestError(f"url {url!r} is not supported; use one of {sorted(ENDPOINTS)}", param="url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise RequestError("body must be a JSON object", param="body")
    if body.get("model") not in (None, model):
        raise RequestError(f"the model {body['model']!r} does not exist; this job serves {model!r}",
                           status=404, param="model", type="NotFoundError")
    req = parse(ENDPOINTS[url], body)
    if req.stream:
        raise RequestError("stream is not supported in a batch job", param="stream")
    items = prepare(req, engine.tokenizer, engine.max_model_len, RequestLimits(max_logprobs=engine.config.max_logprobs),
                    tools, engine.sampling_defaults)
    return _Line(custom_id, req, f"batch-{lineno}-{uuid.uuid4().hex[:8]}", items)


def _body(line: _Line, model: str, tokenizer, tools: ToolParser | None) -> dict:
    outputs = [line.outputs[f"{line.request_id}-{j}"] for j in range(len(line.items))]
    if isinstance(line.request, ChatCompletionRequest):
        return chat_response(line.request, outputs[0], model, tokenizer, tools)
    return completion_response(line.request, outputs, model, tokenizer)
