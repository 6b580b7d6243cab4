"""One-call API: build a decoder from a :class:`SpeculationConfig`, or generate directly."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from flyspec.config import DEFAULT_DEVICE, DEFAULT_DTYPE, DecodeConfig, SamplingConfig, SpeculationConfig
from flyspec.config.names import DEFAULT_MODEL
from flyspec.decoding.draft_length import resolve_policy
from flyspec.decoding.generation import Prompt
from flyspec.decoding.plain import PlainDecoder
from flyspec.decoding.result import GenerationResult
from flyspec.decoding.speculative import SpeculativeDecoder
from flyspec.profiles import decide
from flyspec.resources import ModelRef, Resources, default_resources
from flyspec.runtime.loading import set_threads
from flyspec.sampling.sampler import make_generator
from flyspec.verifiers.registry import checked_verifier


def build_decoder(
    target: ModelRef = DEFAULT_MODEL,
    spec: SpeculationConfig | None = None,
    decode: DecodeConfig | None = None,
    *,
    resources: Resources | None = None,
) -> SpeculativeDecoder:
    """A :class:`SpeculativeDecoder` for ``target`` (the CLI, bench, eval and server use this).

    ``spec`` says what to speculate with (default: n-gram drafter, exact verifier), its ``profile`` the
    calibration profile that sets or limits its lossy settings (``profiles/decision.py``); ``decode`` the
    generation's length, stop strings and sampling. ``resources`` resolves model names (target,
    draft model, stack levels) and holds n-gram caches and layer-skip calibrations; by default a
    private one for this decoder (``resources.default_resources``: only its models are shared, through
    the process-wide ``DEFAULT_MODELS``), so nothing a prompt reaches is shared unless the caller shares it.
    """
    return _build(target, spec or SpeculationConfig(), decode or DecodeConfig(), resources)


def _build(
    target: ModelRef,
    spec: SpeculationConfig,
    decode: DecodeConfig,
    resources: Resources | None,
    dtype: str | torch.dtype = DEFAULT_DTYPE,
    device: str | torch.device = DEFAULT_DEVICE,
) -> SpeculativeDecoder:
    """Decide once, then build each part once, going down: the profile's decision (the config, the profile, the
    dtype; before any model loads), the resources, the verifier (its checks need no model), the models and the
    decision held against them, the drafter, the guards' tables and the step cost, the decoder."""
    if resources is not None:
        decision = decide(spec, target, resources.dtype, resources.device, choose_dtype=False)
    else:
        decision = decide(spec, target, dtype, device)
    resources = resources or default_resources(decision.dtype, device)  # loads nothing yet
    verifier = checked_verifier(decision.spec)  # before any model loads
    target_model = resources.model(target)
    draft_model = resources.model(spec.draft_model) if spec.draft_model and spec.models else None
    confirmed = decision.confirm(target_model, draft_model)
    if confirmed.spec != decision.spec:  # a shipped profile made for another model decides nothing after all
        verifier = checked_verifier(confirmed.spec)
    confirmed.announce()
    spec = confirmed.spec
    # the cost-aware draft length weighs t(k + 1): measured once per model and machine, then cached
    costed = resolve_policy(spec.draft_length, verifier.lossless, spec.drafter, decode.sampling.greedy) == "cost"
    cost = resources.step_cost(target_model, spec.num_draft_tokens + 1) if costed else None
    return SpeculativeDecoder.build(target_model, verifier, decode, spec, resources, cost, confirmed.profile)


def generate(
    prompt: Prompt,
    target: ModelRef = DEFAULT_MODEL,
    spec: SpeculationConfig | None = None,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    use_chat: bool | None = None,
    threads: int | None = None,
    dtype: str | torch.dtype = DEFAULT_DTYPE,
    device: str | torch.device = DEFAULT_DEVICE,
    decode: DecodeConfig | None = None,
    resources: Resources | None = None,
    prediction: str | list[int] | None = None,
    **fields,
) -> GenerationResult:
    """Generate with speculative decoding. Lossy verifiers (``names.LOSSY_VERIFIERS``) must be asked for.

    ``prediction`` (OpenAI's Predicted Outputs): the text (or token ids) the output is expected to be mostly; its
    tokens are drafted where they line up with the output (``drafters/prediction.py``), beside the drafter. Under a
    lossless verifier the text is the same with it or without; ``result.stats`` counts the accepted and rejected
    prediction tokens.

    ``dtype`` and ``device`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``) load a model named by string
    (without ``resources``); a loaded model runs where it is. With ``dtype="auto"`` a calibration profile
    brings its dtype (``spec.profile``, or the shipped one a lossy verifier at its defaults uses; logged).
    Without ``resources``, a model named by string stays loaded for the next call
    (``resources.DEFAULT_MODELS``: the 2 most recently used, ``flyspec.set_max_cached_models``); nothing
    else is kept between calls. ``fields`` are :class:`SpeculationConfig` or :class:`DecodeConfig` fields
    (``verifier="fly"``, ``fly=FlyConfig(...)``, ``num_draft_tokens=8``, ``max_new_tokens=64``, ...).
    """
    set_threads(threads)
    spec, decode = _configs(spec, decode, SamplingConfig(temperature, top_k, top_p), fields)
    decoder = _build(target, spec, decode, resources, dtype, device)
    generator = make_generator(seed, decoder.device)
    return decoder.generate(prompt, generator=generator, use_chat=use_chat, prediction=prediction)


def generate_plain(
    prompt: Prompt,
    target: ModelRef = DEFAULT_MODEL,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    use_chat: bool | None = None,
    dtype: str | torch.dtype = DEFAULT_DTYPE,
    device: str | torch.device = DEFAULT_DEVICE,
    decode: DecodeConfig | None = None,
    resources: Resources | None = None,
    **fields,
) -> GenerationResult:
    """Plain autoregressive decoding with the same options as :func:`generate` (no drafter/verifier).

    ``fields`` are :class:`DecodeConfig` fields (``max_new_tokens=64``, ...).
    """
    decode = dataclasses.replace(decode or DecodeConfig(), sampling=SamplingConfig(temperature, top_k, top_p), **fields)
    decoder = PlainDecoder((resources or default_resources(dtype, device)).model(target), decode)
    return decoder.generate(prompt, generator=make_generator(seed, decoder.device), use_chat=use_chat)


def _configs(
    spec: SpeculationConfig | None, decode: DecodeConfig | None, sampling: SamplingConfig, fields: dict[str, Any]
) -> tuple[SpeculationConfig, DecodeConfig]:
    """``spec`` and ``decode`` with ``fields`` applied to whichever of the two has each field."""
    decode_names = {item.name for item in dataclasses.fields(DecodeConfig)}
    unknown = set(fields) - decode_names - {item.name for item in dataclasses.fields(SpeculationConfig)}
    if unknown:
        raise TypeError(
            f"unknown option(s) {', '.join(sorted(unknown))}: not a SpeculationConfig or DecodeConfig field"
        )
    decode_fields = {name: value for name, value in fields.items() if name in decode_names}
    spec_fields = {name: value for name, value in fields.items() if name not in decode_names}
    decode = dataclasses.replace(decode or DecodeConfig(), sampling=sampling, **decode_fields)
    return dataclasses.replace(spec or SpeculationConfig(), **spec_fields), decode
