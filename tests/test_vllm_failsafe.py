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


def test_every_call_the_plugin_adds_to_a_step_is_inside_a_guard() -> None:
    """``vllm_fault_points``: each call a hook makes is vLLM's own, inside a ``try`` that verifies exactly on error,
    or a helper that guards itself; the fault points (where the vLLM suites inject faults) cover every hook."""
    from vllm_fault_points import analyse

    points, unguarded = analyse()
    assert not unguarded, "calls a step could raise from outside the plugin's guard:\n" + "\n".join(map(str, unguarded))
    hooks = {point.hook for point in points}
    assert {"native.GuardedKernel._launch", "patch._before_v1_step", "v2._wrap_rejection_sample.rejection_sample",
            "patch._wrap_rejection_sample.rejection_sample", "v2._guarded"} <= hooks  # fmt: skip
    assert {str(point).split(" ")[0] for point in points} >= {"v2.verified_call", "native.veto_mask",
                                                               "patch.batch_rules", "patch.apply_batch"}  # fmt: skip


def test_the_analysis_flags_a_call_outside_the_guard() -> None:
    """Negative control: a hook that calls something before its ``try``, or raises from its handler, is flagged."""
    from vllm_fault_points import analyse

    source = """
from flyspec_vllm import failsafe

def helper(x):
    return x.compute()

def _wrap_thing(original):
    def thing(self, x):
        x.prepare()
        helper(x)
        try:
            value = helper(x)
        except Exception as error:
            failsafe.fault("hook", error, ())
            x.undo()
        return original(self, value)
    return thing
"""
    points, unguarded = analyse(("fake",), {"fake": source})
    assert [str(point).split(" ")[0] for point in points] == ["fake.helper"]
    assert sorted((item.call, item.why) for item in unguarded) == [
        ("x.compute", "outside a try"),  # in helper(), called unguarded
        ("x.prepare", "outside a try"),
        ("x.undo", "in an except handler"),
    ]


def test_counting_and_logging_never_raise_out_of_a_step(monkeypatch) -> None:
    """A counter or a log handler that raises costs the count or the line, never the step (``NEVER_RAISES``)."""

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("broken sink")

    metrics.reset()
    failsafe.reset_logging()
    monkeypatch.setattr(failsafe.logger, "error", broken)
    monkeypatch.setattr(failsafe.logger, "warning", broken)
    monkeypatch.setattr(metrics, "_prometheus_counters", broken)
    failsafe.fault("the V1 verification hook", RuntimeError("first"), ["r"])
    failsafe.bypassed("V2 model runner", SimpleNamespace(fly_window_size=6), v2._exact_sampler)
    failsafe.warning("a %s warning", "start-up")
    metrics.add(faults=1)
    metrics.record(SimpleNamespace(fly_requests=1, candidates=1, vetoed=0, loose_positions=[3]))
    assert metrics.snapshot()["faults"] == 2  # the in-process counts still count; Prometheus lost them
    monkeypatch.setattr(metrics, "_lock", None)  # the in-process counters themselves broken
    metrics.add(faults=1)
    failsafe.fault("the V2 verification hook", RuntimeError("second"), ["r"])
    failsafe.reset_logging()
