"""flyspec's rules and guards on vLLM's V2 model runner (``vllm/v1/worker/gpu/model_runner.py``, vLLM 0.33's default
on GPUs), where nothing of the V1 path the rest of the plugin wraps runs.

V2 verifies a batch in one fused Triton kernel (``rejection_sampler_utils.rejection_sample``: ``_rejection_kernel``,
FLy inside it), called by ``RejectionSampler._verify`` through the module global ``rejection_sample`` of
``vllm/v1/worker/gpu/spec_decode/rejection_sampler.py``. The plugin wraps (``internals.py`` checks each at start-up):

1. ``GPUModelRunner.add_requests`` / ``_remove_request``: each request's ``SamplingParams`` (V2 keeps only what its
   sampler reads, not ``extra_args``).
2. ``GPUModelRunner.sample``: publishes the runner for the step, then checks that the verification hook ran
   (``failsafe.bypassed`` where it did not).
3. ``rejection_sample``: each request's loose accepts are decided on the device, from the same inputs the kernel
   reads: flyspec's lossy rule for a greedy request that asks (``rule.apply_batch``, as on V1); with vLLM's own FLy
   (``fly_window_size > 0``) the same FLy for every request — ``FlyConfig(variant="vllm")`` with V2's entropy
   (vLLM's ``compute_fly_entropy`` from the logits) and, at T > 0, V2's own uniform numbers (``v2_random.py``) —
   vetoed by the trust guards and the circuit breaker (``native.guarded``). The kept loose accepts are forced in a
   copy of their logits rows (one-hot on the draft token: accepted by the greedy and the probabilistic test alike)
   and vLLM's unchanged kernel runs with its FLy off: it accepts them, and rejects, resamples and adds the bonus token
   as it always does. Logprobs come from vLLM's own logits (the copy reaches only the kernel).

``tests/vllm033`` runs this on vLLM 0.33.0's real sampler under Triton's interpreter: the commits are flyspec's
verdicts, vLLM's FLy minus the vetoes. Block verification and synthetic acceptance rates keep vLLM's rule alone
(FLy is off there too). A hook that raises verifies its step exactly (``failsafe.py``).

On an engine whose sampler failed the start-up check of speculative sampling (``sampling_guard.py``), a step that
holds a sampled request verifies no drafts: every draft row goes to the kernel as a ``-1`` placeholder, and the kernel
samples each request's first position from the target, as a plain engine does.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flyspec_vllm import failsafe, metrics, sampling_guard
from flyspec_vllm._flyspec import ConfigError, FlyConfig, fly_candidates
from flyspec_vllm.internals import wrap
from flyspec_vllm.native import guarded
from flyspec_vllm.options import REQUEST_KEYS
from flyspec_vllm.requests import PluginState, forget_finished, make_rule, refused, step_options, wants_drafts
from flyspec_vllm.rule import RequestRule, apply_batch

PARAMS = "_flyspec_sampling_params"  # on the runner: request id -> SamplingParams


@dataclass
class V2Step:
    runner: Any
    verified: bool = False  # the module's rejection_sample ran (the plugin's verification hook)
    guarded: bool = False  # sampled without drafts: a sampled request on an engine that failed the sampling check
    sampler_ran: bool = False  # this rank's rejection sampler was called (it had drafts to verify)


@dataclass
class Request:
    """One request of the batch as the kernel sees it: its rows, draft tokens and facts from the host sync."""

    req_id: str
    state_index: int
    rows: range  # its draft positions' logits rows (the bonus row follows)
    draft: list[int]  # the draft tokens verified at ``rows`` (cut at the first placeholder, -1)
    committed: int  # tokens committed before this step
    temperature: float


_step: contextvars.ContextVar[V2Step | None] = contextvars.ContextVar("flyspec_v2_step", default=None)
_state_of: Callable[[], PluginState | None] = lambda: None  # noqa: E731 - set by install()


def install(internals: Any, state_of: Callable[[], PluginState | None]) -> None:
    global _state_of
    _state_of = state_of
    wrap(internals.runner_class, "add_requests", _wrap_add_requests)
    wrap(internals.runner_class, "_remove_request", _wrap_remove_request)
    wrap(internals.runner_class, "sample", _wrap_sample)
    wrap(internals.sampler_module, "rejection_sample", _wrap_rejection_sample)
    wrap(internals.sampler_module.RejectionSampler, "__call__", _wrap_call)


def _wrap_add_requests(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def add_requests(self: Any, scheduler_output: Any) -> Any:
        result = original(self, scheduler_output)
        try:
            params = self.__dict__.setdefault(PARAMS, {})
            for new in scheduler_output.scheduled_new_reqs:
                params[new.req_id] = new.sampling_params
        except Exception as error:  # noqa: BLE001 - such a request gets vLLM's lossless rule (no options seen)
            failsafe.fault("the V2 request hook", error, ())
        return result

    return add_requests


def _wrap_remove_request(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _remove_request(self: Any, req_id: str) -> Any:
        try:
            self.__dict__.get(PARAMS, {}).pop(req_id, None)
        except Exception as error:  # noqa: BLE001 - a stale record is dropped at the next add_requests of the id
            failsafe.fault("the V2 request hook", error, (req_id,), "unaffected")
        return original(self, req_id)

    return _remove_request


def _wrap_sample(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def sample(self: Any, hidden_states: Any, input_batch: Any, grammar_output: Any) -> Any:
        if _state_of() is None:
            return original(self, hidden_states, input_batch, grammar_output)
        step = V2Step(self, guarded=_guarded(self, input_batch))
        token = _step.set(step)
        try:
            result = original(self, hidden_states, input_batch, grammar_output)
        finally:
            _step.reset(token)
        _after_step(self, step)
        return result

    return sample


def _after_step(runner: Any, step: V2Step) -> None:
    """After vLLM sampled the step: the verification hook ran (counted), or vLLM's rejection sampler verified drafts
    without it (a bypass: loose acceptance off from now on). Whether drafts were verified is what this rank's
    rejection sampler was given (``_wrap_call``), not the batch's count: under batch-sharded sampling (tensor
    parallelism) a rank that owns none of the step's drafts verifies none. Never raises."""
    try:
        if not step.sampler_ran:
            return
        if step.verified:
            metrics.add(verified_steps=1)
            return
        state = _state_of()
        if state is not None:
            state.enabled = False
        failsafe.bypassed("V2 model runner", getattr(runner, "rejection_sampler", None), _exact_sampler)
    except Exception as error:  # noqa: BLE001 - the step is sampled already; only its bookkeeping is lost
        failsafe.fault("the V2 step's bookkeeping", error, (), "committed as sampled")


