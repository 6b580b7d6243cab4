"""vLLM 0.33+'s own FLy (``speculative_config: rejection_sample_method "fly"``) with flyspec's trust guards and
circuit breaker on top: vetoes, never extra loose accepts.

vLLM's V1 rejection sampler runs FLy as a pre-pass of two Triton kernels, module globals of
``vllm.v1.sample.rejection_sampler`` launched as ``kernel[grid](...)``: ``apply_fly_greedy_acceptance_kernel``
writes the draft token over the target's argmax where it defers a rejection, ``apply_fly_random_acceptance_kernel``
sets that position's uniform number to 0 (read from 0.33's source; ``tests/vllm_fly_reference.py`` is a torch
copy of both). :class:`GuardedKernel` stands in for each: it launches the real kernel, finds the positions the
kernel changed (vLLM's loose accepts), asks flyspec's guards (``guard_loose_mask``, the circuit breaker through
the request's context) about each request's, and puts the original value back at every position they veto,
so vLLM's unchanged rejection kernel then rejects there. Everything stays on the device but the per-request
guard decisions, which read the request's tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from flyspec_vllm._flyspec import Draft, guard_loose_mask, num_leading_true
from flyspec_vllm.rule import RequestRule

GREEDY_KERNEL = "apply_fly_greedy_acceptance_kernel"
RANDOM_KERNEL = "apply_fly_random_acceptance_kernel"
KERNELS = (GREEDY_KERNEL, RANDOM_KERNEL)


class GuardedKernel:
    """``kernel[grid](*args)`` as vLLM launches it, then flyspec's vetoes (see the module docstring)."""

    def __init__(self, kernel: Any, name: str, rules: Callable[[], Sequence[RequestRule] | None]) -> None:
        self.kernel, self.name, self.rules = kernel, name, rules
        self.vetoed = 0  # native loose accepts the guards refused (a counter for the plugin's metrics)

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return functools.partial(self._launch, grid)

    def _launch(self, grid: Any, *args: Any, **kwargs: Any) -> Any:
        rules = self.rules()
        if not rules or not any(rule.guard is not None for rule in rules):
            return self.kernel[grid](*args, **kwargs)
        cu_num, draft = args[0], args[1]
        if self.name == GREEDY_KERNEL:
            # cu_num_draft_tokens, draft_token_ids, target_argmax, target_logits, fly_entropy, is_greedy, vocab, ...
            decided, logits = args[2], args[3]
            base_accept = draft.long() == decided.long()  # vLLM's greedy rule, before FLy
        else:
            # cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, uniform_probs, fly_entropy, ...
            draft_probs, target_probs, decided = args[2], args[3], args[4]
            logits = target_probs.clamp_min(1e-45).log()  # the guards compare probabilities: log-probs do
            base_accept = random_accepts(draft, draft_probs, target_probs, decided)
        before = decided.clone()
        result = self.kernel[grid](*args, **kwargs)
        changed = decided != before  # [num_tokens]: the positions vLLM's FLy kept loosely
        if bool(changed.any()):
            vetoed = veto_positions(cu_num, draft, base_accept, changed, logits, rules)
            if vetoed:
                index = torch.tensor(vetoed, dtype=torch.long, device=decided.device)
                decided[index] = before[index]
                self.vetoed += len(vetoed)
        return result


def random_accepts(
    draft_token_ids: torch.Tensor,  # [num_tokens]
    draft_probs: torch.Tensor | None,  # [num_tokens, vocab]; None: one-hot drafts (n-gram, greedy drafters)
    target_probs: torch.Tensor,  # [num_tokens, vocab]
    uniform: torch.Tensor,  # [num_tokens]
) -> torch.Tensor:
    """``[num_tokens]`` bool: vLLM's native random acceptance ``q > 0 and p / q >= u`` (before FLy)."""
    tokens = draft_token_ids.long().clamp(0, target_probs.shape[-1] - 1).unsqueeze(-1)
    target = target_probs.gather(-1, tokens).squeeze(-1).double()
    draft = torch.ones_like(target) if draft_probs is None else draft_probs.gather(-1, tokens).squeeze(-1).double()
    return (draft > 0) & (target / draft.clamp_min(1e-300) >= uniform.double())


def veto_positions(
    cu_num_draft_tokens: torch.Tensor,  # [batch] cumulative draft counts
    draft_token_ids: torch.Tensor,  # [num_tokens]
    base_accept: torch.Tensor,  # [num_tokens] bool: the native rule accepts, before FLy
    loose: torch.Tensor,  # [num_tokens] bool: what vLLM's FLy kept
    target_logits: torch.Tensor,  # [num_tokens, vocab] (log-probabilities do as well)
    rules: Sequence[RequestRule],
) -> list[int]:
    """Flat positions of ``loose`` that flyspec's guards (each request's ``guard``, context and breaker) refuse."""
    ends = cu_num_draft_tokens.tolist()
    draft_cpu, loose_cpu = draft_token_ids.to("cpu", torch.int64), loose.cpu()
    base_cpu = base_accept.cpu()
    vetoed: list[int] = []
    start = 0
    for end, rule in zip(ends, rules, strict=True):
        end = int(end)
        request_loose = loose_cpu[start:end]
        if rule.guard is not None and bool(request_loose.any()):
            base, draft = base_cpu[start:end], draft_cpu[start:end]
            rows = target_logits[start:end].cpu()
            kept, _ = guard_loose_mask(base, request_loose, Draft(draft), rows, rule.guard, rule.context)
            accepted = num_leading_true(base | kept)
            refused = request_loose & ~kept
            vetoed += [start + int(j) for j in torch.nonzero(refused).flatten().tolist()]
            if rule.context is not None and rule.context.breaker is not None:
                rule.context.breaker.stats.num_loose_accepts += int(kept[:accepted].sum())
        start = end
    return vetoed


def install(sampler_module: Any, rules: Callable[[], Sequence[RequestRule] | None]) -> list[GuardedKernel]:
    """Put a :class:`GuardedKernel` in place of each native FLy kernel of ``sampler_module`` (idempotent)."""
    guarded = []
    for name in KERNELS:
        kernel = getattr(sampler_module, name)
        if not isinstance(kernel, GuardedKernel):
            kernel = GuardedKernel(kernel, name, rules)
            setattr(sampler_module, name, kernel)
        guarded.append(kernel)
    return guarded
