"""The serving benchmark's arithmetic on results whose numbers are worked out by hand."""

import math

import pytest
from bench_client import RequestResult, metrics_delta, parse_metrics, summarize
from serve_bench import burst_report
from workloads import long_prompt_burst


def result(start, times, prompt_len=10, output_tokens=None, error=None):
    r = RequestResult(prompt_len, len(times), start=start, chunk_times=list(times), error=error)
    r.output_tokens = len(times) if output_tokens is None else output_tokens
    return r


def test_summary_uses_vllm_definitions():
    a = result(0.0, [1.0, 1.5, 2.5])             # ttft 1, itl 0.5 and 1, e2e 2.5, tpot 1.5 / 2
    b = result(1.0, [1.2, 1.4], prompt_len=30)   # ttft 0.2, itl 0.2, e2e 0.4, tpot 0.2
    failed = result(0.0, [], error="HTTP 500")
    s = summarize([a, b, failed], duration=4.0)
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["HTTP 500"]
    assert s["total_input_tokens"] == 40 and s["total_output_tokens"] == 5
    assert s["request_throughput"] == 0.5 and s["output_throughput"] == 1.25
    assert s["total_token_throughput"] == pytest.approx(45 / 4)
    assert s["mean_ttft_ms"] == pytest.approx(600) and s["max_ttft_ms"] == pytest.approx(1000)
    assert s["median_itl_ms"] == pytest.approx(500) and s["max_itl_ms"] == pytest.approx(1000)
    assert s["mean_tpot_ms"] == pytest.approx((750 + 200) / 2)
    assert s["mean_e2el_ms"] == pytest.approx((2500 + 400) / 2)


def test_prometheus_text_is_summed_over_labels_and_differenced():
    text = """# HELP jaxserve:prompt_tokens_total Prompt tokens computed
# TYPE jaxserve:prompt_tokens_total counter
jaxserve:prompt_tokens_total{model_name="m"} 120.0
jaxserve:prefix_cache_queries_total{model_name="m"} 200.0
jaxserve:prefix_cache_hits_total{model_name="m"} 150.0
jaxserve:compiles_after_warmup{model_name="m"} 0.0
jaxserve:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 3.0
jaxserve:time_to_first_token_seconds_count{model_name="m"} 3.0
"""
    after = parse_metrics(text)
    assert after["jaxserve:prompt_tokens_total"] == 120
    assert "jaxserve:time_to_first_token_seconds_bucket" not in after
    before = {"jaxserve:prompt_tokens_total": 20.0, "jaxserve:prefix_cache_queries_total": 100.0,
              "jaxserve:prefix_cache_hits_total": 50.0}
    d = metrics_delta(before, after)
    assert d["prompt_tokens_computed"] == 100 and d["prefix_cache_hit_rate"] == 1.0
    assert d["compiles_after_warmup"] == 0
    assert metrics_delta({}, {})["prefix_cache_hit_rate"] == 0.0


def test_burst_report_splits_steady_and_burst_intervals():
    wl = long_prompt_burst(2, token_budget=4, factor=2, steady_tokens=4, vocab_size=1000)
    # Two streams ticking every 0.1 s; the long prompt is sent at 1.05 and its first token comes at
    # 1.6: the streams' ticks at 1.1 and 1.6 are late (0.5 s gaps), then they tick again.
    ticks = [0.1 * i for i in range(1, 11)] + [1.1, 1.6, 1.7, 1.8]
    s1, s2 = result(0.0, ticks), result(0.0, [t + 0.01 for t in ticks])
    long = result(1.05, [1.6, 1.65])
    out = burst_report([s1, s2], long, t_send=1.05, wl=wl)
    assert out["long_prompt_ttft_ms"] == pytest.approx(550)
    assert out["median_steady_itl_ms"] == pytest.approx(100)
    # Overlapping [1.05, 1.6]: 1.0->1.1, 1.1->1.6 (stream 1) and 1.01->1.11, 1.11->1.61 (stream 2).
    assert out["num_burst_itls"] == 4 and out["max_burst_itl_ms"] == pytest.approx(500)
    assert out["burst_max_over_steady_median"] == pytest.approx(5)
    assert math.isfinite(out["burst_p99_over_steady_p99"])


def test_new_reply_tokens_counts_what_decoding_did_not_compute():
    from serve_bench import new_reply_tokens
    g = ["a", "b", "c", "d"]
    assert new_reply_tokens(g, ["a", "b", "c", "d"]) == 1        # only the last, never fed back
    assert new_reply_tokens(g, ["a", "bc", "d"]) == 2            # from the first difference on
    assert new_reply_tokens(g, ["a", "b", "c"]) == 0             # a prefix of what was computed
    assert new_reply_tokens(g, ["a", "b", "c", "d", "e"]) == 2   # the last generated one and one more
