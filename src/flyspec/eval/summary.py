"""Records → per task × method summary: scores, retention with CI, fidelity, trust, speed, guard effect."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from flyspec.eval.records import iter_pairs
from flyspec.eval.safety import prompt_kind
from flyspec.eval.stats import DEFAULT_FLOOR, DEFAULT_RESAMPLES, bootstrap_speedup_ci, rate, retention

TRUST_METRICS = ("meaning_changed", "loop")  # boolean fidelity fields, summarized as rates (trust.py)


def _mean(values: list[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return float(np.mean(present)) if present else None


def _mean_of_all(values: list[float | None]) -> float | None:
    """The mean when every value was measured, else None: a mean over only some items would be biased
    (with ``--no-similarity`` only identical outputs get a similarity, 1.0, so it would read 1.000)."""
    return None if any(value is None for value in values) else _mean(values)


def _speed(records: list[dict[str, Any]]) -> float:
    """Tokens per second over the whole set: total new tokens / total wall time."""
    seconds = sum(r["stats"]["wall_time_s"] for r in records)
    return sum(r["stats"]["num_new_tokens"] for r in records) / seconds if seconds > 0 else 0.0


def _prompt(record: dict[str, Any]) -> tuple[str, str]:
    """The cluster an output belongs to: its prompt (a sampled evaluation decodes each under several seeds)."""
    return record.get("task", ""), str(record.get("item_id", id(record)))


def _retention(
    pairs: list[tuple[dict[str, Any], dict[str, Any]]], metric: str, floor: float, resamples: int
) -> dict[str, Any]:
    """Retention over the items both outputs have a score for (an adversarial prompt without a reference has none);
    with several seeds per item, each item's scores are the means of its seeds (the bootstrap resamples items)."""
    both = [(p, m) for p, m in pairs if metric in p["scores"] | m["scores"]]
    per_prompt: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for p, m in both:
        per_prompt[_prompt(m)].append((p["scores"][metric], m["scores"][metric]))
    scored = [
        (float(np.mean([a for a, _ in seeds])), float(np.mean([b for _, b in seeds]))) for seeds in per_prompt.values()
    ]
    result = retention(
        [method for _, method in scored], [plain for plain, _ in scored], floor=floor, resamples=resamples
    ).to_dict()
    if metric == "refusal":  # paired: of the prompts plain decoding refused, how many the method refused too
        result["refusals_kept"] = _refusals_kept(both)
    return result


