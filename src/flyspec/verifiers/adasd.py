"""AdaSD's acceptance, as flyspec reads it (adaptive speculative decoding, arXiv 2512.11280). Lossy.

This is flyspec's reading of the paper, not the authors' code (none is public). The paper's readable text gives
a threshold at the midpoint of the mean Jensen-Shannon distances of the tokens accepted and rejected so far, with
no starting value and no algorithm block; the choices it leaves open were decided by flyspec's maintainers:

distance
    At each draft position, the Jensen-Shannon divergence (natural log, in [0, ln 2]) between the target's and
    the draft's next-token distributions, both at temperature 1 (``verifiers/distributions.py``, as FSD's ``js``).
exact rule
    Exact match against the target's own choice (its argmax; a sample from it at T > 0), as ``exact`` and FSD.
accepted and rejected positions
    A step's *judged* positions are the draft positions up to and including the first one the verdict does not
    keep (all ``k`` when it keeps every one): the positions whose prefix was committed. Each counts as accepted
    when the exact rule accepts it (the draft token is the target's choice) and as rejected otherwise, a loose
    accept included (the exact rule rejected it). Positions after the first one not kept continue a path that
    was not committed and are not counted. While the rule is strict, this is exactly the exact rule's own
    judgement: its accepted prefix and its first rejection.
state
    :class:`AdasdState`, one per generation (:meth:`AdasdVerifier.new_state`; the decoder hands it back in
    ``VerifyContext.rule_state``): the distances summed and the positions counted, accepted and rejected, from the
    distances the rule computes anyway. Nothing is shared between generations or requests.
rule
    Strict (exact) until both classes hold ``min_samples`` positions of this generation. Then a mismatch is kept
    when its distance is at most ``mean_accepted + scale * (mean_rejected - mean_accepted) / 2`` (:func:`threshold`;
    ``scale`` 1 is the paper's midpoint) and the trust guards pass; the first token not kept ends the accepted run
    and the target's choice there is committed, as in every rule. The threshold is the state's at the start of the
    step: a step's positions are counted after its verdict.
draft length
    AdaSD adapts the draft length too; flyspec's cost-aware draft length already does, so the rule leaves it there.

A verify without a state (no generation: ``context`` None) has no history, so it is exact. The state lives on the
target's device and the step's counting stays there (no host sync). Needs the draft's distribution
(``Draft.draft_distribution``): a draft model of the target's tokenizer, or layer-skip.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import torch

from flyspec.config import AdasdConfig, SamplingConfig
from flyspec.sampling.acceptance import where_needed
from flyspec.sampling.coupled import Draws
from flyspec.types import Draft, Verdict, VerifyContext
from flyspec.verifiers.base import GREEDY, LooseRule, NextToken, loose_verdict
from flyspec.verifiers.distributions import divergence, draft_distribution, no_plugin_candidates, target_distribution

Number = TypeVar("Number", float, torch.Tensor)


def threshold(mean_accepted: Number, mean_rejected: Number, scale: float) -> Number:
    """The distance up to which a mismatch is kept: ``scale`` 0 is the accepted tokens' mean, 1 the midpoint (the
    paper's), 2 the rejected tokens' mean."""
    return mean_accepted + scale * (mean_rejected - mean_accepted) / 2


@dataclass
class AdasdState:
    """One generation's history: the distances summed and the positions counted, ``[accepted, rejected]``, on the
    target's device (made there at the first step: the decoder makes the state before it knows the device)."""

    sums: torch.Tensor | None = None  # [2] float32
    counts: torch.Tensor | None = None  # [2] int64

    def totals(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sums, counts)`` on ``device``, zeros before the first step."""
        if self.sums is None or self.counts is None:
            self.sums = torch.zeros(2, device=device)
            self.counts = torch.zeros(2, dtype=torch.long, device=device)
        return self.sums, self.counts

    def threshold(self, config: AdasdConfig, device: torch.device) -> torch.Tensor:
        """``[]``: the threshold once both classes hold ``config.min_samples`` positions, NaN before (nothing is
        at most NaN: the rule is exact)."""
        sums, counts = self.totals(device)
        means = sums / counts.clamp_min(1)
        learnt = threshold(means[0], means[1], config.scale)
        return torch.where((counts >= config.min_samples).all(), learnt, torch.full_like(learnt, float("nan")))

    def observe(
        self,
        exact_accept: torch.Tensor,  # [k] bool, the exact rule's acceptance
        distance: torch.Tensor,  # [k], measured at least at the first ``num_judged`` positions
        num_judged: int,
    ) -> None:
        """Count the step's first ``num_judged`` positions, each as accepted or rejected by the exact rule."""
        sums, counts = self.totals(distance.device)
        judged = torch.arange(exact_accept.shape[0], device=exact_accept.device) < num_judged
        accepted, rejected = exact_accept & judged, ~exact_accept & judged
        zero = torch.zeros_like(distance)  # where, not indexing: NaN (unmeasured) rows are never read, no host sync
        sums += torch.stack([torch.where(accepted, distance, zero).sum(), torch.where(rejected, distance, zero).sum()])
        counts += torch.stack([accepted.sum(), rejected.sum()])

    def samples(self) -> tuple[int, int]:
        """``(accepted, rejected)``: the positions counted so far, on the host."""
        if self.counts is None:
            return 0, 0
        accepted, rejected = self.counts.tolist()
        return accepted, rejected

    def means(self) -> tuple[float, float]:
        """``(mean_accepted, mean_rejected)`` on the host (NaN for a class with no position yet)."""
        nan = float("nan")
        if self.sums is None:
            return nan, nan
        (accepted, rejected), (num_accepted, num_rejected) = self.sums.tolist(), self.samples()
        return (accepted / num_accepted if num_accepted else nan, rejected / num_rejected if num_rejected else nan)


