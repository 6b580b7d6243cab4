"""How a setting loosens more than a calibration profile allows: the limit a profile sets (``profile.py``) on
the lossy settings of ``generate``, ``serve``, its requests and the vLLM plugin's. One check per rule: a larger
threshold that keeps more, a smaller one that defers less, a guard left out."""

from __future__ import annotations

from flyspec.config import GuardConfig, SpeculationConfig
from flyspec.config.names import LOSSLESS_VERIFIERS

DRAFT_FIELDS = ("drafter", "draft_model", "stack", "num_proposal_tokens", "ngram", "layer_skip")


def looser(limit: SpeculationConfig, spec: SpeculationConfig) -> list[str]:
    """How ``spec`` loosens more than ``limit`` (empty: it does not; a lossless verifier never does)."""
    if spec.verifier in LOSSLESS_VERIFIERS:
        return []
    if limit.verifier in LOSSLESS_VERIFIERS:
        return [
            f"the profile allows no loose acceptance here (its point is {limit.verifier}), and {spec.verifier} is lossy"
        ]
    if spec.verifier != limit.verifier:
        return [f"verifier {spec.verifier!r} was not calibrated inside the budget ({limit.verifier!r} was)"]
    reasons = [
        f"{name} differs from the calibrated drafts"
        for name in (*DRAFT_FIELDS, "num_draft_tokens", "draft_length")
        if getattr(spec, name) != getattr(limit, name)
    ]
    rule_check = {
        "fly": _looser_fly,
        "margin": _looser_margin,
        "typical": _looser_typical,
        "bild": _looser_bild,
        "lenience": _looser_lenience,
        "fsd": _looser_fsd,
        "cascade": _looser_cascade,
        "adasd": _looser_adasd,
    }[spec.verifier]
    return reasons + rule_check(limit, spec) + _looser_guard(limit.guard, spec.guard) + _looser_breaker(limit, spec)


def _below(name: str, value: float, floor: float) -> list[str]:
    return [f"{name} {value:g} is below the profile's {floor:g}"] if value < floor else []


def _looser_fly(limit: SpeculationConfig, spec: SpeculationConfig) -> list[str]:
    mine, theirs = spec.fly, limit.fly
    reasons = _below("entropy_threshold", mine.entropy_threshold, theirs.entropy_threshold)
    reasons += _below("window_size", mine.window_size, theirs.window_size)
    reasons += _below("min_draft_prob", mine.min_draft_prob, theirs.min_draft_prob)
    # the base rule at T > 0 matters only where the profile measured sampling
    names = ("entropy_top_k", "temperature_rule") if limit.sampling_range.temperature[1] > 0 else ("entropy_top_k",)
    for name in names:
        if getattr(mine, name) != getattr(theirs, name):
            reasons.append(f"fly {name} differs from the profile's")
    return reasons


def _looser_margin(limit: SpeculationConfig, spec: SpeculationConfig) -> list[str]:
    return _below("margin logit_ratio", spec.margin.logit_ratio, limit.margin.logit_ratio)


def _looser_typical(limit: SpeculationConfig, spec: SpeculationConfig) -> list[str]:
    mine, theirs = spec.typical, limit.typical
    return _below("typical epsilon", mine.epsilon, theirs.epsilon) + _below("typical delta", mine.delta, theirs.delta)


def _looser_bild(limit: SpeculationConfig, spec: SpeculationConfig) -> list[str]:
    # a larger threshold keeps more
    return _above("bild rollback_threshold", spec.bild.rollback_threshold, limit.bild.rollback_threshold)


def _looser_lenience(limit: SpeculationConfig, spec: SpeculationConfig) -> list[str]:
    return _below("lenience", spec.lenience.lenience, limit.lenience.lenience)  # smaller keeps more


def _above(name: str, value: float, ceiling: float) -> list[str]:
    return [f"{name} {value:g} is above the profile's {ceiling:g}"] if value > ceiling else []


def _looser_fsd(limit: SpeculationConfig, spec: SpeculationConfig) -> list[str]:
    if spec.fsd.divergence != limit.fsd.divergence:
        return [f"fsd divergence {spec.fsd.divergence!r} differs from the profile's {limit.fsd.divergence!r}"]
    return _above("fsd threshold", spec.fsd.threshold, limit.fsd.threshold)


def _looser_cascade(limit: SpeculationConfig, spec: SpeculationConfig) -> list[str]:
    if spec.cascade.rule != limit.cascade.rule:
        return [f"cascade rule {spec.cascade.rule!r} differs from the profile's {limit.cascade.rule!r}"]
    return _above("cascade lenience", spec.cascade.lenience, limit.cascade.lenience)  # larger defers less


def _looser_adasd(limit: SpeculationConfig, spec: SpeculationConfig) -> list[str]:
    # a larger scale keeps more; fewer samples start loosening sooner
    reasons = _above("adasd scale", spec.adasd.scale, limit.adasd.scale)
    return reasons + _below("adasd min_samples", spec.adasd.min_samples, limit.adasd.min_samples)


def _looser_guard(limit: GuardConfig, guard: GuardConfig) -> list[str]:
    reasons = []
    missing = sorted(set(limit.protect) - set(guard.protect))
    if missing:
        reasons.append(f"protect leaves out {', '.join(missing)}")
    for name in ("top_k", "repeat_ngram"):  # 0 is off (loosest); otherwise a smaller value refuses more
        mine, theirs = getattr(guard, name), getattr(limit, name)
        if theirs and (mine == 0 or mine > theirs):
            reasons.append(f"guard {name} {mine} is looser than the profile's {theirs}")
    reasons += _below("guard copy_ratio", guard.copy_ratio, limit.copy_ratio)
    reasons += _below("exact_first", guard.exact_first, limit.exact_first)
    return reasons


def _looser_breaker(limit: SpeculationConfig, spec: SpeculationConfig) -> list[str]:
    mine, theirs = spec.breaker, limit.breaker
    if not theirs.enabled:
        return []
    if not mine.enabled or mine.max_loose_per_100 > theirs.max_loose_per_100:
        return [f"the circuit breaker trips later than the profile's {theirs.max_loose_per_100:g} per 100 tokens"]
    return []
