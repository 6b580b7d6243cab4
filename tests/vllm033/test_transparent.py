"""What the plugin changes on vLLM 0.33's real samplers and runners is only what it was asked to change:

* outside a runner step (vLLM's sampler warm-up, a test, a direct call) the samplers commit what vLLM alone commits,
  its own FLy included (and its FLy kernels run: they are warm before the first served step);
* a request sending ``rejection_sample_method: "standard"`` under vLLM's own FLy (configured engine-wide) is
  verified exactly on V1 and V2, beside requests that keep vLLM's guarded FLy;
* ``flyspec_draft: false`` on V2 is plain decoding for that request (its drafts are not verified);
* under batch-sharded sampling, a rank whose rejection sampler has no drafts this step claims no bypass;
* the start-up line names the circuit breaker only where a profile brings one.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from flyspec_vllm import metrics, native, patch, v2
from flyspec_vllm.startup import mode_line
from plugin_harness import exact_greedy, guarded_greedy, installed, random_requests
from runners import fly_config, v1_inputs, v1_runner, v1_step, v2_batch, v2_runner, v2_step
from vllm.v1.sample import rejection_sampler as v1_sampler_module

WINDOW, THRESHOLD = 1, 0.05


def direct(runner_name: str, requests: list) -> list[list[int]]:
    """The runner's rejection sampler called as vLLM's warm-up calls it: outside ``_sample`` / ``sample``."""
    if runner_name == "V1":
        runner = v1_runner(requests, fly_config(WINDOW, THRESHOLD))
        metadata, logits = v1_inputs(requests)
        output = runner.rejection_sampler(metadata, None, logits, runner.input_batch.sampling_metadata)
        return [[int(token) for token in row if token >= 0] for row in output.sampled_token_ids]
    runner = v2_runner(requests, fly_config(WINDOW, THRESHOLD))
    batch = v2_batch(requests, runner.offset)
    logits = torch.cat([request.step.logits for request in requests])
    output = runner.rejection_sampler(logits, batch, None, None)
    return [output.sampled_token_ids[i, : int(n)].tolist() for i, n in enumerate(output.num_sampled)]


@pytest.mark.parametrize("runner", ["V1", "V2"])
def test_outside_a_step_the_sampler_is_vllms_own_fly_included(monkeypatch, runner: str) -> None:
    generator = torch.Generator().manual_seed(41)
    requests = random_requests(generator, 10, [0.0, 0.0, 0.8], f"o{runner}")
    alone = direct(runner, requests)
    assert alone != [exact_greedy(request.step) for request in requests]  # vLLM's FLy kept something here
    launches = []
    with installed(monkeypatch):
        if runner == "V1":  # the guarded kernels launch vLLM's: warm before the first served step
            for name in native.KERNELS:
                kernel = getattr(v1_sampler_module, name)
                assert isinstance(kernel, native.GuardedKernel)
                real = kernel.kernel
                monkeypatch.setattr(kernel, "kernel", _Counting(real, launches))
        with_plugin = direct(runner, requests)
        assert metrics.snapshot()["faults"] == metrics.snapshot()["bypassed_steps"] == 0
    assert with_plugin == alone
    assert runner == "V2" or launches  # V2: FLy is inside vLLM's one fused kernel, launched as it always is


class _Counting:
    def __init__(self, kernel: object, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid: object) -> object:
        self.launches.append(grid)
        return self.kernel[grid]  # type: ignore[index]


@pytest.mark.parametrize("runner", ["V1", "V2"])
def test_a_request_asking_standard_under_vllms_fly_is_verified_exactly(monkeypatch, runner: str) -> None:
    generator = torch.Generator().manual_seed(42)
    requests = random_requests(generator, 32, [0.0], f"x{runner}")
    exact = [exact_greedy(request.step) for request in requests]
    guarded = [guarded_greedy(request, WINDOW, THRESHOLD) for request in requests]
    loosened = [i for i in range(len(requests)) if guarded[i] != exact[i]]  # where vLLM's guarded FLy changes a step
    assert len(loosened) >= 4, "too few loose accepts in this batch for the check"
    asking = set(loosened[::2])
    for i in asking:
        requests[i].extra_args = {"rejection_sample_method": "standard"}
    with installed(monkeypatch):
        hooked = (v1_runner if runner == "V1" else v2_runner)(requests, fly_config(WINDOW, THRESHOLD))
        committed = (v1_step if runner == "V1" else v2_step)(hooked, requests)
    for i, tokens in enumerate(committed):
        assert tokens == (exact[i] if i in asking else guarded[i]), (i, i in asking)


def test_flyspec_draft_false_on_v2_is_plain_decoding(monkeypatch) -> None:
    generator = torch.Generator().manual_seed(43)
    requests = random_requests(generator, 8, [0.0], "p")
    for request in requests[:4]:
        request.extra_args = {"flyspec_draft": 0}  # JSON false through vLLM's server
    with installed(monkeypatch):
        committed = v2_step(v2_runner(requests, fly_config(0, 0.0, method="standard")), requests)
    assert committed[:4] == [[int(request.step.logits[0].argmax())] for request in requests[:4]]
    assert committed[4:] == [exact_greedy(request.step) for request in requests[4:]]
    assert any(len(tokens) > 1 for tokens in committed[4:]), "no draft kept beside them: an empty check"


class _Sharder:
    """Batch-sharded sampling where this rank owns none of the step's requests (tensor parallelism)."""

    def __init__(self, empty: object) -> None:
        self.empty = empty

    def shard_sampler_inputs(self, input_batch: object, grammar_output: object) -> tuple:
        return self.empty, torch.zeros(0, dtype=torch.long), grammar_output, object()


