"""A torch reference of vLLM 0.33's native FLy decisions, written from its source (``vllm/v1/spec_decode/fly.py``:
``compute_fly_entropy``, ``apply_fly_greedy_acceptance_kernel``, ``apply_fly_random_acceptance_kernel``; called by
``vllm/v1/sample/rejection_sampler.py``), one loop per kernel, position by position as the Triton programs run.

It shares no code with flyspec's rule (``flyspec.verifiers.fly``, ``variant="vllm"``), which it checks
(``tests/test_vllm_fly_native.py``). vLLM's V1 model runner runs these kernels as a pre-pass that rewrites the
inputs of its unchanged rejection kernels: the greedy one replaces the target's argmax by the draft token where
FLy defers a rejection, the random one sets that position's uniform number to 0.
"""

from __future__ import annotations

import torch


def fly_entropy(target_probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """``compute_fly_entropy(probs, top_k)``: -Σ p log p over the top-k full-vocabulary probabilities."""
    top = torch.topk(target_probs.float(), k=min(top_k, target_probs.shape[-1]), dim=-1).values
    return -torch.where(top > 0, top * top.log(), torch.zeros_like(top)).sum(-1)


def greedy_argmax(
    draft: list[int], target_logits: torch.Tensor, window: int, threshold: float, top_k: int
) -> list[int]:
    """The target argmax the native greedy kernel sees after FLy's pre-pass (one request, ``[n, vocab]`` logits)."""
    vocab = target_logits.shape[-1]
    entropy = fly_entropy(target_logits.float().softmax(-1), top_k)
    argmax = [int(token) for token in target_logits.argmax(-1)]
    rewritten = list(argmax)
    n = len(draft)
    for pos in range(n):
        draft_id, target_id = draft[pos], argmax[pos]
        can_defer = (
            draft_id != target_id and 0 <= draft_id < vocab and pos + window < n and float(entropy[pos]) >= threshold
        )
        if can_defer:
            can_defer = float(target_logits[pos, draft_id]) > float("-inf")
        for offset in range(1, window + 1):
            in_bounds = pos + offset < n
            future_draft = draft[pos + offset] if in_bounds else -1
            future_target = argmax[pos + offset] if in_bounds else -2  # read before any later store
            can_defer = can_defer and future_draft == future_target
        if can_defer:
            rewritten[pos] = draft_id
    return rewritten


def greedy_commit(draft: list[int], target_argmax: list[int], bonus: int) -> list[int]:
    """vLLM's greedy rejection kernel: the matching prefix, then the argmax at the first mismatch, or the bonus."""
    for pos, token in enumerate(draft):
        if token != target_argmax[pos]:
            return [*draft[:pos], target_argmax[pos]]
    return [*draft, bonus]


def random_uniform(
    draft: list[int],
    draft_probs: torch.Tensor | None,  # [n, vocab], None: one-hot drafts (n-gram)
    target_probs: torch.Tensor,  # [n, vocab], the processed (temperature, top-k/top-p) distribution
    uniform: list[float],
    window: int,
    threshold: float,
    top_k: int,
) -> list[float]:
    """The uniform numbers the native random kernel sees after FLy's pre-pass: 0 where FLy defers a rejection."""
    vocab = target_probs.shape[-1]
    entropy = fly_entropy(target_probs, top_k)
    n = len(draft)

    def probabilities(pos: int) -> tuple[bool, float, float]:
        token = draft[pos]
        valid = 0 <= token < vocab
        draft_prob = 1.0 if draft_probs is None else (float(draft_probs[pos, token]) if valid else 0.0)
        return valid, draft_prob, float(target_probs[pos, token]) if valid else 0.0

    def native(pos: int, u: float) -> bool:
        valid, draft_prob, target_prob = probabilities(pos)
        return valid and draft_prob > 0 and target_prob / draft_prob >= u

    rewritten = list(uniform)
    for pos in range(n):
        valid, draft_prob, target_prob = probabilities(pos)
        can_defer = (
            not native(pos, uniform[pos]) and valid and draft_prob > 0 and target_prob > 0
            and pos + window < n and float(entropy[pos]) >= threshold
        )  # fmt: skip
        for offset in range(1, window + 1):
            in_bounds = pos + offset < n
            can_defer = can_defer and in_bounds and native(pos + offset, uniform[pos + offset])
        if can_defer:
            rewritten[pos] = 0.0
    return rewritten


def random_accepts(
    draft: list[int], draft_probs: torch.Tensor | None, target_probs: torch.Tensor, uniform: list[float]
) -> list[bool]:
    """The native random kernel's per-position acceptance (``p / q >= u``)."""
    vocab = target_probs.shape[-1]
    accepts = []
    for pos, token in enumerate(draft):
        valid = 0 <= token < vocab
        draft_prob = 1.0 if draft_probs is None else (float(draft_probs[pos, token]) if valid else 0.0)
        target_prob = float(target_probs[pos, token]) if valid else 0.0
        accepts.append(valid and draft_prob > 0 and target_prob / draft_prob >= uniform[pos])
    return accepts
