"""Several draft candidates, SuffixDecoding's path rule and earlier outputs: do they pay? (issue 15, part 3)

Counted, not timed. Step 1 decodes Spec-Bench prompts greedily in float32 (first turn, the first LIMIT
per category, 128 new tokens) with plain decoding; `exact` verification commits exactly those tokens
(flyspec's tests prove the identity in float32), so the tokens any drafting rule would get accepted
can be counted offline, without running the target again:

- a single path is kept up to its first mismatch with the greedy continuation;
- a token tree (several candidates verified in one forward, with a tree attention mask) is kept up to
  the longest root path that matches: tree verification under `exact` keeps exactly that.

Each step then commits the kept tokens + 1 (the target's own token), as a real step does. τ (tokens per
target forward) and the tokens verified per step are counted. `est tok/s` prices each step at the
target's measured forward cost t(1 + verified tokens), read from flyspec's step-cost table for the
bf16 compiled engine on this machine (`step_cost.step_cost`), plus 1 ms of drafting and engine work
per step (the bench measured 0.9-1.3 ms). It is an estimate for ranking the rules, not a benchmark
figure; the figures of record are `flyspec bench`'s.

Rules:
- `recent dN`, `frequent dN`: flyspec's `ngram` drafter (`longest_match`: ≤ 4-gram, periodic
  extension), verifying N tokens.
- `suffix`: SuffixDecoding's path as vLLM's `suffix` method uses it (one path, no tree): the longest
  context suffix (≤ 24 tokens) that occurs earlier, then the token most of its occurrences continue
  with, step by step, while the path's frequency estimate stays ≥ 0.1, for ≤ 2 × match length tokens.
- `tree bB dD`: a token trie of the continuations (D tokens) of the 64 most recent occurrences of the
  longest matching ≤ 4-gram (`+backoff`: of every n-gram length), keeping the B nodes of highest
  path frequency: several candidates in one verification.
- `+earlier outputs`: when the context has no match, copy from the earlier prompts' outputs (in bench
  order), as a cross-request cache (SuffixDecoding's global tree, flyspec's `ngram-cache`) would.
- `ceiling`: for each step, the longest continuation that any earlier occurrence of the last committed
  token would have drafted (copied on periodically past the end of the context, as the rules above
  do): no copy drafter with any number of candidates keeps more.

    PYTHONPATH=src .venv/bin/python benchmarks/2026-11-23-candidates/candidates.py [--limit 10] [--reuse]
"""

from __future__ import annotations

import argparse
import heapq
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
OTHER_MS = 1.0  # drafting + engine work per step, ms (the bench measured 0.9-1.3)
Rule = Callable[[np.ndarray], list[list[int]]]


def greedy_outputs(limit: int, path: Path) -> list[dict]:
    from flyspec.bench.data import load_prompts
    from flyspec.config import DecodeConfig
    from flyspec.decoding.plain import PlainDecoder
    from flyspec.resources import Resources

    target = Resources("float32").model("smollm2-135m-instruct")
    decoder = PlainDecoder(target, DecodeConfig(max_new_tokens=128))
    rows = []
    for prompt in load_prompts(limit=limit):
        result = decoder.generate(prompt.turns[0])
        rows.append(
            {
                "id": prompt.id,
                "category": prompt.category,
                "prompt": result.prompt_token_ids,
                "output": result.token_ids,
            }
        )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def step_costs_ms() -> dict[int, float]:
    from flyspec.runtime.loading import load_model
    from flyspec.runtime.step_cost import step_cost

    cost = step_cost(load_model("smollm2-135m-instruct", dtype="bfloat16", compile=True), 32)
    return {n: cost(n) * 1000 for n in range(1, 34)}


def starts(context: np.ndarray, n: int) -> np.ndarray:
    """Where the continuations of the earlier occurrences of the last ``n`` tokens begin."""
    if n > len(context) - 1:
        return np.empty(0, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)
    return np.flatnonzero((windows == context[-n:]).all(axis=1)) + n


