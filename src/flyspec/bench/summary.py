"""Aggregate benchmark records into per-method, per-category figures.

Definitions (all over the same prompts, in the same run):

* ``tokens_per_s`` of a method in one repeat = Σ new tokens ÷ Σ wall time over the prompts;
* ``speedup`` = that rate ÷ the baseline's rate in the same repeat; with several repeats the
  reported figure is the median over repeats, with the min and max as the spread;
* ``tau`` (τ) = Σ new tokens ÷ Σ target forwards (bonus/recovered tokens included);
* ``tau_limit`` = τ × t(1) / t(k+1): the speedup if every step cost exactly one (k+1)-token
  target forward and nothing else; ``fraction_of_limit`` = speedup ÷ tau_limit;
* ``cost_limit``: the speedup if each step cost the forward of its actual size, t(1 + drafts
  proposed) — the tighter bound when the drafter often proposes fewer than k tokens — and each
  prompt's prefill took what it took in this run, for the method and for the baseline alike (the
  speedup is over wall time, prefill included; without it the bound would exceed what any method
  could reach by the prefill's share of the run);
* ``in_run_limit``: the speedup if drafting and the engine's own work were free — tokens per
  second of model compute (prefill + target forwards, timed inside this run) relative to the
  baseline's; unlike the τ-limit it is not skewed by machine load during the separate
  t(1)/t(k+1) measurement, and measured speedup ÷ it is the share lost to drafting and overhead;
* ``ttft_median_s`` / ``ttft_p90_s``: the time to first token of each turn (a request of its own), median and
  90th percentile over every turn: flyspec's engine from the loop's start (prefill included) to its first committed
  token, vLLM's from its own request metrics (arrival to first token), transformers' from ``generate``'s call to
  its streamer's first new token; None for a method that does not measure it (llama.cpp);
* ``speedup_vs_context`` (a ``prediction+...`` method, when its context twin ran: ``harness/methods.py``): the
  same ratio over the twin's rate — what the prediction adds to drafting from the context alone —, the twin in
  ``context_method``; ``num_accepted_prediction_tokens`` / ``num_rejected_prediction_tokens``: OpenAI's usage counts,
  summed (None where the method was given no prediction);
* ``target_ms_per_step`` / ``draft_ms_per_step`` / ``other_ms_per_step``: time per target forward
  spent in verification forwards, in drafting, and in the engine's own work (verification rule,
  commit, cache rollback, stop checks, detokenisation) — the last is the engine overhead.

At temperature > 0 only (records with NLL fields, ``bench/nll.py``; over the first repeat, as ``num_identical``):

* ``nll_mean``: mean NLL per generated token under the target at the sampling distribution, over the tokens inside
  it (Σ over prompts ÷ their tokens); ``nll_high_share``: the share of tokens of NLL > 8 (probability < 0.03 %),
  outside ones included; ``outside_share``: the share outside the sampling distribution (removed by top-k / top-p);
  ``plain_*``: plain sampling's same figures over the same prompts;
* ``nll_excess``: the mean over prompts of (the method's mean NLL − plain's on that prompt);
  ``nll_excess_lower_bound`` / ``outside_excess_lower_bound``: the one-sided paired t bounds (``bench/paired.py``) on
  that excess and on the outside share's, at ``sampler_test_level`` each: 1 % over every test of the group
  (Bonferroni: two per method); ``sampler_suspect``: either bound above 0 — the method's text is less likely
  under the target than plain sampling's beyond what chance over these prompts allows (None: plain itself, or
  fewer than two prompts to pair).
"""

from __future__ import annotations

import statistics
from typing import Any

from flyspec.bench.paired import level_per_test, paired_excess
from flyspec.harness.methods import PEER_PLAIN, PLAIN, VLLM_PEERS, context_twin

Record = dict[str, Any]
OVERALL = "overall"


def summarize(records: list[Record], forward_times: dict[int, float] | None, num_draft_tokens: int) -> dict[str, Any]:
    """``{"overall": {method: figures}, "<category>": {...}}`` plus nothing else."""
    categories = list(dict.fromkeys(record["category"] for record in records))
    summary = {OVERALL: _summarize_group(records, forward_times, num_draft_tokens)}
    for category in categories:
        group = [record for record in records if record["category"] == category]
        summary[category] = _summarize_group(group, forward_times, num_draft_tokens)
    return summary


