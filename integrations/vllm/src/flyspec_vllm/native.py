"""vLLM 0.33+'s own FLy (``speculative_config: rejection_sample_method "fly"``) with flyspec's trust guards and
circuit breaker on top: vetoes, never extra loose accepts.

On the **V1 model runner** vLLM runs FLy as a pre-pass of two Triton kernels, module globals of
``vllm.v1.sample.rejection_sampler`` launched as ``kernel[grid](...)``: ``apply_fly_greedy_acceptance_kernel``
writes the draft token over the target's argmax where it defers a rejection, ``apply_fly_random_acceptance_kernel``
sets that position's uniform number to 0. :class:`GuardedKernel` stands in for each: it launches the real kernel,
finds the positions the kernel changed (vLLM's loose accepts), asks flyspec's guards (:func:`guarded`) about each
request's, and puts the original value back at every position they veto, so vLLM's unchanged rejection kernel then
rejects there. (On the V2 runner FLy is inside the rejection kernel: ``v2.py``.)

Everything stays on the device: one host sync per batch (where vLLM's FLy kept something), then two per request with
a loose accept (the guards', and what they kept); no row of logits leaves the device (``tests/test_syncs.py``). A
request whose rule is ``exact`` (its options refused) keeps none of them. A fault while judging undoes every loose
accept of the launch (``failsafe.py``): the step is verified exactly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from flyspec_vllm import failsafe, metrics
from flyspec_vllm._flyspec import Draft, guard_loose_mask
from flyspec_vllm.rule import RequestRule

GREEDY_KERNEL = "apply_fly_greedy_acceptance_kernel"
RANDOM_KERNEL = "apply_fly_random_acceptance_kernel"
KERNELS = (GREEDY_KERNEL, RANDOM_KERNEL)


class GuardedKernel:
    """``kernel[grid](*args)`` as vLLM launches it, then flyspec's vetoes (see the module docstring)."""

    def __init__(self, kernel: Any, name: str, rules: Callable[[], Sequence[RequestRule] | None]) -> None:
        self.kernel, self.name, self.rules = kernel, name, rules

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return functools.partial(self._launch, grid)

    def _launch(self, grid: Any, *args: Any, **kwargs: Any) -> Any:
        rules = self.rules()
        if rules is None:  # outside a runner step (vLLM's warm-up, a direct call): vLLM's own FLy, untouched
            return self.kernel[grid](*args, **kwargs)
        if not rules:  # the step hook published no rules (it failed, or loose acceptance is off): no FLy, exact
            return None
        decided_at = DECIDED_ARGUMENT[self.name]
        decided = args[decided_at]  # what vLLM's rejection kernel reads next: the argmax, or the uniform numbers
        try:
            proposal = decided.clone()  # vLLM's kernel writes its loose accepts here; ``decided`` changes only below
            launched = (*args[:decided_at], proposal, *args[decided_at + 1 :])
            base_accept = self._base_accept(args)
        except Exception as error:  # noqa: BLE001 - fail closed: vLLM's FLy is not launched, the step is exact
            failsafe.fault(f"the guards on vLLM's FLy ({self.name})", error, lambda: [rule.req_id for rule in rules])
            return None
        result = self.kernel[grid](*launched, **kwargs)
        try:
            changed = proposal != decided  # [num_tokens]: the positions vLLM's FLy kept loosely
            # the target's scores at args[3]: logits (greedy kernel) or probabilities (random: their log, per request)
            refused = veto_mask(args[0], args[1], base_accept, changed, args[3], rules, self.name == RANDOM_KERNEL)
            kept = proposal if refused is None else torch.where(refused, decided, proposal)
            decided.copy_(kept)  # the only write to vLLM's tensor: the loose accepts the guards keep
        except Exception as error:  # noqa: BLE001 - fail closed: the step keeps none of vLLM's loose accepts
            failsafe.fault(f"the guards on vLLM's FLy ({self.name})", error, lambda: [rule.req_id for rule in rules])
        return result

    def _base_accept(self, args: tuple[Any, ...]) -> torch.Tensor:
        """``[num_tokens]`` bool: what vLLM's rule accepts before FLy."""
        if self.name == GREEDY_KERNEL:
            # cu_num_draft_tokens, draft_token_ids, target_argmax, target_logits, fly_entropy, is_greedy, vocab, ...
            return args[1].long() == args[2].long()  # vLLM's greedy rule, before FLy
        # cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, uniform_probs, fly_entropy, ...
        return random_accepts(args[1], args[2], args[3], args[4])


