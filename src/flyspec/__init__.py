"""flyspec: training-free speculative decoding (FLy, MARS, lossless rules) over Hugging Face transformers.

Quick start::

    import flyspec
    result = flyspec.generate("Explain KV caches.", verifier="fly")   # lossy: opt-in
    text, tau = result.text, result.stats.mean_acceptance_length

    # a model you loaded with transformers
    result = flyspec.generate("Explain KV caches.", flyspec.from_transformers(model, tokenizer))
    output_ids = model.generate(input_ids, custom_generate=flyspec.custom_generate)
"""

from flyspec.api import build_decoder, generate, generate_plain
from flyspec.baseline import PlainDecoder
from flyspec.config import (
    ConfigError,
    DecodeConfig,
    DraftLengthConfig,
    FlyConfig,
    GuardConfig,
    LayerSkipConfig,
    MarginConfig,
    NgramCacheConfig,
    NgramConfig,
    SamplingConfig,
    SpeculationConfig,
    TypicalConfig,
)
from flyspec.decoding import SpeculativeDecoder
from flyspec.drafters import (
    CrossTokenizerDrafter,
    Drafter,
    DraftModelDrafter,
    LayerSkipDrafter,
    NgramCache,
    NgramCacheDrafter,
    NgramDrafter,
    make_drafter,
    multilevel_drafter,
)
from flyspec.hf_generate import custom_generate, from_transformers
from flyspec.models import DEFAULT_MODEL, LoadedModel, ModelLoadError, load_model
from flyspec.resources import Resources
from flyspec.result import GenerationResult
from flyspec.sampling import make_generator
from flyspec.stats import DecodeStats
from flyspec.streaming import GenerationStream
from flyspec.types import Draft, LooseAccept, Verdict
from flyspec.verifiers import (
    ExactVerifier,
    FlyVerifier,
    MarginVerifier,
    RejectionVerifier,
    TypicalVerifier,
    Verifier,
    make_verifier,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL",
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
    "RejectionVerifier",
    "SamplingConfig",
    "SpeculationConfig",
    "SpeculativeDecoder",
    "Resources",
    "TypicalConfig",
    "TypicalVerifier",
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
]