def _summarize_group(records: list[Record], forward_times: dict[int, float] | None, k: int) -> dict[str, dict]:
    methods = list(dict.fromkeys(record["method"] for record in records))
    figures: dict[str, dict] = {}
    for method in methods:
        mine = [record for record in records if record["method"] == method]
        # rates over the prompts this method completed (all of them, unless a peer was dropped)
        prompts = {_key(record) for record in mine}
        rates = {other: _rates_per_repeat(records, other, prompts) for other in methods}
        baseline = [record for record in records if record["method"] == PLAIN and _key(record) in prompts]
        figures[method] = _figures(mine, baseline, rates, method, forward_times, k)
    sampled = [method for method in methods if method != PLAIN and _scored(records, method)]
    level = level_per_test(2 * len(sampled))  # two tests per method: NLL and tokens outside the distribution
    for method in methods:
        if _scored(records, method):
            figures[method].update(_sampled_figures(records, method, level))
    compute_rates = {method: _compute_rate([r for r in records if r["method"] == method]) for method in methods}
    for method, entry in figures.items():
        rate, base = compute_rates[method], compute_rates.get(PLAIN)
        bound = rate / base if rate and base and method != PLAIN else None
        entry["in_run_limit"] = bound
        entry["fraction_of_in_run_limit"] = entry["speedup"] / bound if bound and entry["speedup"] else None
    return figures


def _scored(records: list[Record], method: str) -> bool:
    """Whether ``method``'s records carry the sampled text's NLL (temperature > 0)."""
    return any(record["method"] == method and "nll_sum" in record for record in records)


def _nll_totals(records: list[Record]) -> dict[str, float | None]:
    tokens = sum(record["num_scored_tokens"] for record in records)
    inside = tokens - sum(record["num_outside_tokens"] for record in records)
    return {
        "nll_mean": sum(record["nll_sum"] for record in records) / inside if inside else None,
        "nll_high_share": sum(record["num_high_nll_tokens"] for record in records) / tokens if tokens else None,
        "outside_share": sum(record["num_outside_tokens"] for record in records) / tokens if tokens else None,
    }


def _nll_mean(record: Record) -> float | None:
    return record["nll_mean"]


def _outside_share(record: Record) -> float | None:
    tokens = record["num_scored_tokens"]
    return record["num_outside_tokens"] / tokens if tokens else None


def _sampled_figures(records: list[Record], method: str, level: float) -> dict[str, Any]:
    """The NLL figures of ``method`` and plain sampling's over the same prompts (first repeat), and the paired tests
    (``bench/paired.py``) against plain at ``level`` each."""
    mine = {r["prompt_id"]: r for r in records if r["method"] == method and r["repeat"] == 0 and "nll_sum" in r}
    plain = {r["prompt_id"]: r for r in records if r["method"] == PLAIN and r["repeat"] == 0 and "nll_sum" in r}
    both = [prompt for prompt in mine if prompt in plain]
    figures: dict[str, Any] = {**_nll_totals(list(mine.values()))}
    figures.update({f"plain_{name}": value for name, value in _nll_totals([plain[p] for p in both]).items()})
    tests = {}
    for name, value in (("nll", _nll_mean), ("outside", _outside_share)):
        pairs = [(value(mine[p]), value(plain[p])) for p in both]
        own = [first for first, second in pairs if first is not None and second is not None]
        base = [second for first, second in pairs if first is not None and second is not None]
        tests[name] = None if method == PLAIN else paired_excess(own, base, level)
    nll, outside = tests["nll"], tests["outside"]
    figures.update(
        nll_excess=nll.mean if nll else None,
        nll_excess_lower_bound=nll.lower_bound if nll else None,
        outside_excess_lower_bound=outside.lower_bound if outside else None,
        sampler_test_level=None if method == PLAIN else level,
        sampler_suspect=None if nll is None and outside is None else any(t.above for t in (nll, outside) if t),
    )
    return figures


def _compute_rate(records: list[Record]) -> float | None:
    """Tokens per second of model compute only (prefill + target forwards; drafting and engine work excluded)."""
    if not records or any(r["target_time_s"] is None or r["prefill_time_s"] is None for r in records):
        return None
    compute = sum(r["target_time_s"] + r["prefill_time_s"] for r in records)
    return sum(r["num_new_tokens"] for r in records) / compute if compute > 0 else None


