"""lm-evaluation-harness model ``flyspec``: generation through flyspec, log-likelihoods through the target.

lm-eval 0.4.13 finds models only in its own registry (no entry-point discovery), so importing
this module registers ``flyspec`` there, and ``python -m flyspec.integrations.lmeval`` runs lm-eval's own
command line after that import::

    python -m flyspec.integrations.lmeval --model flyspec \\
        --model_args target=smollm2-135m-instruct,verifier=fly,num_draft_tokens=8 --tasks gsm8k

(every ``lm_eval`` argument works; in Python, ``lm_eval.simple_evaluate(model=FlyspecLM(...))``).

* ``generate_until`` runs flyspec's speculative decoder: greedy or sampled as the request's
  ``gen_kwargs`` say (``do_sample``, ``temperature``, ``top_k``, ``top_p``), stopping at its
  ``until`` strings, EOS or ``max_gen_toks``. A generation option flyspec cannot honour
  (``num_beams``, ``repetition_penalty``, ...) is an error, never ignored.
* ``loglikelihood`` and ``loglikelihood_rolling`` are lm-eval's own :class:`HFLM` code on the same
  loaded target model: a log-likelihood scores given text with the target's forward pass, and
  speculative decoding changes only how tokens are *chosen*, so these results do not depend on the
  drafter or verifier (a multiple-choice task scores the same whatever ``verifier`` says).

``model_args``: ``target`` (flyspec's model names: packaged name, ``.gguf``, HF directory, hub id),
``dtype``, ``threads``, ``seed`` (sampled generation: a generator seeded with it draws every sample of
one ``generate_until`` call, so a task's repeated requests get different samples),
every flat speculation option (``config_mapping.FLAT_OPTIONS``: ``drafter``, ``verifier``,
``num_draft_tokens``, ``window_size``, ...) plus ``protect`` and ``bare_rule``, and
``speculative_config`` (a JSON object, as ``--speculative-config``). Options that are lists
(``stack``, ``protect``, ``skip_layers``) are JSON lists in the JSON form of ``--model_args`` or
``+``-separated in the ``key=value`` form (``stack=ngram+smollm2-135m-instruct``), since lm-eval
splits ``key=value`` pairs at commas. A few HFLM options pass through (:data:`HFLM_OPTIONS`).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lm_eval.api.instance import Instance
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from flyspec.api import build_decoder
from flyspec.config import ConfigError, DecodeConfig, SamplingConfig, SpeculationConfig
from flyspec.config.mapping import FLAT_OPTIONS
from flyspec.config.names import DEFAULT_MODEL
from flyspec.resources import Resources
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.loading import load_model, set_threads
from flyspec.sampling.sampler import make_generator

logger = logging.getLogger(__name__)

# HFLM options that apply to a model loaded by flyspec (the rest configure HFLM's own loading).
HFLM_OPTIONS = (
    "batch_size",  # log-likelihood batches; generation runs one request at a time
    "max_batch_size",
    "max_length",
    "add_bos_token",
    "prefix_token_id",
    "truncation",
    "logits_cache",
    "softmax_dtype",
    "think_end_token",
    "enable_thinking",
    "chat_template_args",
)
SPECULATION_OPTIONS = (*FLAT_OPTIONS, "protect", "bare_rule")
LIST_OPTIONS = ("stack", "protect", "skip_layers")
# gen_kwargs flyspec honours (after lm-eval's normalize_gen_kwargs); any other is an error.
GENERATION_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")


def speculation_from_args(args: Mapping[str, Any]) -> SpeculationConfig:
    """The :class:`SpeculationConfig` of ``model_args``: ``speculative_config``, then the flat options."""
    base = args.get("speculative_config")
    if isinstance(base, str):
        try:
            base = json.loads(base)
        except json.JSONDecodeError as error:
            raise ConfigError(f"speculative_config is not valid JSON ({error})") from error
    if base is not None and not isinstance(base, Mapping):
        raise ConfigError(f"speculative_config must be a JSON object (got {type(base).__name__})")
    config = SpeculationConfig.from_dict(base) if base else SpeculationConfig()
    options = {name: args[name] for name in SPECULATION_OPTIONS if name in args}
    for name in LIST_OPTIONS:
        if isinstance(options.get(name), str | int):
            options[name] = [part for part in str(options[name]).split("+") if part]
    if options.get("skip_layers") is not None:
        options["skip_layers"] = tuple(int(layer) for layer in options["skip_layers"])
    if options.get("protect") == ["none"]:
        options["protect"] = []
    for name in ("stack", "protect"):
        if options.get(name) is not None:
            options[name] = tuple(options[name])
    return config.with_options(options)


@register_model("flyspec")
class FlyspecLM(HFLM):
    """lm-eval's :class:`HFLM` on a target flyspec loads, generating with speculative decoding (module docstring)."""

    def __init__(
        self,
        target: str | LoadedModel = DEFAULT_MODEL,
        dtype: str = "auto",
        threads: int | None = None,
        seed: int = 1234,
        device: str | None = None,
        **options: Any,
    ) -> None:
        unknown = set(options) - set(SPECULATION_OPTIONS) - set(HFLM_OPTIONS) - {"speculative_config"}
        if unknown:
            raise ConfigError(
                f"unknown flyspec model_args {', '.join(sorted(unknown))}; known: target, dtype, threads, seed, "
                f"device, speculative_config, {', '.join(SPECULATION_OPTIONS)}, {', '.join(HFLM_OPTIONS)}"
            )
        set_threads(threads)
        self.speculation = speculation_from_args(options)
        loaded = target if isinstance(target, LoadedModel) else load_model(target, dtype=dtype)
        device = _available(device)
        if device is not None and loaded.model.device != torch.device(device):
            loaded.model.to(device)  # type: ignore[arg-type]  # transformers wraps `.to`; its stub is wrong
        hflm_options = {name: options[name] for name in HFLM_OPTIONS if options.get(name) is not None}
        super().__init__(pretrained=loaded.model, tokenizer=loaded.tokenizer, backend="causal", **hflm_options)
        self.loaded = loaded
        self.seed = seed
        resources = Resources(loaded.dtype, models=(loaded,))
        self.decoder = build_decoder(loaded, self.speculation, resources=resources)

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation, generated by flyspec's speculative decoder (one request at a time)."""
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        # one generator for the call, not one per request: a task's `repeats` sends the same request
        # k times, and k samples must differ (as with `--model hf`, whose global generator advances)
        generator = make_generator(self.seed, self.decoder.device)
        outputs: list[str] = []
        for request in tqdm(requests, disable=disable_tqdm or self.rank != 0, desc="flyspec generate_until"):
            context, gen_kwargs = request.args
            outputs.append(self._generate(context, gen_kwargs, eos, generator))
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), outputs[-1])
        return outputs

    def _generate(self, context: str, gen_kwargs: dict[str, Any], eos: str, generator: torch.Generator) -> str:
        decode, until = self.decode_config(gen_kwargs, eos)
        room = self.max_length - decode.max_new_tokens
        if room < 1:
            raise ConfigError(
                f"max_gen_toks {decode.max_new_tokens} leaves no room for the prompt within max_length "
                f"{self.max_length}; lower max_gen_toks or raise max_length"
            )
        # HFLM's own encoding (BOS handling, left truncation), so prompts match `--model hf`
        context_ids, _ = self.tok_batch_encode([context], left_truncate_len=room, truncation=self.truncation)
        prompt_ids = [int(token) for token in context_ids[0]]
        greedy = decode.sampling.greedy
        result = self.decoder.generate(prompt_ids, config=decode, generator=None if greedy else generator)
        token_ids = result.token_ids
        if isinstance(self.think_end_token, int) and self.think_end_token in token_ids:
            token_ids = token_ids[len(token_ids) - token_ids[::-1].index(self.think_end_token) :]
        text = self.tok_decode(token_ids)
        if isinstance(self.think_end_token, int):
            text = text.lstrip()  # as HFLM.generate_until
        think_end = self.think_end_token if isinstance(self.think_end_token, str) else None
        return postprocess_generated_text(text, until, think_end)

    def decode_config(self, gen_kwargs: dict[str, Any], eos: str) -> tuple[DecodeConfig, list[str]]:
        """A request's ``gen_kwargs`` as a :class:`DecodeConfig` (and its stop strings, EOS text included)."""
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        unsupported = sorted(set(kwargs) - set(GENERATION_KWARGS))
        if unsupported:
            raise ConfigError(
                f"generation option(s) {', '.join(unsupported)} are not supported by flyspec "
                f"(supported: {', '.join(GENERATION_KWARGS)}); remove them from the task's generation_kwargs"
            )
        until = handle_stop_sequences(kwargs.get("until"), eos=eos)
        temperature = float(kwargs.get("temperature", 0.0))
        if kwargs.get("do_sample") and temperature == 0.0:
            raise ConfigError("do_sample=True needs a temperature > 0 (flyspec samples at the given temperature)")
        sampling = SamplingConfig(
            temperature if kwargs.get("do_sample") else 0.0,
            int(kwargs.get("top_k") or 0),
            float(kwargs.get("top_p", 1.0)),
        )
        stop_strings = tuple(stop for stop in until if stop)
        decode = DecodeConfig(max_new_tokens=int(kwargs["max_gen_toks"]), stop_strings=stop_strings, sampling=sampling)
        return decode, until

    def get_model_info(self) -> dict[str, Any]:
        return {**super().get_model_info(), "flyspec_target": self.loaded.name, **self.speculation.to_dict()}


def _available(device: str | None) -> str | None:
    """``device``, or None (stay where the model was loaded) for a CUDA device on a machine without CUDA.

    lm-eval's command line passes ``cuda:0`` unless told otherwise; its ``hf`` model falls back
    to the CPU then, and so does this one (with a warning).
    """
    if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
        logger.warning("device %s asked for, but CUDA is not available; running on the CPU", device)
        return None
    return device


def main(argv: Sequence[str] | None = None) -> None:
    """``lm_eval``'s command line with the ``flyspec`` model registered (``python -m flyspec.integrations.lmeval``)."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        cli_evaluate()
    except ConfigError as error:  # flyspec's own errors (model_args, generation options) in one line
        from flyspec.cli.app import fail

        fail(str(error))


if __name__ == "__main__":
    main()
