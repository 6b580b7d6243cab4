"""Start-up: check vLLM's internals for each model runner, wrap them, and at engine start say what flyspec does on
the runner the engine uses — or refuse to start.

On the **V1 model runner** (``internals.py``; vLLM-CPU's runner inherits it) two internals are wrapped:

1. ``GPUModelRunner._sample``: before verification, each request's rule (FLy, MARS or typical acceptance from
   ``SamplingParams.extra_args`` and the operator's switch, the generation so far for the guards;
   ``requests.py``) is published in batch order for the duration of the call; for the proposer that runs right
   after, the rows whose request asked for no drafts (``flyspec_draft: false``) or named its output
   (``flyspec_reference``: ``reference.py``).
2. ``vllm.v1.sample.rejection_sampler.rejection_sample`` (called by ``RejectionSampler.forward`` through the
   module's global): the target logits at the loose accepts are rewritten before vLLM's kernel runs (``rule.py``);
   with vLLM's own FLy, its pre-pass kernels are guarded instead (``native.py``).

OpenAI's ``prediction`` (``prediction.py``, ``prediction_api.py``; :func:`install_predictions`): the V1 step hook
also publishes the rows whose request carries a prediction, which the proposer drafts from; the scheduler's
``add_request`` keeps such a request's speculative counts; in the API server's process the request field and its
usage are wrapped. These run whatever the operator's switch (a prediction is drafted and verified losslessly).

On the **V2 model runner** (vLLM 0.33's default on GPUs) the same rules and guards run on its rejection path
(``v2.py``). At engine start (``VllmConfig.__post_init__``, :func:`check_engine`) the plugin reads which runner
vLLM chose and logs one line saying what it does there, or refuses to start (one line naming the fix) where the
runner's internals failed their checks and vLLM's own FLy or ``FLYSPEC_VLLM_FLY=all`` would otherwise run without
flyspec's guards. Every hook fails closed (``failsafe.py``): a hook that raises costs its step the loose accepts
(exact verification, one error line, a counter), a step vLLM verifies without the hook turns loose acceptance off.

A step in which no request has a draft token (a batch schedule's ``k = 0``, no n-gram match anywhere) is sampled as
a plain engine samples it (:func:`without_empty_drafts`), also when the operator turned FLy off. So is a step that
holds a sampled request (temperature > 0) on an engine whose own rejection sampler failed the start-up check of
speculative sampling (``sampling_guard.py``, run at the end of the runner's ``initialize_kv_cache``), whatever the
operator's switch.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flyspec_vllm import failsafe, metrics, native, prediction, sampling_guard, v2
from flyspec_vllm._flyspec import ConfigError, prepare_guards
from flyspec_vllm.internals import (
    OPENAI_MODULES,
    RUNNER_MODULE,
    SAMPLER_MODULE,
    TESTED_VLLM_VERSIONS,
    V1,
    V2,
    Internals,
    check_request_internals,
    check_scheduler_internals,
    check_server_internals,
    check_v2_internals,
    uses_native_fly,
    wrap,
)
from flyspec_vllm.internals import check_internals as _check_v1
from flyspec_vllm.options import operator_guards, operator_profile, operator_switch, operator_trusts_requests
from flyspec_vllm.reference import Reference, reference_rows
from flyspec_vllm.requests import PluginState, batch_rules, context_tokens, draftless_rows, options_of
from flyspec_vllm.rule import RequestRule, apply_batch, keep_draft_tokens
from flyspec_vllm.startup import Setup, check_engine, install_checks, mode_line
from flyspec_vllm.vocabulary import vocabulary_of

__all__ = ["RUNNER_MODULE", "SAMPLER_MODULE", "PluginState", "batch_rules", "check_engine", "context_tokens",
           "draftless_rows", "mode_line"]  # fmt: skip
logger = logging.getLogger(__name__)
EXACT: list[RequestRule] = []  # a step's rules when the step hook failed: vLLM's exact verification, FLy off


@dataclass
class Step:
    """What the V1 step hook published for this step's verification, and whether the verification hook ran."""

    rules: list[RequestRule] | None  # None: every request lossless; EXACT: verify exactly, vLLM's FLy off
    verified: bool = False


STATE: PluginState | None = None
_step: contextvars.ContextVar[Step | None] = contextvars.ContextVar("flyspec_step", default=None)


def check_internals(import_module: Callable[[str], Any] = importlib.import_module) -> Internals | list[str]:
    """The V1 runner's internals if every named check passes, else the failed checks' messages."""
    return _check_v1(import_module)


