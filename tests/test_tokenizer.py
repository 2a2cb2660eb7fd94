"""The tokenizer wrapper on a tiny hand-built tokenizer; chat templates checked against transformers."""

from __future__ import annotations

import json
from datetime import datetime

import numpy as np
import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from checkpoints import load_checkpoint
from jaxserve.tokenizer import Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["he", "ll", "hello", "Ġw", "Ġworld"]
MERGES = [
    ("h", "e"),
    ("l", "l"),
    ("he", "ll"),
    ("hell", "o"),
    ("Ġ", "w"),
    ("o", "r"),
    ("Ġw", "or"),
    ("Ġwor", "l"),
    ("Ġworl", "d"),
]

# Exercises what transformers' renderer sets up: trim_blocks/lstrip_blocks, bos_token, tojson without HTML
# escaping, raise_exception, loop controls, extra keyword variables and strftime_now.
TEMPLATE = """{{ bos_token }}
{%- if tools %}
<|im_start|>system
Tools: {{ tools | tojson }}<|im_end|>
{% endif %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'system' and skip_system %}{% continue %}{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% if date %}Today is {{ strftime_now('%Y') }}.
{% endif %}
{% endif %}"""
GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}[{{ m['content'] }}]{% endif %}{% endfor %}"
)
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  hello world <b>&</b>  "},
    {"role": "assistant", "content": "日本語 😀"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo <city> & co",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]


def _byte_alphabet() -> list[str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling, extra = {}, 0
    for b in range(256):
        spelling[b] = chr(b) if b in printable else chr(256 + (extra := extra + 1) - 1)
    return [spelling[b] for b in range(256)]


def _write_model(folder, *, chat_template=TEMPLATE, add_bos=False, generation_config=None):
    """A tiny byte-level BPE model folder: ids 0-2 special, 3 + byte for bytes, then the merged words."""
    tokens = SPECIALS + _byte_alphabet() + [a + b for a, b in MERGES]
    tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = (
        processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
        if add_bos
        else processors.ByteLevel(trim_offsets=False)
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "pad_token": "<|endoftext|>",
    }
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = {"architectures": ["LlamaForCausalLM"], "eos_token_id": 2, "bos_token_id": 1}
    (folder / "config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    from safetensors.numpy import save_file

    save_file({"model.norm.weight": np.ones(4, np.float32)}, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _write_model(tmp_path_factory.mktemp("tok") / "tiny", generation_config={"eos_token_id": [2, 0]})


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_checkpoint(load_checkpoint(model_dir))


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def test_encode_decode_by_hand(tok):
    hello, world = 3 + 256 + MERGES.index(("hell", "o")), 3 + 256 + MERGES.index(("Ġworl", "d"))
    assert tok.encode("hello world") == [hello, world]
    assert tok.encode("<|im_start|>hello<|im_end|>") == [1, hello, 2]
    assert tok.encode("hi") == [3 + ord("h"), 3 + ord("i")]
    assert tok.decode([1, hello, world, 2]) == "hello world"
    assert tok.decode([1, hello, 2], skip_special_tokens=False) == "<|im_start|>hello<|im_end|>"
    assert tok.vocab_size == 3 + 256 + len(MERGES)


def test_special_token_ids(tok):
    # generation_config's [2, 0] first, then config's 2 and tokenizer_config's <|im_end|> (2) deduplicated.
    assert tok.eos_token_ids == (2, 0)
    assert tok.eos_token_id == 2   # the tokenizer's own: ending on 0 reports stop_reason 0
    assert tok.bos_token_id == 1
    assert tok.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def test_add_special_tokens_follows_the_post_processor(tmp_path):
    tok = Tokenizer.from_checkpoint(load_checkpoint(_write_model(tmp_path / "bos", add_bos=True)))
    assert tok.encode("hi") == [1, 3 + ord("h"), 3 + ord("i")]
    assert tok.encode("hi", add_special_tokens=False) == [3 + ord("h"), 3 + ord("i")]
    assert tok.eos_token_ids == (2,)


def test_truncate_left_keeps_the_specials_as_transformers_does(tmp_path):
    # vLLM's truncate_prompt_tokens on a text prompt: the tokenizer truncates on the left to k,
    # keeping the BOS its post-processor adds (cutting plain ids[-k:] lost it).
    from transformers import AutoTokenizer

    folder = _write_model(tmp_path / "bos", add_bos=True)
    tok = Tokenizer.from_checkpoint(load_checkpoint(folder))
    reference = AutoTokenizer.from_pretrained(str(folder), truncation_side="left")
    text = "hello world, hello world once more"
    ids = tok.encode(text)
    assert ids[0] == 1 and len(ids) > 8
    for keep in (2, 4, 7, len(ids) - 1, len(ids), len(ids) + 3):
        expected = reference(text, truncation=True, max_length=keep)["input_ids"]
        assert tok.truncate_left(text, ids, keep) == expected, keep
    plain = tok.encode(text, add_special_tokens=False)
    assert tok.truncate_left(text, plain, 4) == plain[-4:]      # encoded without specials: the last 4
    assert tok.truncate_left(None, ids, 4) == ids[-4:]          # token ids as given: the last 4


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, reference, add_generation_prompt):
    ours = tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    ref = reference.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours == ref
    assert ours.startswith("<|im_start|><|im_start|>system\nYou are terse.<|im_end|>\n")
    assert ours.endswith("<|im_start|>assistant\n" if add_generation_prompt else "😀<|im_end|>\n")


def test_chat_template_with_tools_and_kwargs_matches_transformers(tok, reference):
    kwargs = {"skip_system": True, "date": True}
    ours = tok.apply_chat_template(MESSAGES, tools=TOOLS, **kwargs)
    assert ours == reference.apply_chat_template(
        MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert '"description": "Météo <city> & co"' in ours  # plain JSON: no \\u escapes, no HTML escaping
    assert "You are terse." not in ours
    assert ours.endswith(f"Today is {datetime.now().year}.\n")


KEEPS_SPACING = ("{% for m in messages %}<{{ m['role'] }}>{% if m['content'] is string %}{{ m['content'] }}"
                 "{% else %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}</{{ m['role'] }}>"
                 "{% endfor %}")
PARTS = [{"type": "text", "text": "a"}, {"type": "text", "text": "Sure,\n"}, {"type": "image_url", "image_url": {}}]


@pytest.mark.parametrize("template,final,end", [
    ("trims", "Sure, the", "\nSure, the"), ("trims", "  Sure, the  ", "\nSure, the"),
    ("keeps spacing", "Sure, the", "<assistant>Sure, the"), ("keeps spacing", "  Sure, the  ", ">  Sure, the  "),
    ("keeps spacing", PARTS, "<assistant>aSure,\n"),
])
def test_continue_final_message_matches_transformers(tmp_path, template, final, end):
    """The text ends where the final message does (no end of turn): transformers' cut, whether the
    template trims the message (the whitespace before the cut goes) or keeps it, and after the
    last text part of a list."""
    from transformers import AutoTokenizer

    folder = _write_model(tmp_path / "m", chat_template=TEMPLATE if template == "trims" else KEEPS_SPACING)
    ours = Tokenizer.from_checkpoint(load_checkpoint(folder))
    messages = [*MESSAGES[:2], {"role": "assistant", "content": final}]
    got = ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    want = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert got == want and got.endswith(end), (got, want)
    with pytest.raises(ValueError, match="cannot both be set"):
        ours.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)


def test_generation_tag_renders_its_body(tmp_path):
    folder = _write_model(tmp_path / "gen", chat_template=GENERATION_TEMPLATE)
    tok = Tokenizer.from_checkpoint(load_checkpoint(folder))
    assert tok.apply_chat_template(MESSAGES[1:]) == "[  hello world <b>&</b>  ]日本語 😀"


def test_template_raise_exception_becomes_value_error(tok):
    with pytest.raises(ValueError, match="Unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_named_templates_pick_tool_use_when_tools_are_given(tmp_path):
    templates = [
        {"name": "default", "template": "plain"},
        {"name": "tool_use", "template": "tools: {{ tools|length }}"},
    ]
    tok = Tokenizer.from_checkpoint(load_checkpoint(_write_model(tmp_path / "named", chat_template=templates)))
    assert tok.apply_chat_template(MESSAGES) == "plain"
    assert tok.apply_chat_template(MESSAGES, tools=TOOLS) == "tools: 1"


def test_model_without_chat_template_raises(tmp_path):
    tok = Tokenizer.from_checkpoint(load_checkpoint(_write_model(tmp_path / "none", chat_template=None)))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)


def test_invalid_template_syntax_raises(tmp_path):
    tok = Tokenizer.from_checkpoint(load_checkpoint(_write_model(tmp_path / "bad", chat_template="{% for %}")))
    with pytest.raises(ValueError, match="chat template is not valid jinja"):
        tok.apply_chat_template(MESSAGES)


def test_assistant_message_with_tool_calls_may_omit_content(tok):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    text = tok.apply_chat_template(messages[:1] + [{"role": "assistant", "content": "ok", "tool_calls": [{"id": "1"}]}])
    assert "<|im_start|>assistant\nok<|im_end|>" in text
    assert "<|im_start|>user\nhi<|im_end|>" in tok.apply_chat_template(messages)


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ("hello", "messages must be a list of dicts, got str"),
        ([], "messages is empty"),
        ([{"role": "user", "content": "hi"}, "oops"], r"messages\[1\] must be a dict"),
        ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
        ([{"role": "user"}], r"messages\[0\] \(role 'user'\) has no 'content'"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content must be a string or a list"),
    ],
)
def test_invalid_messages_raise_value_error_naming_the_problem(tok, messages, message):
    with pytest.raises(ValueError, match=message):
        tok.apply_chat_template(messages)


def test_invalid_tools_raise(tok):
    with pytest.raises(ValueError, match="tools must be a list"):
        tok.apply_chat_template(MESSAGES, tools="get_weather")


def test_corrupt_tokenizer_json_names_the_file(tmp_path):
    folder = _write_model(tmp_path / "corrupt")
    (folder / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ValueError, match=r"tokenizer\.json: cannot load tokenizer"):
        Tokenizer.from_checkpoint(load_checkpoint(folder))
