"""`jaxserve run-batch`: good and bad lines, the in-flight bound and lazy reading, resume after an
interruption, error lines written once, the progress bar, the CLI."""

import json
import os
import re
import threading
import time

import pytest

from jaxserve.batch import run_batch
from jaxserve.cli import main
from jaxserve.engine.llm_engine import LLMEngine
from tests.conftest import TINY_ENGINE_OPTIONS


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


def line(cid, url="/v1/completions", **body):
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


GOOD = [
    line("c1", prompt="hello", max_tokens=5, temperature=0),
    line("c2", prompt=["one", "two"], max_tokens=3, ignore_eos=True, model="llama"),
    line("chat1", url="/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=4),
]
BAD = [
    "{not json",
    line("badurl", url="/v1/embeddings", input="x"),
    line("badtemp", prompt="x", temperature=-1),
    line("badmodel", prompt="x", model="gpt-4"),
    line("toolong", prompt="x", max_tokens=500),
    line("unknownfield", prompt="x", frobnicate=1),
]
# Lines with no usable custom_id: each gets one error line, keyed by its line number and content.
UNIDENTIFIED = {
    "invalid_json": "{broken",
    "invalid_line": "[1, 2]",
    "missing_custom_id": json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
    "invalid_custom_id": line(7, prompt="x", max_tokens=1),
    "duplicate_custom_id": line("c1", prompt="again", max_tokens=1),
}


def read(path):
    # Lines end at "\n" only: str.splitlines() would also split inside a generated text holding
    # U+0085 or U+2028, which JSON leaves unescaped (file iteration does not split there either).
    return [json.loads(x) for x in path.read_text().split("\n") if x]


def many(n, prompts_every=7):
    """n greedy lines of varied lengths; every `prompts_every`-th has three prompts (three engine requests)."""
    out = []
    for i in range(n):
        prompt = [f"p{i} a", f"p{i} b", f"p{i} c"] if i % prompts_every == 3 else f"request number {i}"
        out.append(line(f"r{i}", prompt=prompt, max_tokens=1 + i % 5, temperature=0, ignore_eos=True))
    return out


def answers(path):
    """custom_id (or line key) -> the row without its random ids and timestamps; fails on a duplicate."""
    by_key = {}
    for row in read(path):
        key = row["error"]["line_key"] if row["error"] else row["custom_id"]
        assert key not in by_key, f"two rows for {key}"
        row = {**row, "id": None}
        if row["response"]:
            body = {k: v for k, v in row["response"]["body"].items() if k not in ("id", "created")}
            row["response"] = {**row["response"], "request_id": None, "body": body}
        by_key[key] = row
    return by_key


def test_one_output_line_per_input_line(engine, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(GOOD[:2] + BAD + GOOD[2:]) + "\n")
    summary = run_batch(engine, src, dst, use_tqdm=False)
    assert (summary.total, summary.succeeded, summary.failed) == (9, 3, 6)
    rows = read(dst)
    assert len(rows) == 9
    by_id = {r["custom_id"]: r for r in rows}
    assert by_id["c1"]["response"]["status_code"] == 200
    assert len(by_id["c2"]["response"]["body"]["choices"]) == 2
    assert by_id["c2"]["response"]["body"]["usage"]["completion_tokens"] == 6
    assert by_id["chat1"]["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    assert by_id[None]["error"]["code"] == "invalid_json" and by_id[None]["error"]["line"] == 3
    for cid, param in [("badurl", "url"), ("badtemp", "temperature"), ("toolong", "max_tokens"),
                       ("unknownfield", "frobnicate")]:
        err = by_id[cid]["response"]["body"]["error"]
        assert by_id[cid]["response"]["status_code"] == 400 and err["param"] == param, (cid, err)
    assert by_id["badmodel"]["response"]["status_code"] == 404
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("bound", [1, 4])
def test_in_flight_bound_holds_and_rows_match_the_unbounded_run(engine, tmp_path, monkeypatch, bound):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(many(40)) + "\n")
    unbounded = tmp_path / "unbounded.jsonl"
    run_batch(engine, src, unbounded, max_in_flight=1000, use_tqdm=False)

    added, stepped = [], []   # engine requests unfinished after each add, and at each step
    real_add, real_step = engine.add_request, engine.step

    def add_request(*args, **kwargs):
        real_add(*args, **kwargs)
        added.append(engine.num_unfinished_requests)

    def step():
        stepped.append(engine.num_unfinished_requests)
        return real_step()
    monkeypatch.setattr(engine, "add_request", add_request)
    monkeypatch.setattr(engine, "step", step)
    bounded = tmp_path / "bounded.jsonl"
    summary = run_batch(engine, src, bounded, max_in_flight=bound, use_tqdm=False)
    monkeypatch.undo()
    # A three-prompt line (three engine requests) runs alone when the bound is smaller than that.
    assert max(added) == max(stepped) == max(bound, 3)
    assert all(n <= bound or n == 3 for n in stepped) and len(stepped) > 40 // bound
    assert (summary.succeeded, summary.failed) == (40, 0)
    assert answers(bounded) == answers(unbounded)
    assert not engine.has_unfinished_requests()


def test_results_are_written_before_the_input_ends(engine, tmp_path):
    # A FIFO: lines past the first bound + 2 do not exist until a result is written, so a reader
    # that read (or counted) the whole input first would wait here, and the writer would give up.
    src, dst = tmp_path / "in.fifo", tmp_path / "out.jsonl"
    os.mkfifo(src)
    lines, bound = many(12, prompts_every=1000), 2
    saw_a_result = threading.Event()

    def feed():
        with open(src, "w") as f:
            f.write("\n".join(lines[:bound + 2]) + "\n")
            f.flush()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not (dst.exists() and dst.read_text().count("\n")):
                time.sleep(0.01)
            if dst.exists() and dst.read_text().count("\n"):
                saw_a_result.set()
            f.write("\n".join(lines[bound + 2:]) + "\n")
    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    summary = run_batch(engine, src, dst, max_in_flight=bound, use_tqdm=True)   # no total: a pipe
    writer.join(timeout=10)
    assert saw_a_result.is_set()
    assert summary.succeeded == 12 and len(read(dst)) == 12


def test_interrupted_run_resumes_without_duplicates(engine, tmp_path, monkeypatch):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [line(f"r{i}", prompt=f"request {i}", max_tokens=2 + 3 * i, ignore_eos=True) for i in range(8)]
    src.write_text("\n".join(lines + ["{broken"]) + "\n")
    real_step, calls = engine.step, {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 8:
            raise KeyboardInterrupt
        return real_step()
    monkeypatch.setattr(engine, "step", flaky_step)
    with pytest.raises(KeyboardInterrupt):
        run_batch(engine, src, dst, max_in_flight=3, use_tqdm=False)
    monkeypatch.undo()
    first = read(dst)
    assert 0 < len(first) < 8 and not engine.has_unfinished_requests()
    with open(dst, "a") as f:
        f.write('{"id": "torn')          # a write cut off mid-line
    summary = run_batch(engine, src, dst, max_in_flight=3, use_tqdm=False)
    rows = read(dst)
    ids = [r["custom_id"] for r in rows if r["custom_id"] is not None]
    assert sorted(ids) == [f"r{i}" for i in range(8)] and len(rows) == 9
    assert summary.skipped == len(first)


def test_resume_from_a_partial_output_file(engine, tmp_path):
    src, full, partial = tmp_path / "in.jsonl", tmp_path / "full.jsonl", tmp_path / "partial.jsonl"
    src.write_text("\n".join(many(20) + [UNIDENTIFIED["missing_custom_id"]]) + "\n")
    run_batch(engine, src, full, use_tqdm=False)
    kept = full.read_text().splitlines()[::2]             # every other row, the error row among them or not
    partial.write_text("\n".join(kept) + "\n")
    summary = run_batch(engine, src, partial, max_in_flight=3, use_tqdm=False)
    assert summary.skipped == len(kept) and summary.succeeded + summary.failed == 21 - len(kept)
    assert answers(partial) == answers(full)


def test_error_lines_are_written_once(engine, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join([GOOD[0], *UNIDENTIFIED.values(), "", UNIDENTIFIED["invalid_json"], BAD[2]]) + "\n")
    first = run_batch(engine, src, dst, use_tqdm=False)
    assert (first.total, first.succeeded, first.failed, first.skipped) == (8, 1, 7, 0)
    rows = read(dst)
    errors = {r["error"]["line"]: r for r in rows if r["error"]}
    assert {n: r["error"]["code"] for n, r in errors.items()} == {
        2: "invalid_json", 3: "invalid_line", 4: "missing_custom_id", 5: "invalid_custom_id",
        6: "duplicate_custom_id", 8: "invalid_json"}
    assert errors[6]["custom_id"] == "c1" and errors[2]["error"]["line_key"] != errors[8]["error"]["line_key"]
    assert all(r["response"] is None and r["error"]["line_key"].startswith(f"line-{n}-") for n, r in errors.items())

    before = dst.read_bytes()
    again = run_batch(engine, src, dst, use_tqdm=False)
    assert dst.read_bytes() == before
    assert (again.total, again.succeeded, again.failed, again.skipped) == (8, 0, 0, 8)

    # A fixed line is a new line: it runs, and the old error line stays as the record of the bad one.
    lines = src.read_text().splitlines()
    lines[3] = line("fixed", prompt="x", max_tokens=1)
    src.write_text("\n".join(lines) + "\n")
    fixed = run_batch(engine, src, dst, use_tqdm=False)
    assert (fixed.succeeded, fixed.failed, fixed.skipped) == (1, 0, 7)
    assert read(dst)[-1]["custom_id"] == "fixed" and read(dst)[-1]["response"]["status_code"] == 200


def test_lines_no_request_can_be_made_of_are_error_rows_and_the_job_goes_on(engine, tmp_path):
    # What the HTTP server refuses as a body is an error row here: nesting past the parser's depth
    # (it raised RecursionError and ended the job) and lone surrogates, which no text can hold (in a
    # custom_id the row could not be written, so every rerun ran the line again and stopped there;
    # in a prompt the tokenizer raised TypeError).
    deep = '{"custom_id": "deep", "body": ' + "[" * 100_000 + "]" * 100_000 + "}"
    surrogate_id = '{"custom_id": "\\ud800", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 2}}'
    surrogate_prompt = '{"custom_id": "s", "url": "/v1/completions", "body": {"prompt": "hi \\ud800", "max_tokens": 2}}'
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join([deep, surrogate_id, GOOD[0], surrogate_prompt]) + "\n")
    summary = run_batch(engine, src, dst, use_tqdm=False)
    assert (summary.total, summary.succeeded, summary.failed) == (4, 1, 3)
    rows = read(dst)
    errors = {r["error"]["line"]: r["error"] for r in rows if r["error"]}
    assert {n: e["code"] for n, e in errors.items()} == {1: "invalid_json", 2: "invalid_json", 4: "invalid_json"}
    assert "nested too deeply" in errors[1]["message"] and "surrogate" in errors[2]["message"]
    assert [r["custom_id"] for r in rows if not r["error"]] == ["c1"]
    again = run_batch(engine, src, dst, use_tqdm=False)
    assert (again.succeeded, again.failed, again.skipped) == (0, 0, 4)
    assert not engine.has_unfinished_requests()


def test_max_logprobs_is_the_engines(tiny_models, tmp_path):
    # The limit a line may ask for is the engine's --max-logprobs, as in `jaxserve serve` (it was
    # always the default, 20).
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    chat = dict(url="/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=2, logprobs=True)
    src.write_text("\n".join([line("within", top_logprobs=30, **chat), line("past", top_logprobs=31, **chat)]) + "\n")
    engine = LLMEngine.from_kwargs(str(tiny_models["llama"]), **{**TINY_ENGINE_OPTIONS, "token_buckets": (16, 64)},
                                   max_logprobs=30)
    run_batch(engine, src, dst, use_tqdm=False)
    by_id = {r["custom_id"]: r["response"] for r in read(dst)}
    assert by_id["within"]["status_code"] == 200
    assert len(by_id["within"]["body"]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 30
    assert by_id["past"]["status_code"] == 400 and "limit of 30" in by_id["past"]["body"]["error"]["message"]


def test_tool_calls_are_parsed_with_a_tool_call_parser(engine, tmp_path):
    # `run-batch --enable-auto-tool-choice --tool-call-parser hermes`, as `serve`: a regex makes the
    # tiny model write a call; without a parser, tools with tool_choice "auto" are a 400 row.
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    src = tmp_path / "in.jsonl"
    src.write_text(line("t", url="/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], tools=tools,
                        max_tokens=60, structured_outputs={"regex": re.escape(call)}) + "\n")
    run_batch(engine, src, tmp_path / "plain.jsonl", use_tqdm=False)
    (refused,) = read(tmp_path / "plain.jsonl")
    assert refused["response"]["status_code"] == 400
    assert "--enable-auto-tool-choice" in refused["response"]["body"]["error"]["message"]
    run_batch(engine, src, tmp_path / "parsed.jsonl", use_tqdm=False, tool_parser="hermes")
    (row,) = read(tmp_path / "parsed.jsonl")
    choice = row["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (parsed,) = choice["message"]["tool_calls"]
    assert parsed["function"]["name"] == "f" and json.loads(parsed["function"]["arguments"]) == {"x": 1}


def test_a_duplicate_answered_first_does_not_stand_for_the_original(engine, tmp_path, monkeypatch):
    # The duplicate's error line is written when it is read, before the original finishes; an
    # interrupted run must still run the original on resume.
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join([line("d", prompt="long one", max_tokens=20, ignore_eos=True),
                              line("d", prompt="copy", max_tokens=1)]) + "\n")
    real_step = engine.step

    def interrupted():
        raise KeyboardInterrupt
    monkeypatch.setattr(engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_batch(engine, src, dst, use_tqdm=False)
    monkeypatch.setattr(engine, "step", real_step)
    assert [r["error"]["code"] for r in read(dst)] == ["duplicate_custom_id"]
    summary = run_batch(engine, src, dst, use_tqdm=False)
    assert (summary.succeeded, summary.skipped) == (1, 1)
    assert read(dst)[-1]["response"]["body"]["usage"]["completion_tokens"] == 20


def test_progress_bar_on_a_non_tty(engine, tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(GOOD + ["", BAD[0]]) + "\n")
    run_batch(engine, src, dst, use_tqdm=None)           # default: stderr is captured, not a terminal
    assert capsys.readouterr().err == "" and len(read(dst)) == 4
    src.write_text("\n".join(GOOD + ["", BAD[0]] + many(3)) + "\n")
    summary = run_batch(engine, src, dst, max_in_flight=2, use_tqdm=True)
    err = capsys.readouterr().err
    assert summary.succeeded == 3 and summary.skipped == 4 and len(read(dst)) == 7
    final = err.replace("\r", "\n").strip().splitlines()[-1]
    assert "3/3" in final and "tok/s=" in final and "failed=0" in final, err   # skipped and blank lines leave the total


def test_cli_run_batch(tiny_models, tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(GOOD[0] + "\n" + BAD[1] + "\n")
    rc = main(["run-batch", "-i", str(src), "-o", str(dst), str(tiny_models["llama"]), "--max-num-seqs", "4",
               "--max-num-batched-tokens", "16", "--num-kv-blocks", "64", "--max-model-len", "64",
               "--token-buckets", "16", "--max-in-flight", "1", "--no-progress", "--enable-auto-tool-choice",
               "--tool-call-parser", "hermes"])
    assert rc == 0 and len(read(dst)) == 2
    assert capsys.readouterr().err.rstrip().endswith("1 succeeded, 1 failed, 0 already done -> " + str(dst))


def test_cli_reports_bad_flags_cleanly(tmp_path, capsys):
    rc = main(["run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl"),
               str(tmp_path / "nope")])
    assert rc == 2 and "nope" in capsys.readouterr().err
    rc = main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "o.jsonl"), "--max-in-flight", "0"])
    assert rc == 2 and "--max-in-flight must be at least 1, got 0" in capsys.readouterr().err
    rc = main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "o.jsonl"),
               "--enable-auto-tool-choice"])
    assert rc == 2 and "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err


