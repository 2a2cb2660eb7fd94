"""/metrics extras: a kv-role instance's transfers (by outcome, bytes, pull times) and speculative decoding's counters."""

import types

from prometheus_client import generate_latest

from jaxserve.core.kv_transfer import KVTransferStats
from server.metrics import ServerMetrics

_STATS = ["num_running", "num_waiting", "kv_usage", "kv_free_blocks", "kv_total_blocks", "compiles_after_warmup",
          "num_in_flight", "num_unfinished", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
          "prompt_tokens", "generation_tokens"]


def scrape(kv_role, kv_stats):
    llm = types.SimpleNamespace(kv_stats=kv_stats, kv_role=kv_role)
    engine = types.SimpleNamespace(engine=llm, stats=lambda: dict.fromkeys(_STATS, 0))
    return generate_latest(ServerMetrics(engine, "m").registry).decode()


def test_a_kv_role_instance_exports_its_transfers():
    stats = KVTransferStats()
    stats.record("sent", 1000, 0.02)
    stats.record("sent", 500, 3.0)
    stats.record("expired")
    text = scrape("producer", stats)
    assert 'jaxserve:kv_transfers_total{model_name="m",outcome="sent"} 2.0' in text
    assert 'jaxserve:kv_transfers_total{model_name="m",outcome="expired"} 1.0' in text
    assert 'jaxserve:kv_transfer_bytes_total{model_name="m"} 1500.0' in text
    assert 'jaxserve:kv_transfer_seconds_bucket{le="0.025",model_name="m"} 1.0' in text
    assert 'jaxserve:kv_transfer_seconds_bucket{le="5.0",model_name="m"} 2.0' in text
    assert 'jaxserve:kv_transfer_seconds_count{model_name="m"} 2.0' in text


def test_an_ordinary_instance_has_no_transfer_metrics():
    assert "kv_transfer" not in scrape(None, KVTransferStats())


def test_speculative_decoding_counters_are_exported_when_the_engine_reports_them():
    stats = dict.fromkeys(_STATS, 0) | {"spec_decode_num_drafts": 10, "spec_decode_num_draft_tokens": 40,
                                        "spec_decode_num_accepted_tokens": 25}
    engine = types.SimpleNamespace(engine=types.SimpleNamespace(kv_role=None), stats=lambda: stats)
    text = generate_latest(ServerMetrics(engine, "m").registry).decode()
    assert 'jaxserve:spec_decode_num_draft_tokens_total{model_name="m"} 40.0' in text
    assert 'jaxserve:spec_decode_num_accepted_tokens_total{model_name="m"} 25.0' in text
    assert 'jaxserve:spec_decode_num_drafts_total{model_name="m"} 10.0' in text
