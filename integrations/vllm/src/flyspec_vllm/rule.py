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
from collections.abc import Iterable, Sequence
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
    exact: bool = False  # vLLM's own FLy runs and this request must get none of its loose accepts (native.py)
    req_id: str = ""  # vLLM's request id (for the error line of a fault)

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
    draft_tokens: torch.Tensor,  # [k] int64, on the logits' device
    target_logits: torch.Tensor,  # [k, vocab]
    rule: SpeculationConfig,
    context: VerifyContext | None,
) -> Judgement:
    """One request under ``rule`` (greedy): flyspec's candidates, then its trust guards.

    Computed where the logits are (no copy of them to the host). Host syncs: one when no candidate could
    be committed; otherwise one more in the guards, one for what they kept and one for the evidence of
    the loose accepts (``tests/test_syncs.py`` holds the plugin to that)."""
    k = draft_tokens.shape[0]
    target_tokens = target_logits.argmax(-1)  # [k]
    base_accept = draft_tokens == target_tokens  # greedy: exact match on the target's argmax
    candidates, evidence = verifier_for(rule).candidates(base_accept, draft_tokens, target_logits)
    host = torch.cat([base_accept.long(), candidates.long()]).tolist()  # sync: the masks, 2k integers
    base_host, candidate_host = host[:k], host[k:]
    # only candidates before the first position neither rule accepts could ever be committed
    prefix = _leading(base or candidate for base, candidate in zip(base_host, candidate_host, strict=True))
    reachable = sum(candidate_host[:prefix])
    if not reachable:
        return Judgement()
    kept, vetoes = guard_loose_mask(base_accept, candidates, Draft(draft_tokens), target_logits, rule.guard, context)
    kept_host = kept.tolist()  # sync: what the guards kept
    accepted = _leading(base or keep for base, keep in zip(base_host, kept_host, strict=True))
    loose = tuple(position for position in range(accepted) if kept_host[position])
    if not loose:
        return Judgement(candidates=reachable, vetoes=tuple(vetoes.get(accepted, ())))
    index = torch.tensor(loose, dtype=torch.long, device=target_logits.device)
    # sync: the rule's measure and the target's choice at the loose accepts (float64 holds token ids exactly)
    measured, chosen = torch.stack([evidence[index].double(), target_tokens[index].double()]).tolist()
    return Judgement(
        loose,
        reachable,
        tuple(vetoes.get(accepted, ())),
        tuple(measured),
        tuple(int(token) for token in chosen),
    )


def _leading(flags: Iterable[object]) -> int:
    """How many leading ``flags`` are true."""
    count = 0
    for flag in flags:
        if not flag:
            break
        count += 1
    return count


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
    mismatch: bool | None = None,  # known already (apply_batch): whether any draft token misses the argmax
) -> list[int]:
    """The flat indices of the shadow rules that leave the request's path at this step (see the module docstring)."""
    if mismatch is None:
        mismatch = not bool((draft_tokens == target_logits.argmax(-1)).all())
    if not mismatch:
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
    loose accepts and its shadow rules' divergences go to :mod:`records`.

    Everything stays on the logits' device: one host sync for the batch (its draft tokens and where they
    miss the target's argmax), then :func:`judge` only for the requests with a rule and a miss."""
    outcome = BatchOutcome()
    spans, start = [], 0
    for count in num_draft_tokens:
        spans.append((start, start + int(count)))
        start += int(count)
    if not any(rule.active and end > begin for rule, (begin, end) in zip(rules, spans, strict=True)):
        return outcome
    draft = draft_token_ids.to(torch.int64)
    num_tokens = draft.shape[0]
    missed = draft != target_logits[:num_tokens].argmax(-1)
    host = torch.cat([draft, missed.long()]).tolist()  # the batch's one sync: tokens and misses
    draft_host, missed_host = host[:num_tokens], host[num_tokens:]
    for rule, (begin, end) in zip(rules, spans, strict=True):
        if not rule.active or end == begin:
            continue
        mismatch = any(missed_host[begin:end])
        tokens, logits = draft[begin:end], target_logits[begin:end]
        if rule.shadow and rule.record is not None:
            leaving = shadow_divergences(tokens, logits, rule, records.diverged(rule.record), mismatch)
            records.add_divergences(rule.record, leaving, rule.start)
        if rule.rule is None:
            continue
        outcome.fly_requests += 1
        judgement = judge(tokens, logits, rule.rule, rule.context) if mismatch else Judgement()
        outcome.loose_positions.extend(begin + j for j in judgement.loose)
        outcome.candidates += judgement.candidates
        outcome.vetoed += bool(judgement.vetoes)
        if rule.context is not None and rule.context.breaker is not None:
            rule.context.breaker.stats.num_loose_accepts += len(judgement.loose)
        if rule.record is not None:
            records.add_judgement(rule.record, judgement, rule.start, draft_host[begin:end])
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