def copied(context: np.ndarray, begin: int, depth: int) -> list[int]:
    period = len(context) - begin  # past the end: periodically, as flyspec's copy does
    return [int(context[begin + step % period]) for step in range(depth)]


def flyspec_rule(match: str, depth: int) -> Rule:
    from flyspec.drafters.ngram import longest_match

    def rule(context: np.ndarray) -> list[list[int]]:
        indices = longest_match(context.tolist(), depth, 4, 1, match)[0]
        return [[int(context[index]) for index in indices]] if indices else []

    return rule


def suffix_rule(
    context: np.ndarray, max_match: int = 24, factor: float = 2.0, min_prob: float = 0.1, max_tokens: int = 15
) -> list[list[int]]:
    found = None
    for n in range(1, min(max_match, len(context) - 1) + 1):
        begins = starts(context, n)
        if not begins.size:
            break
        found = n, begins
    if found is None:
        return []
    n, alive = found
    path: list[int] = []
    probability = 1.0
    for step in range(min(max_tokens, int(np.ceil(factor * n)))):
        tokens = np.array([copied(context, int(begin), step + 1)[-1] for begin in alive])
        values, counts = np.unique(tokens, return_counts=True)
        best = values[counts == counts.max()]
        token = next(t for t in tokens[::-1] if t in best)  # ties: the most recent occurrence
        if probability * counts.max() / len(tokens) < min_prob:
            break
        probability *= counts.max() / len(tokens)
        path.append(int(token))
        alive = alive[tokens == token]
    return [path] if path else []


def tree_rule(budget: int, depth: int, backoff: bool) -> Rule:
    def rule(context: np.ndarray) -> list[list[int]]:
        continuations = []
        for n in range(min(4, len(context) - 1), 0, -1):
            begins = starts(context, n)
            continuations += [copied(context, int(b), depth) for b in begins[-64:][::-1]]
            if begins.size and not backoff:
                break
        trie: dict = {}
        for sequence in continuations:
            node = trie
            for token in sequence:
                entry = node.setdefault(token, [0, {}])
                entry[0] += 1
                node = entry[1]
        heap = [(-entry[0] / len(continuations), i, (t,), entry) for i, (t, entry) in enumerate(trie.items())]
        heapq.heapify(heap)
        chosen, tie = [], len(heap)
        while heap and len(chosen) < budget:
            negative, _, path, entry = heapq.heappop(heap)
            chosen.append(path)
            total = sum(child[0] for child in entry[1].values())
            for token, child in entry[1].items():
                tie += 1
                heapq.heappush(heap, (negative * child[0] / total, tie, path + (token,), child))
        return [list(p) for p in chosen if not any(len(q) > len(p) and q[: len(p)] == p for q in chosen)]

    return rule


def ceiling_rule(context: np.ndarray, truth: list[int]) -> int:
    best = 0
    for begin in np.flatnonzero(context[:-1] == context[-1]) + 1:
        period, kept = len(context) - begin, 0  # past the end of the context: periodically, as `copied`
        while kept < len(truth) and context[begin + kept % period] == truth[kept]:
            kept += 1
        best = max(best, kept)
    return best


def kept(paths: list[list[int]], truth: list[int]) -> int:
    best = 0
    for path in paths:
        count = 0
        while count < min(len(path), len(truth)) and path[count] == truth[count]:
            count += 1
        best = max(best, count)
    return best


def nodes(paths: list[list[int]]) -> int:
    return len({tuple(path[:i]) for path in paths for i in range(1, len(path) + 1)})


