"""Fail closed on vLLM 0.33's real runners: a plugin hook that raises costs its step the loose accepts (verified
exactly, one error line naming the requests, the ``faults`` counter), and the next step is served as usual; a step
vLLM verifies without the plugin's hook turns vLLM's own FLy off (exact from then on) and says so once."""

from __future__ import annotations

import logging

import pytest
import torch
from flyspec_vllm import failsafe, metrics, native, patch, v2
from flyspec_vllm.requests import PluginState
from plugin_harness import exact_greedy, guarded_greedy, installed, random_requests
from runners import fly_config, v1_runner, v1_step, v2_runner, v2_step
from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils

WINDOW, THRESHOLD = 1, 0.05


def raising(*args: object, **kwargs: object) -> None:
    raise RuntimeError("injected fault")


def native_step(runner: str, requests: list) -> list[list[int]]:
    speculative = fly_config(WINDOW, THRESHOLD)
    if runner == "V1":
        return v1_step(v1_runner(requests, speculative), requests)
    return v2_step(v2_runner(requests, speculative), requests)


@pytest.mark.parametrize(
    ("runner", "owner", "name"),
    [("V1", native, "guard_loose_mask"), ("V1", patch, "batch_rules"), ("V2", v2, "native_loose"),
     ("V2", v2, "committed_tokens")],
)  # fmt: skip
def test_a_fault_inside_a_hook_verifies_that_step_exactly(monkeypatch, caplog, runner: str, owner, name: str) -> None:
    generator = torch.Generator().manual_seed(21)
    faulty = random_requests(generator, 8, [0.0], f"f{runner}")
    later = random_requests(generator, 8, [0.0], f"g{runner}")
    with installed(monkeypatch), caplog.at_level(logging.ERROR, logger="flyspec_vllm"):
        with monkeypatch.context() as injected:
            injected.setattr(owner, name, raising)
            committed = native_step(runner, faulty)
        assert committed == [exact_greedy(request.step) for request in faulty]  # lossless: vLLM's FLy off
        assert metrics.snapshot()["faults"] == 1 and metrics.snapshot()["bypassed_steps"] == 0
        [line] = [record.getMessage() for record in caplog.records]
        assert "injected fault" in line and "verified exactly" in line and faulty[0].req_id in line
        served = native_step(runner, later)  # the engine keeps serving, with its guards
    assert served == [guarded_greedy(request, WINDOW, THRESHOLD) for request in later]
    assert served != [exact_greedy(request.step) for request in later]  # loose accepts again: not a lossless run


def test_a_fault_in_a_per_request_rule_on_v2_verifies_that_step_exactly(monkeypatch, caplog) -> None:
    generator = torch.Generator().manual_seed(22)
    requests = random_requests(generator, 6, [0.0], "p")
    for request in requests:
        request.extra_args = {"rejection_sample_method": "fly", "fly_window_size": 1, "fly_entropy_threshold": 0.05}
    with installed(monkeypatch), caplog.at_level(logging.ERROR, logger="flyspec_vllm"):
        monkeypatch.setattr(v2, "apply_batch", raising)
        committed = v2_step(v2_runner(requests, fly_config(0, 0.0, method="standard")), requests)
    assert committed == [exact_greedy(request.step) for request in requests]
    assert metrics.snapshot()["faults"] == 1 and "the V2 verification hook raised" in caplog.text


def test_a_step_verified_without_the_plugins_hook_turns_vllms_fly_off(monkeypatch, caplog) -> None:
    """A V2 sampler that calls its kernel directly (not through the module function the plugin wraps): the first
    such step is vLLM's (its loose accepts unguarded), then loose acceptance stops and one error line says why."""
    generator = torch.Generator().manual_seed(23)
    first, second = (random_requests(generator, 8, [0.0], tag) for tag in ("b", "c"))
    with installed(monkeypatch), caplog.at_level(logging.ERROR, logger="flyspec_vllm"):
        runner = v2_runner(first, fly_config(WINDOW, THRESHOLD))
        sampler = runner.rejection_sampler

        def direct_verify(logits, draft_logits, draft_sampled, pos, cu_num_logits, idx_mapping, idx_mapping_np,
                          expanded_idx_mapping, expanded_local_pos, seq_lens, verify_draft_sampled):  # fmt: skip
            sampled, num_sampled = rejection_sampler_utils.rejection_sample(
                logits, draft_logits, verify_draft_sampled, cu_num_logits, pos, idx_mapping, expanded_idx_mapping,
                expanded_local_pos, sampler.sampler.sampling_states.temperature.gpu,
                sampler.sampler.sampling_states.seeds.gpu, sampler.num_speculative_steps,
                fly_window_size=sampler.fly_window_size, fly_entropy_threshold=sampler.fly_entropy_threshold,
            )  # fmt: skip
            return logits, sampled, num_sampled

        monkeypatch.setattr(sampler, "_verify", direct_verify)
        v2_step(runner, first)
        assert sampler.fly_window_size == 0 and isinstance(patch.STATE, PluginState) and not patch.STATE.enabled
        assert metrics.snapshot()["bypassed_steps"] == 1
        [line] = [record.getMessage() for record in caplog.records]
        assert "without flyspec's hook" in line and "switched off" in line and "VLLM_USE_V2_MODEL_RUNNER=0" in line
        runner.req_states, runner.__dict__[v2.PARAMS] = v2_runner(second, fly_config(1, 0.0)).req_states, {}
        committed = v2_step(runner, second)
    assert committed == [exact_greedy(request.step) for request in second]  # exact from then on
    failsafe.reset_logging()
