"""Where vLLM refuses bad input, the plugin refuses what it cannot serve: at engine start and per request.

* **Engine start** (the end of ``VllmConfig.__post_init__``, where vLLM raises a ``ValueError`` naming the setting):
  :func:`check_engine` reads which model runner vLLM chose (``internals.runner_of``) and logs one line saying what
  flyspec does there (:func:`mode_line`), or refuses to start (:func:`refusal`, one line naming the fix) where that
  runner's internals failed their checks and vLLM's own FLy or ``FLYSPEC_VLLM_FLY=all`` would otherwise run without
  flyspec's guards, or where the operator's flyspec settings are refused.
* **Each request** (the end of ``SamplingParams.verify``, where vLLM refuses a bad request): :func:`check_request`
  parses its flyspec options; one refused is vLLM's ``VLLMValidationError`` naming ``vllm_xargs.<field>``, which
  vLLM's OpenAI server answers with a 400 (and ``LLM.generate`` raises).
* **Worker start** (the model runner's ``initialize_kv_cache``, ``sampling_guard.py``): whether this engine's own
  rejection sampler reproduces the target distribution at temperature > 0 (``sampling_check.py``), in one line
  (:func:`sampling_line`); where it does not, steps that hold a sampled request are sampled without drafts.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flyspec_vllm._flyspec import GuardConfig
from flyspec_vllm.internals import TESTED_VLLM_VERSIONS, V1, V2, runner_of, uses_native_fly, wrap
from flyspec_vllm.options import REQUEST_KEYS, RequestError, request_options
from flyspec_vllm.prediction import PREDICTION_KEY, check_prediction_ids
from flyspec_vllm.prediction_api import record_engine
from flyspec_vllm.requests import GREEDY_TEMPERATURE_EPSILON, PluginState
from flyspec_vllm.sampling_check import Verdict

logger = logging.getLogger(__name__)


@dataclass
class Setup:
    """What ``patch.install`` found, for the engine-start check."""

    version: str
    switch: str | None = None  # the operator's switch; None: the operator's settings were refused
    error: str = ""
    problems: dict[str, list[str]] = field(default_factory=dict)  # per runner: failed checks (empty: hooked)
    breaker: bool = False  # the operator's profile has a circuit breaker (FLYSPEC_VLLM_PROFILE)


SETUP: Setup | None = None
_state_of: Callable[[], PluginState | None] = lambda: None  # noqa: E731 - set by install_checks()


def install_checks(
    setup: Setup, state_of: Callable[[], PluginState | None], import_module: Callable[[str], Any]
) -> None:
    """Wrap ``VllmConfig.__post_init__`` and ``SamplingParams.verify`` (where this vLLM has them)."""
    global SETUP, _state_of
    SETUP, _state_of = setup, state_of
    for module, owner, method, wrapper in (
        ("vllm.config", "VllmConfig", "__post_init__", _wrap_post_init),
        ("vllm.sampling_params", "SamplingParams", "verify", _wrap_verify),
    ):
        try:
            found = getattr(import_module(module), owner)
        except (ImportError, AttributeError):
            continue
        if callable(getattr(found, method, None)):
            wrap(found, method, wrapper)


def _wrap_post_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __post_init__(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        runner = runner_of(self)  # predictions are drafted where the step hook runs (prediction_api.py)
        record_engine(self, runner, hooked=SETUP is not None and not SETUP.problems.get(runner, []))
        check_engine(self)
        return result

    return __post_init__


def check_engine(vllm_config: Any) -> None:
    """At engine start: one line saying what flyspec does on the model runner vLLM chose, or a ``ValueError``
    (vLLM's own way to refuse a configuration) naming the fix."""
    setup, speculative = SETUP, getattr(vllm_config, "speculative_config", None)
    if setup is None or speculative is None:
        return
    runner, native_fly = runner_of(vllm_config), uses_native_fly(speculative)
    if setup.error:
        raise ValueError(f"flyspec-vllm: {setup.error} (fix it, or uninstall flyspec-vllm, to start this engine)")
    problems = setup.problems.get(runner, [])
    if problems and setup.switch != "off" and (native_fly or setup.switch == "all"):
        raise ValueError(refusal(setup, runner, native_fly, problems))
    unguarded = bool(problems) or (setup.switch == "off" and native_fly)
    line = mode_line(runner, native_fly, setup.switch or "off", setup.version, hooked=not problems,
                     breaker=setup.breaker)  # fmt: skip
    logger.log(logging.WARNING if unguarded else logging.INFO, "%s", line)


def refusal(setup: Setup, runner: str, native_fly: bool, problems: list[str]) -> str:
    """The one line that refuses an engine whose runner flyspec cannot hook while something needs its guards."""
    what = (
        "vLLM's own FLy (rejection_sample_method 'fly') would run without flyspec's guards"
        if native_fly
        else "FLYSPEC_VLLM_FLY=all asks for flyspec's FLy on every request, which this runner would not apply"
    )
    fix = (
        "set VLLM_USE_V2_MODEL_RUNNER=0 (the V1 runner, hooked)"
        if runner == V2 and not setup.problems.get(V1)
        else "use a vLLM version flyspec-vllm was tested with (" + ", ".join(TESTED_VLLM_VERSIONS) + ")"
    )
    return (f"flyspec-vllm: vLLM {setup.version}'s {runner} model runner differs from the tested ones "
            f"({'; '.join(problems)}): {what}; {fix}, or FLYSPEC_VLLM_FLY=off to serve without flyspec")  # fmt: skip


def mode_line(runner: str, native_fly: bool, switch: str, version: str, hooked: bool = True,
              breaker: bool = False) -> str:  # fmt: skip
    """The one start-up line that says what flyspec does on this engine (true on each runner and mode; ``breaker``:
    the operator's profile brings a circuit breaker, which only then vetoes)."""
    where = f"flyspec-vllm: vLLM {version}, {runner} model runner"
    if not hooked:  # only reached with switch 'request' and no native FLy: requests that ask get lossless
        return f"{where}: not hooked (its internals differ): a request that asks for a flyspec rule gets vLLM's rule"
    if switch == "off":
        if native_fly:
            return f"{where}: vLLM's own FLy runs WITHOUT flyspec's guards (FLYSPEC_VLLM_FLY=off)"
        return f"{where}: flyspec's rules off (FLYSPEC_VLLM_FLY=off): vLLM's lossless rule"
    vetoes = "flyspec's trust guards and the profile's circuit breaker" if breaker else "flyspec's trust guards"
    if native_fly:
        how = "its pre-pass kernels guarded" if runner == V1 else (
            "decided by flyspec's copy of the same rule (variant 'vllm'), then vLLM's rejection kernel with its FLy "
            "off commits them")  # fmt: skip
        return (f"{where}: vLLM's own FLy with {vetoes} vetoing its loose accepts ({how}); a request sending "
                "rejection_sample_method 'standard' gets none of them; flyspec's per-request rules are not applied "
                "while it runs")  # fmt: skip
    return (f"{where}: flyspec's per-request rules (FLy, MARS, typical acceptance) with {vetoes} for "
            f"{'every greedy request' if switch == 'all' else 'the greedy requests that ask'}; the others get vLLM's "
            "lossless rule (sampled requests where the workers' check of speculative sampling passes)")  # fmt: skip


def sampling_line(version: str, runner: str, verdict: Verdict) -> str:
    """The one worker start-up line that says whether sampled requests (temperature > 0) are drafted here, and why."""
    where = f"flyspec-vllm: vLLM {version}, {runner} model runner"
    if verdict.sound:
        return (f"{where}: speculative sampling at temperature > 0 matches the target distribution "
                f"({verdict.describe()}): sampled requests are drafted")  # fmt: skip
    failed = "could not be checked" if verdict.error else "does NOT match the target distribution"
    return (f"{where}: speculative sampling at temperature > 0 {failed} ({verdict.describe()}): a step that holds a "
            "sampled request is sampled without drafts, as a plain engine samples it (greedy requests beside it too); "
            "steps of greedy requests only are drafted and verified as before; counted in "
            "flyspec_vllm_sampled_undrafted and flyspec_vllm_greedy_undrafted")  # fmt: skip


def _wrap_verify(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def verify(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        check_request(self)
        return result

    return verify


def check_request(params: Any) -> None:
    """A request's flyspec options, checked where vLLM checks its sampling parameters: one refused is a
    ``VLLMValidationError`` naming the field, which vLLM's OpenAI server answers with a 400."""
    extra_args = getattr(params, "extra_args", None)
    if extra_args and extra_args.get(PREDICTION_KEY) is not None:
        problem = check_prediction_ids(extra_args[PREDICTION_KEY])
        if problem is not None:
            raise validation_error(RequestError(PREDICTION_KEY, problem))
    if not extra_args or not any(key in extra_args for key in REQUEST_KEYS):
        return
    state = _state_of() or PluginState(switch=SETUP.switch if SETUP is not None and SETUP.switch else "off",
                                       guard=GuardConfig())  # fmt: skip
    greedy = params.temperature < GREEDY_TEMPERATURE_EPSILON
    try:
        request_options(extra_args, greedy, state.switch, state.profile, state.guard, state.trusted)
    except RequestError as error:
        raise validation_error(error) from None


def validation_error(error: RequestError) -> Exception:
    """vLLM's own validation error (a 400 naming ``vllm_xargs.<field>``), or a ValueError where it has none."""
    message = f"flyspec-vllm: {error}"
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return ValueError(f"{message} (vllm_xargs.{error.field})")
    return VLLMValidationError(message, parameter=f"vllm_xargs.{error.field}")
