"""Drafters: propose draft tokens. One file per drafter; names in ``registry``."""

from flyspec.drafters.base import Drafter
from flyspec.drafters.draft_model import DraftModelDrafter, multilevel_drafter
from flyspec.drafters.ngram import NgramDrafter, ngram_lookup
from flyspec.drafters.registry import DRAFTERS, make_drafter

__all__ = [
    "DRAFTERS",
    "DraftModelDrafter",
    "Drafter",
    "NgramDrafter",
    "make_drafter",
    "multilevel_drafter",
    "ngram_lookup",
]
