"""Each request's rule for a step, whichever model runner serves it: its options (parsed once), the generation so far
for the guards, its circuit breaker. The runners' hooks (``patch.py`` for V1, ``v2.py`` for V2) gather the facts from
their runner's batch and ask :func:`make_rule` for each request's :class:`~flyspec_vllm.rule.RequestRule`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flyspec_vllm._flyspec import CircuitBreaker, ConfigError, DecodeStats, GuardConfig, VerifyContext, Vocabulary
from flyspec_vllm.options import OperatorProfile, RequestOptions, flag, request_options
from flyspec_vllm.reference import Reference
from flyspec_vllm.rule import RequestRule
from flyspec_vllm.vocabulary import vocabulary_of

logger = logging.getLogger(__name__)
GREEDY_TEMPERATURE_EPSILON = 1e-5  # vLLM treats temperature below this as greedy


@dataclass
class PluginState:
    switch: str
    guard: GuardConfig
    profile: OperatorProfile | None = None  # the operator's calibration profile (options.py)
    trusted: bool = False  # FLYSPEC_VLLM_TRUST_REQUESTS: requests may set guards, record and shadow
    enabled: bool = True  # False once a bypass was found (failsafe.py): no loose accepts from then on
    draftless: frozenset[int] = frozenset()  # this step's batch rows whose request asked for no drafts
    references: dict[int, Reference] = field(default_factory=dict)  # this step's rows whose drafts are cut
    vocabularies: dict[int, Vocabulary] = field(default_factory=dict)  # per model runner
    memos: dict[str, dict[str, Any]] = field(default_factory=dict)  # per request id: the guards' memo


def options_of(state: PluginState, req_id: str, params: Any) -> RequestOptions:
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


def step_options(state: PluginState, req_id: str, params: Any, native: bool) -> RequestOptions | None:
    """What the request gets this step: its options when a rule (or, with vLLM's own FLy, the guards) must look at
    it, None when vLLM's lossless rule serves it alone. A :class:`ConfigError` when its options are refused."""
    options = options_of(state, req_id, params)
    if native:  # vLLM's FLy runs for every request: the guards look at every one (all vetoed where it asks exact)
        return RequestOptions(exact=options.exact)
    return options if options.rule is not None or options.shadow else None


def forget_finished(state: PluginState, live: Sequence[str]) -> None:
    """Drop the memos of requests no longer in the batch."""
    alive = set(live)
    for stale in [req_id for req_id in state.memos if req_id not in alive]:
        del state.memos[stale]


def make_rule(
    state: PluginState,
    runner: Any,
    req_id: str,
    options: RequestOptions,
    native: bool,
    tokens: list[int],  # the request's committed tokens (its memo's, kept current by the caller)
    prompt_length: int,
) -> RequestRule:
    """The request's rule: its options' lossy rule, or with vLLM's own FLy (``native``) the operator's guards that
    may veto its loose accepts, with the context the guards read."""
    vocabulary = vocabulary_of(runner, state)
    num_tokens = len(tokens)
    if options.prompt_length is not None:  # a continuation: the rest of its prompt is earlier output
        prompt_length = min(prompt_length, options.prompt_length)
    memo = state.memos.setdefault(req_id, {})
    context = VerifyContext(
        token_ids=tokens,
        prompt_length=prompt_length,
        vocabulary=vocabulary,
        memo=memo,
        breaker=_breaker(state, memo, num_tokens - prompt_length),
    )
    start = num_tokens - prompt_length  # the output index of this step's first draft position
    guard = state.guard if native else None
    return RequestRule(options.rule, context, start, options.record, options.shadow, guard, req_id=req_id,
                       exact=native and options.exact)  # fmt: skip


def refused(req_id: str, error: ConfigError, native: bool) -> RequestRule:
    """A request whose options (or the guards' tables) are refused: vLLM's lossless rule, said once per step."""
    logger.warning("flyspec-vllm: request %s gets vLLM's lossless rule: %s", req_id, error)
    return RequestRule(exact=native, req_id=req_id)


def batch_rules(runner: Any, state: PluginState, native: bool = False) -> list[RequestRule]:
    """V1: each request's rule, in the batch order of ``runner.input_batch``; with vLLM's own FLy running
    (``native``), each request's guards and context for the vetoes instead (``native.py``)."""
    batch = runner.input_batch
    forget_finished(state, batch.req_ids)
    rules: list[RequestRule] = []
    for index, req_id in enumerate(batch.req_ids):
        try:
            options = step_options(state, req_id, runner.requests[req_id].sampling_params, native)
            if options is None:
                rules.append(RequestRule())
                continue
            memo = state.memos.setdefault(req_id, {})
            tokens = context_tokens(memo, batch.token_ids_cpu[index], int(batch.num_tokens_no_spec[index]))
            rules.append(make_rule(state, runner, req_id, options, native, tokens, int(batch.num_prompt_tokens[index])))
        except ConfigError as error:
            rules.append(refused(req_id, error, native))
    return rules


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
    """The batch rows whose request asked for no drafts (``flyspec_draft: false``), for the plugin's proposer."""
    return frozenset(index for index, req_id in enumerate(runner.input_batch.req_ids)
                     if not wants_drafts(runner.requests[req_id].sampling_params))  # fmt: skip


def wants_drafts(params: Any) -> bool:
    """False where the request asked for no drafts (``flyspec_draft: false``; 0 / "false" as vLLM's server sends)."""
    extra_args = getattr(params, "extra_args", None) or {}
    try:
        return flag(extra_args.get("flyspec_draft", True), "flyspec_draft")
    except ConfigError:
        return True  # refused when vLLM validated the request (startup.check_request); drafts as usual
