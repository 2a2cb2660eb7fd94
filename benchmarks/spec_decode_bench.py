"""n-gram speculative decoding against plain decoding, side by side in one process.

Two engines of the same model, one with `--speculative-config` (ngram), one without, run the
same workloads one after the other, `--repeats` times interleaved (medians reported):
  edit    "repeat/edit this passage" chat requests, greedy, all at once: outputs copy long spans
          of the prompt, where an n-gram lookup should pay
  edit1   the same requests one at a time (batch 1: a step reads every weight for one token, so
          the drafts ride along almost free)
  random  random-token prompts (64-256 tokens), 128 tokens out, EOS ignored: almost nothing to
          look up, so speculation should cost little
Reported per workload: output tokens per second of each engine and their ratio, whether the
outputs are identical, the acceptance rate (accepted / draft tokens) and the tokens a
speculating sequence gains per step (1 + accepted / drafts).

    python benchmarks/spec_decode_bench.py [--k 4] [--lookup 2,4] [--repeats 3] [--dtype float32]
        [--workloads edit,edit1,random]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from jaxserve import LLM, SamplingParams
from workloads import offline_random_prompts

PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil and a rag. "
    "He cleaned the great lens until it shone, trimmed the wick, and lit the lamp that would warn the fishing "
    "boats away from the rocks below.",
    "To make bread, mix flour, water, salt and yeast in a large bowl. Knead the dough for ten minutes until it "
    "is smooth, then let it rise in a warm place for an hour. Shape the loaf, let it rise again, and bake it "
    "in a hot oven until the crust is brown.",
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, the "
    "members agreed to increase spending on the library, to repair the roof of the town hall, and to plant "
    "new trees along the main street.",
    "A good password is long, hard to guess and used for one account only. Store your passwords in a password "
    "manager, turn on two-factor authentication wherever you can, and never share a code that you receive "
    "by text message.",
    "The river begins as a small stream high in the mountains, fed by melting snow. It flows through forests "
    "and farmland, grows wider as other streams join it, and finally reaches the sea after a journey of more "
    "than three hundred miles.",
    "Our store opens at nine in the morning and closes at six in the evening from Monday to Friday. On "
    "Saturdays we are open from ten until four, and on Sundays and public holidays the store is closed.",
    "The experiment measured how quickly the plants grew under three kinds of light. The plants under blue "
    "light grew the fastest, the plants under red light grew tall but thin, and the plants under green light "
    "barely grew at all.",
    "Please read the instructions carefully before you begin. Answer every question in the space provided, "
    "write clearly in pen, and hand in your paper to the teacher when the bell rings at the end of the hour.",
]
TASKS = ["Repeat the following text exactly, word for word:", "Copy this paragraph, changing nothing:",
         "Rewrite the following text, keeping every sentence as it is:"]


def edit_requests() -> list[list[dict]]:
    return [[{"role": "user", "content": f"{task}\n\n{passage}"}] for passage in PASSAGES for task in TASKS]


def run(llm: LLM, workload: str, prompts, params) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    if workload == "edit":
        outs = llm.chat(prompts, params, use_tqdm=False)
    elif workload == "edit1":
        outs = [llm.chat(p, params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup", default="2,4", help="prompt_lookup_min,prompt_lookup_max")
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="no drafts while this many requests run (the config's disable_by_batch_size)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-random", type=int, default=32)
    ap.add_argument("--workloads", default="edit,edit1,random")
    ap.add_argument("--result-file", default=None)
    args = ap.parse_args(argv)
    lo, hi = (int(x) for x in args.lookup.split(","))
    spec_config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": lo,
                   "prompt_lookup_max": hi, "disable_by_batch_size": args.disable_by_batch_size}
    engines = {"plain": LLM(args.model, dtype=args.dtype),
               "ngram": LLM(args.model, dtype=args.dtype, speculative_config=spec_config)}
    vocab = engines["plain"].engine.model_config.vocab_size
    workloads = {
        "edit": (edit_requests(), SamplingParams(max_tokens=160, temperature=0.0)),
        "edit1": (edit_requests()[::3], SamplingParams(max_tokens=160, temperature=0.0)),
        "random": (offline_random_prompts(args.num_random, vocab, seed=0),
                   SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)),
    }
    report = {"spec_config": spec_config, "dtype": args.dtype}
    print(f"ngram speculation {spec_config}, {args.dtype}, median of {args.repeats}:")
    for name in args.workloads.split(","):
        prompts, params = workloads[name]
        for llm in engines.values():
            run(llm, name, prompts[:2], params)                          # warm the caches
        times = {e: [] for e in engines}
        before = engines["ngram"].engine.stats()
        outputs = {}
        for _ in range(args.repeats):
            for e, llm in engines.items():
                seconds, outputs[e] = run(llm, name, prompts, params)
                times[e].append(seconds)
        after = engines["ngram"].engine.stats()
        drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
        drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        tokens = sum(len(t) for t in outputs["plain"])
        rates = {e: tokens / statistics.median(times[e]) for e in engines}
        row = {"requests": len(prompts), "output_tokens": tokens, "tok_s": rates,
               "speedup": rates["ngram"] / rates["plain"], "identical": outputs["plain"] == outputs["ngram"],
               "acceptance_rate": accepted / drafted if drafted else None,
               "tokens_per_step_when_speculating": 1 + accepted / drafts if drafts else None,
               "compiles_after_warmup": after["compiles_after_warmup"]}
        report[name] = row
        acc = "n/a" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.2f}"
        gain = "n/a" if drafts == 0 else f"{row['tokens_per_step_when_speculating']:.2f}"
        print(f"  {name:7s} {len(prompts)} requests, {tokens} tokens: plain {rates['plain']:.1f} tok/s, ngram "
              f"{rates['ngram']:.1f} tok/s ({row['speedup']:.2f}x); identical outputs: {row['identical']}; "
              f"acceptance {acc}, tokens per speculating step {gain}")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
