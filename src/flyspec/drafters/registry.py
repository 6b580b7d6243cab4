"""Drafter names → instances."""

from __future__ import annotations

from flyspec.config import ConfigError, NgramConfig
from flyspec.drafters.base import Drafter
from flyspec.drafters.draft_model import DraftModelDrafter, multilevel_drafter
from flyspec.drafters.ngram import NgramDrafter
from flyspec.models import LoadedModel, check_same_tokenizer

DRAFTERS = ("ngram", "draft-model", "multilevel")


def make_drafter(
    name: str,
    *,
    target: LoadedModel,
    draft_model: LoadedModel | None = None,
    ngram: NgramConfig | None = None,
    num_ngram_tokens: int = 6,
) -> Drafter:
    """Build a drafter by name. Model drafters need ``draft_model`` with the target's tokenizer."""
    if name == "ngram":
        return NgramDrafter(ngram or NgramConfig())
    if name not in DRAFTERS:
        raise ConfigError(f"unknown drafter {name!r}; choose one of: {', '.join(DRAFTERS)}")
    if draft_model is None:
        raise ConfigError(f"drafter {name!r} needs a draft model; pass --draft-model NAME_OR_PATH")
    check_same_tokenizer(target, draft_model)
    if name == "draft-model":
        return DraftModelDrafter(draft_model)
    if num_ngram_tokens < 1:
        raise ConfigError(f"num_ngram_tokens must be >= 1 for multilevel (got {num_ngram_tokens})")
    return multilevel_drafter(draft_model, num_ngram_tokens, ngram or NgramConfig())
