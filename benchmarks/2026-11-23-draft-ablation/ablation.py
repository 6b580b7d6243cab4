"""Prompt-lookup draft ablation (issue 15 part 3): which of flyspec's n-gram choices pay, counted not timed.

Each variant runs lossless `exact` verification (greedy) on the same Spec-Bench prompts (first turn,
first LIMIT per category, 128 new tokens) with SmolLM2-135M-Instruct; τ (committed tokens per target
forward), the share of steps with a draft, and the drafted tokens kept are counted, so the figures do
not depend on the machine's load. `hf-like` is transformers' prompt lookup's choice (the earliest match
of ≤ 2-grams, 10 tokens, no periodic extension) run in flyspec's engine.

    PYTHONPATH=src .venv/bin/python benchmarks/2026-11-23-draft-ablation/ablation.py [--limit 2] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from flyspec.api import build_decoder
from flyspec.bench.data import load_prompts
from flyspec.config import DecodeConfig, SpeculationConfig
from flyspec.resources import Resources

VARIANTS = {
    "flyspec (recent, ≤4-gram, k 15, extend)": {},
    "earliest match": {"ngram": {"match": "earliest"}},
    "no periodic extension": {"ngram": {"extend": False}},
    "hf-like (earliest, ≤2-gram, k 10, no extension)": {
        "num_draft_tokens": 10,
        "ngram": {"match": "earliest", "max_ngram": 2, "extend": False},
    },
    "frequent (majority continuation)": {"ngram": {"match": "frequent"}},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--dtype", default="float32")  # float32: exact output is the same for every variant
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results.jsonl"))
    args = parser.parse_args()
    prompts = load_prompts(limit=args.limit)
    resources = Resources(args.dtype)
    target = resources.model("smollm2-135m-instruct")
    decode = DecodeConfig(max_new_tokens=args.max_new_tokens)
    rows = []
    with args.out.open("w") as out:
        for name, fields in VARIANTS.items():
            spec = SpeculationConfig.from_dict({"drafter": "ngram", "verifier": "exact", **fields})
            decoder = build_decoder(target, spec, decode, resources=resources.isolated())
            totals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
            for prompt in prompts:
                stats = decoder.generate(prompt.turns[0]).stats
                record = {
                    "variant": name,
                    "prompt": prompt.id,
                    "category": prompt.category,
                    "new_tokens": stats.num_new_tokens,
                    "forwards": stats.num_target_forwards,
                    "steps_with_draft": stats.proposed_per_position[0] if stats.proposed_per_position else 0,
                    "proposed": stats.num_proposed,
                    "accepted": stats.num_accepted,
                }
                out.write(json.dumps(record) + "\n")
                for key in ("all", prompt.category):
                    for field in ("new_tokens", "forwards", "steps_with_draft", "proposed", "accepted"):
                        totals[key][field] += record[field]
            rows.append((name, totals))
            tau = totals["all"]["new_tokens"] / totals["all"]["forwards"]
            print(name, round(tau, 3), file=sys.stderr, flush=True)
    categories = [key for key in rows[0][1] if key != "all"]
    header = " | ".join(f"τ {c}" for c in categories)
    print(f"| variant | τ all | {header} | steps with a draft | kept / drafted |")
    print("|---|" + "---:|" * (len(categories) + 3))
    for name, totals in rows:
        whole = totals["all"]
        taus = [totals[c]["new_tokens"] / totals[c]["forwards"] for c in categories]
        print(
            f"| {name} | {whole['new_tokens'] / whole['forwards']:.2f} | "
            + " | ".join(f"{t:.2f}" for t in taus)
            + f" | {whole['steps_with_draft'] / whole['forwards']:.0%}"
            + f" | {whole['accepted'] / max(whole['proposed'], 1):.0%} |"
        )


if __name__ == "__main__":
    main()
