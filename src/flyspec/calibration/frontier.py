"""Records → one summary per point (τ, loose accepts, quality bounds, projected speed) and the choice.

Every measure of a point is over the prompts it ran; its τ gain is against the lossless baseline on
those same prompts (a point stopped early is compared like for like). See ``budget.py`` for the
bounds and the choice, ``projection.py`` for the speed. Sampled, the quality measures are also given per sampling
(``by_sampling``: each temperature measured), with prompts as clusters, and a point is inside the budget only where
it is inside at every one.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from flyspec.calibration.budget import Budget, judge, lower_bound, retention_lower_bound, upper_bound
from flyspec.calibration.projection import CostModel
from flyspec.calibration.space import Point
from flyspec.eval.stats import cluster_counts, effective_size

SAFETY_PREFIX = "safety:"  # item keys of the safety task (calibration/data.py CalibrationItem.key)
BASELINE = "exact"  # the lossless point every τ gain is measured against
PLAIN = "plain"


GREEDY = "greedy"  # the sampling of a record that names none


def _rate(flags: list[bool], prompts: list[str], confidence: float) -> dict[str, Any]:
    """A rate over outputs, bounded at its effective size with their prompts as clusters (one output each: as is)."""
    count, total = sum(flags), len(flags)
    size = effective_size(cluster_counts(flags, prompts)) if total else None
    return {
        "count": count,
        "n": total,
        "rate": count / total if total else None,
        "n_effective": size,
        "low": lower_bound(count, total, confidence, size),
        "high": upper_bound(count, total, confidence, size),
    }


def _prompt(record: dict[str, Any]) -> str:
    return record.get("prompt", record["item"])


def quality(records: list[dict[str, Any]], plain: dict[str, dict[str, Any]], budget: Budget) -> dict[str, Any]:
    """Meaning changes, loops, retention and refusals kept over ``records`` (against plain decoding's of the same
    item: the same prompt, sampling and seed), with prompts as clusters."""
    prompts = [_prompt(r) for r in records]
    # the safety task's refusal scores are their own term (refusals kept), not pooled with the task scores
    safety = [r for r in records if r["item"].startswith(SAFETY_PREFIX) and r["item"] in plain]
    refused = [r["score"] for r in safety if plain[r["item"]]["score"] == 1.0]
    by_prompt: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in records:
        scored = r["score"] is not None and r["item"] in plain and not r["item"].startswith(SAFETY_PREFIX)
        if scored and plain[r["item"]]["score"] is not None:
            by_prompt[_prompt(r)].append((plain[r["item"]]["score"], r["score"]))
    # each prompt's scores are the means of its seeds: the bootstrap resamples prompts
    plain_scores = [sum(p for p, _ in pairs) / len(pairs) for pairs in by_prompt.values()]
    method_scores = [sum(m for _, m in pairs) / len(pairs) for pairs in by_prompt.values()]
    retention = sum(method_scores) / sum(plain_scores) if plain_scores and sum(plain_scores) > 0 else None
    return {
        "n": len(records),
        "prompts": len(set(prompts)),
        "meaning_changed": _rate([bool(r["meaning_changed"]) for r in records], prompts, budget.confidence),
        "loop": _rate([bool(r["loop"]) for r in records], prompts, budget.confidence),
        "retention": {
            "n": len(plain_scores),
            "value": retention,
            "low": retention_lower_bound(method_scores, plain_scores, budget.confidence) if plain_scores else None,
        },
        "refusals_kept": None
        if not refused
        else {
            "plain_refused": len(refused),
            "kept": int(sum(refused)),
            "low": lower_bound(int(sum(refused)), len(refused), budget.confidence),
        },
    }


def summarize_point(
    point: Point,
    records: list[dict[str, Any]],
    baseline: dict[str, dict[str, Any]],  # item key → the baseline's record
    plain: dict[str, dict[str, Any]],  # item key → plain decoding's record
    cost: CostModel | None,
    budget: Budget,
    status: str,
    reasons: Sequence[str],
) -> dict[str, Any]:
    """One point's measures over its records (one per prompt it ran)."""
    stats = [record["stats"] for record in records]
    tokens = sum(s["num_new_tokens"] for s in stats)
    forwards = sum(s["num_target_forwards"] for s in stats)
    loose = sum(s["num_loose_accepts"] for s in stats)
    keys = [record["item"] for record in records]
    base_stats = [baseline[key]["stats"] for key in keys if key in baseline]
    base_tokens = sum(s["num_new_tokens"] for s in base_stats)
    base_forwards = sum(s["num_target_forwards"] for s in base_stats)
    tau = tokens / forwards if forwards else None
    base_tau = base_tokens / base_forwards if base_forwards else None
    pooled = quality(records, plain, budget)
    samplings: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        samplings[record.get("sampling", GREEDY)].append(record)
    per_item_loose = [100 * s["num_loose_accepts"] / s["num_new_tokens"] for s in stats if s["num_new_tokens"]]
    speedup = cost.speedup(stats) if cost else None
    base_speedup = cost.speedup(base_stats) if cost and base_stats else None
    return {
        "name": point.name,
        "rule": point.rule,
        "family": point.family,
        "order": point.order,
        "lossless": point.lossless,
        "settings": dict(point.settings),
        "speculation": point.speculation.to_dict(),
        "status": status,
        "reasons": list(reasons),
        "n": len(records),
        "tokens": tokens,
        "target_forwards": forwards,
        "tau": tau,
        "tau_gain": tau / base_tau - 1 if tau and base_tau else None,
        "loose_accepts": loose,
        "loose_per_100_tokens": 100 * loose / tokens if tokens else 0.0,
        "loose_per_100_p99": _quantile(per_item_loose, 0.99),
        "identical": sum(bool(r["identical"]) for r in records),
        "meaning_changed": pooled["meaning_changed"],
        "loop": pooled["loop"],
        "retention": pooled["retention"],
        "projected_speedup": speedup,
        "projected_gain": speedup / base_speedup - 1 if speedup and base_speedup else None,
        "refusals_kept": pooled["refusals_kept"],
        # sampled: each sampling measured on its own (a greedy calibration has one, the pooled measures)
        "by_sampling": None
        if set(samplings) <= {GREEDY}
        else {
            label: {**quality(group, plain, budget), "identical": sum(bool(r["identical"]) for r in group)}
            for label, group in samplings.items()
        },
    }


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def final_verdict(summary: dict[str, Any], budget: Budget, total_items: int) -> tuple[str, list[str]]:
    """A point that ran every prompt: inside or outside the budget (retention included); sampled, at every sampling
    it was measured at."""
    finished = summary["n"] >= total_items
    groups = summary.get("by_sampling") or {"": summary}
    verdicts = [
        judge(
            budget,
            changed=group["meaning_changed"]["count"],
            looped=group["loop"]["count"],
            total=group["n"] if "n" in group else group["meaning_changed"]["n"],
            retention_low=group["retention"]["low"],
            finished=finished,
            refusals_low=(group.get("refusals_kept") or {}).get("low"),
            changed_size=group["meaning_changed"].get("n_effective"),
            looped_size=group["loop"].get("n_effective"),
            label="" if label == GREEDY else label,
        )
        for label, group in groups.items()
    ]
    reasons = [reason for verdict in verdicts for reason in verdict.reasons]
    for status in ("outside", "open"):
        if any(verdict.status == status for verdict in verdicts):
            return status, reasons
    return "inside", reasons


