"""flyspec: training-free speculative decoding (FLy, MARS, lossless rules) over Hugging Face transformers.

Quick start::

    import flyspec
    result = flyspec.generate("Explain KV caches.", verifier="fly")   # lossy: opt-in
    text, tau = result.text, result.stats.mean_acceptance_length

    # a model you loaded with transformers
    result = flyspec.generate("Explain KV caches.", flyspec.from_transformers(model, tokenizer))
    output_ids = model.generate(input_ids, custom_generate=flyspec.custom_generate)

The public names are imported on first use (PEP 562), so ``import flyspec`` and ``flyspec --version``
do not import torch or transformers.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from flyspec import _moved
from flyspec.config.names import VERSION

__version__ = VERSION
_moved.install()  # modules that moved into rooms keep their old names (flyspec.stats, flyspec.profile, ...)

if TYPE_CHECKING:  # the same names for type checkers and IDEs; at run time __getattr__ imports them
    from flyspec.api import build_decoder, generate, generate_plain
    from flyspec.calibration import Budget, CalibrationConfig, calibrate
    from flyspec.config import (
        AdasdConfig,
        BildConfig,
        CascadeConfig,
        ConfigError,
        DecodeConfig,
        DraftLengthConfig,
        FlyConfig,
        FsdConfig,
        GuardConfig,
        LayerSkipConfig,
        LenienceConfig,
        MarginConfig,
        NgramCacheConfig,
        NgramConfig,
        SamplingConfig,
        SpeculationConfig,
        TypicalConfig,
    )
    from flyspec.config.names import DEFAULT_MODEL
    from flyspec.decoding.plain import PlainDecoder
    from flyspec.decoding.result import GenerationResult
    from flyspec.decoding.speculative import SpeculativeDecoder
    from flyspec.decoding.stats import DecodeStats
    from flyspec.decoding.streaming import GenerationStream
    from flyspec.drafters import (
        CrossTokenizerDrafter,
        Drafter,
        DraftModelDrafter,
        LayerSkipDrafter,
        NgramCache,
        NgramCacheDrafter,
        NgramDrafter,
        PredictionDrafter,
        make_drafter,
        multilevel_drafter,
    )
    from flyspec.integrations.hf_generate import custom_generate, from_transformers
    from flyspec.profiles import Profile
    from flyspec.resources import Resources, set_max_cached_models
    from flyspec.runtime.loaded_model import LoadedModel
    from flyspec.runtime.loading import ModelLoadError, load_model
    from flyspec.sampling.sampler import make_generator
    from flyspec.types import Draft, LooseAccept, Verdict
    from flyspec.verifiers import (
        AdasdVerifier,
        BildVerifier,
        BlockVerifier,
        CascadeVerifier,
        ExactVerifier,
        FlyVerifier,
        FsdVerifier,
        LenienceVerifier,
        MarginVerifier,
        RejectionVerifier,
        TypicalVerifier,
        Verifier,
        make_verifier,
    )

# module → the public names it defines (tests/test_startup.py checks this against __all__)
_SOURCES = {
    "flyspec.api": ("build_decoder", "generate", "generate_plain"),
    "flyspec.decoding.plain": ("PlainDecoder",),
    "flyspec.calibration": ("Budget", "CalibrationConfig", "calibrate"),
    "flyspec.config": (
        "AdasdConfig",
        "BildConfig",
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
        "SpeculationConfig",
        "TypicalConfig",
    ),
    "flyspec.decoding.speculative": ("SpeculativeDecoder",),
    "flyspec.drafters": (
        "CrossTokenizerDrafter",
        "Drafter",
        "DraftModelDrafter",
        "LayerSkipDrafter",
        "NgramCache",
        "NgramCacheDrafter",
        "NgramDrafter",
        "PredictionDrafter",
        "make_drafter",
        "multilevel_drafter",
    ),
    "flyspec.integrations.hf_generate": ("custom_generate", "from_transformers"),
    "flyspec.config.names": ("DEFAULT_MODEL",),
    "flyspec.runtime.loaded_model": ("LoadedModel",),
    "flyspec.runtime.loading": ("ModelLoadError", "load_model"),
    "flyspec.profiles": ("Profile",),
    "flyspec.resources": ("Resources", "set_max_cached_models"),
    "flyspec.decoding.result": ("GenerationResult",),
    "flyspec.sampling.sampler": ("make_generator",),
    "flyspec.decoding.stats": ("DecodeStats",),
    "flyspec.decoding.streaming": ("GenerationStream",),
    "flyspec.types": ("Draft", "LooseAccept", "Verdict"),
    "flyspec.verifiers": (
        "AdasdVerifier",
        "BildVerifier",
        "BlockVerifier",
        "CascadeVerifier",
        "ExactVerifier",
        "FlyVerifier",
        "FsdVerifier",
        "LenienceVerifier",
        "MarginVerifier",
        "RejectionVerifier",
        "TypicalVerifier",
        "Verifier",
        "make_verifier",
    ),
}
_EXPORTS = {name: module for module, names in _SOURCES.items() for name in names}


def __getattr__(name: str) -> Any:
    """Import a public name (or a submodule, e.g. ``flyspec.runtime``) the first time it is used."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "DEFAULT_MODEL",
    "Budget",
    "CalibrationConfig",
    "Profile",
    "calibrate",
    "ConfigError",
    "DecodeConfig",
    "DecodeStats",
    "Draft",
    "CrossTokenizerDrafter",
    "DraftLengthConfig",
    "DraftModelDrafter",
    "LayerSkipConfig",
    "LayerSkipDrafter",
    "NgramCache",
    "NgramCacheConfig",
    "NgramCacheDrafter",
    "Drafter",
    "ExactVerifier",
    "FlyConfig",
    "FlyVerifier",
    "GenerationResult",
    "GenerationStream",
    "GuardConfig",
    "LooseAccept",
    "LoadedModel",
    "MarginConfig",
    "MarginVerifier",
    "ModelLoadError",
    "NgramConfig",
    "NgramDrafter",
    "PlainDecoder",
    "PredictionDrafter",
    "RejectionVerifier",
    "SamplingConfig",
    "SpeculationConfig",
    "SpeculativeDecoder",
    "Resources",
    "TypicalConfig",
    "TypicalVerifier",
    "AdasdConfig",
    "AdasdVerifier",
    "BildConfig",
    "BildVerifier",
    "BlockVerifier",
    "CascadeConfig",
    "CascadeVerifier",
    "FsdConfig",
    "FsdVerifier",
    "LenienceConfig",
    "LenienceVerifier",
    "Verdict",
    "Verifier",
    "build_decoder",
    "custom_generate",
    "from_transformers",
    "generate",
    "generate_plain",
    "load_model",
    "make_drafter",
    "make_generator",
    "make_verifier",
    "multilevel_drafter",
    "set_max_cached_models",
]
