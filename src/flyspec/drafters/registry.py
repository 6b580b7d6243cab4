"""Drafter names → instances, and drafter stacks.

Every model drafter is a *stack*: levels from the bottom up, each checking the proposals of the
level below in one forward (Hierarchical Speculative Decoding; FLy's multi-level drafter is the
two-level case n-gram → draft model), the top level proposing to the target:

    draft-model   (draft model,)
    multilevel    ("ngram", draft model)
    layer-skip    ("layer-skip",)                  the target with layers skipped
    stack         any levels, e.g. ("ngram", "smollm2-135m-instruct") or ("ngram", "layer-skip")

An n-gram level ("ngram" or "ngram-cache") can only be the bottom one. Where two adjacent levels
(or the top level and the target) use different tokenizers the lower one is wrapped in a
:class:`CrossTokenizerDrafter`, which re-tokenizes its draft text for the level above.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from flyspec.config import ConfigError, NgramCacheConfig, NgramConfig, SpeculationConfig
from flyspec.config.names import DISTRIBUTION_VERIFIERS, DRAFTERS
from flyspec.drafters.base import Drafter
from flyspec.drafters.cross_tokenizer import CrossTokenizerDrafter, tokenizers_match
from flyspec.drafters.draft_model import DraftModelDrafter
from flyspec.drafters.layer_skip import Calibrations, LayerSkipDrafter
from flyspec.drafters.ngram import NgramDrafter
from flyspec.drafters.ngram_cache import NgramCache, NgramCacheDrafter
from flyspec.runtime.loaded_model import LoadedModel

NGRAM_LEVELS = ("ngram", "ngram-cache")
LAYER_SKIP = "layer-skip"
Level = str | LoadedModel  # an n-gram level name, "layer-skip", or a loaded draft model


class StackResources(Protocol):
    """What building a stack takes from the caller's ``flyspec.resources.Resources`` (which sits above the
    drafters and holds their shared state): models by name, n-gram caches, layer-skip calibrations."""

    calibrations: Calibrations

    def model(self, model: str | LoadedModel) -> LoadedModel: ...

    def ngram_cache(self, vocabulary: str, config: NgramCacheConfig, ngram: NgramConfig) -> NgramCache: ...


def drafter_levels(spec: SpeculationConfig) -> tuple[str, ...]:
    """The stack levels of ``spec``'s drafter, bottom first, models by name (see the module docstring)."""
    if spec.drafter not in DRAFTERS:
        raise ConfigError(f"unknown drafter {spec.drafter!r}; choose one of: {', '.join(DRAFTERS)}")
    draft_model = spec.draft_model or ""  # SpeculationConfig refuses a model drafter without one
    return {
        "ngram": ("ngram",),
        "ngram-cache": ("ngram-cache",),
        "draft-model": (draft_model,),
        "multilevel": ("ngram", draft_model),
        "layer-skip": (LAYER_SKIP,),
        "stack": spec.stack,
    }[spec.drafter]


def make_drafter(
    spec: SpeculationConfig, target: LoadedModel, resources: StackResources, keep_distribution: bool | None = None
) -> Drafter:
    """Build ``spec``'s drafter for ``target``; models, n-gram caches and calibrations come from ``resources``.

    ``keep_distribution``: the draft model keeps its distribution in each draft (``Draft.draft_distribution``);
    default: when ``spec``'s verifier reads it (``names.DISTRIBUTION_VERIFIERS``)."""
    levels = drafter_levels(spec)
    resolved_levels = [level if level in (*NGRAM_LEVELS, LAYER_SKIP) else resources.model(level) for level in levels]
    drafter = _StackBuilder(target, spec, resources).build(resolved_levels)
    drafter.name = spec.drafter
    if keep_distribution is None:
        keep_distribution = spec.verifier in DISTRIBUTION_VERIFIERS
    if keep_distribution:
        if not isinstance(drafter, DraftModelDrafter | LayerSkipDrafter):  # another tokenizer: re-tokenized
            raise ConfigError(
                f"verifiers {', '.join(DISTRIBUTION_VERIFIERS)} compare the draft model's distribution with the "
                "target's, so the draft model needs the target's tokenizer: use one of the same tokenizer, "
                "--drafter layer-skip, or another verifier"
            )
        drafter.keep_distribution = True
    return drafter


