"""What the rules that compare the draft model's distribution with the target's share (fsd, cascade, adasd).

Both distributions are at temperature 1: the target's is the softmax of its raw logits, the draft's is
``Draft.draft_distribution`` (the draft model's own softmax at each draft position, kept by a draft model drafter
when such a rule runs: ``drafters/registry.make_drafter``). N-gram drafts have no distribution; the config refuses
the pair (``SpeculationConfig``), and :func:`draft_distribution` says so if a caller built one by hand.
"""

from __future__ import annotations

import torch

from flyspec.config import ConfigError
from flyspec.sampling.acceptance import fit_vocabulary
from flyspec.types import Draft


def draft_distribution(draft: Draft, rule: str, vocab_size: int) -> torch.Tensor:
    """``[k, vocab_size]``: the draft model's distribution in the target's width, or a :class:`ConfigError` naming
    what is missing."""
    if draft.draft_distribution is None and draft.num_tokens == 0:  # an empty draft: nothing to compare
        return torch.zeros(0, vocab_size, device=draft.tokens.device)
    if draft.draft_distribution is None:
        raise ConfigError(
            f"verifier {rule!r} compares the draft model's distribution with the target's, and this draft has none "
            "(n-gram drafts, or a drafter not asked to keep it): use --drafter draft-model, multilevel or layer-skip"
        )
    return fit_vocabulary(draft.draft_distribution, vocab_size)


def no_plugin_candidates(rule: str) -> ConfigError:
    """Why a distribution rule has no ``candidates`` of target logits alone (what the vLLM plugin calls)."""
    return ConfigError(
        f"verifier {rule!r} needs the draft model's distribution, which the vLLM plugin does not see: run it on "
        "flyspec's own engine, or choose a rule of the target's logits alone (fly, margin, typical, bild, lenience)"
    )


def target_distribution(target_logits: torch.Tensor) -> torch.Tensor:
    """``[n, vocab]`` logits → their softmax at temperature 1, in float32."""
    return torch.softmax(target_logits.float(), dim=-1)


def total_variation(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``[n]``: ``½ Σ |p − q|``, in [0, 1]."""
    return 0.5 * (target_probs - draft_probs).abs().sum(-1)


def _kl(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``[n]``: ``Σ left · log(left / right)`` (nats; 0 log 0 = 0; +inf where right is 0 and left is not)."""
    terms = left * (left.clamp_min(1e-45).log() - right.clamp_min(1e-45).log())
    return torch.where(left > 0, terms, torch.zeros_like(terms)).sum(-1)


def divergence(target_probs: torch.Tensor, draft_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """``[n]``: ``js`` (Jensen-Shannon, nats, in [0, ln 2]), ``kl`` (KL(draft || target)) or ``tv``."""
    if kind == "tv":
        return total_variation(target_probs, draft_probs)
    if kind == "kl":
        return _kl(draft_probs, target_probs)
    middle = 0.5 * (target_probs + draft_probs)
    return 0.5 * _kl(target_probs, middle) + 0.5 * _kl(draft_probs, middle)
