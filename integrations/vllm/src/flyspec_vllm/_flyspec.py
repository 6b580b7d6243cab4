"""Everything the plugin takes from flyspec, imported in this one place (the core API may move)."""

from types import SimpleNamespace

from flyspec.config import (
    BreakerConfig,
    ConfigError,
    FlyConfig,
    GuardConfig,
    NgramConfig,
    SamplingConfig,
    SamplingRange,
    SpeculationConfig,
)
from flyspec.config.names import DISTRIBUTION_VERIFIERS, LOSSY_VERIFIERS
from flyspec.config.schedule import BatchSchedule
from flyspec.decoding.breaker import CircuitBreaker
from flyspec.decoding.stats import DecodeStats
from flyspec.drafters.prediction import Alignment, aligned_tokens, follow
from flyspec.profiles import Profile, looser
from flyspec.runtime.loaded_model import tokenizer_fingerprint
from flyspec.sampling.acceptance import num_leading_true
from flyspec.types import Draft, VerifyContext
from flyspec.verifiers.fly import fly_candidates
from flyspec.verifiers.guard import guard_loose_mask
from flyspec.verifiers.guard import prepare as prepare_guards
from flyspec.verifiers.registry import LOSSY_RULE_FIELDS, make_verifier, rule_mapping, verdict_reach
from flyspec.verifiers.tokens import Vocabulary

__all__ = [
    "Alignment",
    "BatchSchedule",
    "BreakerConfig",
    "CircuitBreaker",
    "ConfigError",
    "DecodeStats",
    "Draft",
    "FlyConfig",
    "GuardConfig",
    "DISTRIBUTION_VERIFIERS",
    "LOSSY_RULE_FIELDS",
    "LOSSY_VERIFIERS",
    "NgramConfig",
    "Profile",
    "SamplingConfig",
    "SamplingRange",
    "SpeculationConfig",
    "VerifyContext",
    "Vocabulary",
    "aligned_tokens",
    "fly_candidates",
    "follow",
    "guard_loose_mask",
    "looser",
    "make_verifier",
    "num_leading_true",
    "prepare_guards",
    "prediction_rules",
    "rule_mapping",
    "tokenizer_fingerprint",
    "verdict_reach",
]


def prediction_rules() -> SimpleNamespace:
    """``flyspec serve``'s rules for OpenAI's ``prediction`` (its schema, what may come beside it, its tokens and
    their room, its 400s), imported when vLLM's API server first needs them (they bring pydantic and FastAPI)."""
    from flyspec.server.errors import APIError, from_validation_error
    from flyspec.server.prediction import check_beside_prediction, prediction_ids
    from flyspec.server.schemas import Prediction

    return SimpleNamespace(APIError=APIError, Prediction=Prediction, check_beside_prediction=check_beside_prediction,
                           from_validation_error=from_validation_error, prediction_ids=prediction_ids)  # fmt: skip