class _StackBuilder:
    """Builds a stack bottom-up, wrapping levels whose tokenizer differs from the one above."""

    def __init__(self, target: LoadedModel, spec: SpeculationConfig, resources: StackResources) -> None:
        self.target = target
        self.spec = spec
        self.resources = resources

    def build(self, levels: Sequence[Level]) -> Drafter:
        for position, level in enumerate(levels):
            if isinstance(level, str) and level not in (*NGRAM_LEVELS, LAYER_SKIP):
                raise ConfigError(
                    f"unknown stack level {level!r}; use {', '.join(NGRAM_LEVELS)}, {LAYER_SKIP} or a draft model"
                )
            if level in NGRAM_LEVELS and position > 0:
                raise ConfigError(f"stack level {level!r} must be the bottom (first) level: it checks nothing below it")
        below: Drafter | None = None
        below_model: LoadedModel | None = None  # whose tokenizer ``below`` speaks (None: n-gram, any)
        for position, level in enumerate(levels):
            above = self._model_at(levels, position + 1)
            if isinstance(level, str) and level in NGRAM_LEVELS:
                below, below_model = self._ngram_level(level, above), None
                continue
            model = self.target if level == LAYER_SKIP else level
            assert isinstance(model, LoadedModel)
            proposer = self._translated(below, below_model, model)
            below, below_model = self._model_level(level, model, proposer), model
        top = self._translated(below, below_model, self.target)
        assert top is not None  # levels is never empty
        return top

    def _model_at(self, levels: Sequence[Level], position: int) -> LoadedModel:
        """The model that verifies level ``position - 1``'s proposals (the target above the top)."""
        if position >= len(levels) or levels[position] == LAYER_SKIP:
            return self.target
        level = levels[position]
        assert isinstance(level, LoadedModel)
        return level

    def _ngram_level(self, level: str, above: LoadedModel) -> Drafter:
        # drafts are built on the device of the model that checks them
        if level == "ngram":
            return NgramDrafter(self.spec.ngram, device=above.device)
        # one cache per vocabulary (the model above reads its token ids), owned by the resources
        cache = self.resources.ngram_cache(above.name, self.spec.ngram_cache, self.spec.ngram)
        return NgramCacheDrafter(cache, self.spec.ngram, device=above.device)

    def _model_level(self, level: Level, model: LoadedModel, proposer: Drafter | None) -> Drafter:
        if level == LAYER_SKIP:
            return LayerSkipDrafter(
                model,
                self.spec.layer_skip,
                proposer=proposer,
                num_proposal_tokens=self.spec.num_proposal_tokens,
                confidence_threshold=self.spec.draft_length.confidence_threshold,
                calibration_draft_tokens=self.spec.num_draft_tokens,  # calibrate for the k that will run
                calibrations=self.resources.calibrations,
            )
        return DraftModelDrafter(
            model,
            proposer=proposer,
            num_proposal_tokens=self.spec.num_proposal_tokens,
            confidence_threshold=self.spec.draft_length.confidence_threshold,
            name=model.name,
        )

    @staticmethod
    def _translated(drafter: Drafter | None, speaks: LoadedModel | None, listener: LoadedModel) -> Drafter | None:
        """``drafter`` as seen by ``listener``: re-tokenized when their tokenizers differ."""
        if drafter is None or speaks is None or speaks.tokenizer is listener.tokenizer:
            return drafter
        if tokenizers_match(speaks.tokenizer, listener.tokenizer):
            return drafter
        return CrossTokenizerDrafter(
            drafter, speaks.tokenizer, listener.tokenizer, name=drafter.name, device=listener.device
        )