def simulate(rows: list[dict], rule: Rule | None, costs: dict[int, float], earlier: bool = False) -> dict:
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0, 0.0])  # tokens, steps, verified, ms
    corpus = np.empty(0, dtype=np.int64)
    for row in rows:
        full = row["prompt"] + row["output"]
        context, position, end = np.asarray(full, dtype=np.int64), len(row["prompt"]), len(full)
        while position < end:
            truth = full[position:end]
            if rule is None:  # the ceiling
                paths, accepted = [], ceiling_rule(context[:position], truth)
            else:
                paths = rule(context[:position])
                if not paths and earlier and corpus.size:
                    paths = from_corpus(corpus, context[:position])
                accepted = kept(paths, truth)
            accepted = min(accepted, end - position - 1)
            verified = nodes(paths) if rule is not None else accepted
            for key in ("all", row["category"]):
                total = totals[key]
                total[0] += accepted + 1
                total[1] += 1
                total[2] += verified
                total[3] += costs[min(verified + 1, max(costs))] + OTHER_MS
            position += accepted + 1
        corpus = np.concatenate([corpus, np.asarray(row["output"] + [-1], dtype=np.int64)])
    return totals


def from_corpus(corpus: np.ndarray, context: np.ndarray, depth: int = 5) -> list[list[int]]:
    for n in range(min(4, len(context)), 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(corpus[:-1], n)
        begins = np.flatnonzero((windows == context[-n:]).all(axis=1)) + n
        if begins.size:
            path = [int(t) for t in corpus[int(begins[-1]) : int(begins[-1]) + depth]]
            return [path[: path.index(-1)] if -1 in path else path]
    return []


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--reuse", action="store_true", help="reuse outputs.jsonl instead of decoding again")
    args = parser.parse_args()
    outputs = HERE / "outputs.jsonl"
    rows = [json.loads(line) for line in outputs.open()] if args.reuse else greedy_outputs(args.limit, outputs)
    costs = step_costs_ms()
    rules: dict[str, tuple[Rule | None, bool]] = {
        "recent d3 (flyspec)": (flyspec_rule("recent", 3), False),
        "recent d5 (flyspec)": (flyspec_rule("recent", 5), False),
        "recent d8 (flyspec)": (flyspec_rule("recent", 8), False),
        "recent d15 (flyspec)": (flyspec_rule("recent", 15), False),
        "frequent d5 (flyspec)": (flyspec_rule("frequent", 5), False),
        "suffix (SuffixDecoding's path, as vLLM)": (suffix_rule, False),
        "tree b5 d5": (tree_rule(5, 5, False), False),
        "tree b8 d8": (tree_rule(8, 8, False), False),
        "tree b16 d15 +backoff": (tree_rule(16, 15, True), False),
        "tree b32 d15 +backoff": (tree_rule(32, 15, True), False),
        "recent d5 +earlier outputs": (flyspec_rule("recent", 5), True),
        "ceiling (any earlier occurrence of the last token)": (None, False),
    }
    categories = sorted({row["category"] for row in rows})
    lines = [
        "t(n) ms, bf16 compiled: " + ", ".join(f"t({n}) {costs[n]:.1f}" for n in (1, 2, 4, 6, 8, 12, 16, 24, 32)),
        "",
        "| rule | τ all | " + " | ".join(f"τ {c}" for c in categories) + " | verified per step | est tok/s |",
        "|---|---:|" + "---:|" * (len(categories) + 2),
    ]
    plain = simulate(rows, lambda context: [], costs)["all"]
    ones = " | ".join("1.00" for _ in categories)
    lines.append(f"| plain | 1.00 | {ones} | 0 | {plain[0] / plain[3] * 1000:.1f} |")
    for name, (rule, earlier) in rules.items():
        totals = simulate(rows, rule, costs, earlier)
        whole = totals["all"]
        estimate = "–" if rule is None else f"{whole[0] / whole[3] * 1000:.1f}"
        lines.append(
            f"| {name} | {whole[0] / whole[1]:.2f} | "
            + " | ".join(f"{totals[c][0] / totals[c][1]:.2f}" for c in categories)
            + f" | {whole[2] / whole[1]:.1f} | {estimate} |"
        )
        print(lines[-1], flush=True)
    (HERE / "table.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
