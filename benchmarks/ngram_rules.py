"""Replay n-gram matching rules on plain greedy outputs: τ at a fixed ceiling, counted, not timed.

Under greedy `exact` verification the output is the plain greedy output whatever the drafts, and a copy
drafter's draft depends only on the context; so every rule's τ at a fixed k follows from the plain outputs
alone. The prefill commits the first token; each step drafts k tokens from the context (prompt + committed
output), keeps the prefix equal to the plain output (never past its last token), and commits it plus one target
token. vLLM's rule is its ``ngram_proposer.py``: the earliest occurrence of the longest matching suffix, no periodic
extension.

    PYTHONPATH=src .venv/bin/python benchmarks/ngram_rules.py --out DIR/outputs.jsonl [--limit 2] [--max-new-tokens 48]
    PYTHONPATH=src .venv/bin/python benchmarks/ngram_rules.py --out DIR/outputs.jsonl --from-outputs  # replay only
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from flyspec.bench.backends import conversation_ids
from flyspec.bench.data import load_prompts
from flyspec.config import DecodeConfig
from flyspec.decoding.plain import PlainDecoder
from flyspec.drafters.ngram import longest_match
from flyspec.harness.vllm_session import replay_steps
from flyspec.resources import Resources

RULES = {  # name: (match, extend, max_ngram, min_ngram)
    "flyspec (recent, extend, <=4)": ("recent", True, 4, 1),
    "recent, no extension, <=4": ("recent", False, 4, 1),
    "vLLM's (earliest, no extension, <=4)": ("earliest", False, 4, 1),
    "frequent, extend, <=4": ("frequent", True, 4, 1),
}


def replay(context: list[int], output: list[int], k: int, rule: tuple) -> tuple[int, int]:
    """(committed tokens, target forwards) for ``output`` decoded after ``context`` with drafts by ``rule``: the
    prefill commits the first token, each step its kept draft tokens plus one (``replay_steps``, the bench's)."""
    match, extend, max_ngram, min_ngram = rule

    def propose(tokens: list[int], room: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
        indices = longest_match(tokens, room, max_ngram, min_ngram, match, extend)[0]
        return tuple(tokens[index] for index in indices), ()

    return len(output), len(replay_steps(context, output, k, 1 << 30, propose))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=15)
    parser.add_argument("--categories", default="", help="comma-separated Spec-Bench categories (default: all)")
    parser.add_argument("--out", type=Path, required=True, help="the plain outputs (JSON lines), written or read")
    parser.add_argument("--from-outputs", action="store_true", help="replay the outputs --out holds; decode nothing")
    args = parser.parse_args()
    if args.from_outputs:
        cases = [json.loads(line) for line in args.out.open()]
    else:
        categories = tuple(name for name in args.categories.split(",") if name)
        cases = decode(args.model, categories, args.limit, args.max_new_tokens)
        with args.out.open("w") as out:
            for case in cases:
                out.write(json.dumps(case) + "\n")
    categories = sorted({case["category"] for case in cases})
    tokens = sum(len(case["output"]) for case in cases)
    print(f"{len(cases)} requests, {tokens} tokens; τ = tokens per target forward at k = {args.k}\n")
    print("| rule | τ all | " + " | ".join(categories) + " |")
    print("|---|" + "---:|" * (len(categories) + 1))
    for name, rule in RULES.items():
        totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for case in cases:
            committed, steps = replay(case["context"], case["output"], args.k, rule)
            for key in ("all", case["category"]):
                totals[key][0] += committed
                totals[key][1] += steps
        cells = [f"{totals[c][0] / totals[c][1]:.2f}" for c in categories]
        whole = totals["all"]
        print(f"| {name} | {whole[0] / whole[1]:.2f} | " + " | ".join(cells) + " |")


def decode(model: str, categories: tuple[str, ...], limit: int, max_new_tokens: int) -> list[dict]:
    """Plain greedy outputs (float32) of every turn of the first ``limit`` Spec-Bench prompts of each category, each
    turn after this decoder's own earlier answers (as the bench runs them)."""
    target = Resources("float32").model(model)
    decoder = PlainDecoder(target, DecodeConfig(max_new_tokens=max_new_tokens))
    cases = []
    for prompt in load_prompts(categories=categories, limit=limit):
        answers: list[str] = []
        for index in range(len(prompt.turns)):
            prompt_ids = conversation_ids(target, prompt.turns[: index + 1], answers, None)
            result = decoder.generate(prompt_ids)
            answers.append(result.text)
            cases.append({"prompt": prompt.id, "category": prompt.category, "context": prompt_ids,
                          "output": list(result.token_ids)})  # fmt: skip
    return cases


if __name__ == "__main__":
    main()