DECIDED_ARGUMENT = {GREEDY_KERNEL: 2, RANDOM_KERNEL: 4}  # the argument each kernel writes: target_argmax, uniform_probs


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


def guarded(
    base_accept: torch.Tensor,  # [k] bool: the native rule accepts, before FLy
    loose: torch.Tensor,  # [k] bool: what vLLM's FLy keeps
    draft_tokens: torch.Tensor,  # [k]
    target_logits: torch.Tensor,  # [k, vocab] (log-probabilities do as well)
    rule: RequestRule,
) -> tuple[torch.Tensor, list[bool]]:
    """One request: which of vLLM's loose accepts its guards keep, on the device and on the host (none where the
    rule is ``exact`` or has no guards); its circuit breaker counts the kept ones in the committed prefix. Two host
    syncs (the guards', and what they kept)."""
    if rule.exact or rule.guard is None:
        return torch.zeros_like(loose), [False] * loose.shape[0]
    kept, _ = guard_loose_mask(base_accept, loose, Draft(draft_tokens.long()), target_logits, rule.guard, rule.context)
    kept_host, base_host = torch.stack([kept, base_accept]).tolist()  # sync: what the guards kept
    if rule.context is not None and rule.context.breaker is not None:
        accepted = next((j for j in range(len(kept_host)) if not (base_host[j] or kept_host[j])), len(kept_host))
        rule.context.breaker.stats.num_loose_accepts += sum(kept_host[:accepted])
    return kept, [bool(keep) for keep in kept_host]


def veto_mask(
    cu_num_draft_tokens: torch.Tensor,  # [batch] cumulative draft counts
    draft_token_ids: torch.Tensor,  # [num_tokens]
    base_accept: torch.Tensor,  # [num_tokens] bool: the native rule accepts, before FLy
    loose: torch.Tensor,  # [num_tokens] bool: what vLLM's FLy kept
    target: torch.Tensor,  # [num_tokens, vocab]: logits, or probabilities (``probabilities``)
    rules: Sequence[RequestRule],
    probabilities: bool = False,
) -> torch.Tensor | None:
    """``[num_tokens]`` bool on the device: the loose accepts that flyspec's guards refuse (None: vLLM kept none)."""
    batch = cu_num_draft_tokens.shape[0]
    host = torch.cat([cu_num_draft_tokens.long(), loose.long()]).tolist()  # the batch's one sync
    ends, loose_host = host[:batch], host[batch:]
    if not any(loose_host):
        return None
    kept_parts: list[torch.Tensor] = []
    native = vetoed = 0
    start = 0
    for end, rule in zip(ends, rules, strict=True):
        if any(loose_host[start:end]):
            rows = target[start:end]
            rows = rows.clamp_min(1e-45).log() if probabilities else rows
            kept, kept_host = guarded(base_accept[start:end], loose[start:end], draft_token_ids[start:end], rows, rule)
            kept_parts.append(kept)
            native += sum(loose_host[start:end])
            vetoed += sum(1 for j in range(end - start) if loose_host[start + j] and not kept_host[j])
        else:
            kept_parts.append(torch.zeros_like(loose[start:end]))
        start = end
    metrics.add(native_loose=native, native_vetoed=vetoed)
    return loose & ~torch.cat(kept_parts)


def install(sampler_module: Any, rules: Callable[[], Sequence[RequestRule] | None]) -> list[GuardedKernel]:
    """Put a :class:`GuardedKernel` in place of each native FLy kernel of ``sampler_module`` (idempotent)."""
    guarded_kernels = []
    for name in KERNELS:
        kernel = getattr(sampler_module, name)
        if not isinstance(kernel, GuardedKernel):
            kernel = GuardedKernel(kernel, name, rules)
            setattr(sampler_module, name, kernel)
        guarded_kernels.append(kernel)
    return guarded_kernels
