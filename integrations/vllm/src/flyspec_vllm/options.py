"""Who gets FLy: the operator's switch (environment) and each request's ``extra_args``.

Request fields (``SamplingParams.extra_args``; the OpenAI server fills them from the request's
``vllm_xargs``) use the names of vLLM's own ``speculative_config`` FLy options (pull request
#53987), so a request reads the same whichever implementation serves it:

``rejection_sample_method``
    ``"fly"`` asks for FLy; ``"standard"`` asks for vLLM's lossless rule (an opt-out where the
    operator switched FLy on for all requests).
``fly_window_size`` / ``fly_entropy_threshold`` / ``fly_entropy_top_k``
    FLy's deferred window ``W``, entropy gate (nats) and the number of top probabilities in the
    entropy; defaults from flyspec's ``FlyConfig`` (6, 0.3, 3). flyspec's window: the last ``W``
    draft positions are never loosely accepted (vLLM's built-in rule allows one more).

Operator (environment of the ``vllm serve`` process):

``FLYSPEC_VLLM_FLY``
    ``request`` (default): FLy only for requests that ask; ``all``: FLy for every greedy request
    that does not opt out; ``off``: never (the plugin still offers its drafters).
``FLYSPEC_VLLM_GUARDS``
    ``default`` (flyspec's trust guards, ``GuardConfig()``) or ``bare`` (the paper's rule; EOS and
    cache guards stay). Operator-only: a request cannot turn the guards off.

``FLYSPEC_VLLM_PROFILE``
    a calibration profile (``flyspec calibrate``'s profile.json; flyspec's ``--profile``): FLy's
    settings and guards come from its best FLy point, and a request asking for looser settings
    (a lower threshold, a smaller window) gets vLLM's lossless rule instead, logged. A profile
    with no FLy point inside its budget turns FLy off. The profile's tokenizer must be the served
    model's (checked when FLy first runs; another tokenizer turns FLy off). Its circuit breaker is
    not applied inside vLLM.

Sampled requests (temperature > 0) always keep vLLM's lossless rejection sampling: flyspec has
no tested T > 0 rule for vLLM's kernels yet.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flyspec_vllm._flyspec import ConfigError, FlyConfig, GuardConfig, Profile, SpeculationConfig, looser

logger = logging.getLogger(__name__)

SWITCH_VARIABLE = "FLYSPEC_VLLM_FLY"
GUARDS_VARIABLE = "FLYSPEC_VLLM_GUARDS"
PROFILE_VARIABLE = "FLYSPEC_VLLM_PROFILE"
SWITCH_VALUES = ("request", "all", "off")
GUARD_VALUES = {"default": GuardConfig(), "bare": GuardConfig.bare()}
METHODS = ("fly", "standard")


def operator_switch(environ: Mapping[str, str] = os.environ) -> str:
    value = environ.get(SWITCH_VARIABLE, "request").strip().lower()
    if value not in SWITCH_VALUES:
        raise ConfigError(f"{SWITCH_VARIABLE}={value!r}: choose one of {', '.join(SWITCH_VALUES)}")
    return value


def operator_guards(environ: Mapping[str, str] = os.environ) -> GuardConfig:
    value = environ.get(GUARDS_VARIABLE, "default").strip().lower()
    if value not in GUARD_VALUES:
        raise ConfigError(f"{GUARDS_VARIABLE}={value!r}: choose one of {', '.join(GUARD_VALUES)}")
    return GUARD_VALUES[value]


@dataclass(frozen=True)
class OperatorProfile:
    """What a calibration profile sets for the plugin: FLy's settings (the limit of every request's), the guards."""

    name: str
    fly: FlyConfig
    guard: GuardConfig
    tokenizer: str  # the profile's tokenizer fingerprint (flyspec.runtime.loaded_model.tokenizer_fingerprint)


def operator_profile(environ: Mapping[str, str] = os.environ) -> OperatorProfile | None:
    """The profile ``FLYSPEC_VLLM_PROFILE`` names, or None; a :class:`ConfigError` when it has no FLy point."""
    path = environ.get(PROFILE_VARIABLE, "").strip()
    if not path:
        return None
    if environ.get(GUARDS_VARIABLE):
        raise ConfigError(f"{PROFILE_VARIABLE} sets the guards: leave {GUARDS_VARIABLE} unset")
    profile = Profile.load(path)
    point = profile.point("fly")
    if point is None:
        raise ConfigError(f"{PROFILE_VARIABLE}={path}: the profile found no FLy setting inside its budget")
    spec = SpeculationConfig.from_dict(point["speculation"])
    return OperatorProfile(profile.name, spec.fly, spec.guard, profile.model["tokenizer"])


def request_fly_config(
    extra_args: Mapping[str, Any] | None, greedy: bool, switch: str, limit: OperatorProfile | None = None
) -> FlyConfig | None:
    """The FLy settings for one request, or ``None`` for vLLM's lossless rule (``limit``: the operator's
    profile, whose settings are the defaults and the loosest a request may ask for).

    Raises :class:`ConfigError` with a message for the user on an unknown method, a bad value, or
    settings looser than the profile's.
    """
    args = dict(extra_args or {})
    method = args.get("rejection_sample_method")
    if method is not None and method not in METHODS:
        raise ConfigError(f"rejection_sample_method={method!r}: choose one of {', '.join(METHODS)}")
    wanted = method == "fly" or (switch == "all" and method is None)
    if switch == "off" or not wanted or not greedy:
        return None
    defaults = limit.fly if limit is not None else FlyConfig()
    try:
        fly = dataclasses.replace(
            defaults,
            window_size=int(args.get("fly_window_size", defaults.window_size)),
            entropy_threshold=float(args.get("fly_entropy_threshold", defaults.entropy_threshold)),
            entropy_top_k=int(args.get("fly_entropy_top_k", defaults.entropy_top_k)),
        )
    except (TypeError, ValueError) as error:
        raise ConfigError(f"bad FLy request option ({error})") from error
    if limit is not None:
        reasons = looser(
            SpeculationConfig(verifier="fly", fly=limit.fly, guard=limit.guard),
            SpeculationConfig(verifier="fly", fly=fly, guard=limit.guard),
        )
        if reasons:
            raise ConfigError(f"looser than the operator's profile {limit.name}: {'; '.join(reasons)}")
    return fly
