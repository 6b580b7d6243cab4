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

from flyspec.config import ConfigError, DraftLengthConfig, LayerSkipConfig, NgramCacheConfig, NgramConfig
from flyspec.drafters.base import Drafter
from flyspec.drafters.cross_tokenizer import CrossTokenizerDrafter, tokenizers_match
from flyspec.drafters.draft_model import DraftModelDrafter
from flyspec.drafters.layer_skip import LayerSkipDrafter
from flyspec.drafters.ngram import NgramDrafter
from flyspec.drafters.ngram_cache import NgramCache, NgramCacheDrafter, shared_ngram_cache
from flyspec.models import LoadedModel

DRAFTERS = ("ngram", "ngram-cache", "draft-model", "multilevel", "layer-skip", "stack")
NGRAM_LEVELS = ("ngram", "ngram-cache")
LAYER_SKIP = "layer-skip"
Level = str | LoadedModel  # an n-gram level name, "layer-skip", or a loaded draft model


def make_drafter(
    name: str,
    *,
    target: LoadedModel,
    draft_model: LoadedModel | None = None,
    ngram: NgramConfig | None = None,
    num_ngram_tokens: int = 6,
    draft_length: DraftLengthConfig | None = None,
    layer_skip: LayerSkipConfig | None = None,
    ngram_cache: NgramCache | NgramCacheConfig | None = None,
    stack: Sequence[Level] = (),
) -> Drafter:
    """Build a drafter by name (see the module docstring); ``stack`` gives the levels of ``"stack"``."""
    if name not in DRAFTERS:
        raise ConfigError(f"unknown drafter {name!r}; choose one of: {', '.join(DRAFTERS)}")
    if name == "stack" and not stack:
        raise ConfigError("drafter 'stack' needs its levels, bottom first: e.g. --stack ngram,DRAFT_MODEL")
    if name in ("draft-model", "multilevel") and draft_model is None:
        raise ConfigError(f"drafter {name!r} needs a draft model; pass --draft-model NAME_OR_PATH")
    if name in ("multilevel", "stack") and num_ngram_tokens < 1:
        raise ConfigError(f"num_ngram_tokens must be >= 1 for {name} (got {num_ngram_tokens})")
    levels: Sequence[Level] = {
        "ngram": ("ngram",),
        "ngram-cache": ("ngram-cache",),
        "draft-model": (draft_model,),
        "multilevel": ("ngram", draft_model),
        "layer-skip": (LAYER_SKIP,),
        "stack": stack,
    }[name]  # type: ignore[assignment]
    builder = _StackBuilder(
        target,
        ngram or NgramConfig(),
        num_ngram_tokens,
        draft_length or DraftLengthConfig(),
        layer_skip or LayerSkipConfig(),
        ngram_cache,
    )
    drafter = builder.build(levels)
    drafter.name = name
    return drafter


class _StackBuilder:
    """Builds a stack bottom-up, wrapping levels whose tokenizer differs from the one above."""

    def __init__(
        self,
        target: LoadedModel,
        ngram: NgramConfig,
        num_proposal_tokens: int,
        draft_length: DraftLengthConfig,
        layer_skip: LayerSkipConfig,
        ngram_cache: NgramCache | NgramCacheConfig | None,
    ) -> None:
        self.target = target
        self.ngram = ngram
        self.num_proposal_tokens = num_proposal_tokens
        self.confidence_threshold = draft_length.confidence_threshold
        self.layer_skip = layer_skip
        self.ngram_cache = ngram_cache

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
        assert below is not None
        return self._translated(below, below_model, self.target)

    def _model_at(self, levels: Sequence[Level], position: int) -> LoadedModel:
        """The model that verifies level ``position - 1``'s proposals (the target above the top)."""
        if position >= len(levels) or levels[position] == LAYER_SKIP:
            return self.target
        level = levels[position]
        assert isinstance(level, LoadedModel)
        return level

    def _ngram_level(self, level: str, above: LoadedModel) -> Drafter:
        if level == "ngram":
            return NgramDrafter(self.ngram)
        cache = self.ngram_cache
        if not isinstance(cache, NgramCache):  # one shared cache per model (tokenizer) in this process
            cache = shared_ngram_cache(above.name, cache or NgramCacheConfig(), self.ngram)
        return NgramCacheDrafter(cache, self.ngram)

    def _model_level(self, level: Level, model: LoadedModel, proposer: Drafter | None) -> Drafter:
        if level == LAYER_SKIP:
            return LayerSkipDrafter(
                model,
                self.layer_skip,
                proposer=proposer,
                num_proposal_tokens=self.num_proposal_tokens,
                confidence_threshold=self.confidence_threshold,
            )
        return DraftModelDrafter(
            model,
            proposer=proposer,
            num_proposal_tokens=self.num_proposal_tokens,
            confidence_threshold=self.confidence_threshold,
            name=model.name,
        )

    @staticmethod
    def _translated(drafter: Drafter | None, speaks: LoadedModel | None, listener: LoadedModel) -> Drafter | None:
        """``drafter`` as seen by ``listener``: re-tokenized when their tokenizers differ."""
        if drafter is None or speaks is None or speaks.tokenizer is listener.tokenizer:
            return drafter
        if tokenizers_match(speaks.tokenizer, listener.tokenizer):
            return drafter
        return CrossTokenizerDrafter(drafter, speaks.tokenizer, listener.tokenizer, name=drafter.name)
