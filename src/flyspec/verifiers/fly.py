"""FLy: training-free loosely speculative decoding (arXiv 2511.22972; code: AMD-AGI/FLy).

FLy wraps a strict base rule and additionally keeps ("loosely accepts") a mismatching draft
token ``d_j`` when both hold:

1. **Entropy gate** — the target was genuinely uncertain at ``j``: its top-k entropy
   ``H_j = -sum_{t in top-k} p_t log p_t`` is ``>= entropy_threshold``. As in the reference code,
   ``p`` is the softmax of the target's *raw* logits over the full vocabulary (no temperature),
   the top-k (k=3) probabilities are **not** renormalised, and the log is natural.
2. **Deferred window** of size ``W = window_size`` — the target does not "correct course" after
   ``j``: the next ``W - 1`` draft tokens ``d_{j+1} .. d_{j+W-1}`` are all accepted by the *base*
   rule (a loosely accepted token does not count as a match for another's window). The mismatch
   must also be judgeable: following the reference code (``generate_chunks``), the last ``W``
   draft positions are never loosely accepted, i.e. loose acceptance needs ``j <= k - W - 1``.
   (The paper's text allows one more position; we follow the code.) Mismatches that cannot be
   judged are treated strictly. Two mismatches closer than ``W`` therefore reject the first.
3. **Draft probability floor** (``min_draft_prob``, default 0: off) — the target gives the draft
   token at least this probability (softmax of the raw logits over the full vocabulary). The FLy
   pull request on vLLM (#53987) keeps only draft tokens of non-zero target probability; a floor
   above zero is a calibration's knob (``flyspec calibrate``): a 135M target is "uncertain" nearly
   everywhere, and the floor keeps only the alternatives it gave real weight to.

**vLLM 0.33's native FLy** (``variant="vllm"``, read from ``vllm/v1/spec_decode/fly.py``; a torch
reference of its kernels is in ``tests/vllm_fly_reference.py``): the same judgeable positions
(``j <= k - W - 1``), but the window asks the ``W`` draft tokens after a mismatch to match (one more than
the reference code's ``W - 1``), the draft token must have a non-zero probability under the distribution
the target samples from (greedy: a finite logit), and at T > 0 the entropy is of that distribution
(temperature-scaled and filtered) rather than of the raw logits. Its entropy is computed as vLLM's V1 sampler
computes it (softmax, then the log of the top-k probabilities), so that a threshold equal to an entropy value
decides as vLLM does; vLLM's V2 kernel takes it from the logits instead (``top - logsumexp``), which the vLLM
plugin passes in (``fly_candidates(entropy=...)``). Checked against vLLM 0.33's unmodified kernels under Triton's
interpreter (``tests/vllm033``). A flyspec setting with window ``W`` keeps
everything vLLM's at the same ``fly_window_size`` keeps, and more.

Ablations are values: ``window_size=0`` drops the window (every gated mismatch is kept,
anywhere), ``entropy_threshold=0`` drops the gate. The committed tokens are the draft up to the
first position that is neither accepted nor loosely accepted, plus the base rule's recovered (or
bonus) token there.

Base rule by temperature: greedy → exact match on the target's argmax. At T > 0 (``temperature_rule``):
``"coupled"`` (the default) → exact match on the target's coupled sample (``sampling/coupled.py``): the gate and
the window judge the draft against the tokens plain sampling commits for the same seed, as greedy FLy judges it
against plain greedy decoding's, and a recovered token is that sample; ``"rejection"`` → speculative rejection
sampling of a sampled draft (gate and window apply to its rejections; recovered tokens from the residual), which is
the coupled rule for deterministic drafts; ``"two-sample"`` → the reference code's rule: two samples from the target
per position (the coupled one and one of an independent stream), a draft token matches if it equals either, the
recovered token is the first sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flyspec.config import FlyConfig, SamplingConfig
from flyspec.sampling.acceptance import where_needed
from flyspec.sampling.coupled import SECOND, Draws, choose_tokens
from flyspec.sampling.sampler import logits_to_probs
from flyspec.types import Draft
from flyspec.verifiers.base import GREEDY, LooseRule, NextToken, rejection_rule, strict_base_rule


def topk_entropy(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[n, vocab]`` → ``[n]``: entropy (nats) of the top-k full-vocabulary probabilities, not renormalised."""
    top_log_probs = torch.topk(torch.log_softmax(logits.float(), dim=-1), top_k, dim=-1).values
    return -(top_log_probs.exp() * top_log_probs).sum(-1)