def _rates_per_repeat(records: list[Record], method: str, prompts: set[tuple[str, int]]) -> dict[int, float]:
    tokens: dict[int, int] = {}
    times: dict[int, float] = {}
    for record in records:
        if record["method"] == method and (record["prompt_id"], record["repeat"]) in prompts:
            tokens[record["repeat"]] = tokens.get(record["repeat"], 0) + record["num_new_tokens"]
            times[record["repeat"]] = times.get(record["repeat"], 0.0) + record["wall_time_s"]
    return {repeat: tokens[repeat] / times[repeat] if times[repeat] > 0 else 0.0 for repeat in tokens}


def _speedups(rates: dict[str, dict[int, float]], method: str, reference: str) -> list[float]:
    return [
        rate / rates[reference][repeat]
        for repeat, rate in sorted(rates[method].items())
        if rates[reference].get(repeat)
    ]


def _key(record: Record) -> tuple[str, int]:
    return record["prompt_id"], record["repeat"]


def _figures(
    mine: list[Record],
    baseline: list[Record],
    rates: dict[str, dict[int, float]],
    method: str,
    forward_times: dict[int, float] | None,
    k: int,
) -> dict[str, Any]:
    first = [record for record in mine if record["repeat"] == 0]
    speedups = _speedups(rates, method, PLAIN) if PLAIN in rates else []
    tokens = sum(record["num_new_tokens"] for record in mine)
    forwards = _total(mine, "num_target_forwards")
    tau = tokens / forwards if forwards else None
    limit = None
    own_engine = method not in VLLM_PEERS  # the forward times are flyspec's; vLLM's kernels cost differently
    times = forward_times or {}
    if tau is not None and 1 in times and k + 1 in times and method != PLAIN and own_engine:
        limit = tau * times[1] / times[k + 1]
    speedup = statistics.median(speedups) if speedups else None
    cost_limit = _cost_limit(mine, baseline, forwards, forward_times) if method != PLAIN and own_engine else None
    figures: dict[str, Any] = {
        "lossless": first[0]["lossless"] if first else None,
        "num_prompts": len(first),
        "num_new_tokens": sum(record["num_new_tokens"] for record in first),
        "tokens_per_s": statistics.median(rates[method].values()),
        "tokens_per_s_per_repeat": [rates[method][repeat] for repeat in sorted(rates[method])],
        "speedup": speedup,
        "speedup_per_repeat": speedups,
        "speedup_min": min(speedups) if speedups else None,
        "speedup_max": max(speedups) if speedups else None,
        "tau": tau,
        "tau_limit": limit,
        "fraction_of_limit": speedup / limit if speedup is not None and limit else None,
        "cost_limit": cost_limit,
        "fraction_of_cost_limit": speedup / cost_limit if speedup is not None and cost_limit else None,
        "num_target_forwards": forwards,
        "drafts_per_step": _drafts_per_step(mine, forwards) if own_engine else None,
        "num_loose_accepts": _total(mine, "num_loose_accepts"),
        "num_identical": sum(record["identical_to_baseline"] for record in first),
        "acceptance_by_position": _acceptance_by_position(mine),
    }
    figures.update(_per_step_ms(mine, forwards))
    figures.update(_first_token(mine))
    plain = PEER_PLAIN.get(method)
    if plain in rates:
        own = _speedups(rates, method, plain)
        figures["speedup_vs_own_plain"] = statistics.median(own) if own else None
    figures.update(_prediction_figures(mine, rates, method))
    return figures


def _prediction_figures(mine: list[Record], rates: dict[str, dict[int, float]], method: str) -> dict[str, Any]:
    """A prediction method's speedup over its context twin, and the prediction tokens accepted and rejected."""
    figures: dict[str, Any] = {
        key: _total([{key: record.get(key)} for record in mine], key)  # absent in records of older runs
        for key in ("num_accepted_prediction_tokens", "num_rejected_prediction_tokens")
    }
    twin = context_twin(method)
    if twin is not None and twin in rates:
        ratios = _speedups(rates, method, twin)
        figures.update(context_method=twin, speedup_vs_context=statistics.median(ratios) if ratios else None)
    return figures