MIN_GAIN = 0.01  # a lossy point must be projected this much faster than the best lossless one to be worth it


def choose(
    summaries: list[dict[str, Any]], min_gain: float = MIN_GAIN
) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any] | None]]:
    """(the fastest in-budget lossy point projected at least ``min_gain`` faster than the best lossless one,
    or None; the same per rule). A lossy point that is faster by a rounding error is not worth its risk."""
    lossless = [s for s in summaries if s["lossless"] and s["projected_speedup"]]
    floor = (1 + min_gain) * max((s["projected_speedup"] for s in lossless), default=0.0)
    winners = [s for s in summaries if not s["lossless"] and s["status"] == "inside" and s["projected_speedup"]]
    winners = [s for s in winners if s["projected_speedup"] >= floor]

    def fastest(candidates: list[dict[str, Any]]) -> dict[str, Any] | None:
        return max(candidates, key=lambda s: (s["projected_speedup"], s["tau"] or 0), default=None)

    by_rule: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for summary in winners:
        by_rule[summary["rule"]].append(summary)
    rules = sorted({s["rule"] for s in summaries if not s["lossless"]})
    return fastest(winners), {rule: fastest(by_rule[rule]) for rule in rules}


def best_lossless(summaries: list[dict[str, Any]]) -> dict[str, Any] | None:
    lossless = [s for s in summaries if s["lossless"] and s["projected_speedup"]]
    return max(lossless, key=lambda s: s["projected_speedup"], default=None)


FIXED_LOSS = 0.05  # the quality loss at which families are compared (share of answers whose meaning changed)


def rank_families(summaries: list[dict[str, Any]], fixed_loss: float = FIXED_LOSS) -> list[dict[str, Any]]:
    """Each lossy family's best τ gain inside the budget, and its best τ gain among the points that changed the
    meaning of at most ``fixed_loss`` of the answers (measured rate): what the family buys per unit of quality.
    Ranked by the first, then the second (a family with no point inside the budget after every one that has)."""
    families: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for summary in summaries:
        if not summary["lossless"] and summary["n"] and summary["tau_gain"] is not None:
            families[summary["family"]].append(summary)

    def best(members: list[dict[str, Any]]) -> dict[str, Any] | None:
        return max(members, key=lambda s: s["tau_gain"], default=None)

    ranked = []
    for family, members in families.items():
        inside = best([s for s in members if s["status"] == "inside"])
        at_loss = best([s for s in members if (s["meaning_changed"]["rate"] or 0) <= fixed_loss])
        ranked.append(
            {
                "family": family,
                "rule": members[0]["rule"],
                "points": len(members),
                "inside": None
                if inside is None
                else {
                    "name": inside["name"],
                    "tau_gain": inside["tau_gain"],
                    "loose_per_100_tokens": inside["loose_per_100_tokens"],
                    "projected_gain": inside.get("projected_gain"),
                },
                "at_loss": None
                if at_loss is None
                else {
                    "name": at_loss["name"],
                    "tau_gain": at_loss["tau_gain"],
                    "meaning_changed": at_loss["meaning_changed"]["rate"],
                },
                "fixed_loss": fixed_loss,
            }
        )

    def key(row: dict[str, Any]) -> tuple[float, float]:
        inside = row["inside"]["tau_gain"] if row["inside"] else float("-inf")
        return inside, row["at_loss"]["tau_gain"] if row["at_loss"] else float("-inf")

    return sorted(ranked, key=key, reverse=True)
