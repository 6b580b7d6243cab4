"""A loaded model: a causal LM with its tokenizer (:class:`LoadedModel`), and the fingerprints
that identify its weights and tokenizer (for calibration profiles and the step-cost cache).

Loading one (from a packaged name, a ``.gguf`` file, a directory or a hub id) is ``loading.py``.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flyspec.config import ConfigError


def decode_text(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], **options: Any) -> str:
    """``tokenizer.decode`` of one flat id list, special tokens skipped (typed ``str``, not ``str | list[str]``)."""
    text = tokenizer.decode(list(ids), skip_special_tokens=True, **options)
    if not isinstance(text, str):  # only a batch of id lists decodes to a list
        raise TypeError(f"decoding one id list gave {type(text).__name__}, not str")
    return text


class PromptCodec:
    """Prompts to token ids and back, with the chat template: what a model needs of its tokenizer and name
    (shared by :class:`LoadedModel` and :class:`ServedModel`)."""

    tokenizer: PreTrainedTokenizerBase
    name: str

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode_prompt(self, prompt: str | list[dict[str, str]], use_chat: bool | None = None) -> list[int]:
        """Token ids of a prompt; chat models get their chat template unless ``use_chat=False``.

        ``prompt`` may be a string or a list of chat messages (``{"role", "content"}``).
        """
        if isinstance(prompt, str) and not prompt.strip():
            raise ConfigError("the prompt is empty; give some text to continue")
        chat = self.has_chat_template if use_chat is None else use_chat
        if isinstance(prompt, list) or chat:
            if not self.has_chat_template:
                raise ConfigError(f"model {self.name!r} has no chat template; pass a plain string with --no-chat")
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            encoded: Any = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = encoded["input_ids"] if not isinstance(encoded, list) else encoded
            return [int(i) for i in ids]
        return [int(i) for i in self.tokenizer(prompt)["input_ids"]]

    def decode(self, token_ids: list[int]) -> str:
        return decode_text(self.tokenizer, token_ids)


@dataclass(eq=False)
class ServedModel(PromptCodec):
    """A model another engine runs (vLLM, on this machine or a cluster): only its tokenizer, EOS ids, dtype and
    fingerprints are here, never its weights (``loading.load_served``)."""

    tokenizer: PreTrainedTokenizerBase
    name: str
    path: str  # the Hugging Face model directory the engine loads
    dtype_name: str  # bfloat16, float32, float16
    eos_token_ids: frozenset[int]
    weights_fingerprint: str

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype_name)

    @property
    def fingerprints(self) -> dict[str, str]:
        return {"weights": self.weights_fingerprint, "tokenizer": tokenizer_fingerprint(self.tokenizer)}


@dataclass(eq=False)
class LoadedModel(PromptCodec):
    """A causal LM, its tokenizer, and the name it was loaded under.

    ``step_forward``: the model's forward compiled for the cached steps (``compiled_steps.compile_steps``);
    None runs them eagerly. ``prefill_forward``: the same compiled for a prefill from an empty cache (its own
    graph, one for every prompt length); None prefills eagerly. ``kernels``: flyspec's CPU kernels are
    installed (``kernels.py``), so a ``CachedModel`` keeps its cache in place. Compared and hashed by
    identity (``eq=False``): two loads are two models, and what is derived from one
    (``verifiers.tokens.vocabulary_of``) is keyed by it.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    step_forward: Callable[..., Any] | None = None
    prefill_forward: Callable[..., Any] | None = None
    kernels: bool = False
    weights_fingerprint: str | None = None  # taken before the kernels pack the weights (see weights_fingerprint)
    weight_bytes: int | None = None  # read by a one-token step (memory_floor.step_weight_bytes), counted before packing

    @functools.cached_property
    def fingerprints(self) -> dict[str, str]:
        """What identifies this model for a calibration profile (``profiles/profile.py``): its weights and tokenizer."""
        weights = self.weights_fingerprint or weights_fingerprint(self.model)
        return {"weights": weights, "tokenizer": tokenizer_fingerprint(self.tokenizer)}

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        """Where the weights are; every tensor of a step on this model lives here too."""
        return next(self.model.parameters()).device

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source is not None:
                ids.update(int(i) for i in source)
        return frozenset(ids)


FINGERPRINT_SAMPLES = 64  # weight values hashed per tensor (evenly spaced)


def weights_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 of every floating-point tensor's name, shape and evenly spaced values rounded to bfloat16
    (a float32 and a bfloat16 load of the same weights agree; a profile checks the dtype on its own)."""
    return _fingerprint(
        (name, tensor)
        for name, tensor in sorted(model.state_dict().items())
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
    )


def _fingerprint(named_tensors: Any) -> str:
    digest = hashlib.sha256()
    for name, tensor in named_tensors:
        flat = tensor.detach().reshape(-1)
        count = min(FINGERPRINT_SAMPLES, flat.numel())
        index = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)
        values = flat[index].to(torch.bfloat16).float().cpu().numpy().tobytes()
        digest.update(f"{name}:{tuple(tensor.shape)}:".encode() + values)
    return digest.hexdigest()[:32]


def checkpoint_fingerprint(directory: str) -> str:
    """:func:`weights_fingerprint` of a Hugging Face safetensors checkpoint, without building the model: the state
    dict's names and shapes come from a skeleton on the ``meta`` device, the values are read one tensor at a time
    (a tied tensor, stored once, is read under the name the file has). Equal to the loaded model's fingerprint."""
    from pathlib import Path

    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{directory} has no .safetensors weights to fingerprint; give a safetensors checkpoint")
    where: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            where.update(dict.fromkeys(handle.keys(), path))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    state = skeleton.state_dict(keep_vars=True)
    aliases: dict[int, list[str]] = {}  # tied parameters: one tensor, several names
    for name, tensor in state.items():
        aliases.setdefault(id(tensor), []).append(name)

    def tensors() -> Any:
        for name, tensor in sorted(state.items()):
            if not tensor.is_floating_point():
                continue
            stored = next((alias for alias in [name, *aliases[id(tensor)]] if alias in where), None)
            if stored is None:
                raise ConfigError(f"{directory}: tensor {name} is not in its safetensors files; cannot fingerprint it")
            with safe_open(str(where[stored]), framework="pt") as handle:
                yield name, handle.get_tensor(stored)

    return _fingerprint(tensors())


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 of the vocabulary (token → id) and the special tokens."""
    vocabulary = sorted(tokenizer.get_vocab().items())
    special = sorted(str(token) for token in tokenizer.all_special_tokens)
    return hashlib.sha256(json.dumps([vocabulary, special]).encode()).hexdigest()[:32]