def install(import_module: Callable[[str], Any] = importlib.import_module) -> bool:
    """Check vLLM's internals and wrap those of each runner that passes; True where flyspec's rules run."""
    global STATE
    setup = Setup(_version(import_module))
    sampling_guard.set_version(setup.version)
    install_predictions(import_module, setup.version)
    try:
        switch, profile, trusted = operator_switch(), operator_profile(), operator_trusts_requests()
        guard = profile.guard if profile is not None else operator_guards()
    except ConfigError as error:
        setup.error = str(error)
        install_checks(setup, lambda: STATE, import_module)
        logger.warning("flyspec-vllm: %s; nothing patched, a speculative engine is refused at start", error)
        return False
    setup.switch = switch
    setup.breaker = profile is not None and profile.breaker.enabled
    v1_internals, v2_internals = check_internals(import_module), check_v2_internals(import_module)
    setup.problems = {
        V1: v1_internals if isinstance(v1_internals, list) else [],
        V2: v2_internals if isinstance(v2_internals, list) else [],
    }
    install_checks(setup, lambda: STATE, import_module)
    if switch == "off":
        if not isinstance(v1_internals, list):  # lossless: the shortcut for steps without drafts, the sampling guard
            wrap(v1_internals.runner_class, "_sample", _wrap_sample)
            wrap_sampling_check(v1_internals.runner_class, V1)
        logger.info("flyspec-vllm: flyspec's rules off by the operator (FLYSPEC_VLLM_FLY=off); drafters offered")
        return False
    for runner, problems in setup.problems.items():
        if problems:
            logger.warning(
                "flyspec-vllm: vLLM %s's %s model runner differs from the tested ones (%s): not hooked; failed "
                "checks: %s",
                setup.version,
                runner,
                ", ".join(TESTED_VLLM_VERSIONS),
                "; ".join(problems),
            )
    hooked = [runner for runner, problems in setup.problems.items() if not problems]
    if not hooked:
        return False
    STATE = PluginState(switch=switch, guard=guard, profile=profile, trusted=trusted)
    if not isinstance(v1_internals, list):
        if v1_internals.builtin_fly:
            native.install(v1_internals.sampler_module, current_rules)
        wrap(v1_internals.sampler_module, "rejection_sample", _wrap_rejection_sample)
        wrap(v1_internals.runner_class, "_sample", _wrap_sample)
        wrap_sampling_check(v1_internals.runner_class, V1)
        if callable(getattr(v1_internals.runner_class, "load_model", None)):  # else: tables at the first FLy step
            wrap(v1_internals.runner_class, "load_model", _wrap_load_model)
    if not isinstance(v2_internals, list):
        v2.install(v2_internals, lambda: STATE)
        wrap_sampling_check(v2_internals.runner_class, V2)
    logger.info("flyspec-vllm: hooks on the %s model runner (switch=%s, guards=%s)", " and ".join(hooked), switch,
                guard)  # fmt: skip
    return True


def install_predictions(import_module: Callable[[str], Any], version: str, server: bool | None = None) -> None:
    """OpenAI's ``prediction``: the scheduler's per-request counts (every process; the engine's uses them) and, in
    vLLM's OpenAI server's process (``server``; None: where vLLM's OpenAI protocol is loaded), the request field and
    its usage (``prediction_api.py``). Internals that differ: one warning each, nothing wrapped there (where the
    requests can still be refused, a request with a prediction is a 400 naming it)."""
    scheduler = check_scheduler_internals(import_module)
    if isinstance(scheduler, list):
        logger.warning("flyspec-vllm: vLLM %s's scheduler differs from the tested ones (%s): responses to requests "
                       "with a prediction carry no prediction counts", version, "; ".join(scheduler))  # fmt: skip
    else:
        wrap(scheduler.scheduler_class, "add_request",
             functools.partial(prediction.wrap_add_request, metrics_class=scheduler.metrics_class))  # fmt: skip
    if not (sys.modules.get(OPENAI_MODULES["chat"][0]) is not None if server is None else server):
        return
    from flyspec_vllm import prediction_api

    found = check_server_internals(import_module)
    if not isinstance(found, list):
        prediction_api.install(found)
        return
    logger.warning("flyspec-vllm: vLLM %s's OpenAI server differs from the tested ones (%s): requests with a "
                   "prediction are refused", version, "; ".join(found))  # fmt: skip
    prediction_api.refuse_predictions(check_request_internals(import_module)[0], found)


