"""One-call API: build a decoder from names, or generate directly."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from flyspec.baseline import PlainDecoder
from flyspec.config import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_NUM_DRAFT_TOKENS,
    DecodeConfig,
    DraftLengthConfig,
    FlyConfig,
    GuardConfig,
    LayerSkipConfig,
    MarginConfig,
    NgramCacheConfig,
    NgramConfig,
    SamplingConfig,
    TypicalConfig,
)
from flyspec.decoding import Prompt, SpeculativeDecoder
from flyspec.drafters.ngram_cache import NgramCache
from flyspec.drafters.registry import LAYER_SKIP, NGRAM_LEVELS, Level, make_drafter
from flyspec.models import DEFAULT_MODEL, LoadedModel, load_model, resolve_dtype, set_threads
from flyspec.types import GenerationResult
from flyspec.verifiers.registry import make_verifier

ModelRef = str | LoadedModel


@functools.lru_cache(maxsize=4)
def _load_cached(name: str, dtype: torch.dtype) -> LoadedModel:
    return load_model(name, dtype=dtype)


def resolve_model(model: ModelRef, dtype: str | torch.dtype = "auto") -> LoadedModel:
    """A loaded model as is, or a name/path loaded once per process and dtype."""
    if isinstance(model, LoadedModel):
        return model
    return _load_cached(model, resolve_dtype(dtype))


def build_decoder(
    target: ModelRef = DEFAULT_MODEL,
    drafter: str = "ngram",
    verifier: str = "exact",
    draft_model: ModelRef | None = None,
    *,
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    stop: tuple[str, ...] = (),
    sampling: SamplingConfig | None = None,
    fly: FlyConfig | None = None,
    margin: MarginConfig | None = None,
    typical: TypicalConfig | None = None,
    ngram: NgramConfig | None = None,
    num_ngram_tokens: int = 6,
    dtype: str | torch.dtype = "auto",
    guard: GuardConfig | None = None,
    draft_length: DraftLengthConfig | None = None,
    layer_skip: LayerSkipConfig | None = None,
    ngram_cache: NgramCache | NgramCacheConfig | None = None,
    stack: Sequence[ModelRef] = (),
) -> SpeculativeDecoder:
    """A :class:`SpeculativeDecoder` from component names (the CLI, bench and server use this).

    ``guard``: the lossy verifiers' trust guards (default on; ``GuardConfig.bare()`` = the papers' bare
    rules; see ``verifiers/guard.py``).
    ``draft_length`` makes the draft length adaptive; ``stack`` lists the levels of drafter ``"stack"``,
    bottom first: ``"ngram"``/``"ngram-cache"``, ``"layer-skip"`` or draft models (names, paths or loaded).
    ``ngram_cache``: the cache object (or its size) for ``ngram-cache``; by default one per model per process.
    """
    draft_length = draft_length or DraftLengthConfig()
    config = DecodeConfig(
        num_draft_tokens, max_new_tokens, tuple(stop), sampling or SamplingConfig(), draft_length=draft_length
    )
    make_verifier(verifier)  # an unknown name fails before any model is loaded
    target_model = resolve_model(target, dtype)
    verifier_obj = make_verifier(verifier, fly=fly, margin=margin, typical=typical, guard=guard)
    draft = resolve_model(draft_model, dtype) if draft_model is not None else None
    drafter_obj = make_drafter(
        drafter,
        target=target_model,
        draft_model=draft,
        ngram=ngram,
        num_ngram_tokens=num_ngram_tokens,
        draft_length=draft_length,
        layer_skip=layer_skip,
        ngram_cache=ngram_cache,
        stack=[_resolve_level(level, dtype) for level in stack] if drafter == "stack" else (),
    )
    return SpeculativeDecoder(target_model, drafter_obj, verifier_obj, config)


def _resolve_level(level: ModelRef, dtype: str | torch.dtype) -> Level:
    """A stack level: the n-gram and layer-skip keywords as they are, anything else a model to load."""
    if isinstance(level, str) and level in (*NGRAM_LEVELS, LAYER_SKIP):
        return level
    return resolve_model(level, dtype)


def generate(
    prompt: Prompt,
    target: ModelRef = DEFAULT_MODEL,
    drafter: str = "ngram",
    verifier: str = "exact",
    draft_model: ModelRef | None = None,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    use_chat: bool | None = None,
    threads: int | None = None,
    **options,
) -> GenerationResult:
    """Generate with speculative decoding. Lossy verifiers (fly, margin, typical) must be asked for.

    ``options`` are :func:`build_decoder`'s keyword arguments (``num_draft_tokens``, ``fly=FlyConfig(...)``, ...).
    """
    set_threads(threads)
    decoder = build_decoder(
        target, drafter, verifier, draft_model, sampling=SamplingConfig(temperature, top_k, top_p), **options
    )
    return decoder.generate(prompt, generator=make_generator(seed), use_chat=use_chat)


def generate_plain(
    prompt: Prompt,
    target: ModelRef = DEFAULT_MODEL,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    use_chat: bool | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    stop: tuple[str, ...] = (),
    dtype: str | torch.dtype = "auto",
) -> GenerationResult:
    """Plain autoregressive decoding with the same options as :func:`generate` (no drafter/verifier)."""
    config = DecodeConfig(
        max_new_tokens=max_new_tokens, stop_strings=tuple(stop), sampling=SamplingConfig(temperature, top_k, top_p)
    )
    decoder = PlainDecoder(resolve_model(target, dtype), config)
    return decoder.generate(prompt, generator=make_generator(seed), use_chat=use_chat)


def make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    if seed is not None:
        generator.manual_seed(seed)
    else:
        generator.seed()
    return generator
