"""Who gets which rule: the operator's switches (environment) and each request's ``extra_args``.

Request fields (``SamplingParams.extra_args``; the OpenAI server fills them from the request's
``vllm_xargs``). FLy's use the names of vLLM's own ``speculative_config`` options (pull request
#53987), so a request reads the same whichever implementation serves it:

``rejection_sample_method``
    ``"fly"`` asks for FLy; ``"standard"`` asks for vLLM's lossless rule: an opt-out where the
    operator switched FLy on for all requests, and under vLLM's own FLy (configured engine-wide) a request
    verified exactly (every loose accept vLLM's FLy makes for it is vetoed, on V1 and V2).
``fly_window_size`` / ``fly_entropy_threshold`` / ``fly_entropy_top_k``
    FLy's deferred window ``W``, entropy gate (nats) and the number of top probabilities in the
    entropy; defaults from flyspec's ``FlyConfig`` (6, 0.3, 3). flyspec's window: the ``W - 1`` draft
    tokens after a mismatch must match (vLLM 0.33's built-in rule asks ``W``: one position stricter).
``flyspec_rule``
    any of flyspec's lossy rules with its settings, as a ``--speculative-config`` mapping of the rule's
    fields: ``{"verifier": "margin", "margin": {"logit_ratio": 0.9}}``, ``{"verifier": "fly", "fly":
    {"entropy_threshold": 0.6, "window_size": 6, "min_draft_prob": 0.1}}``, or a rule's name, ``"typical"``.
    Through vLLM's OpenAI server (``vllm_xargs``, whose values are strings, numbers or lists) the mapping is
    sent as a JSON string. The same code as ``flyspec generate --verifier ...`` decides (``rule.py``).
    ``"guard"`` is the operator's unless requests are trusted.
``flyspec_draft``
    ``false``: no draft tokens for this request (plain decoding inside a speculative engine). Through the
    OpenAI server JSON ``false`` arrives as ``0``; ``0``/``1`` and ``"true"``/``"false"`` are taken.

A refused option is a 400 from vLLM's OpenAI server naming the field (``vllm_xargs.<field>``): the plugin checks
every request's options where vLLM validates its sampling parameters (``SamplingParams.verify``, ``patch.py``).

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
import json
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
    SamplingConfig,
    SamplingRange,
    SpeculationConfig,
    looser,
    make_verifier,
    rule_mapping,
)
from flyspec_vllm.prediction import PREDICTION_KEY  # a request's prediction: exact unless its profile measured some

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
    # where the profile measured its points: its rules apply only to requests inside it (the plugin loosens greedy
    # requests only, so a profile that did not measure greedy decoding loosens none)
    sampling: SamplingRange = field(default_factory=lambda: SamplingRange(measured=True))

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
    sampling = profile.sampling_range
    if not sampling.covers(SamplingConfig()):
        logger.warning("flyspec-vllm: profile %s was measured at %s, not greedy: no request gets its loose accepts "
                       "(the plugin loosens greedy requests only)", profile.name, sampling.describe())  # fmt: skip
    name, tokenizer = profile.name, profile.model["tokenizer"]
    return OperatorProfile(name, rule_of(chosen), rule_of(fly), tokenizer, breaker, sampling)


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
    exact: bool = False  # rejection_sample_method "standard": vLLM's lossless rule, also under vLLM's own FLy


class RequestError(ConfigError):
    """A request's option refused; ``field`` names it (vLLM's OpenAI server answers 400 naming it: ``patch.py``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def flag(value: Any, field: str) -> bool:
    """A boolean as vLLM's OpenAI server delivers it: ``vllm_xargs`` values are typed str / int / float / list, so
    JSON ``false`` arrives as ``0``; ``"true"`` / ``"false"`` (and ``"1"`` / ``"0"``) are taken too."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise RequestError(field, f"{field} must be true or false, not {value!r}")


def structured(value: Any, field: str) -> Any:
    """An object or a list, as itself or as a JSON string (``vllm_xargs`` carries no objects)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as error:
        raise RequestError(field, f"{field}: not valid JSON ({error.msg} at character {error.pos})") from None


