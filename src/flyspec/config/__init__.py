"""The torch-free declarations every layer shares: the frozen configs (every default lives in one of these files),
their vLLM-style mapping, the option names, and the batch schedule's format.

- ``speculation.py``  SpeculationConfig (the one config object), DecodeConfig, SamplingConfig, GuardConfig, ...
- ``rules.py``        the lossy rules' own settings (FlyConfig, MarginConfig, ...)
- ``drafters.py``     the drafters' settings (NgramConfig, LayerSkipConfig, DraftLengthConfig, ...)
- ``mapping.py``      ConfigError, and configs to and from JSON mappings (vLLM's key names)
- ``names.py``        the names the CLI lists (verifiers, drafters, dtypes, packaged models) and the version
- ``schedule.py``     BatchSchedule: draft tokens per batch size (vLLM's ``num_speculative_tokens_per_batch_size``)

Nothing here imports torch or anything of flyspec outside this package (``tests/test_layout.py``), so
``flyspec --help`` stays instant and every layer may import it.
"""

from flyspec.config.drafters import NGRAM_MATCHES, DraftLengthConfig, LayerSkipConfig, NgramCacheConfig, NgramConfig
from flyspec.config.mapping import ConfigError
from flyspec.config.rules import (
    FLY_VARIANTS,
    AdasdConfig,
    BildConfig,
    CascadeConfig,
    FlyConfig,
    FsdConfig,
    LenienceConfig,
    MarginConfig,
    TypicalConfig,
)
from flyspec.config.speculation import (
    DEFAULT_DEVICE,
    DEFAULT_DTYPE,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_NUM_DRAFT_TOKENS,
    DEFAULT_NUM_PROPOSAL_TOKENS,
    GREEDY_BELOW,
    MODEL_DRAFTERS,
    PROFILE_AUTO,
    PROFILE_NONE,
    PROTECT_CLASSES,
    BreakerConfig,
    DecodeConfig,
    GuardConfig,
    SamplingConfig,
    SamplingRange,
    SpeculationConfig,
    check_device,
)

__all__ = [
    "DEFAULT_DEVICE",
    "DEFAULT_DTYPE",
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_NUM_DRAFT_TOKENS",
    "DEFAULT_NUM_PROPOSAL_TOKENS",
    "FLY_VARIANTS",
    "GREEDY_BELOW",
    "MODEL_DRAFTERS",
    "NGRAM_MATCHES",
    "PROFILE_AUTO",
    "PROFILE_NONE",
    "PROTECT_CLASSES",
    "AdasdConfig",
    "BildConfig",
    "BreakerConfig",
    "CascadeConfig",
    "ConfigError",
    "DecodeConfig",
    "DraftLengthConfig",
    "FlyConfig",
    "FsdConfig",
    "GuardConfig",
    "LayerSkipConfig",
    "LenienceConfig",
    "MarginConfig",
    "NgramCacheConfig",
    "NgramConfig",
    "SamplingConfig",
    "SamplingRange",
    "SpeculationConfig",
    "TypicalConfig",
    "check_device",
]
