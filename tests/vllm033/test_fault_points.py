"""A fault injected at every fault point of the plugin (``tests/vllm_fault_points.py``: derived from its source, so a
new call inside a step's guard is injected here without a new line in this file), on vLLM 0.33's real V1 and V2
runners: nothing escapes the step, the step commits what exact verification commits or what it commits without the
fault, the fault is counted, and the next step is served as before.

Each point runs on the scenarios of its runner (vLLM's own FLy, a per-request flyspec rule, a sampled step on an
engine whose sampler failed the sampling check, the start-up hooks); a point no scenario reaches fails: add one."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from flyspec_vllm import metrics, patch, sampling_guard
from flyspec_vllm.sampling_check import CaseResult, Verdict
from plugin_harness import exact_greedy, installed, random_requests
from runners import Request, fly_config, v1_runner, v1_step, v2_runner, v2_step

from vllm_fault_points import FaultPoint, analyse

WINDOW, THRESHOLD = 1, 0.05
FAILED = Verdict((CaseResult("forced", 0.9, 0.1, 0, 0),), 0.0)
POINTS, _ = analyse()
STARTUP = {"patch.prepare_tables", "sampling_guard.check_runner"}  # reached by the runners' start-up hooks


@dataclass
class Scenario:
    name: str
    runner: str  # "V1" or "V2"
    requests: list[Request]
    native: bool  # the engine runs vLLM's own FLy
    failed_check: bool = False  # the engine's sampler failed the sampling check
    extra_args: dict = field(default_factory=dict)

    def run(self, lossless: bool = False) -> list[list[int]]:
        """What the step commits (``lossless``: on an engine with vLLM's lossless rule, the requests asking nothing)."""
        for request in self.requests:
            request.extra_args = {} if lossless else dict(self.extra_args)
        native = self.native and not lossless
        config = fly_config(WINDOW, THRESHOLD) if native else fly_config(0, 0.0, method="standard")
        runner = (v1_runner if self.runner == "V1" else v2_runner)(self.requests, config)
        if self.failed_check and not lossless:
            runner.__dict__[sampling_guard.VERDICT] = FAILED
        return (v1_step if self.runner == "V1" else v2_step)(runner, self.requests)

    def undrafted(self) -> list[list[int]]:
        """What each request commits sampled without drafts (a plain engine's step): the argmax of its first row
        (greedy), or what the step of an engine that failed the sampling check draws for it (sampled)."""
        plain = Scenario(self.name, self.runner, self.requests, self.native, True, self.extra_args).run()
        return [[int(request.step.logits[0].argmax())] if request.step.temperature == 0 else tokens
                for request, tokens in zip(self.requests, plain, strict=True)]  # fmt: skip


def scenarios(runner: str) -> list[Scenario]:
    generator = torch.Generator().manual_seed(31)
    rule = {"rejection_sample_method": "fly", "fly_window_size": 2, "fly_entropy_threshold": 0.05}
    return [
        Scenario("vLLM's FLy", runner, random_requests(generator, 6, [0.0, 0.0, 0.8], f"n{runner}"), native=True),
        Scenario("a flyspec rule", runner, random_requests(generator, 6, [0.0], f"r{runner}"), False, extra_args=rule),
        Scenario(
            "no drafts asked",
            runner,
            random_requests(generator, 4, [0.0], f"d{runner}"),
            False,
            extra_args={"flyspec_draft": False},
        ),  # fmt: skip
        Scenario("a failed check", runner, random_requests(generator, 4, [0.8, 0.0], f"s{runner}"), True, True),
    ]


def runner_of(point: FaultPoint) -> str:
    return "V2" if point.hook.startswith("v2.") else "V1"


def startup(point: FaultPoint) -> Callable[[], object]:
    """The start-up hook that reaches the point, on a runner whose own method does nothing."""
    if point.name == "prepare_tables":
        return lambda: patch._wrap_load_model(lambda self: "loaded")(object())
    return lambda: patch._wrap_initialize_kv_cache(lambda self: "initialized", runner_name="V1")(object())


def case_lossless_is_exact(case: Scenario, greedy: list[Request]) -> bool:
    """The harness's lossless run is vLLM's exact verification (its greedy requests: the argmax prefix)."""
    committed = dict(zip((request.req_id for request in case.requests), case.run(lossless=True), strict=True))
    return all(committed[request.req_id] == exact_greedy(request.step) for request in greedy)


class Raising:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args: object, **kwargs: object) -> None:
        self.calls += 1
        raise RuntimeError("injected fault")


@pytest.mark.parametrize("point", POINTS, ids=str)
def test_a_fault_at_every_point_leaves_a_lossless_step_and_a_serving_engine(monkeypatch, caplog, point) -> None:
    owner, name = point.target()
    raising = Raising()
    with installed(monkeypatch), caplog.at_level(logging.ERROR, logger="flyspec_vllm"):
        if f"{point.owner}.{point.name}" in STARTUP:
            with monkeypatch.context() as injected:
                injected.setattr(owner, name, raising)
                startup(point)()  # does not raise
            assert raising.calls == 1
            return
        cases = scenarios(runner_of(point))
        unfaulted = [case.run() for case in cases]
        greedy = [request for request in cases[1].requests if request.step.temperature == 0]
        assert case_lossless_is_exact(cases[1], greedy)
        reached = []
        for case, expected in zip(cases, unfaulted, strict=True):
            faults, calls = metrics.snapshot()["faults"], raising.calls
            with monkeypatch.context() as injected:
                injected.setattr(owner, name, raising)
                committed = case.run()  # nothing escapes the step
            if raising.calls == calls:
                assert committed == expected
                continue
            reached.append(case.name)
            assert metrics.snapshot()["faults"] > faults, "the fault was not counted"
            lossless = case.run(lossless=True)  # vLLM's rule alone (same seeds: the same draws)
            undrafted = case.undrafted()  # plain sampling: where a guard that fails closes to that
            for request, *outcomes in zip(case.requests, committed, lossless, expected, undrafted, strict=True):
                assert outcomes[0] in outcomes[1:], f"{case.name}, {request.req_id}: not lossless, not unfaulted"
        assert reached, f"no scenario reaches {point}: add one to scenarios()"
        assert [case.run() for case in cases] == unfaulted  # the engine serves on, as before the fault
