"""Who gets which rule: the operator's switches (environment) and each request's ``extra_args``.

Request fields (``SamplingParams.extra_args``; the OpenAI server fills them from the request's
``vllm_xargs``). FLy's use the names of vLLM's own ``speculative_config`` options (pull request
#53987), so a request reads the same whichever implementation serves it:

``rejection_sample_method``
    ``"fly"`` asks for FLy; ``"standard"`` asks for vLLM's lossless rule (an opt-out where the
    operator switched FLy on for all requests).
``fly_window_size`` / ``fly_entropy_threshold`` / ``fly_entropy_top_k``
    FLy's deferred window ``W``, entropy gate (nats) and the number of top probabilities in the
    entropy; defaults from flyspec's ``FlyConfig`` (6, 0.3, 3). flyspec's window: the ``W - 1`` draft
    tokens after a mismatch must match (vLLM 0.33's built-in rule asks ``W``: one position stricter).
``flyspec_rule``
    any of flyspec's lossy rules with its settings, as a ``--speculative-config`` mapping of the rule's
    fields: ``{"verifier": "margin", "margin": {"logit_ratio": 0.9}}``, ``{"verifier": "fly", "fly":
    {"entropy_threshold": 0.6, "window_size": 6, "min_draft_prob": 0.1}}``, ``"typical"``. The same
    code as ``flyspec generate --verifier ...`` decides (``rule.py``). ``"guard"`` is the operator's
    unless requests are trusted.
``flyspec_draft``
    ``false``: no draft tokens for this request (plain decoding inside a speculative engine).

Trusted requests only (``FLYSPEC_VLLM_TRUST_REQUESTS=1``, for flyspec's own calibrate/eval worker):
``flyspec_rule`` may set the trust guards; ``flyspec_record`` (a key) records the request's loose
accepts for :func:`flyspec_vllm.records.take`; ``flyspec_shadow`` (families of rules, each from strict
to loose) records, for each rule, where it would first have kept a draft token this request's rule did
not (``rule.py``: what lets a calibration decode a setting only from where it leaves the shared path);
``flyspec_prompt_length`` says how much of the request's prompt is the user's prompt (the rest: output a
continuation resumes from), so that the guards that look at the prompt and the recorded output indices see
the generation as it was; ``flyspec_reference`` (token ids; with ``flyspec_shadow``) names the output a shadow
request will produce, so that its drafts are cut to what its shadow rules read (``reference.py``).

Operator (environment of the ``vllm serve`` process):

``FLYSPEC_VLLM_FLY``
    ``request`` (default): a lossy rule only for requests that ask; ``all``: FLy for every greedy
    request that does not opt out; ``off``: never (the plugin still offers its drafters).
``FLYSPEC_VLLM_GUARDS``
    ``default`` (flyspec's trust guards, ``GuardConfig()``) or ``bare`` (the paper's rule; EOS and
    cache guards stay). Operator-only unless requests are trusted.
``FLYSPEC_VLLM_PROFILE``
    a calibration profile (``flyspec calibrate``'s profile.json; flyspec's ``--profile``): the lossy
    settings and guards come from its chosen point (or its best FLy point for a plain FLy request), and
    a request asking for looser settings gets vLLM's lossless rule instead, logged. A profile with no
    lossy point inside its budget turns loose acceptance off. The profile's tokenizer must be the
    served model's (checked when a lossy rule first runs). Its circuit breaker applies per request: once a
    request's loose accepts run far above the calibrated rate, the rest of it is verified strictly.
``FLYSPEC_VLLM_TRUST_REQUESTS``
    ``1``: requests may set the guards, record and shadow (above). Never on a server others reach.

Sampled requests (temperature > 0) always keep vLLM's lossless rejection sampling: flyspec has
no tested T > 0 rule for vLLM's kernels yet.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flyspec_vllm._flyspec import (
    DISTRIBUTION_VERIFIERS,
    LOSSY_RULE_FIELDS,
    LOSSY_VERIFIERS,
    BreakerConfig,
    ConfigError,
    FlyConfig,
    GuardConfig,
    Profile,
    SpeculationConfig,
    looser,
    make_verifier,
    rule_mapping,
)

logger = logging.getLogger(__name__)

SWITCH_VARIABLE = "FLYSPEC_VLLM_FLY"
GUARDS_VARIABLE = "FLYSPEC_VLLM_GUARDS"
PROFILE_VARIABLE = "FLYSPEC_VLLM_PROFILE"
TRUST_VARIABLE = "FLYSPEC_VLLM_TRUST_REQUESTS"
SWITCH_VALUES = ("request", "all", "off")
GUARD_VALUES = {"default": GuardConfig(), "bare": GuardConfig.bare()}
METHODS = ("fly", "standard")
# every lossy rule that reads the target's logits alone: a rewrite of them at the draft positions (fsd and cascade
# also read the draft model's distribution, which the plugin's n-gram proposer has not)
LOSSY_RULES = tuple(name for name in LOSSY_VERIFIERS if name not in DISTRIBUTION_VERIFIERS)
REQUEST_KEYS = (
    "rejection_sample_method",
    "fly_window_size",
    "fly_entropy_threshold",
    "fly_entropy_top_k",
    "flyspec_rule",
    "flyspec_draft",
    "flyspec_record",
    "flyspec_shadow",
    "flyspec_prompt_length",
    "flyspec_reference",
)
TRUSTED_KEYS = ("flyspec_record", "flyspec_shadow", "flyspec_prompt_length", "flyspec_reference")


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


def operator_trusts_requests(environ: Mapping[str, str] = os.environ) -> bool:
    value = environ.get(TRUST_VARIABLE, "0").strip().lower()
    if value not in ("0", "1", "false", "true", ""):
        raise ConfigError(f"{TRUST_VARIABLE}={value!r}: choose 1 (trust) or 0")
    return value in ("1", "true")


@dataclass(frozen=True)
class OperatorProfile:
    """What a calibration profile sets for the plugin: the lossy rule (the limit of every request's) and the
    rule a plain FLy request gets (its best FLy point, if it has one)."""

    name: str
    rule: SpeculationConfig | None  # the chosen point's rule; None: no lossy point inside the budget
    fly: SpeculationConfig | None  # the best FLy point's rule
    tokenizer: str  # the profile's tokenizer fingerprint (flyspec.runtime.loaded_model.tokenizer_fingerprint)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)  # the chosen point's circuit breaker

    @property
    def guard(self) -> GuardConfig:
        return (self.rule or self.fly or SpeculationConfig()).guard


def operator_profile(environ: Mapping[str, str] = os.environ) -> OperatorProfile | None:
    """The profile ``FLYSPEC_VLLM_PROFILE`` names, or None; a :class:`ConfigError` when it has no lossy point."""
    path = environ.get(PROFILE_VARIABLE, "").strip()
    if not path:
        return None
    if environ.get(GUARDS_VARIABLE):
        raise ConfigError(f"{PROFILE_VARIABLE} sets the guards: leave {GUARDS_VARIABLE} unset")
    profile = Profile.load(path)
    profile.check_engine("vllm")
    chosen, fly = profile.point(), profile.point("fly")
    if chosen is None and fly is None:
        raise ConfigError(f"{PROFILE_VARIABLE}={path}: the profile found no lossy setting inside its budget")

    def rule_of(point: dict[str, Any] | None) -> SpeculationConfig | None:
        return None if point is None else lossy_rule(SpeculationConfig.from_dict(point["speculation"]))

    breaker = SpeculationConfig.from_dict((chosen or fly or {"speculation": {}})["speculation"]).breaker
    return OperatorProfile(profile.name, rule_of(chosen), rule_of(fly), profile.model["tokenizer"], breaker)


def lossy_rule(spec: SpeculationConfig) -> SpeculationConfig:
    """Only what decides a loose accept (verifier, its settings, the guards): a request's rule, hashable."""
    return dataclasses.replace(SpeculationConfig(), **{name: getattr(spec, name) for name in LOSSY_RULE_FIELDS})


def parse_rule(mapping: Any, what: str = "flyspec_rule") -> SpeculationConfig:
    """A lossy rule from a request's mapping (``{"verifier": "margin", "margin": {...}}``)."""
    if not isinstance(mapping, Mapping):
        raise ConfigError(f'{what} must be an object such as {{"verifier": "fly"}}, not {type(mapping).__name__}')
    unknown = sorted(set(mapping) - set(LOSSY_RULE_FIELDS))
    if unknown:
        raise ConfigError(
            f"{what}: {', '.join(unknown)} cannot be set per request (the drafter is the engine's); "
            f"give only {', '.join(LOSSY_RULE_FIELDS)}"
        )
    if mapping.get("verifier") in DISTRIBUTION_VERIFIERS:  # before the config, which would ask for a draft model
        raise ConfigError(
            f"{what}: verifier {mapping['verifier']!r} compares the draft model's distribution with the target's, "
            f"which the plugin does not see; choose one of {', '.join(LOSSY_RULES)}, or run it on flyspec's own engine"
        )
    spec = lossy_rule(SpeculationConfig.from_dict(mapping))
    if spec.verifier not in LOSSY_RULES:
        lossless = (
            ' (vLLM runs block verification itself, engine-wide: speculative_config rejection_sample_method "block")'
            if spec.verifier == "block"
            else ""
        )
        raise ConfigError(
            f"{what}: verifier {spec.verifier!r} is not a lossy rule{lossless}; choose one of {LOSSY_RULES}"
        )
    make_verifier(spec.verifier, spec)  # the rule's own checks
    return spec


@dataclass(frozen=True)
class RequestOptions:
    """One request's settings: its lossy rule (None: vLLM's lossless rule), whether it gets drafts, and
    (trusted requests) its record key and shadow families."""

    rule: SpeculationConfig | None = None
    draft: bool = True
    record: str | None = None
    shadow: tuple[tuple[SpeculationConfig, ...], ...] = ()
    prompt_length: int | None = None  # the user's prompt within the request's (a continuation's: the rest is output)
    reference: tuple[int, ...] | None = None  # the output a shadow request will produce (reference.py)


def request_options(
    extra_args: Mapping[str, Any] | None,
    greedy: bool,
    switch: str,
    limit: OperatorProfile | None = None,
    guard: GuardConfig | None = None,
    trusted: bool = False,
) -> RequestOptions:
    """What one request asked for, within what the operator allows (``guard``: the operator's guards; ``limit``:
    the operator's profile, whose settings are the defaults and the loosest a request may ask for).

    Raises :class:`ConfigError` with a message for the user on an unknown method, a bad value, a field
    only trusted requests may set, or settings looser than the profile's.
    """
    args = dict(extra_args or {})
    draft = args.get("flyspec_draft", True)
    if not isinstance(draft, bool):
        raise ConfigError(f"flyspec_draft must be true or false, not {draft!r}")
    untrusted = [key for key in TRUSTED_KEYS if key in args] if not trusted else []
    if untrusted:
        raise ConfigError(f"{', '.join(untrusted)}: only for trusted requests (the operator's {TRUST_VARIABLE}=1)")
    record = args.get("flyspec_record")
    if record is not None and not isinstance(record, str):
        raise ConfigError(f"flyspec_record must be a string key, not {record!r}")
    shadow = tuple(
        tuple(parse_rule(rule, "flyspec_shadow") for rule in family) for family in args.get("flyspec_shadow", ())
    )
    if shadow and record is None:
        raise ConfigError("flyspec_shadow needs a flyspec_record key (the shadow is read from the record)")
    prompt_length = args.get("flyspec_prompt_length")
    if prompt_length is not None and (not isinstance(prompt_length, int) or prompt_length < 1):
        raise ConfigError(f"flyspec_prompt_length must be a positive number of tokens, not {prompt_length!r}")
    reference = args.get("flyspec_reference")
    if reference is not None:
        if not isinstance(reference, list | tuple) or not all(isinstance(t, int) and t >= 0 for t in reference):
            raise ConfigError("flyspec_reference must be a list of token ids")
        if not shadow:
            raise ConfigError("flyspec_reference cuts drafts to what the shadow rules read: give flyspec_shadow too")
        reference = tuple(reference)
    rule = _request_rule(args, greedy, switch, limit, guard or GuardConfig(), trusted)
    if shadow and rule is not None:
        raise ConfigError("flyspec_shadow follows a lossless request's path: leave its own lossy rule out")
    return RequestOptions(rule, draft, record, shadow, prompt_length, reference)


def _request_rule(
    args: Mapping[str, Any], greedy: bool, switch: str, limit: OperatorProfile | None, guard: GuardConfig, trusted: bool
) -> SpeculationConfig | None:
    method = args.get("rejection_sample_method")
    if method is not None and method not in METHODS:
        raise ConfigError(f"rejection_sample_method={method!r}: choose one of {', '.join(METHODS)}")
    asked = args.get("flyspec_rule")
    if asked is not None and method == "standard":
        raise ConfigError("flyspec_rule with rejection_sample_method='standard': ask for one or the other")
    wanted = asked is not None or method == "fly" or (switch == "all" and method is None)
    if switch == "off" or not wanted or not greedy:
        return None
    if asked is not None:
        mapping = _as_mapping(asked)
        if "guard" in mapping and not trusted:
            raise ConfigError(
                f"the trust guards are the operator's: leave guard out of flyspec_rule ({TRUST_VARIABLE})"
            )
        rule = parse_rule(mapping)
        if "guard" not in mapping:
            rule = dataclasses.replace(rule, guard=limit.guard if limit is not None else guard)
    else:
        base = limit.fly if limit is not None and limit.fly is not None else None
        rule = base or dataclasses.replace(SpeculationConfig(verifier="fly"), guard=guard)
        rule = dataclasses.replace(rule, fly=_vllm_fly_options(args, rule.fly))
    if limit is not None:
        allowed = limit.rule if limit.rule is not None and limit.rule.verifier == rule.verifier else limit.fly
        if allowed is None or allowed.verifier != rule.verifier:
            raise ConfigError(f"the operator's profile {limit.name} has no {rule.verifier} point inside its budget")
        reasons = looser(allowed, rule)
        if reasons:
            raise ConfigError(f"looser than the operator's profile {limit.name}: {'; '.join(reasons)}")
    return rule


def _as_mapping(value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f'flyspec_rule must be an object such as {{"verifier": "fly"}}, not {value!r}')
    return value


def _vllm_fly_options(args: Mapping[str, Any], defaults: FlyConfig) -> FlyConfig:
    try:
        return dataclasses.replace(
            defaults,
            window_size=int(args.get("fly_window_size", defaults.window_size)),
            entropy_threshold=float(args.get("fly_entropy_threshold", defaults.entropy_threshold)),
            entropy_top_k=int(args.get("fly_entropy_top_k", defaults.entropy_top_k)),
        )
    except (TypeError, ValueError) as error:
        raise ConfigError(f"bad FLy request option ({error})") from error


def shadow_request(families: Sequence[Sequence[SpeculationConfig]]) -> list[list[dict[str, Any]]]:
    """``flyspec_shadow`` for these families of rules (the request side of :func:`request_options`)."""
    return [[rule_request(rule) for rule in family] for family in families]


def rule_request(rule: SpeculationConfig) -> dict[str, Any]:
    """``flyspec_rule`` for a rule: its verifier, settings and guards, JSON-ready."""
    return rule_mapping(rule)
