"""The Verifier protocol, and the glossary every module in flyspec uses.

Glossary
--------
draft tokens
    ``d_0 .. d_{k-1}``, proposed by a drafter for the positions after the last committed token.
target logits
    ``[k + 1, vocab]``: the target's logits after scoring ``[last committed token] + draft`` in
    one forward. Row ``i`` is the target's distribution for the position of ``d_i``; row ``k``
    is the position after the whole draft.
target_probs / draft_probs
    The target's (filtered, temperature-scaled) probabilities, and the probabilities the drafter
    drew its tokens from. Never ``p``/``q``: papers disagree on which is which.
draft distribution
    The draft model's own next-token distribution at each draft position, at temperature 1
    (``Draft.draft_distribution``), greedy or not: what fsd, cascade and adasd compare with the target's.
accepted
    A draft token that is kept. A verifier accepts a prefix ``d_0 .. d_{n-1}``.
recovered
    The token committed at the first rejected position ``n < k``: the target's argmax (greedy),
    or its sample there (T > 0: the coupled sample, plain sampling's token for the seed, ``sampling/coupled.py``;
    rejection sampling of a sampled draft: a sample of the residual ``max(0, target_probs - draft_probs)``).
bonus
    The target's next token when all ``k`` draft tokens are accepted (from row ``k``).
loose accept
    A draft token that the strict base rule rejects but a lossy rule (``names.LOSSY_VERIFIERS``)
    keeps. Loose accepts count as accepted.
acceptance length, τ
    Tokens committed per target forward, the recovered/bonus token included. Plain decoding
    has τ = 1; a verdict commits ``num_accepted + 1`` tokens.
proposer
    A drafter below a draft model that proposes tokens for the draft model to check (an n-gram
    lookup, or another draft model), so the draft model needs fewer forwards (FLy's multi-level
    drafting). A proposer can itself have a proposer.
proposal
    The tokens a proposer offers its draft model in one round (up to ``num_proposal_tokens``);
    the draft model keeps a prefix, as a verifier keeps a prefix of a draft.
level
    One drafter in a stack: an n-gram lookup (bottom only), a draft model, or the target with
    layers skipped. Each level checks the proposal of the level below in one forward.
stack
    Levels from the bottom up, the top one drafting for the target (``drafters/registry.py``):
    ``draft-model`` is one level, ``multilevel`` is n-gram → draft model, ``stack`` any levels.

Every verifier commits ``d_0 .. d_{n-1}`` plus one recovered or bonus token, where ``n`` is the
number of leading positions its acceptance mask keeps.

A rule is one small file that says only what it accepts (as vLLM's samplers do): a lossless rule subclasses
:class:`StrictRule` and overrides ``strict`` (its acceptance mask and what follows the accepted prefix) where
it is not the default (exact match on the target's own choice: its argmax when greedy, its coupled sample at T > 0,
``sampling/coupled.py``); a lossy rule subclasses
:class:`LooseRule` and writes ``candidates`` (the mismatches of the strict rule it would keep, and its measure
there). :class:`Rule` does the rest: the strict rule, the trust guards, the verdict.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import torch

from flyspec.config import GuardConfig, SamplingConfig
from flyspec.sampling.acceptance import (
    draft_probs_or_one_hot,
    exact_match,
    rejection_accept_mask,
    rejection_next_token,
)
from flyspec.sampling.coupled import ACCEPT, Draws
from flyspec.sampling.sampler import logits_to_probs
from flyspec.types import Draft, LooseAccept, Verdict, VerifyContext
from flyspec.verifiers.guard import guard_loose_mask

GREEDY = SamplingConfig()


@runtime_checkable
class Verifier(Protocol):
    """Decides which draft tokens to keep, given the target's logits for every draft position."""

    @property
    def name(self) -> str:
        """The registry name (``exact``, ``fly``, …)."""
        ...

    @property
    def lossless(self) -> bool:
        """True when the output distribution provably equals plain decoding's."""
        ...

    @property
    def min_draft_tokens(self) -> int:
        """The shortest draft length at which the rule can do what it is for (FLy: its window + 1)."""
        ...

    def new_state(self) -> Any:
        """This rule's state for one generation, or None when it keeps none: the decoder makes one per generation
        and hands it back at every step in ``VerifyContext.rule_state`` (adasd's running means), so nothing a rule
        learns outlives the generation."""
        ...

    def verify(
        self,
        draft: Draft,
        target_logits: torch.Tensor,  # [k + 1, vocab]
        sampling: SamplingConfig,
        draws: Draws | None,
        context: VerifyContext | None = None,
    ) -> Verdict: ...


NextToken = Callable[[int], int] | torch.Tensor
"""The recovered (position ``n < k``) or bonus (``n == k``) token: ``[k + 1]`` tokens when known for every
position (the target's choices), or ``position -> token`` when drawn once the position is known (residual
sampling)."""


