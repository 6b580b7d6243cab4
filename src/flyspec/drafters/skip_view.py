"""The *skip view* of a model: the target with some decoder layers left out, for layer-skip drafting.

It shares every parameter tensor with the target but presents only the kept decoder layers, renumbered
``0..kept-1``, under a copied config (``num_hidden_layers``, ``layer_types`` cut to match), so the model's
own forward runs unchanged. The target (config, modules, parameters, ``layer_idx``) is never touched.
Used by ``layer_skip.py`` (calibration and drafting).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, TypeVar

from torch import nn

from flyspec.config import ConfigError
from flyspec.runtime.loaded_model import LoadedModel

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder stack (``model.model.layers`` for Llama, Gemma3, Qwen, Mistral, ...)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(base, "layers", None)
    config = getattr(model, "config", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) != getattr(config, "num_hidden_layers", -1):
        raise ConfigError(
            f"layer-skip needs a decoder-only model with its layers at `model.layers` ({type(model).__name__} "
            "has none); use another drafter"
        )
    if getattr(config, "is_heterogeneous", False):
        raise ConfigError("layer-skip does not support models with per-layer configs; use another drafter")
    return layers


def validate_skip_layers(skip_layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Sorted skip indices; a :class:`ConfigError` naming the valid range for any outside it."""
    outside = sorted(layer for layer in skip_layers if not 0 <= layer < num_layers)
    if outside:
        raise ConfigError(
            f"skip layers {outside} are out of range: the model has {num_layers} layers, valid indices are "
            f"0..{num_layers - 1} (1..{num_layers - 2} keep the first and last layers)"
        )
    if len(set(skip_layers)) >= num_layers:
        raise ConfigError(f"cannot skip all {num_layers} layers; keep at least one")
    return tuple(sorted(set(skip_layers)))


def _shallow_clone(module: ModuleT) -> ModuleT:
    """The module sharing parameters and children, with its own child/parameter/hook tables (so edits stay local)."""
    clone = copy.copy(module)
    clone.__dict__.update(
        {key: copy.copy(value) for key, value in vars(module).items() if isinstance(value, dict | set)}
    )
    return clone


def _renumbered(module: nn.Module, layer_index: int) -> nn.Module:
    """A clone of a decoder layer whose ``layer_idx`` attributes (the KV-cache slot) say ``layer_index``.

    Only the modules on a path to a ``layer_idx`` are cloned; the rest (and every parameter) is shared.
    """
    clone = _shallow_clone(module)
    if "layer_idx" in vars(module):
        clone.__dict__["layer_idx"] = layer_index
    for name, child in module.named_children():
        if any("layer_idx" in vars(sub) for sub in child.modules()):
            clone._modules[name] = _renumbered(child, layer_index)
    return clone


def _view_config(config: Any, kept: Sequence[int]) -> Any:
    view = copy.deepcopy(config)
    view.num_hidden_layers = len(kept)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        view.layer_types = [layer_types[index] for index in kept]
    return view


def skip_view(target: LoadedModel, skip_layers: Sequence[int]) -> LoadedModel:
    """The target without ``skip_layers``: shared parameters, own config and module tree (see module doc)."""
    model = target.model
    layers = decoder_layers(model)
    skipped = validate_skip_layers(skip_layers, len(layers))
    kept = [index for index in range(len(layers)) if index not in skipped]
    config = _view_config(model.config, kept)
    base_name = getattr(model, "base_model_prefix", "model")
    base = _shallow_clone(getattr(model, base_name))
    base.__dict__["config"] = config
    base._modules["layers"] = nn.ModuleList([_renumbered(layers[index], new) for new, index in enumerate(kept)])
    view = _shallow_clone(model)
    view.__dict__["config"] = config
    view._modules[base_name] = base
    suffix = "-skip" + ",".join(map(str, skipped)) if skipped else "-full"
    return LoadedModel(model=view, tokenizer=target.tokenizer, name=target.name + suffix)
