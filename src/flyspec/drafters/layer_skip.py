"""Layer-skip self-speculation (``layer-skip``): the target drafts for itself with some decoder layers skipped.

No second model, no training (Draft & Verify, Zhang et al. 2023; SWIFT, Xia et al. 2024). A *skip view*
(``skip_view.py``) shares every parameter tensor with the target but presents only the kept decoder layers, renumbered
``0..kept-1``, under a copied config (``num_hidden_layers``, ``layer_types`` cut to match), so the model's
own forward runs unchanged: scaled embeddings, masks and rotary embeddings per layer type, norm, head,
soft-capping. The target (config, modules, parameters, ``layer_idx``) is never touched and keeps verifying
with its own cache. Drafting is :class:`DraftModelDrafter` over the view (proposers and the confidence
stop come with it), on a cache that keeps every position (``CachedModel(full_history=True)``).

Calibration (``skip_layers=None``) runs on the first prompt the drafter sees, once per target model:

1. One full forward over up to ``LayerSkipConfig.calibration_tokens`` prompt tokens gives the reference greedy tokens
   and each layer's Block Influence, ``1 - cos(layer input, layer output)`` averaged over positions
   (ShortGPT, Men et al. 2024): layers that barely change the residual stream rank first. The first and
   last layers are never candidates.
2. Nested skip sets along that ranking are scored teacher-forced: the share of positions where the skip
   view's argmax equals the full model's estimates the per-token acceptance rate α.
3. The set with the best predicted speedup over plain decoding is kept (at least one layer is skipped):
   ``E / (k·c + 1)``, with ``E = (1 - α^(k+1)) / (1 - α)`` expected tokens per step, verification costing
   one full forward, and ``c`` a draft forward's cost relative to a full one counted in parameters (head
   + kept layers over head + all layers: decoding reads each weight once per token). Deterministic on
   purpose: a choice based on timings would change from run to run.

Sizes are scanned coarse to fine (step ``ceil(candidates / 10)``, stopping after two sizes worse than the
best, then every size next to the best): about ten short forwards for 30 layers. Prompts shorter than
``MIN_CALIBRATION_TOKENS`` are followed by a short built-in text.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from flyspec.config import (
    DEFAULT_NUM_DRAFT_TOKENS,
    DEFAULT_NUM_PROPOSAL_TOKENS,
    ConfigError,
    LayerSkipConfig,
    SamplingConfig,
)
from flyspec.drafters.base import Drafter
from flyspec.drafters.draft_model import DraftModelDrafter
from flyspec.drafters.skip_view import decoder_layers, skip_view, validate_skip_layers
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.sampling.coupled import Draws
from flyspec.types import Draft

logger = logging.getLogger(__name__)

MIN_CALIBRATION_TOKENS = 16
SCAN_PATIENCE = 2  # evaluated sizes worse than the best before the coarse scan stops
CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding lets a cheap draft propose several "
    "tokens that the full model then checks in a single forward pass.\n"
    "def mean(values):\n    return sum(values) / len(values)\n"
    "Question: What is the capital of France? Answer: The capital of France is Paris."
)


# --- calibration ----------------------------------------------------------------------------------------


def expected_tokens_per_step(acceptance: float, num_draft_tokens: int) -> float:
    """Tokens committed per step when each draft token is accepted with probability α (bonus included)."""
    if acceptance >= 1:
        return float(num_draft_tokens + 1)
    return (1 - acceptance ** (num_draft_tokens + 1)) / (1 - acceptance)


def predicted_speedup(acceptance: float, draft_cost: float, num_draft_tokens: int) -> float:
    """Tokens per full-forward time: ``k`` drafts of relative cost ``draft_cost`` plus one verification."""
    return expected_tokens_per_step(acceptance, num_draft_tokens) / (num_draft_tokens * draft_cost + 1)


def relative_draft_cost(model: PreTrainedModel, skip_layers: Sequence[int]) -> float:
    """A skip view's forward cost over a full forward's, counted in parameters (output head + kept layers)."""
    layer_sizes = [sum(p.numel() for p in layer.parameters()) for layer in decoder_layers(model)]
    head = model.get_output_embeddings()
    head_weight = getattr(head, "weight", None)  # nn.Module attributes are typed Tensor | Module
    head_size = head_weight.numel() if isinstance(head_weight, torch.Tensor) else 0
    skipped = sum(layer_sizes[index] for index in set(skip_layers))
    return 1 - skipped / (head_size + sum(layer_sizes))


def scan_num_skipped(speedup_at: Callable[[int], float], max_skipped: int) -> dict[int, float]:
    """Predicted speedups of the sizes a coarse-to-fine scan over ``1..max_skipped`` evaluates.

    Coarse: every ``step``-th size until ``SCAN_PATIENCE`` evaluated sizes are worse than the best;
    fine: every size within ``step - 1`` of the best.
    """
    step = max(1, math.ceil(max_skipped / 10))
    scores: dict[int, float] = {}
    best, worse = step, 0
    for size in range(step, max_skipped + 1, step):
        scores[size] = speedup_at(size)
        best, worse = (size, 0) if scores[size] > scores[best] else (best, worse + (size != best))
        if worse >= SCAN_PATIENCE:
            break
    for size in range(max(1, best - step + 1), min(max_skipped, best + step - 1) + 1):
        if size not in scores:
            scores[size] = speedup_at(size)
    return scores


@dataclass(frozen=True)
class Calibration:
    """The calibrated skip set and the estimates it was chosen by."""

    skip_layers: tuple[int, ...]
    estimated_acceptance: float  # teacher-forced argmax agreement with the full model
    estimated_speedup: float  # predicted tokens per full-forward time (plain decoding: 1)
    draft_cost: float  # relative to a full forward
    num_draft_tokens: int  # the k the speedup was predicted for
    num_tokens: int  # calibration positions
    num_forwards: int
    seconds: float


def calibration_ids(target: LoadedModel, prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
    """The last ``max_tokens`` prompt tokens; a short prompt is followed by ``CALIBRATION_TEXT``."""
    if len(prompt_ids) >= MIN_CALIBRATION_TOKENS:
        return list(prompt_ids[-max_tokens:])
    text_ids = target.tokenizer(CALIBRATION_TEXT, add_special_tokens=False)["input_ids"]
    return [*prompt_ids, *map(int, text_ids)][:max_tokens]


def _greedy_tokens(view: LoadedModel, input_ids: torch.Tensor) -> torch.Tensor:
    logits = view.model(input_ids=input_ids, use_cache=False).logits  # [1, n, vocab]
    return logits[0].argmax(-1)  # [n]


def _reference_and_influence(target: LoadedModel, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """The full model's greedy tokens ``[n]`` and each layer's Block Influence (one forward).

    Hooks go on the layers of a full skip view, whose hook tables are its own: the target stays untouched.
    """
    view = skip_view(target, ())
    influence: list[float] = []

    def record(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        hidden_in = args[0] if args else kwargs["hidden_states"]  # [1, n, hidden]
        hidden_out = output[0] if isinstance(output, tuple) else output  # [1, n, hidden]
        similarity = torch.cosine_similarity(hidden_in.float(), hidden_out.float(), dim=-1)  # [1, n]
        influence.append(float(1 - similarity.mean()))

    for layer in decoder_layers(view.model):
        layer.register_forward_hook(record, with_kwargs=True)
    reference = _greedy_tokens(view, input_ids)
    return reference, influence


@torch.inference_mode()
def calibrate_skip_layers(
    target: LoadedModel,
    prompt_ids: Sequence[int],
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
    config: LayerSkipConfig | None = None,
) -> Calibration:
    """Choose the skip set with the best predicted speedup on this prompt (uncached; see module doc)."""
    started = time.perf_counter()
    num_layers = len(decoder_layers(target.model))
    if num_layers < 3:
        raise ConfigError(
            f"model {target.name!r} has {num_layers} layers; calibration keeps the first and last, so it needs "
            "at least 3: give skip layers explicitly"
        )
    ids = calibration_ids(target, prompt_ids, (config or LayerSkipConfig()).calibration_tokens)
    device = next(target.model.parameters()).device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)  # [1, n]
    reference, influence = _reference_and_influence(target, input_ids)
    candidates = range(1, num_layers - 1)
    ranking = sorted(candidates, key=lambda index: (influence[index], index))
    acceptance: dict[int, float] = {}

    def speedup_at(size: int) -> float:
        skipped = ranking[:size]
        drafted = _greedy_tokens(skip_view(target, skipped), input_ids)
        acceptance[size] = float((drafted == reference).float().mean())
        return predicted_speedup(acceptance[size], relative_draft_cost(target.model, skipped), num_draft_tokens)

    scores = scan_num_skipped(speedup_at, len(ranking))
    size = max(scores, key=lambda candidate: (scores[candidate], -candidate))
    chosen = tuple(sorted(ranking[:size]))
    return Calibration(
        skip_layers=chosen,
        estimated_acceptance=acceptance[size],
        estimated_speedup=scores[size],
        draft_cost=relative_draft_cost(target.model, chosen),
        num_draft_tokens=num_draft_tokens,
        num_tokens=len(ids),
        num_forwards=1 + len(scores),
        seconds=time.perf_counter() - started,
    )


class Calibrations:
    """Calibrations by target model (weakly held: a freed model frees its entry) and draft length.

    Owned by whoever shares it (:class:`flyspec.resources.Resources`): the server builds a drafter
    per request but calibrates each model once. A drafter without one calibrates privately.
    """

    def __init__(self) -> None:
        self._by_model: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, int], Calibration]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def get(
        self, target: LoadedModel, prompt_ids: Sequence[int], num_draft_tokens: int, config: LayerSkipConfig
    ) -> tuple[Calibration, bool]:
        """(The calibration for ``num_draft_tokens``, whether it was reused); calibrates on this prompt if new."""
        key = (num_draft_tokens, config.calibration_tokens)
        with self._lock:
            per_model = self._by_model.setdefault(target.model, {})
            if key in per_model:
                return per_model[key], True
            calibration = calibrate_skip_layers(target, prompt_ids, num_draft_tokens, config)
            per_model[key] = calibration
        logger.info("layer-skip calibrated %s: %s", target.name, calibration)
        return calibration, False


# --- the drafter ----------------------------------------------------------------------------------------


class LayerSkipDrafter:
    """The target with some layers skipped drafts for itself: a :class:`DraftModelDrafter` over a skip view.

    An explicit ``config.skip_layers`` is used as given; ``None`` calibrates on the first prompt
    (through ``calibrations``, private unless shared), predicting the speedup for
    ``calibration_draft_tokens`` draft tokens (the decoder's ``num_draft_tokens``).
    """

    name = "layer-skip"

    def __init__(
        self,
        target: LoadedModel,
        config: LayerSkipConfig | None = None,
        proposer: Drafter | None = None,
        num_proposal_tokens: int = DEFAULT_NUM_PROPOSAL_TOKENS,
        confidence_threshold: float = 0.0,
        calibration_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
        calibrations: Calibrations | None = None,
    ) -> None:
        self.target = target
        self.config = config or LayerSkipConfig()
        self.proposer = proposer
        self.num_proposal_tokens = num_proposal_tokens
        self.confidence_threshold = confidence_threshold
        self.calibration_draft_tokens = calibration_draft_tokens
        self.calibrations = calibrations or Calibrations()
        self.num_layers = len(decoder_layers(target.model))
        self.calibration: Calibration | None = None
        self.calibration_reused = False
        self.skip_layers: tuple[int, ...] | None = None  # chosen at construction (given) or first reset
        self.drafter: DraftModelDrafter | None = None
        self._keep_distribution = False
        if self.config.skip_layers is not None:
            self._build(validate_skip_layers(self.config.skip_layers, self.num_layers))

    def _build(self, skip_layers: tuple[int, ...]) -> None:
        self.skip_layers = skip_layers
        view = skip_view(self.target, skip_layers)
        self.drafter = DraftModelDrafter(
            view,
            proposer=self.proposer,
            num_proposal_tokens=self.num_proposal_tokens,
            confidence_threshold=self.confidence_threshold,
            name=self.name,
            keep_distribution=self._keep_distribution,
        )

    @property
    def keep_distribution(self) -> bool:
        """Drafts carry the skip view's own distribution (``Draft.draft_distribution``): it exits through the
        target's norm and head, so it is a distribution over the target's vocabulary (fsd, cascade, adasd)."""
        return self._keep_distribution

    @keep_distribution.setter
    def keep_distribution(self, keep: bool) -> None:
        self._keep_distribution = keep
        if self.drafter is not None:
            self.drafter.keep_distribution = keep

    def reset(self, prompt_ids: list[int]) -> None:
        if self.drafter is None:
            self.calibration, self.calibration_reused = self.calibrations.get(
                self.target, prompt_ids, self.calibration_draft_tokens, self.config
            )
            self._build(self.calibration.skip_layers)
        self._ready().reset(prompt_ids)

    def _ready(self) -> DraftModelDrafter:
        if self.drafter is None:
            raise RuntimeError("call reset(prompt_ids) first: the skip set is chosen on the first prompt")
        return self.drafter

    def propose(
        self,
        token_ids: list[int],
        num_draft_tokens: int,
        sampling: SamplingConfig,
        draws: Draws | None,
    ) -> Draft:
        return self._ready().propose(token_ids, num_draft_tokens, sampling, draws)

    def rollback(self, num_committed: int) -> None:
        self._ready().rollback(num_committed)

    def finish(self, token_ids: list[int]) -> None:
        if self.drafter is not None:  # None: the generation failed before drafting (calibration)
            self.drafter.finish(token_ids)

    def report(self) -> dict[str, Any]:
        report: dict[str, Any] = {
            "skip_layers": list(self.skip_layers) if self.skip_layers is not None else None,
            "num_layers": self.num_layers,
            "skip_source": "given" if self.config.skip_layers is not None else "calibrated",
        }
        report.update(self.drafter.report() if self.drafter is not None else {"draft_forwards": 0})
        if self.calibration is not None:
            calibration = asdict(self.calibration)
            del calibration["skip_layers"]
            report["calibration"] = {**calibration, "reused": self.calibration_reused}
        return report
