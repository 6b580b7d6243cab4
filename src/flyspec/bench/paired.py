"""Is a method's sampled text less likely than plain sampling's? A one-sided paired comparison over prompts.

Per prompt ``i`` the difference ``d_i`` = the method's figure − plain sampling's on the same prompt (mean NLL per
token, or share of tokens outside the sampling distribution: ``bench/nll.py``). A method whose sampler is right
draws its text from the distribution plain sampling draws from, so ``E[d_i] = 0`` however the two texts are coupled
(``exact`` commits plain's very text: ``d_i = 0``; ``rejection`` with a draft model's drafts shares plain's noise:
another text, the same distribution; vLLM's and transformers' samplers draw their own). Pairing by prompt removes
what differs between prompts (a translation is likelier than a poem).

The test: Student's one-sided t bound on the mean difference, ``L = mean(d) − t(1 − α; n − 1) · sd(d) / √n``, the
lower end of a (1 − α) confidence interval; the method is *suspect* when ``L > 0``: its text is less likely than
plain's by more than the prompts' spread allows at level α. Each ``d_i`` is a mean over a generation's tokens, so
close to normal (the central limit theorem) even where one token's NLL is not. ``α`` is a family's level split
over its tests (Bonferroni): :func:`level_per_test`. No test below two prompts.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

FAMILY_LEVEL = 0.01  # the chance that any method of a run whose samplers are all right is called suspect, at most


@dataclass(frozen=True)
class Excess:
    """How far a method's per-prompt figures lie above plain's: the mean difference and its lower bound."""

    num_prompts: int
    mean: float
    lower_bound: float  # one-sided (1 - level) confidence bound on the mean difference
    level: float

    @property
    def above(self) -> bool:
        """The bound excludes 0: the method's figure is above plain's beyond chance at ``level``."""
        return self.lower_bound > 0


def level_per_test(num_tests: int, family_level: float = FAMILY_LEVEL) -> float:
    """Each test's α so that ``num_tests`` of them call anything suspect with probability at most ``family_level``
    when every sampler is right (Bonferroni)."""
    return family_level / max(num_tests, 1)


def paired_excess(method: Sequence[float], reference: Sequence[float], level: float) -> Excess | None:
    """The one-sided paired t bound on mean(method − reference) over pairs (``[n]`` each); None below 2 pairs."""
    if len(method) != len(reference):
        raise ValueError(f"{len(method)} values against {len(reference)}: a paired test needs one pair per prompt")
    differences = [m - r for m, r in zip(method, reference, strict=True)]
    n = len(differences)
    if n < 2:
        return None
    mean = statistics.fmean(differences)
    spread = statistics.stdev(differences) / math.sqrt(n)  # 0 when every difference is the same (exact: all 0)
    return Excess(n, mean, mean - t_quantile(1 - level, n - 1) * spread, level)


def t_cdf(t: float, df: int) -> float:
    """Student's t distribution function with ``df`` (a whole number ≥ 1) degrees of freedom, in closed form
    (Abramowitz & Stegun 26.7.3-4: a finite sum in θ = atan(t / √df))."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1 (got {df})")
    theta = math.atan(t / math.sqrt(df))
    cos2, sin = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:  # odd: (2/π)(θ + sin θ cos θ (1 + 2/3 cos²θ + 2·4/(3·5) cos⁴θ + ...)), ν - 2 powers of cos at most
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for j in range(1, (df - 1) // 2):
            term *= cos2 * (2 * j) / (2 * j + 1)
            total += term
        within = 2 / math.pi * (theta + sin * math.cos(theta) * total)  # P(|T| < t) for t >= 0, odd in t
    else:  # even: sin θ (1 + 1/2 cos²θ + 1·3/(2·4) cos⁴θ + ...)
        term, total = 1.0, 1.0
        for j in range(1, df // 2):
            term *= cos2 * (2 * j - 1) / (2 * j)
            total += term
        within = sin * total
    return (1 + within) / 2


def t_quantile(probability: float, df: int) -> float:
    """The ``probability`` quantile of Student's t with ``df`` degrees of freedom (bisection on :func:`t_cdf`)."""
    if not 0 < probability < 1:
        raise ValueError(f"a quantile's probability is in (0, 1) (got {probability})")
    if probability < 0.5:
        return -t_quantile(1 - probability, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < probability:
        low, high = high, 2 * high
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if t_cdf(middle, df) < probability else (low, middle)
        if high - low <= 1e-12 * high:
            break
    return (low + high) / 2