def _wrap_call(original: Callable[..., Any]) -> Callable[..., Any]:
    """V2's ``RejectionSampler.__call__``: the step's drafts reached this rank's rejection sampler."""

    @functools.wraps(original)
    def __call__(self: Any, logits: Any, input_batch: Any, *args: Any, **kwargs: Any) -> Any:
        step = _step.get()
        if step is not None:
            step.sampler_ran = True
        return original(self, logits, input_batch, *args, **kwargs)

    return __call__


def _guarded(runner: Any, input_batch: Any) -> bool:
    """This step is sampled without drafts (``sampling_guard.v2_guarded``); a guard that raises guards (fail closed)."""
    try:
        return sampling_guard.v2_guarded(runner, runner.__dict__.get(PARAMS, {}), input_batch)
    except Exception as error:  # noqa: BLE001 - fail closed: a plain sample is right on every engine
        failsafe.fault("the V2 sampling guard", error, (), "sampled without drafts, as a plain engine samples")
        return True


def _exact_sampler(sampler: Any) -> bool:
    """vLLM's own FLy off on a V2 ``RejectionSampler`` (it passes ``fly_window_size`` to its kernel per call)."""
    if not hasattr(sampler, "fly_window_size"):
        return False
    sampler.fly_window_size = 0
    return True