def rule_mapping_of(value: Any, field: str = "flyspec_rule") -> Mapping[str, Any]:
    """``flyspec_rule`` as a mapping: an object, its JSON string, or a rule's bare name (``"typical"``)."""
    if isinstance(value, str) and not value.strip().startswith(("{", '"')):
        value = {"verifier": value.strip()}
    value = structured(value, field)
    if isinstance(value, str):
        value = {"verifier": value}
    if not isinstance(value, Mapping):
        raise RequestError(field, f'{field} must be an object such as {{"verifier": "fly"}}, not {value!r}')
    return value


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

    Values come as vLLM delivers them (``SamplingParams.extra_args``; through the OpenAI server, ``vllm_xargs``:
    objects as JSON strings, booleans as 0 / 1). Raises :class:`RequestError` naming the field, with a message for
    the user, on an unknown method, a bad value, a field only trusted requests may set, or settings looser than the
    profile's.
    """
    args = dict(extra_args or {})
    draft = flag(args.get("flyspec_draft", True), "flyspec_draft")
    untrusted = [key for key in TRUSTED_KEYS if key in args] if not trusted else []
    if untrusted:
        raise RequestError(untrusted[0], f"{', '.join(untrusted)}: only for trusted requests (the operator's "
                           f"{TRUST_VARIABLE}=1)")  # fmt: skip
    record = args.get("flyspec_record")
    if record is not None and not isinstance(record, str):
        raise RequestError("flyspec_record", f"flyspec_record must be a string key, not {record!r}")
    families = structured(args.get("flyspec_shadow", ()), "flyspec_shadow")
    try:
        shadow = tuple(tuple(parse_rule(rule, "flyspec_shadow") for rule in family) for family in families)
    except (ConfigError, TypeError) as error:
        raise RequestError("flyspec_shadow", f"flyspec_shadow: {error}") from None
    if shadow and record is None:
        raise RequestError("flyspec_shadow", "flyspec_shadow needs a flyspec_record key (the shadow is read from it)")
    prompt_length = args.get("flyspec_prompt_length")
    if prompt_length is not None and (not isinstance(prompt_length, int) or prompt_length < 1):
        message = f"flyspec_prompt_length must be a positive number of tokens, not {prompt_length!r}"
        raise RequestError("flyspec_prompt_length", message)
    reference = args.get("flyspec_reference")
    if reference is not None:
        if not isinstance(reference, list | tuple) or not all(isinstance(t, int) and t >= 0 for t in reference):
            raise RequestError("flyspec_reference", "flyspec_reference must be a list of token ids")
        if not shadow:
            raise RequestError("flyspec_reference", "flyspec_reference cuts drafts to what the shadow rules read: "
                               "give flyspec_shadow too")  # fmt: skip
        reference = tuple(reference)
    rule = _request_rule(args, greedy, switch, limit, guard or GuardConfig(), trusted)
    if shadow and rule is not None:
        raise RequestError("flyspec_shadow", "flyspec_shadow follows a lossless request's path: leave its own lossy "
                           "rule out")  # fmt: skip
    # under vLLM's own FLy, a request with a prediction its profile did not measure is verified exactly too
    unmeasured = limit is not None and not limit.sampling.covers(SamplingConfig(), args.get(PREDICTION_KEY) is not None)
    exact = args.get("rejection_sample_method") == "standard" or unmeasured
    return RequestOptions(rule, draft, record, shadow, prompt_length, reference, exact)


def _request_rule(
    args: Mapping[str, Any], greedy: bool, switch: str, limit: OperatorProfile | None, guard: GuardConfig, trusted: bool
) -> SpeculationConfig | None:
    method = args.get("rejection_sample_method")
    if method is not None and method not in METHODS:
        raise RequestError("rejection_sample_method",
                           f"rejection_sample_method={method!r}: choose one of {', '.join(METHODS)}")  # fmt: skip
    asked = args.get("flyspec_rule")
    if asked is not None and method == "standard":
        raise RequestError("flyspec_rule", "flyspec_rule with rejection_sample_method='standard': ask for one or the "
                           "other")  # fmt: skip
    mapping = rule_mapping_of(asked) if asked is not None else None
    if mapping is not None and "guard" in mapping and not trusted:
        raise RequestError("flyspec_rule", f"the trust guards are the operator's: leave guard out of flyspec_rule "
                           f"({TRUST_VARIABLE})")  # fmt: skip
    try:
        rule = parse_rule(mapping) if mapping is not None else None
    except ConfigError as error:
        raise RequestError("flyspec_rule", str(error)) from None
    _vllm_fly_options(args, FlyConfig())  # checked whether or not a rule applies (T > 0, the switch off)
    wanted = asked is not None or method == "fly" or (switch == "all" and method is None)
    if switch == "off" or not wanted or not greedy:
        return None
    # a profile measured only sampled, or (a request with a prediction) without predictions: vLLM's lossless rule
    if limit is not None and not limit.sampling.covers(SamplingConfig(), args.get(PREDICTION_KEY) is not None):
        return None
    if rule is not None:
        if "guard" not in (mapping or {}):
            rule = dataclasses.replace(rule, guard=limit.guard if limit is not None else guard)
    else:
        base = limit.fly if limit is not None and limit.fly is not None else None
        rule = base or dataclasses.replace(SpeculationConfig(verifier="fly"), guard=guard)
        rule = dataclasses.replace(rule, fly=_vllm_fly_options(args, rule.fly))
    if limit is not None:
        allowed = limit.rule if limit.rule is not None and limit.rule.verifier == rule.verifier else limit.fly
        field = "flyspec_rule" if asked is not None else "rejection_sample_method"
        if allowed is None or allowed.verifier != rule.verifier:
            raise RequestError(field, f"the operator's profile {limit.name} has no {rule.verifier} point inside its "
                               "budget")  # fmt: skip
        reasons = looser(allowed, rule)
        if reasons:
            raise RequestError(field, f"looser than the operator's profile {limit.name}: {'; '.join(reasons)}")
    return rule


def _vllm_fly_options(args: Mapping[str, Any], defaults: FlyConfig) -> FlyConfig:
    names = {"fly_window_size": "window_size", "fly_entropy_threshold": "entropy_threshold",
             "fly_entropy_top_k": "entropy_top_k"}  # fmt: skip
    values: dict[str, Any] = {}
    for key, name in names.items():
        if key in args:
            try:
                values[name] = (float if name == "entropy_threshold" else int)(args[key])
            except (TypeError, ValueError):
                raise RequestError(key, f"{key} must be a number, not {args[key]!r}") from None
    try:
        return dataclasses.replace(defaults, **values)
    except ConfigError as error:
        raise RequestError(next(iter(key for key in names if key in args), "fly_window_size"), str(error)) from None


def shadow_request(families: Sequence[Sequence[SpeculationConfig]]) -> list[list[dict[str, Any]]]:
    """``flyspec_shadow`` for these families of rules (the request side of :func:`request_options`)."""
    return [[rule_request(rule) for rule in family] for family in families]


def rule_request(rule: SpeculationConfig) -> dict[str, Any]:
    """``flyspec_rule`` for a rule: its verifier, settings and guards, JSON-ready."""
    return rule_mapping(rule)