def build_verdict(
    draft_tokens: torch.Tensor,  # [k]
    accept: torch.Tensor,  # [k] bool, final acceptance (loose accepts included)
    loose: torch.Tensor,  # [k] bool, positions kept only by the lossy rule
    next_token: NextToken,  # [k + 1] tokens, or position n -> recovered (n < k) or bonus (n == k) token
) -> Verdict:
    """Commit the accepted prefix plus one recovered or bonus token.

    Everything the verdict needs from the device comes back in one transfer (draft tokens, masks and,
    when given as a tensor, the target's choices): one host sync per step on a GPU, not one per token.
    """
    k = draft_tokens.shape[0]
    parts = [draft_tokens, accept.long(), loose.long()]
    if isinstance(next_token, torch.Tensor):
        parts.append(next_token.long())
    host = torch.cat(parts).tolist()  # the step's device-to-host transfer
    accepted = host[k : 2 * k]
    num_accepted = accepted.index(0) if 0 in accepted else k
    kept = host[:num_accepted]
    loose_positions = tuple(i for i, flag in enumerate(host[2 * k : 2 * k + num_accepted]) if flag)
    following = host[3 * k + num_accepted] if isinstance(next_token, torch.Tensor) else int(next_token(num_accepted))
    return Verdict(
        tokens=kept + [following],
        num_accepted=num_accepted,
        loose_positions=loose_positions,
        bonus=num_accepted == draft_tokens.shape[0],
    )


def loose_verdict(
    draft: Draft,
    target_logits: torch.Tensor,  # [k + 1, vocab]
    base_accept: torch.Tensor,  # [k] bool, the strict rule's acceptance
    candidates: torch.Tensor,  # [k] bool, mismatches the lossy rule would keep
    evidence: torch.Tensor,  # [k], the lossy rule's measure at each position (see LooseAccept)
    next_token: NextToken,
    guard: GuardConfig,
    context: VerifyContext | None,
) -> Verdict:
    """A lossy verifier's verdict: candidates filtered by the trust guards, each loose accept explained."""
    kept, vetoes = guard_loose_mask(base_accept, candidates, draft, target_logits, guard, context)
    verdict = build_verdict(draft.tokens, base_accept | kept, kept, next_token)
    positions = list(verdict.loose_positions)
    if not positions:
        return replace(verdict, vetoes=vetoes.get(verdict.num_accepted, ()))
    index = torch.tensor(positions, dtype=torch.long, device=target_logits.device)
    # what the strict rule would have committed there: the target's choices where known (its argmax greedy, its
    # coupled sample at T > 0: plain decoding's token), else (a residual rule) its argmax
    wanted = next_token[index] if isinstance(next_token, torch.Tensor) else target_logits[index].argmax(-1)
    # one transfer for every explanation: [2, loose accepts] (float64 holds token ids exactly)
    explained = torch.stack([wanted.double(), evidence[index].double()])
    target_tokens, evidences = explained.tolist()
    loose = tuple(
        LooseAccept(
            position=j,
            draft_token=verdict.tokens[j],  # a loose accept is in the accepted prefix
            target_token=int(target_token),
            evidence=value,
            source=draft.source(j),
        )
        for j, target_token, value in zip(positions, target_tokens, evidences, strict=True)
    )
    return replace(verdict, loose=loose, vetoes=vetoes.get(verdict.num_accepted, ()))


def strict_base_rule(
    draft: Draft,
    target_logits: torch.Tensor,  # [k + 1, vocab]
    sampling: SamplingConfig,
    draws: Draws | None,
    prefix_only: bool = False,
) -> tuple[torch.Tensor, NextToken]:
    """The lossless rule the lossy verifiers relax: exact match on the target's own choice, its argmax when greedy
    and its coupled sample at T > 0 (``sampling/coupled.py``), which is plain sampling's token at that position
    for the same seed. Returns the ``[k]`` acceptance mask and the ``[k + 1]`` choices (recovered or bonus);
    ``prefix_only``: only through the first mismatch (``acceptance.exact_match``)."""
    return exact_match(draft.tokens, target_logits, sampling, draws, prefix_only)


def rejection_rule(
    draft: Draft,
    target_logits: torch.Tensor,  # [k + 1, vocab]
    sampling: SamplingConfig,
    draws: Draws | None,
    prefix_only: bool = False,
) -> tuple[torch.Tensor, NextToken]:
    """Speculative rejection sampling of a sampled draft (``draft_probs``): ``[k]`` acceptance and
    ``position -> token`` (residual or bonus), every draw keyed by its position (``sampling/coupled.py``).

    Greedy, and for deterministic drafts (one-hot ``draft_probs``), it is :func:`strict_base_rule`: a one-hot
    draft token is accepted with probability ``target_probs[d]`` by either rule, and the token after a rejection
    is distributed as the target's without ``d`` by either; exact match against the coupled sample also commits
    plain sampling's text."""
    if sampling.greedy or draft.draft_probs is None:
        return strict_base_rule(draft, target_logits, sampling, draws, prefix_only=prefix_only)
    assert draws is not None, "sampling draws"
    target_probs = logits_to_probs(target_logits, sampling)  # [k + 1, vocab]
    draft_probs = draft_probs_or_one_hot(draft, target_probs.shape[-1])  # [k, vocab]
    uniforms = draws.uniforms(draft.num_tokens, ACCEPT)  # [k]
    accept = rejection_accept_mask(draft.tokens, draft_probs, target_probs, uniforms)
    return accept, lambda n: rejection_next_token(n, target_probs, draft_probs, draws)


