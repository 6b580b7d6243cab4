"""The plugin installed on vLLM 0.33's real modules for one test (and taken off after), and random hand-made
requests over the guards' word vocabulary (``tests/test_guard.py``: digits, names, EOS, code), with what flyspec's
own verifier commits for each: the expectation the real runners are held to."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch
from flyspec_vllm import failsafe, metrics, patch
from flyspec_vllm import requests as plugin_requests
from kernels import Step, random_step
from runners import Request

from flyspec.config import FlyConfig, GuardConfig, SamplingConfig
from flyspec.sampling.acceptance import num_leading_true
from flyspec.types import Draft, VerifyContext
from flyspec.verifiers.fly import FlyVerifier, fly_candidates
from flyspec.verifiers.guard import guard_loose_mask
from guard_words import EOS, VOCAB, VOCABULARY

WRAPPED = {  # everything patch.install may replace, to put back after each test
    "vllm.v1.sample.rejection_sampler": ("rejection_sample", "apply_fly_greedy_acceptance_kernel",
                                          "apply_fly_random_acceptance_kernel"),
    "vllm.v1.worker.gpu_model_runner": (("GPUModelRunner", "_sample"), ("GPUModelRunner", "load_model"),
                                        ("GPUModelRunner", "initialize_kv_cache")),
    "vllm.v1.worker.gpu.spec_decode.rejection_sampler": ("rejection_sample", ("RejectionSampler", "__call__")),
    "vllm.v1.worker.gpu.model_runner": (("GPUModelRunner", "sample"), ("GPUModelRunner", "add_requests"),
                                        ("GPUModelRunner", "_remove_request"),
                                        ("GPUModelRunner", "initialize_kv_cache")),
    "vllm.config": (("VllmConfig", "__post_init__"),),
    "vllm.sampling_params": (("SamplingParams", "verify"),),
}  # fmt: skip


@contextlib.contextmanager
def installed(monkeypatch: Any, switch: str = "request") -> Iterator[None]:
    """``patch.install()`` on the real modules (the guards' word vocabulary as the served model's), undone after."""
    saved = []
    for module_name, names in WRAPPED.items():
        module = importlib.import_module(module_name)
        for name in names:
            owner, attribute = (getattr(module, name[0]), name[1]) if isinstance(name, tuple) else (module, name)
            saved.append((owner, attribute, owner.__dict__.get(attribute, getattr(owner, attribute))))
    monkeypatch.setenv("FLYSPEC_VLLM_FLY", switch)
    for variable in ("FLYSPEC_VLLM_GUARDS", "FLYSPEC_VLLM_PROFILE", "FLYSPEC_VLLM_TRUST_REQUESTS"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(plugin_requests, "vocabulary_of", lambda runner, state: VOCABULARY)
    metrics.reset()
    failsafe.reset_logging()
    try:
        assert patch.install() is True
        yield
    finally:
        for owner, attribute, original in saved:
            setattr(owner, attribute, original)
        patch.STATE = None


def random_requests(generator: torch.Generator, size: int, temperatures: list[float], tag: str) -> list[Request]:
    """Flat target distributions (FLy defers often) over the guards' words; unique request ids."""
    requests = []
    for index in range(size):
        k = int(torch.randint(4, 11, (1,), generator=generator))
        step = random_step(generator, k, temperatures[index % len(temperatures)], vocab=VOCAB)
        step.logits = step.logits * 0.35
        prompt = torch.randint(1, VOCAB, (int(torch.randint(3, 8, (1,), generator=generator)),), generator=generator)
        output = torch.randint(0, VOCAB, (int(torch.randint(0, 5, (1,), generator=generator)),), generator=generator)
        output = output[output != EOS]  # a request that produced EOS has ended
        requests.append(Request(f"{tag}-{index}", prompt.tolist(), output.tolist(), step))
    return requests


def context(request: Request) -> VerifyContext:
    return VerifyContext(request.tokens, len(request.prompt), VOCABULARY)


def native_config(window: int, threshold: float) -> FlyConfig:
    return FlyConfig(window_size=window, entropy_threshold=threshold, variant="vllm")


def guarded_greedy(request: Request, window: int, threshold: float, guard: GuardConfig | None = None) -> list[int]:
    """vLLM's FLy (flyspec's copy) with flyspec's guards: what a greedy request commits under the plugin."""
    verifier = FlyVerifier(native_config(window, threshold), guard=guard or GuardConfig())
    step = request.step
    return verifier.verify(Draft(step.draft), step.logits, SamplingConfig(), None, context(request)).tokens


def exact_greedy(step: Step) -> list[int]:
    argmax = step.logits.argmax(-1)
    accepted = int(num_leading_true(step.draft == argmax[:-1]))
    return [*step.draft[:accepted].tolist(), int(argmax[accepted])]


def guarded_accepted(
    request: Request, base: torch.Tensor, window: int, threshold: float, rows: torch.Tensor,
    entropy: torch.Tensor | None, sampling: SamplingConfig,
) -> tuple[int, int]:  # fmt: skip
    """At T > 0 given the kernel's own acceptance ``base``: draft tokens accepted under the guards, and by FLy alone."""
    step = request.step
    candidates, _ = fly_candidates(base, step.logits, native_config(window, threshold), step.draft, sampling, entropy)
    kept, _ = guard_loose_mask(base, candidates, Draft(step.draft), rows, GuardConfig(), context(request))
    return int(num_leading_true(base | kept)), int(num_leading_true(base | candidates))