def _version(import_module: Callable[[str], Any]) -> str:
    try:
        return str(import_module("vllm").__version__)
    except (ImportError, AttributeError):
        return "(unknown version)"


def current_rules() -> list[RequestRule] | None:
    """This step's rules for native.py's kernels: None outside a runner step (vLLM's own FLy, untouched: a test or
    vLLM's sampler warm-up calling the sampler directly), :data:`EXACT` (empty) where the step hook published none
    (verify exactly, vLLM's FLy off), else one rule per request."""
    step = _step.get()
    if step is None:
        return None
    return step.rules if step.rules is not None else EXACT


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


def wrap_sampling_check(runner_class: Any, runner_name: str) -> None:
    """The sampling check at the end of the runner's ``initialize_kv_cache`` (where it has one; else at its first
    step, ``sampling_guard.verdict_of``)."""
    if callable(getattr(runner_class, "initialize_kv_cache", None)):
        wrap(runner_class, "initialize_kv_cache", functools.partial(_wrap_initialize_kv_cache, runner_name=runner_name))


def _wrap_initialize_kv_cache(original: Callable[..., Any], runner_name: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def initialize_kv_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        metrics.register()  # the counters at 0 from the first scrape of /metrics (never raises)
        try:
            sampling_guard.check_runner(self, runner_name)
        except Exception as error:  # noqa: BLE001 - not fatal: the runner's first step checks instead
            failsafe.warning("the sampling check did not run at start-up (%s); it runs at the first step", error)
        return result

    return initialize_kv_cache


def _guarded(runner: Any) -> bool:
    """This step is sampled without drafts (``sampling_guard.v1_guarded``); a guard that raises guards (fail closed:
    a plain sample is right on every engine)."""
    try:
        return sampling_guard.v1_guarded(runner)
    except Exception as error:  # noqa: BLE001 - fail closed
        failsafe.fault("the V1 sampling guard", error, lambda: runner.input_batch.req_ids, SAMPLED_PLAINLY)
        sampling_guard.GUARD.step_guarded = True
        return True


SAMPLED_PLAINLY = "sampled without drafts, as a plain engine samples"
UNGUARDED = "verified exactly by vLLM's own rejection sampler, which FAILED the sampling check"


def _wrap_sample(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _sample(self: Any, logits: Any, spec_decode_metadata: Any) -> Any:
        metadata, guarded, step = _before_v1_step(self, spec_decode_metadata)
        if guarded:  # a sampled request on an engine that failed the sampling check: no drafts this step
            if metadata is None:
                return original(self, logits, None)
            try:
                return sampling_guard.sample_without_drafts(functools.partial(original, self), logits, metadata)
            except Exception as error:  # noqa: BLE001 - never the engine: vLLM's own path, said in an error line
                failsafe.fault("the V1 sampling guard", error, lambda: self.input_batch.req_ids, UNGUARDED)
                token = _step.set(Step(rules=EXACT))  # exact: vLLM's own FLy off on this path too
                try:
                    return original(self, logits, metadata)
                finally:
                    _step.reset(token)
        if step is None:  # the plugin's rules are not installed: vLLM's own step
            return original(self, logits, metadata)
        token = _step.set(step)
        try:
            result = original(self, logits, metadata)
        finally:
            _step.reset(token)
        _after_v1_step(self, metadata, step)
        return result

    return _sample


def _before_v1_step(runner: Any, spec_decode_metadata: Any) -> tuple[Any, bool, Step | None]:
    """What a V1 step needs before vLLM samples it: its spec-decode metadata (None: no drafts anywhere), whether it
    is sampled without drafts (``_guarded``), and the rules it publishes (None: the plugin's rules are not
    installed). Never raises: a fault verifies the step exactly (:data:`EXACT`), or, where it came before the sampling
    guard decided, samples it without drafts, as a plain engine samples it (lossless on every engine; exact
    verification is not where the engine's own speculative sampling is broken: vLLM-CPU 0.32's, with a sampled
    request in the batch, even for the greedy ones)."""
    metadata, decided = spec_decode_metadata, False
    try:
        prediction.PREDICTIONS.gather(runner)  # the rows drafted from their prediction (a fault: no drafts)
        metadata = without_empty_drafts(spec_decode_metadata)
        if _guarded(runner):
            return metadata, True, None
        decided = True  # the step needs no sampling guard: exact verification is lossless here
        state = STATE
        if state is None:
            return metadata, False, None
        step = Step(rules=None)
        state.draftless = draftless_rows(runner)
        state.references = reference_rows(runner, state.memos, functools.partial(options_of, state), state.trusted)
        if metadata is not None:
            native_fly = uses_native_fly(getattr(runner.vllm_config, "speculative_config", None))
            step.rules = batch_rules(runner, state, native_fly) if state.enabled else EXACT
        return metadata, False, step
    except Exception as error:  # noqa: BLE001 - fail closed: exact, or without drafts where the guard did not decide
        outcome = "verified exactly, lossless" if decided else SAMPLED_PLAINLY
        failsafe.fault("the V1 step hook", error, lambda: runner.input_batch.req_ids, outcome)
        if STATE is not None:
            STATE.draftless, STATE.references = frozenset(), {}
        return metadata, not decided, Step(rules=EXACT)


def _after_v1_step(runner: Any, metadata: Any, step: Step) -> None:
    """After vLLM sampled a step with drafts: the verification hook ran (counted), or vLLM verified without it (a
    bypass: loose acceptance off from now on). Never raises."""
    try:
        if metadata is None:
            return
        if step.verified:
            metrics.add(verified_steps=1)
            return
        if STATE is not None:
            STATE.enabled = False
        failsafe.bypassed("V1 model runner", getattr(runner, "rejection_sampler", None), _v1_exact)
    except Exception as error:  # noqa: BLE001 - the step is sampled already; only its bookkeeping is lost
        failsafe.fault("the V1 step's bookkeeping", error, lambda: runner.input_batch.req_ids, "committed as sampled")


def _v1_exact(sampler: Any) -> bool:
    """vLLM's own FLy off on a V1 ``RejectionSampler`` (``forward`` passes ``fly_window_size=None`` then)."""
    if not hasattr(sampler, "fly_window_size"):
        return False
    sampler.fly_window_size = None
    sampler.use_fly = False
    return True


def _wrap_load_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if STATE is not None and STATE.enabled:
            try:
                prepare_tables(self, STATE)
            except Exception as error:  # noqa: BLE001 - not fatal: the first FLy step builds them instead
                failsafe.warning("token tables not built at start-up (%s); built at the first FLy step", error)
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
        step = _step.get()
        if step is None:  # outside a runner step (vLLM's warm-up, a direct call): vLLM's own rule, its FLy included
            return original(draft_token_ids, num_draft_tokens, *args, **kwargs)
        step.verified = True
        native_fly = "fly_window_size" in kwargs and kwargs["fly_window_size"] is not None
        exact = kwargs | {"fly_window_size": None} if native_fly else kwargs
        rules = step.rules
        if rules is None or rules is EXACT:  # no rules for this step: exact, vLLM's FLy off
            return original(draft_token_ids, num_draft_tokens, *args, **exact)
        try:
            if native_fly or not any(rule.active for rule in rules):  # native.py's kernels veto
                rewritten = None
            else:
                bound = dict(zip(REJECTION_SAMPLE_ARGUMENTS, args, strict=False)) | kwargs
                outcome = apply_batch(draft_token_ids, num_draft_tokens, bound["target_logits"], rules)
                rewritten = bound | {"target_logits": keep_draft_tokens(bound["target_logits"], draft_token_ids,
                                                                        outcome.loose_positions)}  # fmt: skip
                metrics.record(outcome)
        except Exception as error:  # noqa: BLE001 - fail closed: this step is verified exactly
            failsafe.fault("the V1 verification hook", error, lambda: _request_ids(rules))
            return original(draft_token_ids, num_draft_tokens, *args, **exact)
        if rewritten is None:
            return original(draft_token_ids, num_draft_tokens, *args, **kwargs)
        return original(draft_token_ids, num_draft_tokens, **rewritten)

    return rejection_sample


REJECTION_SAMPLE_ARGUMENTS = ("max_spec_len", "cu_num_draft_tokens", "draft_probs", "target_logits",
                              "bonus_token_ids", "sampling_metadata")  # fmt: skip


def _request_ids(rules: list[RequestRule]) -> list[str]:
    return [rule.req_id for rule in rules if rule.req_id]


def draftless() -> frozenset[int]:
    """This step's batch rows that get no drafts: the proposer asks right after ``_sample`` (same batch order)."""
    return STATE.draftless if STATE is not None and STATE.enabled else frozenset()


def references() -> dict[int, Reference]:
    """This step's batch rows whose drafts are cut to a reference (``reference.py``), for the proposer."""
    return STATE.references if STATE is not None and STATE.enabled else {}
