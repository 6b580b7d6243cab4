"""Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Lossless at any T.

Draft token ``d_i`` drawn from ``draft_probs[i]`` is accepted with probability
``min(1, target_probs[i, d_i] / draft_probs[i, d_i])``. At the first rejection the recovered
token is sampled from the residual ``normalize(max(0, target_probs[i] - draft_probs[i]))``; when
all are accepted, the bonus token is sampled from ``target_probs[k]``. N-gram drafts are
deterministic and count as one-hot draft probabilities. Greedy (T=0) this reduces to exact match,
which is what runs (no random numbers are drawn).
"""

from __future__ import annotations

from dataclasses import dataclass

from flyspec.verifiers.base import StrictRule
from flyspec.verifiers.base import strict_base_rule as strict_base_rule  # re-exported: the rule lossy verifiers relax


@dataclass(frozen=True)
class RejectionVerifier(StrictRule):
    """Rejection sampling is :class:`StrictRule`'s default :meth:`~StrictRule.strict`: nothing to add."""

    name: str = "rejection"
