"""`jaxserve run-batch`: good and bad lines, resume after an interruption, the CLI."""

import json

import pytest

from jaxserve.batch import run_batch
from jaxserve.cli import main


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


def read(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


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
    assert by_id[None]["error"]["code"] == "invalid_json"
    for cid, param in [("badurl", "url"), ("badtemp", "temperature"), ("toolong", "max_tokens"),
                       ("unknownfield", "frobnicate")]:
        err = by_id[cid]["response"]["body"]["error"]
        assert by_id[cid]["response"]["status_code"] == 400 and err["param"] == param, (cid, err)
    assert by_id["badmodel"]["response"]["status_code"] == 404
    assert not engine.has_unfinished_requests()


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
        run_batch(engine, src, dst, use_tqdm=False)
    monkeypatch.undo()
    first = read(dst)
    assert 0 < len(first) < 9 and not engine.has_unfinished_requests()
    with open(dst, "a") as f:
        f.write('{"id": "torn')          # a write cut off mid-line
    summary = run_batch(engine, src, dst, use_tqdm=False)
    rows = read(dst)
    ids = [r["custom_id"] for r in rows if r["custom_id"] is not None]
    assert sorted(ids) == [f"r{i}" for i in range(8)] and len(rows) == 9
    assert summary.skipped == len(first)


def test_cli_run_batch(tiny_models, tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(GOOD[0] + "\n" + BAD[1] + "\n")
    rc = main(["run-batch", "-i", str(src), "-o", str(dst), str(tiny_models["llama"]), "--max-num-seqs", "4",
               "--max-num-batched-tokens", "16", "--num-kv-blocks", "64", "--max-model-len", "64",
               "--token-buckets", "16"])
    assert rc == 0 and len(read(dst)) == 2
    assert "1 succeeded, 1 failed" in capsys.readouterr().err


def test_cli_reports_bad_flags_cleanly(tmp_path, capsys):
    rc = main(["run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl"),
               str(tmp_path / "nope")])
    assert rc == 2 and "nope" in capsys.readouterr().err
