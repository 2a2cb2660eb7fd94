"""Incremental detokenization and stop strings, on the tiny model's byte-level BPE."""

import pytest

from checkpoints import load_hf_folder
from jaxserve.core import SamplingParams
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_models):
    return Tokenizer.from_checkpoint(load_hf_folder(tiny_models["llama"]))


def stream(tok, text, **params):
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, tok.encode("Prompt:", add_special_tokens=False), SamplingParams(**params))
    seen, stop = [], None
    for t in ids:
        stop = d.update([t])
        seen.append(d.output_text(False))
        if stop:
            break
    return ids, d, seen, stop


def test_multibyte_characters_split_across_tokens_never_show_replacement_chars(tok):
    text = " naïve café 日本語 🙂 done"
    ids, d, seen, _ = stream(tok, text)
    # The tiny vocab has few merges, so these characters span several byte tokens.
    assert len(ids) > len(text) // 2
    assert all("\ufffd" not in s for s in seen)
    assert d.text == tok.decode(ids) == text
    assert all(seen[i] == seen[i + 1][:len(seen[i])] for i in range(len(seen) - 1)), "text only ever grows"


def test_stop_string_across_token_boundaries_is_excluded(tok):
    ids, d, seen, stop = stream(tok, "the cat sat on the mat and then", stop=["t on th"])
    assert stop == "t on th" and d.text == "the cat sa"
    assert not any("t on" in s for s in seen), "no prefix of a stop string is ever shown"


def test_stop_string_included_when_asked(tok):
    _, d, _, stop = stream(tok, "the cat sat on the mat", stop=["on the"], include_stop_str_in_output=True)
    assert stop == "on the" and d.text == "the cat sat on the"


def test_held_back_tail_released_at_finish(tok):
    _, d, seen, stop = stream(tok, "abc xyz", stop=["zzzz"])
    assert stop is None and seen[-1] == "abc " and d.output_text(True) == "abc xyz"
