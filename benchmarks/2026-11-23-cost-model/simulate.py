"""Cost model of the draft length (issue 15 part 4): every policy replayed on the same greedy outputs.

Lossless `exact` verification keeps exactly the draft's common prefix with plain greedy decoding,
so once the plain greedy outputs are known (float32, where flyspec's exact output is token for
token plain decoding's), each policy's steps can be replayed without the target: flyspec's own
n-gram drafter proposes from the context, flyspec's own policy classes (`draft_length.py`) choose
the length, and the kept prefix is counted. Each step is charged t(1 + verified tokens) from a
measured t(n) table (a `flyspec bench` run's `forward_times_ms`), so the modelled speedup over
plain decoding is Σ t(1) per token ÷ Σ t(n) per step: forward cost only (no drafting, no engine
overhead; the timed bench run measures those). The oracle knows how many tokens will be kept and
verifies the cheapest number of tokens that includes them all (t(n) need not grow with n): no
policy can beat it.

    PYTHONPATH=src .venv/bin/python benchmarks/2026-11-23-cost-model/simulate.py \
        --times benchmarks/2026-11-23-cost-model/bench/results.json [--dump greedy.jsonl --limit 4]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flyspec.bench.data import load_prompts
from flyspec.config import DecodeConfig, DraftLengthConfig, SamplingConfig
from flyspec.decoding.draft_length import new_draft_length
from flyspec.decoding.plain import PlainDecoder
from flyspec.drafters.ngram import NgramDrafter
from flyspec.resources import Resources
from flyspec.runtime.step_cost import StepCost

K = 15


def dump_greedy(path: Path, limit: int, max_new_tokens: int) -> None:
    target = Resources("float32").model("smollm2-135m-instruct")
    decoder = PlainDecoder(target, DecodeConfig(max_new_tokens=max_new_tokens))
    with path.open("w") as out:
        for prompt in load_prompts(limit=limit):
            result = decoder.generate(prompt.turns[0])
            row = {"id": prompt.id, "category": prompt.category, "prompt": result.prompt_token_ids}
            out.write(json.dumps({**row, "output": result.token_ids}) + "\n")


def replay(rows: list[dict], cost: StepCost, policy: str | None, k: int = K) -> dict[str, float]:
    """τ, mean verified draft length and modelled speedup of ``policy`` (None: the oracle)."""
    seconds = tokens = steps = verified_total = 0.0
    for row in rows:
        context, output, done = list(row["prompt"]), row["output"], 0
        drafter = NgramDrafter()
        drafter.reset(context)
        length = new_draft_length(DraftLengthConfig(policy=policy or "fixed"), k, 1, cost, cheap_drafts=True)
        while done < len(output):
            budget = min(length.next(), len(output) - done - 1)
            draft = drafter.propose(context, budget, SamplingConfig(), None) if budget > 0 else None
            proposed = draft.tokens.tolist() if draft is not None else []
            kept = 0
            while kept < len(proposed) and proposed[kept] == output[done + kept]:
                kept += 1
            if policy is None:  # knowing the kept count: the cheapest forward that still verifies them all
                verified = min(range(kept, len(proposed) + 1), key=lambda size: cost(size + 1))
            else:
                verified = length.choose(draft, 0.0) if draft is not None else 0
            kept = min(kept, verified)
            length.observe(verified, kept)
            context += output[done : done + kept + 1]
            done += kept + 1
            seconds += cost(verified + 1)
            tokens += kept + 1
            steps += 1
            verified_total += verified
    return {"tau": tokens / steps, "verified": verified_total / steps, "speedup": tokens * cost(1) / seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--times", type=Path, required=True, help="a flyspec bench results.json (forward_times_ms)")
    parser.add_argument("--dump", type=Path, default=Path(__file__).with_name("greedy.jsonl"))
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    if not args.dump.exists():
        dump_greedy(args.dump, args.limit, args.max_new_tokens)
    rows = [json.loads(line) for line in args.dump.open()]
    meta = json.loads(args.times.read_text())["meta"]
    times = {int(size): ms for size, ms in meta["forward_times_ms"].items()}
    cost = StepCost(tuple(sorted(times)), tuple(times[size] for size in sorted(times)))
    print(f"t(n)/t(1) from {args.times} ({meta['machine']}, {meta['dtype']}, compile {meta.get('compile')}):")
    print(" ".join(f"{n}: {ratio:.2f}" for n, ratio in cost.relative().items()))
    print(f"\n{len(rows)} greedy outputs (float32), exact verification, n-gram drafter, k ≤ {K}\n")
    print("| policy | τ | mean verified draft | modelled speedup (forward cost only) | % of oracle |")
    print("|---|---:|---:|---:|---:|")
    oracle = replay(rows, cost, None)
    policies = [(f"fixed k = {k}", "fixed", k) for k in (1, 2, 3, 4, 6, 8, 10, 15)]
    policies += [("heuristic (transformers)", "heuristic", K), ("cost", "cost", K), ("oracle", None, K)]
    for label, policy, k in policies:
        result = oracle if policy is None else replay(rows, cost, policy, k)
        print(
            f"| {label} | {result['tau']:.2f} | {result['verified']:.1f} | {result['speedup']:.2f}x | "
            f"{100 * result['speedup'] / oracle['speedup']:.0f}% |"
        )


if __name__ == "__main__":
    main()