@pytest.mark.slow
def test_memory_stays_flat_on_a_long_file(engine, tmp_path):
    # Python heap peak per extra input line: the bounded reader keeps a custom_id per line (~0.2 KB
    # here); reading and queueing the whole file first held ~6 KB per line of this shape.
    import tracemalloc

    def peak(n):
        src, dst = tmp_path / f"in{n}.jsonl", tmp_path / f"out{n}.jsonl"
        src.write_text("".join(line(f"r{i}", prompt=f"request number {i} " * 4, max_tokens=1) + "\n"
                               for i in range(n)))
        tracemalloc.start()
        try:
            summary = run_batch(engine, src, dst, use_tqdm=False)
            top = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert summary.succeeded == n
        return top
    small, large = peak(2_000), peak(20_000)
    assert (large - small) / 18_000 < 1_000, (small, large)


def test_a_line_that_fails_in_the_engine_is_a_500_row_and_the_job_goes_on(engine, tmp_path, monkeypatch):
    from tests.faults import MARKER, fail_marked_requests
    fail_marked_requests(monkeypatch, after=2)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    # "two": three prompts, the second marked (its siblings still running are aborted with it).
    lines = [line("one", prompt=[3, 4, 5], max_tokens=6, ignore_eos=True, temperature=0),
             line("two", prompt=[[6, 7], [8] * 4 + MARKER, [9, 10]], max_tokens=30, ignore_eos=True),
             line("three", prompt=[11, 12], max_tokens=6, ignore_eos=True, temperature=0)]
    src.write_text("\n".join(lines) + "\n")
    free = engine.stats()["kv_free_blocks"]
    summary = run_batch(engine, src, dst, use_tqdm=False)
    assert (summary.total, summary.succeeded, summary.failed) == (3, 2, 1)
    by_id = {r["custom_id"]: r for r in read(dst)}
    assert by_id["two"]["response"]["status_code"] == 500
    assert by_id["two"]["response"]["body"]["error"]["type"] == "internal_error"
    assert "InjectedFault" in by_id["two"]["response"]["body"]["error"]["message"]
    for cid in ("one", "three"):
        assert by_id[cid]["response"]["body"]["usage"]["completion_tokens"] == 6
    assert not engine.has_unfinished_requests() and engine.stats()["kv_free_blocks"] == free


def test_a_line_whose_constraints_leave_no_token_is_a_400_row(engine, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [line("stuck", prompt=[3, 4, 5], max_tokens=6, allowed_token_ids=[2],      # EOS, which the choice
                  structured_outputs={"choice": ["yes", "no"]}),                       # does not allow first
             line("fine", prompt=[3, 4, 5], max_tokens=6, ignore_eos=True, temperature=0)]
    src.write_text("\n".join(lines) + "\n")
    summary = run_batch(engine, src, dst, use_tqdm=False)
    assert (summary.total, summary.succeeded, summary.failed) == (2, 1, 1)
    by_id = {r["custom_id"]: r for r in read(dst)}
    error = by_id["stuck"]["response"]["body"]["error"]
    assert by_id["stuck"]["response"]["status_code"] == 400 and error["type"] == "invalid_request_error"
    assert "no token can be sampled" in error["message"]
    assert by_id["fine"]["response"]["body"]["usage"]["completion_tokens"] == 6
