"""Configs from and to mappings: flat option names, vLLM's ``speculative_config`` keys, JSON.

The generic half of :mod:`flyspec.config`: it knows no config class, only dataclasses, so the
classes there (the one home of every default) stay declarations.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message says how to fix it."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


# Flat option names (``--window-size``, a request's ``speculative.window_size``) → SpeculationConfig field.
FLAT_OPTIONS = {
    "drafter": "drafter",
    "verifier": "verifier",
    "num_draft_tokens": "num_draft_tokens",
    "draft_model": "draft_model",
    "stack": "stack",
    "num_proposal_tokens": "num_proposal_tokens",
    "window_size": "fly.window_size",
    "entropy_threshold": "fly.entropy_threshold",
    "fly_temperature_rule": "fly.temperature_rule",
    "margin_ratio": "margin.logit_ratio",
    "typical_epsilon": "typical.epsilon",
    "typical_delta": "typical.delta",
    "bild_rollback": "bild.rollback_threshold",
    "lenience": "lenience.lenience",
    "fsd_divergence": "fsd.divergence",
    "fsd_threshold": "fsd.threshold",
    "cascade_rule": "cascade.rule",
    "cascade_lenience": "cascade.lenience",
    "adasd_min_samples": "adasd.min_samples",
    "adasd_scale": "adasd.scale",
    "exact_first": "guard.exact_first",
    "max_ngram": "ngram.max_ngram",
    "min_ngram": "ngram.min_ngram",
    "ngram_match": "ngram.match",
    "ngram_cache_entries": "ngram_cache.max_entries",
    "skip_layers": "layer_skip.skip_layers",
    "draft_length": "draft_length.policy",
    "min_draft_tokens": "draft_length.min_tokens",
    "draft_confidence": "draft_length.confidence_threshold",
    "profile": "profile",
}

# vLLM ``speculative_config`` key → flyspec field (dotted: a component's field). Names as in vLLM's
# docs (docs.vllm.ai, features/speculative_decoding: n_gram, draft_model and fly pages).
VLLM_KEYS = {
    "num_speculative_tokens": "num_draft_tokens",
    "model": "draft_model",
    "prompt_lookup_max": "ngram.max_ngram",
    "prompt_lookup_min": "ngram.min_ngram",
    "fly_window_size": "fly.window_size",
    "fly_entropy_threshold": "fly.entropy_threshold",
    "fly_entropy_top_k": "fly.entropy_top_k",
}
VLLM_METHODS = {"ngram": "ngram", "draft_model": "draft-model"}  # vLLM ``method`` → flyspec drafter


def from_vllm(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """``mapping`` with vLLM's keys turned into flyspec's (nested dicts for component fields)."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if key == "method":
            require(
                value in VLLM_METHODS,
                f"vLLM method {value!r} has no flyspec drafter; use one of {', '.join(VLLM_METHODS)} "
                "or flyspec's own key 'drafter'",
            )
            out["drafter"] = VLLM_METHODS[value]
        elif key == "rejection_sample_method":
            # vLLM's FLy switch; its default (strict rejection sampling) is flyspec's lossless default
            require(value == "fly", f"rejection_sample_method {value!r} is not supported; use 'fly' or leave it out")
            out["verifier"] = "fly"
        elif key in VLLM_KEYS:
            *component, name = VLLM_KEYS[key].split(".")
            target = out.setdefault(component[0], {}) if component else out
            target[name] = value
        else:
            if isinstance(value, Mapping) and isinstance(out.get(key), dict):
                value = {**out[key], **value}
            out[key] = value
    return out


@functools.cache
def _type_hints(cls: Any) -> dict[str, Any]:
    """A config class's field types, resolved once (``typing.get_type_hints`` parses the annotations each call:
    most of a rule's parse time, which the vLLM plugin paid per request per step)."""
    return typing.get_type_hints(cls)


def replaced(config: Any, fields: Mapping[str, Any], where: str) -> Any:
    """``dataclasses.replace`` that recurses into nested config dataclasses and turns lists into tuples."""
    known = {item.name: item for item in dataclasses.fields(config)}
    changes: dict[str, Any] = {}
    hints = _type_hints(config.__class__)
    for name, value in fields.items():
        require(
            name in known,
            f"unknown {where} key {name!r}; known: {', '.join(known)}"
            + (
                f", and vLLM's {', '.join(['method', 'rejection_sample_method', *VLLM_KEYS])}"
                if where == "speculative config"
                else ""
            ),
        )
        current = getattr(config, name)
        if dataclasses.is_dataclass(current) and isinstance(value, Mapping):
            changes[name] = replaced(current, value, f"{where} {name}")
        else:
            changes[name] = coerced(value, hints[name], f"{where} {name}")
    return dataclasses.replace(config, **changes)


def coerced(value: Any, hint: Any, where: str) -> Any:
    """A JSON value as the field's type wants it: lists become tuples, ints are floats where floats are due."""
    if isinstance(value, list):
        return tuple(value)
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if isinstance(value, int) and not isinstance(value, bool) and float in options and int not in options:
        return float(value)
    wanted = tuple(option for option in options if isinstance(option, type) and option is not type(None))
    acceptable = value is None and type(None) in options
    if not acceptable and wanted and not isinstance(value, wanted):
        raise ConfigError(f"{where} must be {' or '.join(option.__name__ for option in wanted)} (got {value!r})")
    return value


def jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: jsonable(inner) for key, inner in value.items()}
    if isinstance(value, tuple | list):
        return [jsonable(inner) for inner in value]
    return value


def floats(value: object, prefix: str = "") -> list[tuple[str, float]]:
    """Every float field of a (nested) dataclass, as ``(dotted name, value)``."""
    found: list[tuple[str, float]] = []
    for item in dataclasses.fields(value):  # type: ignore[arg-type]
        inner = getattr(value, item.name)
        if isinstance(inner, float):
            found.append((prefix + item.name, inner))
        elif dataclasses.is_dataclass(inner):
            found.extend(floats(inner, f"{prefix}{item.name}."))
    return found
