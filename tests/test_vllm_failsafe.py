"""The plugin's fail-closed plumbing without vLLM (on vLLM's real runners: ``tests/vllm033/test_failsafe.py``,
``tests/vllm_engine/test_engine_failsafe.py``): faults are counted and logged, a flood of them is not; the V2
runner's request hooks keep each request's sampling parameters for exactly as long as vLLM keeps the request."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations" / "vllm" / "src"))

from flyspec_vllm import failsafe, metrics, v2  # noqa: E402


def test_every_fault_is_counted_and_at_most_twenty_are_logged(caplog) -> None:
    metrics.reset()
    failsafe.reset_logging()
    with caplog.at_level(logging.ERROR, logger="flyspec_vllm"):
        for step in range(25):
            failsafe.fault("the V1 verification hook", RuntimeError(f"bad {step}"), [f"req-{step}"])
    assert metrics.snapshot()["faults"] == 25
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == failsafe.MAX_LOGGED_FAULTS
    assert "bad 0" in lines[0] and "req-0" in lines[0] and "verified exactly, lossless" in lines[0]
    assert "counted in flyspec_vllm_faults, not logged" in lines[-1]
    failsafe.reset_logging()


def test_a_bypass_turns_the_samplers_fly_off_and_says_so_once(caplog) -> None:
    metrics.reset()
    failsafe.reset_logging()
    sampler = SimpleNamespace(fly_window_size=6)
    with caplog.at_level(logging.ERROR, logger="flyspec_vllm"):
        for _ in range(3):
            failsafe.bypassed("V2 model runner", sampler, v2._exact_sampler)
        failsafe.bypassed("V2 model runner", object(), v2._exact_sampler)
    assert sampler.fly_window_size == 0 and metrics.snapshot()["bypassed_steps"] == 4
    [line] = [record.getMessage() for record in caplog.records]
    assert "switched off" in line and "VLLM_USE_V2_MODEL_RUNNER=0" in line
    failsafe.reset_logging()
    with caplog.at_level(logging.ERROR, logger="flyspec_vllm"):
        failsafe.bypassed("V2 model runner", object(), v2._exact_sampler)  # a sampler without vLLM's FLy switch
    assert "could not be switched off and runs WITHOUT flyspec's guards" in caplog.records[-1].getMessage()
    failsafe.reset_logging()


def test_the_v2_runner_keeps_each_requests_sampling_parameters_while_vllm_does() -> None:
    class Runner:
        def add_requests(self, scheduler_output: object) -> str:
            return "added"

        def _remove_request(self, req_id: str) -> bool:
            return True

    add = v2._wrap_add_requests(Runner.add_requests)
    remove = v2._wrap_remove_request(Runner._remove_request)
    runner = Runner()
    params = SimpleNamespace(temperature=0.0, extra_args={"rejection_sample_method": "fly"})
    new = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="a", sampling_params=params)])
    assert add(runner, new) == "added" and runner.__dict__[v2.PARAMS] == {"a": params}
    assert remove(runner, "a") is True and runner.__dict__[v2.PARAMS] == {}
    metrics.reset()
    assert add(runner, SimpleNamespace()) == "added"  # a scheduler output of another shape: vLLM's step goes on
    assert metrics.snapshot()["faults"] == 1
