"""flyspec for a model you loaded with transformers: :func:`from_transformers` and :func:`custom_generate`.

::

    model = AutoModelForCausalLM.from_pretrained(...)
    tokenizer = AutoTokenizer.from_pretrained(...)
    result = flyspec.generate("Hello", flyspec.from_transformers(model, tokenizer), verifier="fly")

    # or inside transformers' own generate (transformers 5 calls the callable as its decoding loop):
    output_ids = model.generate(input_ids, custom_generate=flyspec.custom_generate, max_new_tokens=64,
                                speculation=flyspec.SpeculationConfig(verifier="exact"))

``model.generate`` prepares the generation config and the logits processors and stopping criteria
it implies, then hands them to :func:`custom_generate`. What flyspec honours: ``max_new_tokens`` /
``max_length``, greedy or ``do_sample`` with ``temperature``, ``top_k`` and ``top_p``,
``eos_token_id``, ``return_dict_in_generate`` (sequences only), and ``stop_strings`` once
transformers passes the tokenizer on. Transformers 5.23 drops ``tokenizer=`` before calling a
``custom_generate`` callable: ``stop_strings`` then fail in transformers itself ("we could not
locate a tokenizer"), and flyspec loads the tokenizer saved with the model (``model.name_or_path``).
For stop strings, or a model built in memory, use ``flyspec.generate(prompt,
flyspec.from_transformers(model, tokenizer), stop_strings=...)``. Anything else that would
change the output (``num_beams`` > 1, ``num_return_sequences`` > 1,
``repetition_penalty``, ``min_new_tokens``, any other logits processor or stopping criterion, a
batch of more than one prompt, padding, a pre-filled cache, ``output_scores``...) is a
:class:`ConfigError` naming it, never ignored. Transformers does not pass ``assistant_model`` or
``streamer`` to a ``custom_generate`` callable, so they cannot be checked: leave them out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation import (
    EosTokenCriteria,
    GenerateDecoderOnlyOutput,
    LogitsProcessorList,
    MaxLengthCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from flyspec.api import build_decoder
from flyspec.config import ConfigError, DecodeConfig, SamplingConfig, SpeculationConfig
from flyspec.resources import Resources
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.sampling.sampler import make_generator

SAMPLING_WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
STOPPING_CRITERIA = (MaxLengthCriteria, EosTokenCriteria, StopStringCriteria)
# model kwargs transformers prepares for every decoder-only call (checked below where they matter)
# past_key_values: transformers < 5.2x; cache: its newer name
MODEL_KWARGS = (
    "attention_mask",
    "position_ids",
    "use_cache",
    "logits_to_keep",
    "past_key_values",
    "cache",
    "cache_position",
)
OUTPUT_FLAGS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def from_transformers(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str | None = None
) -> LoadedModel:
    """Your loaded causal LM and tokenizer as a flyspec target (the ``target`` of :func:`flyspec.generate`).

    ``name`` (default: the model's ``name_or_path``) is how a shared :class:`Resources` finds it.
    The model is used as it is (device, dtype, mode): put it in ``eval()`` mode, as ``from_pretrained`` does.
    """
    return LoadedModel(model=model, tokenizer=tokenizer, name=name or model.name_or_path or type(model).__name__)


@dataclass(eq=False)
class _CallTarget(LoadedModel):
    """The target with the EOS ids of one ``generate`` call (the call's generation config decides them)."""

    call_eos_token_ids: frozenset[int] = frozenset()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.call_eos_token_ids


def custom_generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    tokenizer: PreTrainedTokenizerBase | None = None,
    speculation: SpeculationConfig | None = None,
    resources: Resources | None = None,
    **model_kwargs: Any,
) -> torch.LongTensor | GenerateDecoderOnlyOutput:
    """The decoding loop for ``model.generate(..., custom_generate=flyspec.custom_generate)`` (module docstring).

    flyspec needs the tokenizer (it stops on text, its drafters read it): ``tokenizer`` when
    transformers passes it, else the one saved with the model (``model.name_or_path``); ``speculation``
    chooses drafter and verifier (default: n-gram drafter, exact verifier, so the output is the
    model's own); ``resources`` shares draft models and n-gram caches between calls. Sampling
    draws from a generator seeded from torch's global generator, so ``torch.manual_seed`` makes
    it reproducible.
    """
    _check_unsupported(generation_config, logits_processor, stopping_criteria)  # beams also widen input_ids
    prompt_ids = _single_prompt(input_ids, model_kwargs)
    tokenizer = tokenizer or _tokenizer_of(model)
    max_new_tokens = generation_config.max_length - len(prompt_ids)
    if max_new_tokens < 1:
        raise ConfigError(
            f"max_length {generation_config.max_length} leaves no room after the {len(prompt_ids)}-token prompt"
        )
    decode = DecodeConfig(
        max_new_tokens=max_new_tokens,
        stop_strings=_stop_strings(generation_config),
        sampling=_sampling(generation_config),
    )
    name = model.name_or_path or type(model).__name__
    target = _CallTarget(model, tokenizer, name, call_eos_token_ids=_eos_ids(generation_config))
    decoder = build_decoder(target, speculation or SpeculationConfig(), decode, resources=resources)
    seed = None if decode.sampling.greedy else int(torch.randint(0, 2**62, ()))  # follows torch.manual_seed
    generator = None if seed is None else make_generator(seed, decoder.device)  # the model's, maybe not the input's
    result = decoder.generate(prompt_ids, generator=generator)
    sequences = cast(
        torch.LongTensor,
        torch.tensor([prompt_ids + result.token_ids], dtype=input_ids.dtype, device=input_ids.device),
    )
    return GenerateDecoderOnlyOutput(sequences=sequences) if generation_config.return_dict_in_generate else sequences


def _tokenizer_of(model: PreTrainedModel) -> PreTrainedTokenizerBase:
    """The tokenizer saved with the model (transformers 5 keeps ``tokenizer=`` from custom_generate callables)."""
    from transformers import AutoTokenizer

    source = model.name_or_path
    try:
        if not source:
            raise OSError("the model was not loaded from a directory or hub id")
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"flyspec.custom_generate could not load the tokenizer of {source or type(model).__name__!r} ({error}); "
            "transformers does not pass tokenizer= to a custom_generate callable, so load the model from a "
            "directory or hub id that holds its tokenizer, or use flyspec.generate(prompt, "
            "flyspec.from_transformers(model, tokenizer), ...)"
        ) from error


