"""Acceptance math shared by verifiers and by drafters that check a proposal (stack levels).

Pure tensor-in/tensor-out functions; terms as in the glossary of ``verifiers/base.py``. A draft
model checking its proposer's tokens applies the same rules as a verifier checking a draft, so
these live below both: drafters never import verifiers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flyspec.config import SamplingConfig
from flyspec.sampling.coupled import RESIDUAL, Draws, choose_tokens
from flyspec.types import Draft


def num_leading_true(mask: torch.Tensor) -> int:
    """Length of the all-True prefix of a 1-D bool mask."""
    if mask.numel() == 0:
        return 0
    return int(mask.to(torch.int64).cumprod(0).sum())


# Devices where where_needed finds the needed rows first (a host sync: free on a CPU, a stall on a GPU).
SELECT_ROWS_ON = frozenset({"cpu"})


def where_needed(
    needed: torch.Tensor,  # [k] bool
    logits: torch.Tensor,  # [k (+1), vocab]
    measure: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],  # (logits [rows, vocab], positions [rows]) -> [rows]
    fill: float | int | bool,
) -> torch.Tensor:
    """``[k]``: ``measure`` of the logits' rows where ``needed`` holds, ``fill`` elsewhere (its type
    sets the result's: float32, int64 or bool).

    A lossy rule needs its measure only at a few positions (the mismatches it might keep). On a CPU
    only those rows are computed: a pass over every row's vocabulary costs more than finding them.
    Elsewhere every row is (finding them would wait on the device)."""
    k = needed.shape[0]
    out = torch.full((k,), fill, device=logits.device)
    if logits.device.type not in SELECT_ROWS_ON:
        return torch.where(needed, measure(logits[:k], torch.arange(k, device=logits.device)).to(out.dtype), out)
    positions = needed.nonzero().squeeze(-1)
    if positions.numel():
        out[positions] = measure(logits[positions], positions).to(out.dtype)
    return out


def exact_match(
    draft_tokens: torch.Tensor,  # [k]
    target_logits: torch.Tensor,  # [k + 1, vocab]
    sampling: SamplingConfig,
    draws: Draws | None,
    prefix_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([k] bool, [k + 1])``: exact match on the target's own choices (argmax greedy, coupled sample at T > 0),
    and the choices.

    ``prefix_only`` (a lossless rule: nothing after the first mismatch decides anything): on a CPU at T > 0
    (:data:`SELECT_ROWS_ON`, where a row's host sync is free) the samples are drawn row by row only through the
    first mismatch, since each costs a vocabulary of noise; the mask is False and the choices ``-1`` after it."""
    lazy = prefix_only and not sampling.greedy and target_logits.device.type in SELECT_ROWS_ON
    if not lazy:
        target_tokens = choose_tokens(target_logits, sampling, draws)  # [k + 1]
        return exact_accept_mask(draft_tokens, target_tokens), target_tokens
    assert draws is not None, "sampling draws"
    k = draft_tokens.shape[0]
    drafted = draft_tokens.tolist()
    choices: list[int] = []
    for row in range(k + 1):
        choices.append(int(draws.at(draws.position + row).choose(target_logits[row : row + 1], sampling)[0]))
        if row == k or choices[row] != drafted[row]:
            break
    matched = len(choices) - 1  # rows before the last choice matched
    accept = torch.arange(k, device=target_logits.device) < matched
    target_tokens = torch.full((k + 1,), -1, dtype=torch.long, device=target_logits.device)
    target_tokens[: len(choices)] = torch.tensor(choices, dtype=torch.long, device=target_logits.device)
    return accept, target_tokens


def exact_accept_mask(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """``[k]`` bool: draft token equals the target's choice at its position (``target_tokens``: ``[k+1]``)."""
    return draft_tokens == target_tokens[: draft_tokens.shape[0]]


def rejection_accept_mask(
    draft_tokens: torch.Tensor,  # [k]
    draft_probs: torch.Tensor,  # [k, vocab]
    target_probs: torch.Tensor,  # [k (+1), vocab]
    uniforms: torch.Tensor,  # [k] in [0, 1)
) -> torch.Tensor:
    """``[k]`` bool: ``u_i < target_probs[i, d_i] / draft_probs[i, d_i]``."""
    k = draft_tokens.shape[0]
    index = draft_tokens.unsqueeze(-1)
    target_p = target_probs[:k].gather(-1, index).squeeze(-1)
    draft_p = draft_probs.gather(-1, index).squeeze(-1)
    # A drawn token has draft_p > 0; the clamp only guards against a drafter that lies about it.
    return uniforms * draft_p.clamp_min(1e-20) < target_p


def residual_probs(target_row: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
    """``normalize(max(0, target - draft))`` (``[vocab]``); the target row when they are equal."""
    residual = (target_row - draft_row).clamp_min(0)
    total = residual.sum()
    return torch.where(total > 0, residual / total, target_row)  # no host sync to test ``total``


def rejection_next_token(
    position: int,
    target_probs: torch.Tensor,  # [k + 1, vocab]
    draft_probs: torch.Tensor,  # [k, vocab]
    draws: Draws,
) -> int:
    """Recovered token at a rejected ``position < k`` (residual), bonus token at ``position == k``.

    Both are drawn from the residual stream, not the token noise: the draft token at a rejected position was
    drawn with that position's token noise (the residual must not depend on it), and one drafted past the verified
    draft may have been drawn at the bonus's. Each position's residual draw is used once: when it is committed."""
    if position == draft_probs.shape[0]:
        return draws.sample(target_probs[position], position, RESIDUAL)
    return draws.sample(residual_probs(target_probs[position], draft_probs[position]), position, RESIDUAL)


def draft_probs_or_one_hot(draft: Draft, vocab_size: int) -> torch.Tensor:
    """``[k, vocab_size]`` draft probabilities; deterministic drafts are one-hot.

    A draft model may have a padded vocabulary of another size than the target's (same
    tokenizer): columns are cut or zero-padded to the target's size.
    """
    if draft.draft_probs is None:  # scatter, not one_hot: one_hot checks the ids' range, a host sync
        one_hot = torch.zeros(draft.num_tokens, vocab_size, device=draft.tokens.device)
        return one_hot.scatter_(1, draft.tokens.long().unsqueeze(-1), 1.0)
    return fit_vocabulary(draft.draft_probs, vocab_size)


def fit_vocabulary(probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[k, vocab_size]`` float32: a draft model's rows cut or zero-padded to the target's width (same tokenizer,
    another padding of the vocabulary)."""
    probs = probs.float()
    if probs.shape[-1] > vocab_size:
        return probs[:, :vocab_size]
    if probs.shape[-1] < vocab_size:
        return torch.nn.functional.pad(probs, (0, vocab_size - probs.shape[-1]))
    return probs
