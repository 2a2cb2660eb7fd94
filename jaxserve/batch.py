"""`jaxserve run-batch`: an OpenAI Batch file through one engine, continuously batched.

Runs on the caller's thread. Every input line is validated and added to the engine up
front, so all lines are batched together; a bad line becomes an error line for its
custom_id and the rest still runs. Result lines are appended and flushed as requests
finish, so an interrupted job keeps what it finished; a rerun with the same output file
skips custom_ids already written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import uuid
from pathlib import Path

from tqdm.auto import tqdm

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.outputs import RequestOutput
from jaxserve.protocol import (ENDPOINTS, ChatCompletionRequest, RequestError, chat_response,
                               completion_response, parse, prepare)


@dataclasses.dataclass
class _Line:
    custom_id: str
    request: object
    request_id: str
    engine_ids: list[str]
    outputs: dict[str, RequestOutput] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class BatchSummary:
    total: int = 0        # non-empty input lines
    skipped: int = 0      # already in the output file
    succeeded: int = 0
    failed: int = 0


def _done_ids(output: Path) -> set[str]:
    """custom_ids (and "line:N" of unparsable lines) already written; a torn last line is cut off."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[:data.rfind(b"\n") + 1]
        with open(output, "r+b") as f:
            f.truncate(len(data))
    done = set()
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and obj.get("custom_id") is not None:
            done.add(str(obj["custom_id"]))
        elif isinstance(obj, dict) and isinstance(obj.get("error"), dict) and "line" in obj["error"]:
            done.add(f"line:{obj['error']['line']}")
    return done


def _result(custom_id, request_id, status, body=None, error=None) -> dict:
    response = None if status is None else {"status_code": status, "request_id": request_id, "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}


def run_batch(engine: LLMEngine, input_path: str | os.PathLike, output_path: str | os.PathLike, *,
              served_model_name: str | None = None, use_tqdm: bool = True) -> BatchSummary:
    model = served_model_name or engine.model_name
    output = Path(output_path)
    done = _done_ids(output)
    summary = BatchSummary()
    try:
        lines = Path(input_path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"cannot read the batch input file {input_path}: {e.strerror}") from e
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "a", encoding="utf-8") as out_file:
        def write(obj: dict) -> None:
            out_file.write(json.dumps(obj, ensure_ascii=False) + "\n")
            out_file.flush()

        def fail(custom_id, error: RequestError, request_id=None) -> None:
            summary.failed += 1
            write(_result(custom_id, request_id, error.status, body=error.to_dict()))

        pending: dict[str, _Line] = {}    # engine request id -> its line
        for lineno, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            summary.total += 1
            if f"line:{lineno}" in done:
                summary.skipped += 1
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                summary.failed += 1
                write(_result(None, None, None, error={"code": "invalid_json", "line": lineno,
                                                       "message": f"line {lineno} is not valid JSON: {e}"}))
                continue
            custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
            if custom_id is not None and str(custom_id) in done:
                summary.skipped += 1
                continue
            try:
                line = _admit(engine, obj, lineno, model)
            except RequestError as e:
                fail(custom_id, e)
                continue
            for eid in line.engine_ids:
                pending[eid] = line

        with tqdm(total=summary.total - summary.skipped, initial=summary.failed, desc="Batch requests",
                  disable=not use_tqdm, file=sys.stderr, dynamic_ncols=True) as bar:
            try:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        line = pending.get(out.request_id)
                        if line is None or not out.finished:
                            continue
                        line.outputs[out.request_id] = out
                        if len(line.outputs) == len(line.engine_ids):
                            write(_result(line.custom_id, line.request_id, 200,
                                          body=_body(line, model, engine.tokenizer)))
                            summary.succeeded += 1
                            bar.update(1)
            except BaseException:
                engine.abort_all()   # interrupted: what was written stays; a rerun does the rest
                raise
    return summary


def _admit(engine: LLMEngine, obj, lineno: int, model: str) -> _Line:
    if not isinstance(obj, dict):
        raise RequestError(f"line {lineno} must be a JSON object")
    custom_id = obj.get("custom_id")
    if custom_id is None:
        raise RequestError(f"line {lineno} has no custom_id", param="custom_id")
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
    items = prepare(req, engine.tokenizer, engine.max_model_len)
    request_id = f"batch-{lineno}-{uuid.uuid4().hex[:8]}"
    engine_ids = []
    try:
        for j, (prompt, params) in enumerate(items):
            engine.add_request(f"{request_id}-{j}", prompt, params, priority=req.priority,
                               cache_salt=req.cache_salt)
            engine_ids.append(f"{request_id}-{j}")
    except ValueError as e:
        engine.abort_request(engine_ids)
        raise RequestError(str(e)) from e
    return _Line(str(custom_id), req, request_id, engine_ids)


def _body(line: _Line, model: str, tokenizer) -> dict:
    outputs = [line.outputs[eid] for eid in line.engine_ids]
    if isinstance(line.request, ChatCompletionRequest):
        return chat_response(line.request, outputs[0], model, tokenizer)
    return completion_response(line.request, outputs, model, tokenizer)
