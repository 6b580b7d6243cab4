"""The operating points a calibration measures: lossless baselines and the lossy rules' settings.

A point is a whole :class:`SpeculationConfig`: the drafter the user calibrates, with one verifier
setting. Points come in *families*, ordered from strict to loose along one knob (FLy's entropy
threshold, MARS's margin, typical acceptance's epsilon, BiLD's rollback threshold) with everything else fixed. Within a
family a looser point keeps every loose accept a stricter one would keep at the same place, so
when a point is decisively outside the budget the looser ones of its family are pruned
(``runner.py``) instead of being run to the same verdict.

The default grid (``grid="default"``):

- ``exact`` — the lossless baseline every gain is measured against (for copy drafters also at the
  cost-aware draft length, the lossless default).
- ``fly`` — the entropy gate from 1.08 nats (open only where the target's top three are nearly tied:
  top-3 entropy is at most ln 3 = 1.0986) down to 0.15, window 6 (the paper's); and from 1.04 to 0.3
  with windows 8 and 4; with flyspec's trust guards. The strict end is dense on purpose: on small models
  nearly every loose accept changes the answer, so the budget is decided there.
- ``fly floor`` — the gate from 0.8 down to 0 with a floor on the draft token's own target
  probability (FLy's vLLM pull request asks for a non-zero one; 0.1 to 0.3 keep only real
  alternatives).
- ``margin`` — MARS: z2/z1 from 0.995 down to 0.7, guarded.
- ``typical`` — typical acceptance: epsilon from 0.8 down to 0.09 (Medusa's), guarded.
- ``fly bare`` — the paper's bare rule (threshold 0.3, window 6, no guards): the reference point
  that shows what the guards buy.
- ``fly vllm`` — vLLM 0.33's native rule (``FlyConfig.variant="vllm"``, no guards: what
  ``rejection_sample_method: "fly"`` runs), from 1.08 down to 0.3 at window 6: a profile whose point is
  one of these deploys as vLLM's own ``speculative_config``, without flyspec (``calibration/deploy.py``).
- ``fsd``, ``cascade chow|diff|opt``, ``adasd n>=8|32`` — where the drafter gives a distribution over the
  target's vocabulary (a draft model of its tokenizer, layer-skip): FSD's JS threshold, each deferral rule's α, and
  AdaSD's scale (0.5, 1: the paper's midpoint, 1.5) after 8 or 32 positions of each class.

- sampled (``--temperature`` above 0), FLy's two other base rules at T > 0 beside the coupled one every FLy point
  runs (``verifiers/fly.py``): ``fly two-sample`` (the reference code's: a draft token matches either of two target
  samples) and, where the drafter samples its drafts with probabilities, ``fly rejection`` (the gate and window over
  rejection sampling), from 1.0 down to 0.3 at window 6, so the evidence decides between them.

``grid="quick"`` keeps a handful (the tests' and a first look's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from flyspec.config import (
    PROFILE_NONE,
    AdasdConfig,
    BildConfig,
    CascadeConfig,
    ConfigError,
    DraftLengthConfig,
    FlyConfig,
    FsdConfig,
    GuardConfig,
    LenienceConfig,
    MarginConfig,
    SpeculationConfig,
    TypicalConfig,
)
from flyspec.config.names import COPY_DRAFTERS, DISTRIBUTION_DRAFTERS, LOSSY_VERIFIERS

GRIDS = ("default", "quick")
RULES = LOSSY_VERIFIERS  # the lossy rules a calibration can compare: all of them
# top-3 entropy is at most ln 3 = 1.0986 nats: the gate at 1.08 opens only where the top three are nearly tied
FLY_THRESHOLDS = (1.08, 1.06, 1.04, 1.02, 1.0, 0.95, 0.9, 0.8, 0.6, 0.45, 0.3, 0.15)
FLY_WINDOW_THRESHOLDS = (1.04, 1.0, 0.9, 0.8, 0.6, 0.3)  # the other windows' families
FLY_WINDOWS = (6, 8, 4)  # the paper's first; 8 is stricter (more tokens must match after), 4 looser
FLY_FLOORS = (0.3, 0.2, 0.1)
FLY_FLOOR_THRESHOLDS = (0.8, 0.6, 0.3, 0.0)
NATIVE_THRESHOLDS = (1.08, 1.04, 1.0, 0.9, 0.6, 0.3)  # vLLM 0.33's native FLy (variant "vllm", no trust guards)
MARGIN_RATIOS = (0.995, 0.99, 0.98, 0.95, 0.9, 0.8, 0.7)
TYPICAL_EPSILONS = (0.8, 0.5, 0.3, 0.2, 0.09)
# -log p_target(draft token) <= threshold; a mismatch has p <= 1/2 when greedy, so below ln 2 ≈ 0.69 nothing loosens
BILD_THRESHOLDS = (0.75, 0.9, 1.1, 1.4, 1.8, 2.3, 3.0)
LENIENCES = (0.9, 0.7, 0.5, 0.3, 0.15)  # p(x) >= l * max p: strict to loose
FSD_THRESHOLDS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4)  # JS in nats (at most ln 2)
# speculative cascades' α per deferral rule, strict (defers most) to loose
CASCADE_LENIENCES = {
    "chow": (0.02, 0.05, 0.1, 0.2, 0.35),
    "diff": (-0.2, -0.1, 0.0, 0.1, 0.2),
    "opt": (-1.0, -0.5, 0.0, 0.5, 1.0),
}
# AdaSD as flyspec reads it: per min_samples (the positions of each class learnt before loosening), its scale from
# the accepted tokens' mean JS distance toward the rejected ones' (1: the paper's midpoint), strict to loose
ADASD_MIN_SAMPLES = (8, 32)
ADASD_SCALES = (0.5, 1.0, 1.5)


@dataclass(frozen=True)
class Point:
    """One operating point: a name, its rule, its family (strict → loose by ``order``) and its config."""

    name: str
    rule: str  # "exact" (lossless) or one of RULES
    family: str
    order: int
    speculation: SpeculationConfig
    settings: dict[str, Any] = field(default_factory=dict, compare=False)  # what distinguishes it, for reports

    @property
    def lossless(self) -> bool:
        return self.rule == "exact"


def base_speculation(spec: SpeculationConfig, policy: str | None = None) -> SpeculationConfig:
    """The drafter part of ``spec`` every point shares: lossy settings reset, the draft length pinned.

    Copy drafters run at the cost-aware length (their fastest); model drafters at a fixed length,
    since a cost-aware model drafter's length depends on timings that a replayed run does not have.
    ``policy`` pins another (``fixed`` on vLLM, whose draft length is its ``num_speculative_tokens``).
    """
    policy = policy or ("cost" if spec.drafter in COPY_DRAFTERS else "fixed")
    return dataclasses.replace(
        spec,
        profile=PROFILE_NONE,  # every point runs as given, never a shipped profile's settings
        verifier="exact",
        fly=FlyConfig(),
        margin=MarginConfig(),
        typical=TypicalConfig(),
        bild=BildConfig(),
        lenience=LenienceConfig(),
        fsd=FsdConfig(),
        cascade=CascadeConfig(),
        adasd=AdasdConfig(),
        guard=GuardConfig(),
        draft_length=dataclasses.replace(spec.draft_length, policy=policy),
    )


def _point(
    base: SpeculationConfig, rule: str, family: str, order: int, name: str, settings: dict[str, Any], **changes: Any
) -> Point:
    return Point(name, rule, family, order, dataclasses.replace(base, verifier=rule, **changes), settings)


def fly_point(
    base: SpeculationConfig,
    family: str,
    order: int,
    threshold: float,
    window: int,
    floor: float = 0.0,
    bare: bool = False,
    variant: str = "flyspec",
    temperature_rule: str = "coupled",
) -> Point:
    settings: dict[str, Any] = {"entropy_threshold": threshold, "window_size": window}
    name = f"fly H>={threshold:g} W{window}"
    if variant != "flyspec":
        settings["variant"] = variant
        name = f"fly {variant} H>={threshold:g} W{window}"
        temperature_rule = "rejection"  # vLLM's native FLy at T > 0 relaxes its rejection sampling
    elif temperature_rule != "coupled":
        settings["temperature_rule"] = temperature_rule
        name += f" {temperature_rule}"
    if floor:
        settings["min_draft_prob"] = floor
        name += f" p>={floor:g}"
    if bare and variant == "flyspec":
        settings["guards"] = "bare"
        name += " bare"
    fly = FlyConfig(window, threshold, min_draft_prob=floor, variant=variant, temperature_rule=temperature_rule)
    guard = GuardConfig.bare() if bare else GuardConfig()
    return _point(base, "fly", family, order, name, settings, fly=fly, guard=guard)


def points(
    spec: SpeculationConfig,
    grid: str = "default",
    rules: tuple[str, ...] = RULES,
    draft_length: str | None = None,
    exact_first: tuple[int, ...] = (0,),
    sampled: bool = False,
) -> list[Point]:
    """The grid's points for ``spec``'s drafter (lossless baselines first; ``draft_length``: see base_speculation;
    ``sampled``: FLy's other base rules at T > 0 too).

    ``exact_first``: the exact-first axis (``GuardConfig.exact_first``): every lossy point once per value, a value
    above 0 as a family of its own (``"fly W6 first16"``), so each keeps its strict-to-loose order."""
    if any(value < 0 for value in exact_first) or not exact_first:
        raise ConfigError(f"exact-first values must be >= 0 (got {', '.join(map(str, exact_first)) or 'none'})")
    found = _grid(spec, grid, rules, draft_length, sampled)
    lossy = [point for point in found if not point.lossless]
    for value in dict.fromkeys(value for value in exact_first if value > 0):
        found += [_exact_first(point, value) for point in lossy]
    if 0 not in exact_first:
        found = [point for point in found if point.lossless or point.speculation.guard.exact_first]
    return found


def _exact_first(point: Point, value: int) -> Point:
    """``point`` with its first ``value`` output tokens verified exactly: a family of its own."""
    guard = dataclasses.replace(point.speculation.guard, exact_first=value)
    return Point(
        f"{point.name} first{value}",
        point.rule,
        f"{point.family} first{value}",
        point.order,
        dataclasses.replace(point.speculation, guard=guard),
        {**point.settings, "exact_first": value},
    )


def _grid(
    spec: SpeculationConfig, grid: str, rules: tuple[str, ...], draft_length: str | None, sampled: bool = False
) -> list[Point]:
    """The grid's points without the exact-first axis."""
    if grid not in GRIDS:
        raise ConfigError(f"unknown grid {grid!r}; choose from: {', '.join(GRIDS)}")
    unknown = [rule for rule in rules if rule not in RULES]
    if unknown or not rules:
        raise ConfigError(f"unknown rule {(unknown or [''])[0]!r}; choose from: {', '.join(RULES)}")
    base = base_speculation(spec, draft_length)
    found = [Point("exact", "exact", "exact", 0, base, {"draft_length": base.draft_length.policy})]
    if base.draft_length.policy == "cost":
        fixed = dataclasses.replace(base, draft_length=DraftLengthConfig(policy="fixed"))
        found.append(Point("exact fixed", "exact", "exact", 1, fixed, {"draft_length": "fixed"}))
    quick = grid == "quick"
    windows = [window for window in FLY_WINDOWS if window < base.num_draft_tokens]
    if "fly" in rules and windows:
        for index, window in enumerate(windows[:1] if quick else windows):
            thresholds = (0.6, 0.3) if quick else FLY_THRESHOLDS if index == 0 else FLY_WINDOW_THRESHOLDS
            for order, threshold in enumerate(thresholds):
                found.append(fly_point(base, f"fly W{window}", order, threshold, window))
        if not quick:
            for floor in FLY_FLOORS:
                for order, threshold in enumerate(FLY_FLOOR_THRESHOLDS):
                    found.append(
                        fly_point(base, f"fly W{windows[0]} p>={floor:g}", order, threshold, windows[0], floor)
                    )
        found.append(fly_point(base, "fly bare", 0, 0.3, windows[0], bare=True))
        if sampled:  # FLy's other base rules at T > 0, compared with the coupled one on the same prompts and seeds
            others = ["two-sample"] + ["rejection"] * (base.drafter in DISTRIBUTION_DRAFTERS)
            for rule in others:
                for order, threshold in enumerate((0.3,) if quick else (1.0, 0.6, 0.3)):
                    found.append(
                        fly_point(
                            base, f"fly W{windows[0]} {rule}", order, threshold, windows[0], temperature_rule=rule
                        )
                    )
        # vLLM 0.33's native rule (no guards): what `rejection_sample_method: "fly"` runs, deployable without flyspec
        for order, threshold in enumerate((0.3,) if quick else NATIVE_THRESHOLDS):
            found.append(
                fly_point(base, f"fly vllm W{windows[0]}", order, threshold, windows[0], bare=True, variant="vllm")
            )
    if "margin" in rules:
        for order, ratio in enumerate((0.9,) if quick else MARGIN_RATIOS):
            name = f"margin z2/z1>{ratio:g}"
            found.append(
                _point(base, "margin", "margin", order, name, {"logit_ratio": ratio}, margin=MarginConfig(ratio))
            )
    if "typical" in rules:
        for order, epsilon in enumerate((0.3,) if quick else TYPICAL_EPSILONS):
            name = f"typical eps={epsilon:g}"
            typical = TypicalConfig(epsilon=epsilon)
            found.append(_point(base, "typical", "typical", order, name, {"epsilon": epsilon}, typical=typical))
    if "lenience" in rules:
        for order, lenience in enumerate((0.5,) if quick else LENIENCES):
            name = f"lenience l={lenience:g}"
            config = LenienceConfig(lenience)
            found.append(_point(base, "lenience", "lenience", order, name, {"lenience": lenience}, lenience=config))
    if base.drafter in DISTRIBUTION_DRAFTERS:  # fsd, cascade, adasd read the draft's distribution
        found += _distribution_points(base, rules, quick)
    if "bild" in rules:
        for order, threshold in enumerate((1.4,) if quick else BILD_THRESHOLDS):
            name = f"bild -log p<={threshold:g}"
            bild = BildConfig(rollback_threshold=threshold)
            found.append(_point(base, "bild", "bild", order, name, {"rollback_threshold": threshold}, bild=bild))
    return found


def _distribution_points(base: SpeculationConfig, rules: tuple[str, ...], quick: bool) -> list[Point]:
    """The families of the rules that read the draft's distribution (a draft model's, or layer-skip's)."""
    found: list[Point] = []
    if "fsd" in rules:
        for order, threshold in enumerate((0.1,) if quick else FSD_THRESHOLDS):
            fsd = FsdConfig(threshold=threshold)
            found.append(_point(base, "fsd", "fsd", order, f"fsd js<={threshold:g}", {"threshold": threshold}, fsd=fsd))
    if "cascade" in rules:
        for rule, leniences in CASCADE_LENIENCES.items():
            for order, lenience in enumerate(leniences[2:3] if quick else leniences):
                cascade = CascadeConfig(rule=rule, lenience=lenience)
                name = f"cascade {rule} a={lenience:g}"
                chosen = {"rule": rule, "lenience": lenience}
                found.append(_point(base, "cascade", f"cascade {rule}", order, name, chosen, cascade=cascade))
    if "adasd" in rules:
        for min_samples in ADASD_MIN_SAMPLES[:1] if quick else ADASD_MIN_SAMPLES:
            for order, scale in enumerate((1.0,) if quick else ADASD_SCALES):
                adasd = AdasdConfig(min_samples=min_samples, scale=scale)
                name, chosen = f"adasd n>={min_samples} s={scale:g}", {"min_samples": min_samples, "scale": scale}
                found.append(_point(base, "adasd", f"adasd n>={min_samples}", order, name, chosen, adasd=adasd))
    return found
