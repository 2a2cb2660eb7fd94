import pytest

from jaxserve import SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, 16)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop == [] and p.stop_token_ids == [] and p.seed is None and p.logprobs is None


def test_stop_string_becomes_list_and_greedy_resets_truncation():
    p = SamplingParams(stop="###", temperature=0.0, top_p=0.5, top_k=3)
    assert p.stop == ["###"]
    assert p.greedy and (p.top_p, p.top_k) == (1.0, 0)
    assert SamplingParams(top_k=-1).top_k == 0


@pytest.mark.parametrize("field,value", [
    ("max_tokens", -1), ("max_tokens", 0), ("top_p", 0.0), ("top_p", 1.5), ("temperature", -0.1),
    ("top_k", -2), ("min_p", 1.1), ("n", 0), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("min_tokens", -1), ("logprobs", -1), ("seed", 1.5),
    ("temperature", float("nan")), ("n", True), ("stop", [""]), ("stop_token_ids", [-1]),
])
def test_invalid_values_name_the_field_and_value(field, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert field in str(e.value) and repr(value) in str(e.value)


def test_min_tokens_above_max_tokens_refused():
    with pytest.raises(ValueError, match="min_tokens=5.*max_tokens=3"):
        SamplingParams(min_tokens=5, max_tokens=3)


@pytest.mark.parametrize("bias,rule", [
    ({-1: 1.0}, "non-negative integer token ids"), ({"5": 1.0}, "non-negative integer token ids"),
    ({True: 1.0}, "non-negative integer token ids"), ({5: 100.5}, r"biases in \[-100, 100\]"),
    ({5: float("nan")}, r"biases in \[-100, 100\]"), ({5: float("-inf")}, r"biases in \[-100, 100\]"),
    ({5: "1"}, r"biases in \[-100, 100\]"), ({t: 1.0 for t in range(301)}, "at most 300 tokens"),
    ([(5, 1.0)], "dict of token id -> bias"),
])
def test_invalid_logit_bias_is_refused(bias, rule):
    with pytest.raises(ValueError, match="logit_bias.*" + rule):
        SamplingParams(logit_bias=bias)


@pytest.mark.parametrize("ids", [[], [-1], [3, 1.5], [True], "abc", 5])
def test_invalid_allowed_token_ids_are_refused(ids):
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=ids)


@pytest.mark.parametrize("kw", [dict(bad_words=[""]), dict(bad_words=["  "]), dict(bad_words=[3]),
                                dict(bad_words="word"), dict(bad_words=["w"] * 129), dict(bad_words_token_ids=[[]]),
                                dict(bad_words_token_ids=[[-1]]), dict(bad_words_token_ids=[5]),
                                dict(bad_words_token_ids=[[1]] * 257)])
def test_invalid_bad_words_are_refused(kw):
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(**kw)


def test_bad_words_of_two_tokens_or_more_read_the_output():
    assert not SamplingParams(bad_words_token_ids=[[5], [6]]).reads_output_tokens
    assert SamplingParams(bad_words_token_ids=[[5], [6, 7]]).reads_output_tokens
    assert SamplingParams(presence_penalty=0.5).reads_output_tokens


def test_logit_bias_is_copied_and_empty_means_none():
    given = {5: -100, 7: 2.5}
    p = SamplingParams(logit_bias=given)
    given[9] = 1.0
    assert p.logit_bias == {5: -100, 7: 2.5}
    assert SamplingParams(logit_bias={}).logit_bias is None and SamplingParams().logit_bias is None


def test_a_bad_word_of_more_than_256_characters_is_refused():
    SamplingParams(bad_words=["w" * 256])
    with pytest.raises(ValueError, match="at most 256 characters"):
        SamplingParams(bad_words=["w" * 257])
