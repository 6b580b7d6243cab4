"""FLy over a vLLM batch: which draft tokens to keep loosely, and the kernel inputs that keep them.

vLLM verifies a whole batch at once: the draft tokens of all requests are concatenated
(``draft_token_ids [num_tokens]``, ``num_draft_tokens`` per request) and so are the target's
logits at those positions (``target_logits [num_tokens, vocab]``; the bonus row is separate).
The plugin does not replace vLLM's greedy kernel (Triton on GPU, C++ on CPU). It decides per
request, with flyspec's own FLy rule and trust guards (``fly_candidates``, ``guard_loose_mask``:
the code ``flyspec generate --verifier fly`` runs), which mismatches to keep, and rewrites the
target logits there so that their argmax is the draft token. The unchanged kernel then accepts
the kept tokens and commits the recovered or bonus token exactly as flyspec's verifier does.
This is the design of vLLM's built-in FLy (pull request #53987): rewrite the kernel's inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from flyspec_vllm._flyspec import (
    Draft,
    FlyConfig,
    GuardConfig,
    VerifyContext,
    fly_candidates,
    guard_loose_mask,
    num_leading_true,
)


@dataclass(frozen=True)
class RequestRule:
    """How to verify one request of the batch: ``fly=None`` keeps vLLM's lossless rule."""

    fly: FlyConfig | None = None
    guard: GuardConfig = field(default_factory=GuardConfig)
    context: VerifyContext | None = None  # the generation so far, for the guards that need it


@dataclass
class BatchOutcome:
    """What the rule did to one batch (the counters the plugin exports)."""

    loose_positions: list[int] = field(default_factory=list)  # flat indices into draft_token_ids
    candidates: int = 0  # mismatches FLy would keep before the guards, up to the first strict rejection
    vetoed: int = 0  # candidates a guard refused (the first refusal of each request ends its prefix)
    fly_requests: int = 0


def loose_accepts(
    draft_tokens: torch.Tensor,  # [k] int64
    target_logits: torch.Tensor,  # [k, vocab]
    rule: RequestRule,
) -> tuple[list[int], int, bool]:
    """One request: ``(loose positions, candidates, vetoed)`` under flyspec's FLy rule and guards."""
    assert rule.fly is not None
    target_tokens = target_logits.argmax(-1)  # [k]
    base_accept = draft_tokens == target_tokens  # greedy: exact match on the target's argmax
    candidates, _ = fly_candidates(base_accept, target_logits, rule.fly, draft_tokens)
    # only candidates before the first position neither rule accepts could ever be committed
    reachable = int(candidates[: num_leading_true(base_accept | candidates)].sum())
    if not reachable:
        return [], 0, False
    kept, vetoes = guard_loose_mask(
        base_accept, candidates, Draft(draft_tokens), target_logits, rule.guard, rule.context
    )
    accepted = num_leading_true(base_accept | kept)
    loose = [int(j) for j in torch.nonzero(kept[:accepted]).flatten().tolist()]
    return loose, reachable, bool(vetoes)


def fly_batch(
    draft_token_ids: torch.Tensor,  # [num_tokens], all requests' draft tokens concatenated
    num_draft_tokens: Sequence[int],  # [batch]
    target_logits: torch.Tensor,  # [num_tokens, vocab]
    rules: Sequence[RequestRule],  # [batch], in batch order
) -> BatchOutcome:
    """The loose accepts of a whole batch, as flat positions into ``draft_token_ids``."""
    outcome = BatchOutcome()
    start = 0
    draft_cpu = draft_token_ids.to("cpu", torch.int64)
    for count, rule in zip(num_draft_tokens, rules, strict=True):
        end = start + int(count)
        if rule.fly is not None and end > start:
            outcome.fly_requests += 1
            loose, candidates, vetoed = loose_accepts(draft_cpu[start:end], target_logits[start:end].cpu(), rule)
            outcome.loose_positions.extend(start + j for j in loose)
            outcome.candidates += candidates
            outcome.vetoed += int(vetoed)
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