def _cost_limit(
    records: list[Record], baseline: list[Record], forwards: int | None, forward_times: dict[int, float] | None
) -> float | None:
    """Speedup if each step cost exactly one target forward of its actual size (1 + drafts proposed),
    with each side's prefill as timed in the run (none where a record has no prefill time).

    Tighter than the τ-limit when drafters propose fewer than k tokens (an n-gram miss proposes
    none): the baseline's rate is its tokens ÷ (prefill + tokens × t(1)); the method's is its
    tokens ÷ (prefill + Σ over steps of t(1 + n)).
    """
    if not forwards or not forward_times:
        return None
    proposed = [0] * max((len(r["proposed_per_position"]) for r in records), default=0)
    for record in records:
        for position, count in enumerate(record["proposed_per_position"]):
            proposed[position] += count
    # steps with at least n drafts = proposed[n - 1]; with exactly n = that minus those with n + 1
    at_least = [forwards, *proposed, 0]
    cost = 0.0
    for size in range(len(at_least) - 1):
        steps = at_least[size] - at_least[size + 1]
        if steps and size + 1 not in forward_times:
            return None
        cost += steps * forward_times.get(size + 1, 0.0)
    tokens = sum(record["num_new_tokens"] for record in records)
    base_tokens = sum(record["num_new_tokens"] for record in baseline) if baseline else tokens
    own, base = _prefill(records), _prefill(baseline)
    if own is None or base is None:
        own = base = 0.0
    if cost + own <= 0 or not base_tokens:
        return None
    return (tokens / (own + cost)) / (base_tokens / (base + base_tokens * forward_times[1]))


def _prefill(records: list[Record]) -> float | None:
    """Seconds of prefill over ``records`` (None if any has no prefill time, or there are none)."""
    values: list[float | None] = [record.get("prefill_time_s") for record in records]
    return None if not values or None in values else sum(value or 0.0 for value in values)


def _drafts_per_step(records: list[Record], forwards: int | None) -> float | None:
    """Draft tokens verified per target forward (what the draft-length policy chose, on average)."""
    if not forwards:
        return None
    return sum(sum(record["proposed_per_position"]) for record in records) / forwards


def _total(records: list[Record], key: str) -> int | None:
    values = [record[key] for record in records]
    return None if any(value is None for value in values) else sum(values)


def _acceptance_by_position(records: list[Record]) -> list[float]:
    accepted: list[int] = []
    proposed: list[int] = []
    for record in records:
        for counts, values in (
            (accepted, record["accepted_per_position"]),
            (proposed, record["proposed_per_position"]),
        ):
            counts.extend([0] * (len(values) - len(counts)))
            for position, value in enumerate(values):
                counts[position] += value
    return [a / p if p else 0.0 for a, p in zip(accepted, proposed, strict=False)]


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank ``fraction`` quantile of ``values`` (NaN when there are none)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))] if ordered else float("nan")


def _first_token(records: list[Record]) -> dict[str, float | None]:
    """Median and p90 time to first token over every turn of ``records`` (None unless every turn measured it)."""
    turns = [seconds for record in records for seconds in record.get("time_to_first_token_s") or [None]]
    if not turns or any(seconds is None for seconds in turns):
        return {"ttft_median_s": None, "ttft_p90_s": None}
    return {"ttft_median_s": statistics.median(turns), "ttft_p90_s": percentile(turns, 0.9)}


def _per_step_ms(records: list[Record], forwards: int | None) -> dict[str, float | None]:
    keys = ("target_time_s", "draft_time_s", "prefill_time_s")
    if not forwards or any(record[key] is None for record in records for key in keys):
        return {"target_ms_per_step": None, "draft_ms_per_step": None, "other_ms_per_step": None}
    target = sum(record["target_time_s"] for record in records)
    draft = sum(record["draft_time_s"] for record in records)
    prefill = sum(record["prefill_time_s"] for record in records)
    wall = sum(record["wall_time_s"] for record in records)
    return {
        "target_ms_per_step": 1000 * target / forwards,
        "draft_ms_per_step": 1000 * draft / forwards,
        "other_ms_per_step": 1000 * max(0.0, wall - prefill - target - draft) / forwards,
    }
