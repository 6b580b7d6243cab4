"""flyspec's lossy rules over a vLLM batch: which draft tokens to keep loosely, and the kernel inputs that keep them.

vLLM verifies a whole batch at once: the draft tokens of all requests are concatenated
(``draft_token_ids [num_tokens]``, ``num_draft_tokens`` per request) and so are the target's
logits at those positions (``target_logits [num_tokens, vocab]``; the bonus row is separate).
The plugin does not replace vLLM's greedy kernel (Triton on GPU, C++ on CPU). It decides per
request, with the very code ``flyspec generate --verifier fly|margin|typical`` runs (each verifier's
``candidates``, then ``guard_loose_mask``: the trust guards), which mismatches to keep, and rewrites
the target logits there so that their argmax is the draft token. The unchanged kernel then accepts
the kept tokens and commits the recovered or bonus token exactly as flyspec's verifier does.
This is the design of vLLM's built-in FLy (pull request #53987): rewrite the kernel's inputs.

**Shadow rules** (a calibration's): a request verified by one rule can also say, for other rules, at
which step each would first have kept a draft token this request's rule did not keep. Up to that step
the other rule's output is this one's, token for token (same drafts, same logits, same verdicts), so a
calibration decodes a setting only from where it leaves the shared path. In greedy decoding a rule
leaves the path at a step exactly when it keeps the step's first mismatch (nothing after it can be
committed otherwise), and within a family ordered strict to loose a looser rule keeps whatever a
stricter one keeps there, so each family is judged from its loosest member down and stops at the first
that keeps nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from flyspec_vllm import records
from flyspec_vllm._flyspec import (
    Draft,
    GuardConfig,
    SpeculationConfig,
    VerifyContext,
    guard_loose_mask,
    make_verifier,
    num_leading_true,
)


@dataclass(frozen=True)
class RequestRule:
    """How to verify one request of the batch: ``rule=None`` keeps vLLM's lossless rule.

    ``start``: the output index of the request's first draft position this step (tokens generated so far);
    ``record``/``shadow``: a trusted request's record key and shadow families (``options.py``)."""

    rule: SpeculationConfig | None = None
    context: VerifyContext | None = None  # the generation so far, for the guards that need it
    start: int = 0
    record: str | None = None
    shadow: tuple[tuple[SpeculationConfig, ...], ...] = ()
    guard: GuardConfig | None = None  # vLLM's own FLy runs: the guards that may veto its loose accepts (native.py)

    @property
    def active(self) -> bool:
        return self.rule is not None or bool(self.shadow)


@dataclass(frozen=True)
class Judgement:
    """One rule on one request's draft: the loose positions it keeps (in the accepted prefix), how many
    candidates it had before the guards (up to the first strict rejection), and what the guards refused."""

    loose: tuple[int, ...] = ()
    candidates: int = 0
    vetoes: tuple[str, ...] = ()
    evidence: tuple[float, ...] = ()  # the rule's measure at each loose position (FLy: the entropy)
    target_tokens: tuple[int, ...] = ()  # the target's choice at each loose position


@dataclass
class BatchOutcome:
    """What the rules did to one batch (the counters the plugin exports)."""

    loose_positions: list[int] = field(default_factory=list)  # flat indices into draft_token_ids
    candidates: int = 0  # mismatches a rule would keep before the guards, up to the first strict rejection
    vetoed: int = 0  # request-steps whose first candidate a guard refused
    fly_requests: int = 0  # request-steps verified with a lossy rule


@functools.lru_cache(maxsize=1024)
def verifier_for(rule: SpeculationConfig):  # type: ignore[no-untyped-def]  # a flyspec lossy verifier
    return make_verifier(rule.verifier, rule)


def judge(
    draft_tokens: torch.Tensor,  # [k] int64
    target_logits: torch.Tensor,  # [k, vocab]
    rule: SpeculationConfig,
    context: VerifyContext | None,
) -> Judgement:
    """One request under ``rule`` (greedy): flyspec's candidates, then its trust guards."""
    target_tokens = target_logits.argmax(-1)  # [k]
    base_accept = draft_tokens == target_tokens  # greedy: exact match on the target's argmax
    candidates, evidence = verifier_for(rule).candidates(base_accept, draft_tokens, target_logits)
    # only candidates before the first position neither rule accepts could ever be committed
    reachable = int(candidates[: num_leading_true(base_accept | candidates)].sum())
    if not reachable:
        return Judgement()
    kept, vetoes = guard_loose_mask(base_accept, candidates, Draft(draft_tokens), target_logits, rule.guard, context)
    accepted = num_leading_true(base_accept | kept)
    loose = tuple(int(j) for j in torch.nonzero(kept[:accepted]).flatten().tolist())
    if not loose:
        return Judgement(candidates=reachable, vetoes=tuple(vetoes.get(accepted, ())))
    index = torch.tensor(loose, dtype=torch.long)
    return Judgement(
        loose,
        reachable,
        tuple(vetoes.get(accepted, ())),
        tuple(float(value) for value in evidence[index].tolist()),
        tuple(int(token) for token in target_tokens[index].tolist()),
    )