def _single_prompt(input_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> list[int]:
    """The one prompt's ids, after checking nothing in the call asks for what flyspec does not do."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ConfigError(f"flyspec generates for one prompt at a time (input_ids has shape {list(input_ids.shape)})")
    unknown = sorted(set(model_kwargs) - set(MODEL_KWARGS))
    if unknown:
        raise ConfigError(f"flyspec.custom_generate does not support {', '.join(unknown)}; leave them out")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        raise ConfigError("flyspec.custom_generate does not support padding: pass an attention mask of ones, or none")
    positions = model_kwargs.get("position_ids")
    if positions is not None and not torch.equal(positions.flatten().cpu(), torch.arange(input_ids.shape[1])):
        raise ConfigError("flyspec.custom_generate does not support custom position_ids")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and cache.get_seq_length() > 0:
        raise ConfigError(
            "flyspec.custom_generate starts from the prompt: a pre-filled past_key_values is not supported"
        )
    return [int(token) for token in input_ids[0]]


def _check_unsupported(
    config: GenerationConfig, logits_processor: LogitsProcessorList, stopping_criteria: StoppingCriteriaList
) -> None:
    for name in ("num_beams", "num_return_sequences"):
        if (getattr(config, name, None) or 1) > 1:
            raise ConfigError(f"{name}={getattr(config, name)} is not supported by flyspec; use 1")
    flags = [name for name in OUTPUT_FLAGS if getattr(config, name, None)]
    if flags:
        raise ConfigError(f"{', '.join(flags)} not supported by flyspec.custom_generate; leave them out")
    allowed = SAMPLING_WARPERS if config.do_sample else ()
    processors = sorted(
        {type(processor).__name__ for processor in logits_processor if not isinstance(processor, allowed)}
    )
    if processors:
        raise ConfigError(
            f"flyspec.custom_generate honours temperature, top_k and top_p only; this call also asks for "
            f"{', '.join(processors)} (from the generation config or logits_processor): remove what sets it"
        )
    criteria = sorted({type(item).__name__ for item in stopping_criteria if not isinstance(item, STOPPING_CRITERIA)})
    if criteria:
        raise ConfigError(
            f"flyspec.custom_generate stops at max length, EOS and stop strings only; this call also asks for "
            f"{', '.join(criteria)}: remove what sets it"
        )


def _sampling(config: GenerationConfig) -> SamplingConfig:
    if not config.do_sample:
        return SamplingConfig()  # greedy, as transformers (which ignores temperature then)
    temperature = 1.0 if config.temperature is None else float(config.temperature)
    return SamplingConfig(temperature, int(config.top_k or 0), 1.0 if config.top_p is None else float(config.top_p))


def _stop_strings(config: GenerationConfig) -> tuple[str, ...]:
    stops = config.stop_strings
    return () if stops is None else (stops,) if isinstance(stops, str) else tuple(stops)


def _eos_ids(config: GenerationConfig) -> frozenset[int]:
    eos = config.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([int(eos)] if isinstance(eos, int) else (int(token) for token in eos))