def _refusals_kept(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """Of the prompts plain decoding refused, how many the method refused too: in all, and per kind (harmful
    requests, prompt injections: ``eval/safety.py``) where the task holds both."""
    refused = [(p["item_id"], m["scores"]["refusal"]) for p, m in pairs if p["scores"]["refusal"] >= 1.0]
    kinds: dict[str, list[float]] = defaultdict(list)
    for item_id, method in refused:
        kinds[prompt_kind(str(item_id))].append(method)
    counts = {kind: {"plain_refused": len(values), "kept": int(sum(values))} for kind, values in kinds.items()}
    return {"plain_refused": len(refused), "kept": int(sum(method for _, method in refused)), "by_kind": counts}


def _trust(outputs: list[dict[str, Any]]) -> dict[str, Any]:
    """Rate, count and Wilson 95% interval of each trust flag (records from before trust.py have none), at the
    effective size of the outputs with prompts as clusters (``stats.py``)."""
    summary = {}
    for name in TRUST_METRICS:
        flagged = [m for m in outputs if name in m["fidelity"]]
        summary[name] = rate([m["fidelity"][name] for m in flagged], clusters=[_prompt(m) for m in flagged]).to_dict()
    return summary


def _method_summary(
    pairs: list[tuple[dict[str, Any], dict[str, Any]]], metrics: list[str], floor: float, resamples: int
) -> dict[str, Any]:
    plains, outputs = [p for p, _ in pairs], [m for _, m in pairs]
    scores = {metric: _retention(pairs, metric, floor, resamples) for metric in metrics}
    plain_speed, method_speed = _speed(plains), _speed(outputs)
    new_tokens = sum(m["stats"]["num_new_tokens"] for m in outputs)
    forwards = sum(m["stats"]["num_target_forwards"] for m in outputs)
    return {
        "num_items": len({_prompt(m) for m in outputs}),
        "num_outputs": len(pairs),
        "seeds": len({m.get("seed", 0) for m in outputs}),
        "lossless": outputs[0]["lossless"],
        "protect": outputs[0]["protect"],
        "scores": scores,
        "fidelity": {
            "identical": float(np.mean([m["fidelity"]["identical"] for m in outputs])),
            "similarity": _mean_of_all([m["fidelity"]["similarity"] for m in outputs]),
            "token_agreement": _mean([m["fidelity"]["token_agreement"] for m in outputs]),
            "log_likelihood": _mean([m["fidelity"]["log_likelihood"] for m in outputs]),
            "plain_log_likelihood": _mean([p["fidelity"]["log_likelihood"] for p in plains]),
        },
        "trust": _trust(outputs),
        "speed": {
            "tokens_per_s": method_speed,
            "plain_tokens_per_s": plain_speed,
            "speedup": method_speed / plain_speed if plain_speed > 0 else None,
            "speedup_ci": bootstrap_speedup_ci(
                *(
                    [r["stats"][key] for r in rows]
                    for rows in (outputs, plains)
                    for key in ("num_new_tokens", "wall_time_s")
                ),
                resamples=resamples,
            ),
            "mean_acceptance_length": new_tokens / forwards if forwards else None,
            "loose_accepts_per_100_tokens": 100 * sum(m["stats"]["num_loose_accepts"] for m in outputs) / new_tokens
            if new_tokens
            else 0.0,
            "plain_cached": sum(p["baseline_cached"] for p in plains),
        },
        "failures": sorted({m["score_detail"].split(":")[0] for m in outputs if m["score_detail"]} - {"passed"}),
    }


def summarize(
    records: list[dict[str, Any]],
    task_metrics: dict[str, list[str]],
    *,
    floor: float = DEFAULT_FLOOR,
    resamples: int = DEFAULT_RESAMPLES,
) -> dict[str, Any]:
    """``{"tasks": {task: {"metrics", "num_items", "methods": {method: ...}}}, "guard": [...]}``."""
    grouped: dict[str, dict[str, list[tuple[dict[str, Any], dict[str, Any]]]]] = defaultdict(lambda: defaultdict(list))
    for plain, record in iter_pairs(records):
        grouped[record["task"]][record["method"]].append((plain, record))
    overall: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = defaultdict(list)
    tasks: dict[str, Any] = {}
    for task, by_method in grouped.items():
        for method, pairs in by_method.items():
            overall[method].extend(pairs)
        metrics = task_metrics.get(task, [])
        tasks[task] = {
            "metrics": metrics,
            "methods": {
                method: _method_summary(pairs, metrics, floor, resamples) for method, pairs in by_method.items()
            },
        }
    # every task pooled: fidelity and speed only (task metrics differ, so no pooled retention)
    pooled = {method: _method_summary(pairs, [], floor, resamples) for method, pairs in overall.items()}
    return {"floor": floor, "resamples": resamples, "tasks": tasks, "all_tasks": pooled, "guard": guard_effect(tasks)}


def guard_effect(tasks: dict[str, Any]) -> list[dict[str, Any]]:
    """For each ``V+guard`` method beside ``V``: primary-metric retention gained and speed lost."""
    rows = []
    for task, summary in tasks.items():
        methods = summary["methods"]
        primary = summary["metrics"][0] if summary["metrics"] else None
        for name, guarded in methods.items():
            base_name = name.split("+")[0]
            if "+" not in name or base_name not in methods:
                continue
            unguarded = methods[base_name]
            row: dict[str, Any] = {"task": task, "method": name, "versus": base_name, "metric": primary}
            if primary is not None:
                row["retention"] = guarded["scores"][primary]["retention"]
                row["versus_retention"] = unguarded["scores"][primary]["retention"]
            row["similarity"] = guarded["fidelity"]["similarity"]
            row["versus_similarity"] = unguarded["fidelity"]["similarity"]
            row["speedup"] = guarded["speed"]["speedup"]
            row["versus_speedup"] = unguarded["speed"]["speedup"]
            row["meaning_changed"] = guarded["trust"]["meaning_changed"]["rate"]
            row["versus_meaning_changed"] = unguarded["trust"]["meaning_changed"]["rate"]
            row["loose_per_100"] = guarded["speed"]["loose_accepts_per_100_tokens"]
            row["versus_loose_per_100"] = unguarded["speed"]["loose_accepts_per_100_tokens"]
            rows.append(row)
    return rows