def topk_entropy_of_probs(probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[n, vocab]`` probabilities → ``[n]``: entropy (nats) of the top-k, not renormalised (0 log 0 = 0)."""
    top = torch.topk(probs.float(), top_k, dim=-1).values
    return -torch.where(top > 0, top * top.clamp_min(1e-45).log(), torch.zeros_like(top)).sum(-1)


def deferred_window_mask(base_accept: torch.Tensor, window_size: int, following: int | None = None) -> torch.Tensor:
    """``[k]`` bool: mismatches whose deferred window is clean and judgeable (see module docstring).

    Mismatch ``j`` qualifies when ``j <= k - W - 1`` and ``d_{j+1} .. d_{j+F}`` contain no mismatch, with
    ``F = following``: ``W - 1`` by default (the reference code's), ``W`` for vLLM 0.33's native rule. Counted
    with a running sum so the whole mask is a handful of tensor ops.
    """
    mismatch = ~base_accept
    if window_size == 0:
        return mismatch
    following = window_size - 1 if following is None else following
    k = base_accept.shape[-1]
    judgeable = max(0, k - window_size)  # positions 0 .. k - W - 1
    eligible = torch.zeros_like(base_accept)
    if judgeable:
        mismatches_so_far = mismatch.to(torch.int64).cumsum(-1)  # [k]
        # mismatches among d_{j+1} .. d_{j+F} = count up to j + F minus count up to j
        in_window = mismatches_so_far[following : following + judgeable] - mismatches_so_far[:judgeable]
        eligible[:judgeable] = mismatch[:judgeable] & (in_window == 0)
    return eligible


def fly_loose_mask(
    base_accept: torch.Tensor,  # [k] bool
    entropy: torch.Tensor,  # [k]
    window_size: int,
    entropy_threshold: float,
) -> torch.Tensor:
    """``[k]`` bool: positions FLy keeps although the base rule rejects them."""
    return deferred_window_mask(base_accept, window_size) & (entropy >= entropy_threshold)


Measure = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits [rows, vocab], positions [rows]) -> [rows]


def _entropy_measure(config: FlyConfig, sampling: SamplingConfig) -> Measure:
    """The top-k entropy of logits rows as the rule reads it. The vllm variant computes it as vLLM's V1 rejection
    sampler does (``compute_fly_entropy``: the softmax, in float32, of the processed logits, then the log of its
    top-k), so that a threshold equal to an entropy value decides as vLLM decides (``log_softmax`` differs from it
    in the last bits)."""
    if config.variant != "vllm":
        return lambda rows, _: topk_entropy(rows, config.entropy_top_k)
    if sampling.greedy:
        return lambda rows, _: topk_entropy_of_probs(torch.softmax(rows.float(), dim=-1), config.entropy_top_k)
    # vLLM: of the temperature-scaled, filtered distribution
    return lambda rows, _: topk_entropy_of_probs(logits_to_probs(rows, sampling), config.entropy_top_k)


def fly_candidates(
    base_accept: torch.Tensor,  # [k] bool, the strict base rule's acceptance
    target_logits: torch.Tensor,  # [k (+1), vocab]
    config: FlyConfig,
    draft_tokens: torch.Tensor | None = None,  # [k]; needed with config.min_draft_prob and the vllm variant
    sampling: SamplingConfig = GREEDY,  # the vllm variant's entropy and non-zero test are of the sampled distribution
    entropy: torch.Tensor | None = None,  # [k]: the entropy as the engine computed it (default: computed here)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([k] bool, [k])``: the mismatches FLy would keep (before the trust guards), and the entropy
    at the mismatches whose deferred window holds (NaN at the other positions).

    The one implementation of the FLy rule: :class:`FlyVerifier` and the vLLM plugin
    (``integrations/vllm``) both call it, so the two cannot drift.
    """
    native = config.variant == "vllm"
    window = deferred_window_mask(base_accept, config.window_size, config.window_size if native else None)  # [k]
    # the entropy only where the window holds (NaN elsewhere: not needed, and never >= a threshold)
    if entropy is not None:  # the engine's own values (vLLM's V2 kernel takes them from the logits)
        entropy = torch.where(window, entropy[: window.shape[0]].float(), float("nan"))
    else:
        entropy = where_needed(window, target_logits, _entropy_measure(config, sampling), float("nan"))
    candidates = window & (entropy >= config.entropy_threshold)
    if native:  # vLLM keeps only a draft token the target could have sampled (its logit > -inf, p > 0)
        if draft_tokens is None:
            raise ValueError("fly_candidates needs the draft tokens for the vllm variant")
        tokens = draft_tokens

        def possible(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            chosen = tokens[positions].unsqueeze(-1)
            if sampling.greedy:
                return rows.float().gather(-1, chosen).squeeze(-1) > float("-inf")
            return logits_to_probs(rows, sampling).gather(-1, chosen).squeeze(-1) > 0

        candidates &= where_needed(candidates, target_logits, possible, False)
    if config.min_draft_prob > 0:
        if draft_tokens is None:
            raise ValueError("fly_candidates needs the draft tokens to apply min_draft_prob")
        tokens, log_floor = draft_tokens, math.log(config.min_draft_prob)

        def above_floor(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            log_probs = torch.log_softmax(rows.float(), dim=-1)  # [rows, vocab]
            return log_probs.gather(-1, tokens[positions].unsqueeze(-1)).squeeze(-1) >= log_floor

        candidates &= where_needed(candidates, target_logits, above_floor, False)
    return candidates, entropy


@dataclass(frozen=True)
class FlyVerifier(LooseRule):
    config: FlyConfig = field(default_factory=FlyConfig)
    name: str = "fly"

    @property
    def min_draft_tokens(self) -> int:
        """A draft of ``W`` tokens leaves no position with a judgeable window: FLy needs ``W + 1``."""
        return self.config.window_size + 1

    def strict(
        self, draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig, draws: Draws | None
    ) -> tuple[torch.Tensor, NextToken]:
        rule = self.config.temperature_rule
        if sampling.greedy or rule == "coupled":
            return strict_base_rule(draft, target_logits, sampling, draws)
        if rule == "rejection":
            return rejection_rule(draft, target_logits, sampling, draws)
        # the reference code's two-sample rule: the coupled sample and a second one of its own stream
        assert draws is not None, "sampling draws"
        first = choose_tokens(target_logits, sampling, draws)  # [k + 1]
        second = draws.choose(target_logits, sampling, SECOND)  # [k + 1]
        base_accept = (first[: draft.num_tokens] == draft.tokens) | (second[: draft.num_tokens] == draft.tokens)
        return base_accept, first  # [k + 1]: the recovered token is the first sample

    def candidates(
        self,
        base_accept: torch.Tensor,
        draft_tokens: torch.Tensor,
        target_logits: torch.Tensor,
        sampling: SamplingConfig = GREEDY,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``([k] bool, [k])``: the mismatches this rule would keep before the guards, and its evidence (the
        entropy). What the vLLM plugin applies to a request (``integrations/vllm``: the same code)."""
        return fly_candidates(base_accept, target_logits, self.config, draft_tokens, sampling)
