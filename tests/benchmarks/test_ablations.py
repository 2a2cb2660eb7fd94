"""The ablations compare configurations that differ only in the feature under test."""

import ablations
import pytest


def parse(argv):
    ap = ablations.serve_bench.build_parser()
    args = ap.parse_args(argv)
    args.model_path, args.max_num_seqs = None, 16
    args.agent_budget, args.agent_buckets, args.agent_max_model_len = 256, "8,32,64,256", 2048
    args.burst_budget = 32
    return args


def flag(flags, name):
    return flags[flags.index(name) + 1]


def test_prefix_caching_configs_differ_only_in_caching():
    (on_label, on), (off_label, off) = ablations.ablation_configs(parse([]))["prefix-caching"]
    assert (on_label, off_label) == ("on", "off")
    assert off == on + ["--no-enable-prefix-caching"]


def test_chunked_prefill_off_gets_a_budget_that_fits_the_long_prompt():
    args = parse(["--burst-streams", "16", "--burst-factor", "8"])
    (_, on), (_, off) = ablations.ablation_configs(args)["chunked-prefill"]
    assert flag(on, "--max-num-batched-tokens") == "32" and "--no-enable-chunked-prefill" not in on
    # 8 x 32 prompt tokens plus one decode token per stream in one step; max_model_len equal on both sides.
    assert flag(off, "--max-num-batched-tokens") == str(8 * 32 + 16) and "--no-enable-chunked-prefill" in off
    assert flag(on, "--max-model-len") == flag(off, "--max-model-len") == str(8 * 32 + 16)
    assert flag(off, "--token-buckets").endswith(",272")
    assert flag(on, "--max-num-seqs") == flag(off, "--max-num-seqs") == "17"   # a slot for the long prompt


@pytest.mark.slow
def test_both_ablations_run_on_the_tiny_model(tiny_models, tmp_path):
    rc = ablations.main([
        "--model-path", str(tiny_models["llama"]), "--vocab-size", "512", "--max-num-seqs", "8",
        "--num-agents", "3", "--num-turns", "3", "--agent-system-len", "16", "--agent-tools-len", "16",
        "--agent-repo-len", "16", "--agent-task-len", "8", "--agent-user-len", "4,8", "--agent-output-len", "4",
        "--agent-max-model-len", "256", "--agent-budget", "64", "--agent-buckets", "16,64",
        "--burst-streams", "4", "--burst-budget", "8", "--burst-stream-prompt-len", "8",
        "--burst-steady-tokens", "6", "--result-file", str(tmp_path / "a.json"), "--log-dir", str(tmp_path)])
    import json
    out = json.loads((tmp_path / "a.json").read_text())
    assert rc == 0
    pc, cp = out["prefix-caching"], out["chunked-prefill"]
    assert pc["off"]["server"]["prefix_cache_hit_rate"] == 0 and pc["on"]["server"]["prefix_cache_hit_rate"] > 0.5
    assert pc["off"]["prefill_tokens_computed"] == pc["off"]["prompt_tokens_total"]
    assert pc["on"]["prefill_tokens_computed"] < pc["off"]["prefill_tokens_computed"]
    assert cp["on"]["burst"]["long_prompt_len"] == cp["off"]["burst"]["long_prompt_len"] == 64
    assert all(o["server"]["compiles_after_warmup"] == 0 for o in (*pc.values(), *cp.values()))
