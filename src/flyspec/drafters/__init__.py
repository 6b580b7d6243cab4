"""Drafters: propose draft tokens. One file per drafter; names in ``registry``."""

from flyspec.drafters.base import Drafter
from flyspec.drafters.cross_tokenizer import CrossTokenizerDrafter, tokenizers_match
from flyspec.drafters.draft_model import DraftModelDrafter, multilevel_drafter
from flyspec.drafters.layer_skip import LayerSkipDrafter
from flyspec.drafters.ngram import NgramDrafter, ngram_lookup
from flyspec.drafters.ngram_cache import NgramCache, NgramCacheDrafter
from flyspec.drafters.prediction import PredictionDrafter
from flyspec.drafters.registry import DRAFTERS, make_drafter

__all__ = [
    "DRAFTERS",
    "CrossTokenizerDrafter",
    "LayerSkipDrafter",
    "NgramCache",
    "NgramCacheDrafter",
    "tokenizers_match",
    "DraftModelDrafter",
    "Drafter",
    "NgramDrafter",
    "PredictionDrafter",
    "make_drafter",
    "multilevel_drafter",
    "ngram_lookup",
]