def loose_accepts(
    draft_tokens: torch.Tensor,  # [k] int64
    target_logits: torch.Tensor,  # [k, vocab]
    rule: RequestRule,
) -> tuple[list[int], int, bool]:
    """One request: ``(loose positions, candidates, vetoed)`` under its rule and guards."""
    assert rule.rule is not None
    judgement = judge(draft_tokens, target_logits, rule.rule, rule.context)
    return list(judgement.loose), judgement.candidates, bool(judgement.vetoes)


def shadow_divergences(
    draft_tokens: torch.Tensor,  # [k] int64
    target_logits: torch.Tensor,  # [k, vocab]
    rule: RequestRule,
    diverged: set[int],  # flat indices of the shadow rules that already left this request's path
) -> list[int]:
    """The flat indices of the shadow rules that leave the request's path at this step (see the module docstring)."""
    if bool((draft_tokens == target_logits.argmax(-1)).all()):
        return []  # no mismatch: every rule commits what the request's own rule commits
    leaving: list[int] = []
    offset = 0
    for family in rule.shadow:
        indices = [offset + index for index in range(len(family)) if offset + index not in diverged]
        for index in reversed(indices):  # loosest first
            if not judge(draft_tokens, target_logits, family[index - offset], rule.context).loose:
                break  # this one keeps nothing here, so neither does any stricter one
            leaving.append(index)
        offset += len(family)
    return leaving


def apply_batch(
    draft_token_ids: torch.Tensor,  # [num_tokens], all requests' draft tokens concatenated
    num_draft_tokens: Sequence[int],  # [batch]
    target_logits: torch.Tensor,  # [num_tokens, vocab]
    rules: Sequence[RequestRule],  # [batch], in batch order
) -> BatchOutcome:
    """The loose accepts of a whole batch, as flat positions into ``draft_token_ids``; a recorded request's
    loose accepts and its shadow rules' divergences go to :mod:`records`."""
    outcome = BatchOutcome()
    start = 0
    draft_cpu = draft_token_ids.to("cpu", torch.int64)
    for count, rule in zip(num_draft_tokens, rules, strict=True):
        end = start + int(count)
        if rule.active and end > start:
            draft, logits = draft_cpu[start:end], target_logits[start:end].cpu()
            if rule.shadow and rule.record is not None:
                leaving = shadow_divergences(draft, logits, rule, records.diverged(rule.record))
                records.add_divergences(rule.record, leaving, rule.start)
            if rule.rule is not None:
                outcome.fly_requests += 1
                judgement = judge(draft, logits, rule.rule, rule.context)
                outcome.loose_positions.extend(start + j for j in judgement.loose)
                outcome.candidates += judgement.candidates
                outcome.vetoed += bool(judgement.vetoes)
                if rule.context is not None and rule.context.breaker is not None:
                    rule.context.breaker.stats.num_loose_accepts += len(judgement.loose)
                if rule.record is not None:
                    records.add_judgement(rule.record, judgement, rule.start, draft.tolist())
        start = end
    return outcome


def keep_draft_tokens(
    target_logits: torch.Tensor,  # [num_tokens, vocab]
    draft_token_ids: torch.Tensor,  # [num_tokens]
    positions: Sequence[int],
) -> torch.Tensor:
    """A copy of ``target_logits`` whose argmax is the draft token at ``positions`` (the input untouched).

    The draft token's logit is raised above the row's maximum; a copy, so that nothing else that
    reads the logits (logprobs) sees the rewrite.
    """
    if not positions:
        return target_logits
    rewritten = target_logits.clone()
    index = torch.tensor(list(positions), dtype=torch.long, device=target_logits.device)
    tokens = draft_token_ids[index].to(torch.long)
    rows = rewritten[index]  # [n, vocab]
    top = rows.max(-1).values  # [n]
    # + 1 and the next representable value: bf16 rounds max + 1 back to max for large logits
    raised = torch.nextafter(top + 1, torch.full_like(top, float("inf")))
    rewritten[index, tokens] = raised
    return rewritten
