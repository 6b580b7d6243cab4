"""Everything the plugin takes from flyspec, imported in this one place (the core API may move)."""

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
    "fly_candidates",
    "guard_loose_mask",
    "looser",
    "make_verifier",
    "num_leading_true",
    "prepare_guards",
    "rule_mapping",
    "tokenizer_fingerprint",
    "verdict_reach",
]