def _wrap_rejection_sample(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def rejection_sample(*args: Any, **kwargs: Any) -> Any:
        step = _step.get()
        if step is None:  # outside a runner step (vLLM's warm-up, a direct call): vLLM's own rule, its FLy included
            return original(*args, **kwargs)
        step.verified = True
        arguments = signature.bind(*args, **kwargs).arguments  # vLLM's own call: it binds, or vLLM's call fails
        exact = fly_off(arguments)  # what a fault falls back to
        try:
            call = verified_call(step, arguments)
        except Exception as error:  # noqa: BLE001 - fail closed: this step is verified exactly
            failsafe.fault("the V2 verification hook", error, lambda: _request_ids(step.runner, arguments))
            call = exact
        return original(**call)

    return rejection_sample


def verified_call(step: V2Step, arguments: dict[str, Any]) -> dict[str, Any]:
    """The arguments vLLM's kernel gets for this step: FLy off (``fly_window_size`` 0), the loose accepts flyspec
    keeps forced in a copy of their logits rows, the draft rows of requests that get no drafts made placeholders."""
    state = _state_of()
    if step.guarded:  # no drafts: each request's first position sampled from the target
        rows = sampling_guard.without_draft_rows(arguments["draft_sampled"], arguments["expanded_local_pos"])
        return fly_off(arguments) | {"draft_sampled": rows}
    if state is None or not state.enabled:
        return fly_off(arguments)  # no rules for this step: exact, vLLM's FLy off
    if arguments.get("synthetic_conditional_rates") is not None or arguments.get("use_block_verification"):
        return arguments  # vLLM's own rule (its FLy is off there)
    drafted = without_drafts_of(step.runner, arguments)
    forced = loose_accepts(step.runner, state, drafted, int(arguments.get("fly_window_size") or 0) > 0)
    if forced is None:
        return fly_off(drafted)
    return fly_off(drafted) | {"target_logits": force(arguments["target_logits"], *forced)}


def fly_off(arguments: dict[str, Any]) -> dict[str, Any]:
    """The kernel's arguments with vLLM's own FLy off (``fly_window_size`` 0 where the call passes it)."""
    return arguments | {"fly_window_size": 0} if "fly_window_size" in arguments else arguments


def without_drafts_of(runner: Any, arguments: dict[str, Any]) -> dict[str, Any]:
    """The arguments with the draft rows of every request that asked for none (``flyspec_draft: false``) made ``-1``
    placeholders: the kernel samples that request's first position from the target, as a plain engine does."""
    params = runner.__dict__.get(PARAMS, {})
    names = runner.req_states.index_to_req_id
    draftless = [index for index, req_id in names.items() if not wants_drafts(params.get(req_id))]
    if not draftless:
        return arguments
    mapping = arguments["expanded_idx_mapping"].long()
    rows = torch.isin(mapping, torch.tensor(draftless, dtype=torch.long, device=mapping.device))
    drafted = arguments["draft_sampled"].masked_fill(rows & (arguments["expanded_local_pos"] > 0),
                                                     sampling_guard.PLACEHOLDER_TOKEN_ID)  # fmt: skip
    return arguments | {"draft_sampled": drafted}


def _request_ids(runner: Any, arguments: dict[str, Any]) -> list[str]:
    names = runner.req_states.index_to_req_id
    return [names.get(int(index), "?") for index in arguments["idx_mapping"].tolist()]


def batch_requests(runner: Any, arguments: dict[str, Any]) -> list[Request]:
    """The batch's requests, from one host sync of the kernel's small inputs (no logits)."""
    cu, idx = arguments["cu_num_logits"].long(), arguments["idx_mapping"].long()
    num_reqs = idx.shape[0]
    starts = cu[:-1]
    host = torch.cat(
        [cu.double(), idx.double(), arguments["pos"][starts].double(), arguments["temperature"][idx].double(),
         arguments["draft_sampled"].double()]
    ).tolist()  # fmt: skip
    ends, host = host[: num_reqs + 1], host[num_reqs + 1 :]
    states, host = host[:num_reqs], host[num_reqs:]
    positions, host = host[:num_reqs], host[num_reqs:]
    temperatures, drafted = host[:num_reqs], host[num_reqs:]
    names = runner.req_states.index_to_req_id
    requests = []
    for i in range(num_reqs):
        start, end = int(ends[i]), int(ends[i + 1])
        draft = [int(token) for token in drafted[start + 1 : end]]
        cut = next((j for j, token in enumerate(draft) if token < 0), len(draft))
        state_index = int(states[i])
        requests.append(Request(names[state_index], state_index, range(start, start + cut), draft[:cut],
                                int(positions[i]) + 1, temperatures[i]))  # fmt: skip
    return requests


def loose_accepts(
    runner: Any, state: PluginState, arguments: dict[str, Any], native: bool
) -> tuple[list[int], list[int]] | None:
    """The rows to accept loosely and their draft tokens (None: none), per request's rule (module docstring)."""
    params = runner.__dict__.get(PARAMS, {})
    if not native and state.switch != "all" and not any(_asks(value) for value in params.values()):
        return None  # no live request asks for a rule: nothing to read from the device
    requests = [request for request in batch_requests(runner, arguments) if request.draft]
    forget_finished(state, list(runner.req_states.index_to_req_id.values()))
    options: dict[str, Any] = {}
    rules: dict[str, RequestRule] = {}
    for request in requests:
        try:
            found = step_options(state, request.req_id, params.get(request.req_id), native)
            if found is not None:
                options[request.req_id] = found
        except ConfigError as error:
            rules[request.req_id] = refused(request.req_id, error, native)
    tokens = committed_tokens(runner, state, [request for request in requests if request.req_id in options])
    for request in requests:
        if request.req_id in options:
            prompt = int(runner.req_states.prompt_len.np[request.state_index])
            try:
                rules[request.req_id] = make_rule(state, runner, request.req_id, options[request.req_id], native,
                                                  tokens[request.req_id], prompt)  # fmt: skip
            except ConfigError as error:
                rules[request.req_id] = refused(request.req_id, error, native)
    if not rules:
        return None
    ruled = [request for request in requests if request.req_id in rules]
    found_rows, found_tokens = (native_loose if native else rule_loose)(ruled, rules, arguments)
    return (found_rows, found_tokens) if found_rows else None


def _asks(params: Any) -> bool:
    """The request's options name a flyspec rule or shadow (``options.REQUEST_KEYS``)."""
    extra_args = getattr(params, "extra_args", None) or {}
    return any(key in extra_args for key in REQUEST_KEYS)


def committed_tokens(runner: Any, state: PluginState, requests: list[Request]) -> dict[str, list[int]]:
    """Each request's committed tokens, kept in its memo and extended by what is new since its last step: one read
    of the new tokens of the whole batch (the last known token read again: a reused request id starts over)."""
    table = runner.req_states.all_token_ids.gpu  # [max_num_reqs, max_model_len]
    memos = {r.req_id: state.memos.setdefault(r.req_id, {}).setdefault("token_ids", []) for r in requests}
    rows: list[int] = []
    columns: list[int] = []
    starts = {}
    for request in requests:
        known = memos[request.req_id]
        if len(known) > request.committed:
            known.clear()
        starts[request.req_id] = start = max(len(known) - 1, 0)
        rows += [request.state_index] * (request.committed - start)
        columns += range(start, request.committed)
    if not rows:
        return memos
    device = table.device
    fresh = table[torch.tensor(rows, device=device), torch.tensor(columns, device=device)].tolist()  # one sync
    offset = 0
    for request in requests:
        known, start = memos[request.req_id], starts[request.req_id]
        new = fresh[offset : offset + request.committed - start]
        offset += request.committed - start
        if known and new[0] != known[-1]:
            known.clear()
            new = table[request.state_index, : request.committed].tolist()  # rare: another request under this id
            start = 0
        known[start:] = [int(token) for token in new]
    return memos


def rule_loose(
    requests: list[Request], rules: dict[str, RequestRule], arguments: dict[str, Any]
) -> tuple[list[int], list[int]]:
    """flyspec's lossy rules (greedy requests), through the same batch code as on V1 (``rule.apply_batch``)."""
    target_logits = arguments["target_logits"]
    rows = [row for request in requests for row in request.rows]
    draft_host = [token for request in requests for token in request.draft]
    index = torch.tensor(rows, dtype=torch.long, device=target_logits.device)
    draft = torch.tensor(draft_host, dtype=torch.long, device=target_logits.device)
    batch = [rules[request.req_id] for request in requests]
    outcome = apply_batch(draft, [len(request.draft) for request in requests], target_logits[index], batch)
    metrics.record(outcome)
    return [rows[j] for j in outcome.loose_positions], [draft_host[j] for j in outcome.loose_positions]


def native_loose(
    requests: list[Request], rules: dict[str, RequestRule], arguments: dict[str, Any]
) -> tuple[list[int], list[int]]:
    """vLLM's own FLy, decided by flyspec's copy of it (one host sync for the batch), vetoed by the guards (two per
    request where FLy would keep something)."""
    from vllm.v1.spec_decode.fly import compute_fly_entropy  # V2's entropy, from the logits (vLLM 0.33+)

    target_logits = arguments["target_logits"]
    config = FlyConfig(
        window_size=int(arguments["fly_window_size"]),
        entropy_threshold=float(arguments.get("fly_entropy_threshold", 0.3)),
        entropy_top_k=int(arguments.get("fly_entropy_top_k", 3)),
        variant="vllm",
    )
    uniforms = None
    if any(request.temperature != 0.0 for request in requests):
        from flyspec_vllm.v2_random import rejection_uniforms

        uniforms = rejection_uniforms(arguments["seed"], arguments["pos"], arguments["expanded_idx_mapping"])
    draft_logits = arguments.get("draft_logits")
    vocab = target_logits.shape[-1] if draft_logits is None else min(target_logits.shape[-1], draft_logits.shape[-1])
    judged = []
    for request in requests:
        rows = target_logits[request.rows.start : request.rows.stop, :vocab].float()  # [k, vocab] as the kernel reads
        draft = torch.tensor(request.draft, dtype=torch.long, device=rows.device)
        base = native_accepts(request, rows, draft, uniforms, draft_logits)
        entropy = compute_fly_entropy(rows, config.entropy_top_k, from_logits=True)
        candidates, _ = fly_candidates(base, rows, config, draft, entropy=entropy)
        judged.append((request, rows, draft, base, candidates))
    host = torch.cat([torch.cat([base, candidates]) for _, _, _, base, candidates in judged]).tolist()  # one sync
    rows_out: list[int] = []
    tokens_out: list[int] = []
    seen = vetoed = offset = 0
    for request, rows, draft, base, candidates in judged:
        k = len(request.draft)
        base_host, candidate_host = host[offset : offset + k], host[offset + k : offset + 2 * k]
        offset += 2 * k
        if not any(candidate_host):
            continue
        _, kept = guarded(base, candidates, draft, rows, rules[request.req_id])
        accepted = next((j for j in range(k) if not (base_host[j] or kept[j])), k)
        rows_out += [request.rows.start + j for j in range(accepted) if kept[j]]
        tokens_out += [request.draft[j] for j in range(accepted) if kept[j]]
        seen += sum(candidate_host)
        vetoed += sum(candidate_host) - sum(kept)
    metrics.add(native_loose=seen, native_vetoed=vetoed)
    return rows_out, tokens_out


def native_accepts(
    request: Request,
    rows: torch.Tensor,  # [k, vocab] the processed logits
    draft: torch.Tensor,  # [k]
    uniforms: torch.Tensor | None,  # [num_logits]
    draft_logits: torch.Tensor | None,  # [max_num_reqs, num_speculative_steps, vocab], before the temperature
) -> torch.Tensor:
    """``[k]`` bool: what V2's kernel accepts before FLy: the argmax (greedy), else ``log p > log u + log q``."""
    if request.temperature == 0.0:
        return draft == rows.argmax(-1)
    assert uniforms is not None
    target = rows.log_softmax(-1).gather(-1, draft.unsqueeze(-1)).squeeze(-1)
    proposed = torch.zeros_like(target)
    if draft_logits is not None:
        k, vocab = rows.shape
        scaled = draft_logits[request.state_index, :k, :vocab].float() / request.temperature
        proposed = scaled.log_softmax(-1).gather(-1, draft.unsqueeze(-1)).squeeze(-1)
    return (target > uniforms[request.rows.start : request.rows.stop].log() + proposed) & (proposed > float("-inf"))


def force(target_logits: torch.Tensor, rows: list[int], tokens: list[int]) -> torch.Tensor:
    """A copy of the logits whose ``rows`` are one-hot on their draft token (log-probability 0, argmax): the kernel
    accepts the token there, greedy or not (the input untouched)."""
    forced = target_logits.clone()
    index = torch.tensor(rows, dtype=torch.long, device=target_logits.device)
    forced[index] = float("-inf")
    forced[index, torch.tensor(tokens, dtype=torch.long, device=target_logits.device)] = 0.0
    return forced
