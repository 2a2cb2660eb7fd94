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