class Rule:
    """What every verifier shares: the strict rule (:meth:`strict`), then, in a lossy rule, the mismatches its
    :meth:`candidates` would keep, filtered by the trust guards; the verdict from both."""

    @property
    def lossless(self) -> bool:
        raise NotImplementedError

    @property
    def min_draft_tokens(self) -> int:
        return 1

    def new_state(self) -> Any:
        """None: a rule keeps no state across steps unless it says so (``verifiers/adasd.py``)."""
        return None

    def strict(
        self,
        draft: Draft,
        target_logits: torch.Tensor,  # [k + 1, vocab]
        sampling: SamplingConfig,
        draws: Draws | None,
    ) -> tuple[torch.Tensor, NextToken]:
        """The ``[k]`` strict acceptance and the recovered or bonus token (:data:`NextToken`): by default
        :func:`strict_base_rule` (exact match on the target's argmax, or on its coupled sample at T > 0)."""
        return strict_base_rule(draft, target_logits, sampling, draws)

    def verify(
        self,
        draft: Draft,
        target_logits: torch.Tensor,  # [k + 1, vocab]
        sampling: SamplingConfig,
        draws: Draws | None,
        context: VerifyContext | None = None,
    ) -> Verdict:
        accept, next_token = self.strict(draft, target_logits, sampling, draws)
        return self.relax(draft, target_logits, sampling, draws, context, accept, next_token)

    def relax(
        self,
        draft: Draft,
        target_logits: torch.Tensor,  # [k + 1, vocab]
        sampling: SamplingConfig,
        draws: Draws | None,
        context: VerifyContext | None,
        accept: torch.Tensor,  # [k] bool, the strict acceptance
        next_token: NextToken,
    ) -> Verdict:
        """The verdict from the strict acceptance: as it is (lossless), or with loose accepts (:class:`LooseRule`)."""
        return build_verdict(draft.tokens, accept, torch.zeros_like(accept), next_token)


class StrictRule(Rule):
    """A lossless verifier: a subclass overrides :meth:`strict` where its rule is not :func:`strict_base_rule`."""

    @property
    def lossless(self) -> bool:
        return True

    def strict(
        self,
        draft: Draft,
        target_logits: torch.Tensor,  # [k + 1, vocab]
        sampling: SamplingConfig,
        draws: Draws | None,
    ) -> tuple[torch.Tensor, NextToken]:
        """:func:`strict_base_rule` through the first mismatch: nothing after it decides a lossless verdict."""
        return strict_base_rule(draft, target_logits, sampling, draws, prefix_only=True)


@dataclass(frozen=True)
class LooseRule(Rule):
    """A lossy verifier: a subclass (a frozen dataclass) writes :meth:`candidates` (and :meth:`strict` where it
    relaxes another base rule); the trust guards (``guard``, keyword-only: ``verifiers/guard.py``) filter them."""

    guard: GuardConfig = field(default_factory=GuardConfig, kw_only=True)

    @property
    def lossless(self) -> bool:
        return False

    def relax(
        self,
        draft: Draft,
        target_logits: torch.Tensor,  # [k + 1, vocab]
        sampling: SamplingConfig,
        draws: Draws | None,
        context: VerifyContext | None,
        accept: torch.Tensor,  # [k] bool, the strict acceptance
        next_token: NextToken,
    ) -> Verdict:
        candidates, evidence = self.judge(accept, draft, target_logits, sampling, draws)
        return loose_verdict(draft, target_logits, accept, candidates, evidence, next_token, self.guard, context)

    def judge(
        self,
        base_accept: torch.Tensor,  # [k] bool, the strict rule's acceptance
        draft: Draft,
        target_logits: torch.Tensor,  # [k + 1, vocab]
        sampling: SamplingConfig,
        draws: Draws | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`candidates` of the draft's tokens; a rule that reads more of the draft than its tokens (the draft
        model's distribution: ``names.DISTRIBUTION_VERIFIERS``) or draws at T > 0 (lenience) overrides this."""
        return self.candidates(base_accept, draft.tokens, target_logits, sampling)

    def candidates(
        self,
        base_accept: torch.Tensor,  # [k] bool, the strict rule's acceptance
        draft_tokens: torch.Tensor,  # [k]
        target_logits: torch.Tensor,  # [k (+1), vocab]
        sampling: SamplingConfig = GREEDY,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``([k] bool, [k])``: the mismatches this rule would keep before the guards, and its measure there
        (NaN where not measured). What the vLLM plugin applies to a request (``integrations/vllm``)."""
        raise NotImplementedError