def test_a_rank_without_drafts_under_batch_sharded_sampling_claims_no_bypass(monkeypatch, caplog) -> None:
    from vllm.v1.worker.gpu import model_runner

    generator = torch.Generator().manual_seed(44)
    requests = random_requests(generator, 4, [0.0], "t")
    with installed(monkeypatch), caplog.at_level(logging.ERROR, logger="flyspec_vllm"):
        runner = v2_runner(requests, fly_config(WINDOW, THRESHOLD))
        empty = SimpleNamespace(num_reqs=0, num_draft_tokens=0)  # this rank's share of the batch
        runner.batch_sharder = _Sharder(empty)
        runner.model.compute_logits_local = lambda hidden_states: hidden_states
        runner.vocab_size, runner.device = requests[0].step.logits.shape[-1], torch.device("cpu")
        runner.sampler.get_logprobs_dims = lambda *args, **kwargs: None
        monkeypatch.setattr(model_runner, "all_to_all_logits", lambda local, meta: local)
        gathered = SimpleNamespace(num_sampled="n", num_rejected="r")  # the other ranks' outputs, gathered
        monkeypatch.setattr(model_runner, "gather_sampler_output", lambda output, meta, **kwargs: gathered)
        batch = v2_batch(requests, runner.offset)  # the global batch: it has drafts, this rank none of them
        logits = torch.cat([request.step.logits for request in requests])
        assert runner.sample(logits, batch, None) == (gathered, "n", "r")
        assert patch.STATE is not None and patch.STATE.enabled  # loose acceptance stays on
        assert metrics.snapshot()["bypassed_steps"] == 0 and not caplog.records
        served = v2_step(v2_runner(requests, fly_config(WINDOW, THRESHOLD)), requests)
    assert served == [guarded_greedy(request, WINDOW, THRESHOLD) for request in requests]


def test_the_start_line_names_the_circuit_breaker_only_where_a_profile_brings_one() -> None:
    for runner in ("V1", "V2"):
        for native_fly in (True, False):
            plain = mode_line(runner, native_fly, "request", "0.33.0")
            assert "trust guards" in plain and "circuit breaker" not in plain
            assert "the profile's circuit breaker" in mode_line(runner, native_fly, "request", "0.33.0", breaker=True)
        assert "rejection_sample_method 'standard' gets none" in mode_line(runner, True, "request", "0.33.0")
    assert v2.V2Step(None).sampler_ran is False