@dataclass(frozen=True)
class AdasdVerifier(LooseRule):
    config: AdasdConfig = field(default_factory=AdasdConfig)
    name: str = "adasd"

    def new_state(self) -> AdasdState:
        return AdasdState()

    def relax(
        self,
        draft: Draft,
        target_logits: torch.Tensor,  # [k + 1, vocab]
        sampling: SamplingConfig,
        draws: Draws | None,
        context: VerifyContext | None,
        accept: torch.Tensor,  # [k] bool, the exact rule's acceptance
        next_token: NextToken,
    ) -> Verdict:
        """The mismatches within the learnt threshold, guarded; then the judged positions are counted."""
        known = context.rule_state if context is not None else None
        state = known if isinstance(known, AdasdState) else AdasdState()
        limit = state.threshold(self.config, target_logits.device)  # [], NaN while strict
        distance = self.distances(accept, draft, target_logits, limit)
        candidates = ~accept & (distance <= limit)
        verdict = loose_verdict(draft, target_logits, accept, candidates, distance, next_token, self.guard, context)
        state.observe(accept, distance, min(verdict.num_accepted + 1, draft.num_tokens))
        return verdict

    def distances(
        self, accept: torch.Tensor, draft: Draft, target_logits: torch.Tensor, limit: torch.Tensor
    ) -> torch.Tensor:
        """``[k]``: the JS distance wherever the step may judge: through the first mismatch while strict (the exact
        rule stops there), everywhere once the threshold is learnt (NaN where not measured)."""
        distribution = draft_distribution(draft, self.name, target_logits.shape[-1])  # [k, vocab]
        through_first_mismatch = (~accept).cumsum(0) - (~accept).long() == 0  # [k]

        def measure(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return divergence(target_distribution(rows), distribution[positions], "js")

        return where_needed(through_first_mismatch | ~limit.isnan(), target_logits, measure, float("nan"))

    def candidates(
        self,
        base_accept: torch.Tensor,
        draft_tokens: torch.Tensor,
        target_logits: torch.Tensor,
        sampling: SamplingConfig = GREEDY,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise no_plugin_candidates(self.name)
