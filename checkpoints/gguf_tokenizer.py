"""Rebuilding a Hugging Face `tokenizers` tokenizer from a GGUF file's metadata.

A GGUF carries no tokenizer.json: it stores llama.cpp's description (tokens, merges,
token types, special token ids, and a pre-tokenizer name in `tokenizer.ggml.pre`).
This module turns that back into a byte-level BPE `tokenizers.Tokenizer` plus the
tokenizer_config.json entries (special tokens, chat template). Only byte-level BPE
("gpt2" in llama.cpp's terms) is supported; that covers Llama 3, Qwen and SmolLM.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from checkpoints.base import CheckpointError

# llama.cpp token types (tokenizer.ggml.token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclasses.dataclass(frozen=True)
class _PreTokenizer:
    split: str | None = None  # regex splitting text before byte-level BPE; None: GPT-2's own
    digits: bool = False  # split every digit on its own first (StarCoder-style vocabularies)
    ignore_merges: bool = False  # a word that is already a token is not merged further (Llama 3)


_GPT2 = _PreTokenizer()
_DIGITS = _PreTokenizer(digits=True)
_LLAMA3 = _PreTokenizer(split=_LLAMA3_SPLIT, ignore_merges=True)
_QWEN2 = _PreTokenizer(split=_QWEN2_SPLIT)

# tokenizer.ggml.pre -> how to split text; names and groupings follow llama.cpp's vocab loader.
_FAMILIES = (
    (_GPT2, ("default", "gpt-2", "gpt2", "phi-2", "roberta-bpe")),
    (_DIGITS, ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")),
    (_LLAMA3, ("llama3", "llama-v3", "llama-bpe", "falcon3")),
    (dataclasses.replace(_LLAMA3, ignore_merges=False), ("dbrx", "smaug-bpe")),
    (_QWEN2, ("qwen2", "deepseek-r1-qwen", "megrez")),
)
PRE_TOKENIZERS: Mapping[str, _PreTokenizer] = {name: spec for spec, names in _FAMILIES for name in names}


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map used to spell byte-level tokens."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _byte_spelled(token: str) -> str:
    """`token` in the byte alphabet (most GGUF tokens already are; a few writers store raw text)."""
    alphabet = _byte_alphabet()
    if set(token) <= set(alphabet.values()):
        return token
    return "".join(alphabet[b] for b in token.encode("utf-8"))


def _pre_tokenizer(spec: _PreTokenizer):
    if spec.split is None:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    else:
        byte_level = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(spec.split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
            ]
        )
    if spec.digits:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _post_processor(tokens: list[str], bos_id: int | None, eos_id: int | None, add_bos: bool, add_eos: bool):
    if not ((add_bos and bos_id is not None) or (add_eos and eos_id is not None)):
        return processors.ByteLevel(trim_offsets=False)
    bos = [(tokens[bos_id], bos_id)] if add_bos and bos_id is not None else []
    eos = [(tokens[eos_id], eos_id)] if add_eos and eos_id is not None else []
    pre = "".join(f"{t} " for t, _ in bos)
    post = "".join(f" {t}" for t, _ in eos)
    return processors.TemplateProcessing(
        single=f"{pre}$A{post}",
        pair=f"{pre}$A{post} {pre}$B:1{post}",
        special_tokens=bos + eos,
    )


def _special_token_id(meta: Mapping[str, Any], key: str, n_tokens: int) -> int | None:
    token_id = meta.get(f"tokenizer.ggml.{key}")
    if token_id is None:
        return None
    if not 0 <= int(token_id) < n_tokens:
        raise CheckpointError(f"tokenizer.ggml.{key} = {token_id} is outside the vocabulary of {n_tokens} tokens")
    return int(token_id)


def _vocabulary(tokens: list[str], token_types: list[int], source: str) -> dict[str, int]:
    """Token -> id; normal tokens in the byte alphabet, added (control/user-defined) ones as written."""
    vocab: dict[str, int] = {}
    for i, (token, token_type) in enumerate(zip(tokens, token_types, strict=True)):
        spelled = token if token_type in (_CONTROL, _USER_DEFINED) else _byte_spelled(token)
        if spelled in vocab:
            raise CheckpointError(
                f"{source}: token {token!r} appears twice in tokenizer.ggml.tokens (ids {vocab[spelled]}, {i})"
            )
        vocab[spelled] = i
    return vocab


def _add_special_and_user_tokens(tokenizer: Tokenizer, tokens: list[str], token_types: list[int], special_ids: set):
    """Control tokens (and bos/eos/unk/pad) become special; user-defined ones plain added tokens, matched whole."""
    typed = list(enumerate(zip(tokens, token_types, strict=True)))
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for i, (t, kind) in typed
            if kind == _CONTROL or i in special_ids
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for i, (t, kind) in typed
            if kind == _USER_DEFINED and i not in special_ids
        ]
    )


def build_tokenizer(meta: Mapping[str, Any], source: str) -> tuple[Tokenizer, dict[str, Any]]:
    """(tokenizer, tokenizer_config dict) from GGUF metadata; `source` names the file in errors."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(
            f"{source}: tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') GGUF tokenizers are supported"
        )
    pre_name = meta.get("tokenizer.ggml.pre", "default")
    if pre_name not in PRE_TOKENIZERS:
        known = ", ".join(sorted(PRE_TOKENIZERS))
        raise CheckpointError(f"{source}: unknown pre-tokenizer tokenizer.ggml.pre={pre_name!r}; known: {known}")
    spec = PRE_TOKENIZERS[pre_name]
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    token_types = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    if len(token_types) != len(tokens):
        raise CheckpointError(f"{source}: {len(token_types)} token types for {len(tokens)} tokens")
    if "tokenizer.ggml.merges" not in meta:
        raise CheckpointError(f"{source}: byte-level BPE tokenizer without tokenizer.ggml.merges")
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    if any(len(m) != 2 for m in merges):
        raise CheckpointError(f"{source}: malformed entry in tokenizer.ggml.merges (expected 'left right')")

    tokenizer = Tokenizer(
        models.BPE(vocab=_vocabulary(tokens, token_types, source), merges=merges, ignore_merges=spec.ignore_merges)
    )
    tokenizer.pre_tokenizer = _pre_tokenizer(spec)
    tokenizer.decoder = decoders.ByteLevel()
    ids = {key: _special_token_id(meta, f"{key}_token_id", len(tokens)) for key in ("bos", "eos", "unknown", "padding")}
    _add_special_and_user_tokens(tokenizer, tokens, token_types, {i for i in ids.values() if i is not None})
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    tokenizer.post_processor = _post_processor(tokens, ids["bos"], ids["eos"], add_bos, add_eos)
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise CheckpointError(
            f"{source}: rebuilt tokenizer has {tokenizer.get_vocab_size()} tokens, the file {len(tokens)}"
        )

    names = {"bos": "bos_token", "eos": "eos_token", "unknown": "unk_token", "padding": "pad_token"}
    tokenizer_config: dict[str, Any] = {names[key]: tokens[i] for key, i in ids.items() if i is not None}
    tokenizer_config.update(add_bos_token=add_bos, add_eos_token=add_eos, clean_up_tokenization_spaces=False)
    chat_template = _chat_template(meta)
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    return tokenizer, tokenizer_config


def _chat_template(meta: Mapping[str, Any]) -> str | list[dict[str, str]] | None:
    """tokenizer.chat_template, or HF's list form when the file also has named templates."""
    default = meta.get("tokenizer.chat_template")
    prefix = "tokenizer.chat_template."
    named = {key[len(prefix) :]: value for key, value in meta.items() if key.startswith(prefix)}
    if not named:
        return default
    templates = [{"name": "default", "template": default}] if default is not None else []
    return templates + [{"name": name, "template": template} for name, template in sorted(named.items())]


def eos_token_ids(meta: Mapping[str, Any]) -> list[int]:
    """EOS plus llama.cpp's end-of-turn / end-of-message ids, deduplicated, EOS first."""
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and int(token_id) not in ids:
            ids.append(int(token_id))
    return ids
