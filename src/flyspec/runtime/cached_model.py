"""A causal LM run incrementally over one sequence, with a KV cache that can be cropped.

The target (``target.py``) and every model drafter (draft model, layer-skip) run through it;
rollback is ``crop_to``. Caches that cannot be cropped are refused when it is made. Every layer keeps its keys
and values in place (``kernels.GrowingLayer``: a buffer that doubles when full, a rollback shortens a length) on
every device, sliding-window layers included: they keep every position, and the model's sliding mask hides those
older than the window.

Why sliding-window layers too (Gemma-3: five of every six layers): transformers' ``DynamicSlidingWindowLayer``
concatenates its whole window at every step and hands out views whose strides change with each rollback and once the
window fills; a compiled step guards on those strides, so Gemma-3-270M's compiled steps recompiled during generation
(seconds a step) until torch gave up and ran them eagerly: ``--compile`` was 10x slower than eager (issue 79). In
place, every layer's buffer keeps its strides, a step copies nothing, and the cache can rewind to any length (prefix
reuse, drafters). The cost: memory grows with the sequence rather than the window, and a sliding layer's attention
reads its whole history under the mask (BENCHMARKS.md, "Gemma-3 compiled").
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from flyspec.config import ConfigError
from flyspec.runtime.kernels import GrowingLayer
from flyspec.runtime.loaded_model import LoadedModel

_CROPPABLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


class CachedModel:
    """Runs a causal LM incrementally over one sequence, with a KV cache that can be cropped.

    ``full_history`` (drafters): keep every position in every layer, sliding-window layers
    included, also with ``in_place=False``. A drafter's rollback removes positions added by several of its forwards
    (one per draft token), but a transformers sliding-window cache layer, even recording its past, can
    only drop the positions added since its last crop. Plain layers can drop any number, and
    sliding-window attention stays exact because the model's sliding mask hides older positions
    (memory then grows with the sequence, not the window). The in-place cache (the default) keeps every position in
    every layer whatever ``full_history`` says; ``in_place=False`` without it keeps transformers' own layers (the
    reference the tests compare against), whose target crops once per forward.
    """

    def __init__(self, model: LoadedModel, full_history: bool = False, in_place: bool = True) -> None:
        self.full_history = full_history
        self.model = model.model
        self.compiled = model.step_forward is not None
        # the in-place cache (kernels.GrowingLayer) on every device, with or without flyspec's CPU kernels: a
        # step writes its keys and values into a buffer instead of concatenating (copying) the whole cache
        # (``in_place=False``: transformers' concatenating layers, the reference the tests compare against)
        self.in_place = in_place
        self.step_forward = model.step_forward or model.model  # compiled (compiled_steps.compile_steps) or eager
        self.prefill_forward = model.prefill_forward  # compiled for a prefill from an empty cache, or None
        self.device = next(self.model.parameters()).device
        # transformers 5.2x renamed the forward's past_key_values to cache (the old name warns); older ones lack it
        parameters = inspect.signature(self.model.forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"
        model_layers = DynamicCache(config=self.model.config).layers  # the layer kinds the model's config asks for
        # a sliding window's mask differs on either side of the window: its prefill stays eager (no graph per side)
        self.sliding = any(type(layer) is DynamicSlidingWindowLayer for layer in model_layers)
        self.cache = self._new_cache()
        uncroppable = {type(layer).__name__ for layer in model_layers if type(layer) not in _CROPPABLE_LAYERS}
        if uncroppable:
            raise ConfigError(
                f"model {model.name!r} uses KV cache layers that cannot be rolled back "
                f"({', '.join(sorted(uncroppable))}); speculative decoding needs a croppable cache"
            )

    def _new_cache(self) -> DynamicCache:
        if self.in_place:  # every layer in place, sliding-window ones included (the module doc)
            cache = DynamicCache(config=self.model.config)
            cache.layers = [GrowingLayer() for _ in cache.layers]
            return cache
        if self.full_history:
            return DynamicCache()  # no config: one plain DynamicLayer per layer, created on first use
        cache = DynamicCache(config=self.model.config)
        cache.activate_past_recording()  # lets sliding-window layers roll back past their window
        return cache

    def reset(self) -> None:
        self.cache = self._new_cache()

    @property
    def cached_length(self) -> int:
        return int(self.cache.get_seq_length())

    @property
    def rewindable(self) -> bool:
        """Whether ``crop_to`` may go back to any length, not only past the last forwards: every
        layer is a plain one (a sliding-window layer only drops what it added since its last crop)."""
        return all(type(layer) in (DynamicLayer, GrowingLayer) for layer in self.cache.layers)

    @torch.inference_mode()
    def forward(self, token_ids: list[int] | torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        """Append ``token_ids`` (a list, or ``[n]`` int64 on the model's device) to the cache; return
        their logits ``[n, vocab]`` (float32).

        ``logits_to_keep > 0`` computes only the last that many rows (prefill needs none).
        """
        if isinstance(token_ids, torch.Tensor):
            # a compiled graph also guards on a tensor being an inference tensor or not: a draft made
            # outside inference mode is copied into one, as a list's tensor and the warm-up's are
            copy = self.compiled and not token_ids.is_inference()
            inputs = token_ids.clone()[None] if copy else token_ids.unsqueeze(0)  # [1, n]
        else:
            inputs = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        for layer in self.cache.layers if self.in_place else ():
            if isinstance(layer, GrowingLayer):
                layer.reserve(inputs.shape[1])  # outside the graph: a compiled step never grows a buffer
        forward = self._forward_for(inputs.shape[1], logits_to_keep)
        cache = {self._cache_argument: self.cache}
        output = forward(input_ids=inputs, use_cache=True, logits_to_keep=logits_to_keep, **cache)
        return output.logits[0].float()

    def _forward_for(self, num_tokens: int, logits_to_keep: int) -> Any:
        """The forward for a call: a step's compiled graph (every logit kept); a prefill's from an empty cache of
        plain layers (2 tokens or more, the last one's logits: the shapes its one graph was compiled for); eager
        for anything else that keeps some rows (a prefill after a cache, a draft model's checks)."""
        if logits_to_keep == 0:
            return self.step_forward
        # not into a drafter's cache, nor for a model with sliding-window layers, whose mask could ask for a new graph
        # at some prompt length
        fresh = self.cached_length == 0 and not self.full_history and not self.sliding
        if self.prefill_forward is not None and logits_to_keep == 1 and num_tokens >= 2 and fresh:
            return self.prefill_forward
        return self.model

    def crop_to(self, length: int) -> None:
        """Drop cached positions beyond ``length`` (always called, so sliding layers shrink too)."""
        if length == self.cached_length == 0:
            return  # nothing cached yet (a sliding-window layer cannot be cropped before its first forward)
        if length > self.cached_length:
            raise RuntimeError(f"cannot crop a cache of {self.cached_length} positions to {length}")
        removed = self.cached_length - length
        self.cache.crop(-removed)
        if self.compiled and removed:
            self._make_contiguous()

    @torch.inference_mode()
    def _make_contiguous(self) -> None:
        """A cropped cache layer is a view that keeps the longer tensor's strides, and a compiled
        graph guards on strides: without this copy every rollback shape compiles a new graph (torch
        gives up after 8 and runs the rest eagerly). Compiled steps only; the next forward's
        concatenation copies the cache anyway. In inference mode, so the copies stay inference
        tensors like the rest of the cache (the graph guards on that too)."""
        for layer in self.cache.layers:
            if isinstance(layer, GrowingLayer):
                continue  # views of a buffer whose strides never change
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                if isinstance(tensor, torch.Tensor) and not tensor.is_contiguous():
                    setattr(layer, name, tensor.contiguous())
