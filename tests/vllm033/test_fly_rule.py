"""flyspec's FLy in vLLM semantics (``FlyConfig(variant="vllm")``) commits what vLLM 0.33's own FLy commits, checked
against vLLM's unmodified V1 and V2 rejection samplers run by Triton's interpreter: 500 random steps per runner and
per temperature class (greedy; sampled at T = 1 and 0.7 given the uniform numbers vLLM draws), every window size
from 1 to 4, and thresholds set exactly to the kernels' own entropy values (the boundary: ``>=``)."""

from __future__ import annotations

import torch
from flyspec_vllm.v2_random import rejection_uniforms
from kernels import Step, random_batch, v1_verify, v2_batch, v2_verify
from vllm.v1.spec_decode.fly import compute_fly_entropy

from flyspec.config import FlyConfig, GuardConfig, SamplingConfig
from flyspec.sampling.acceptance import num_leading_true
from flyspec.types import Draft
from flyspec.verifiers.fly import FlyVerifier, deferred_window_mask, fly_candidates, topk_entropy

GREEDY = SamplingConfig()
BATCH, BATCHES = 25, 20  # 500 steps


def config(window: int, threshold: float) -> FlyConfig:
    return FlyConfig(window_size=window, entropy_threshold=threshold, variant="vllm")


def greedy_commit(step: Step, window: int, threshold: float) -> list[int]:
    verifier = FlyVerifier(config(window, threshold), guard=GuardConfig.bare())
    return verifier.verify(Draft(step.draft), step.logits, GREEDY, None).tokens


def exact_commit(step: Step) -> list[int]:
    """Greedy exact verification: the matching prefix, then the target's argmax or the bonus."""
    argmax = step.logits.argmax(-1)
    accepted = int(num_leading_true(step.draft == argmax[:-1]))
    return [*step.draft[:accepted].tolist(), int(argmax[accepted])]


def v1_accepted(step: Step, uniform: torch.Tensor, window: int, threshold: float) -> tuple[int, int]:
    """Draft tokens flyspec accepts at T > 0 given V1's uniforms, with FLy and without: vLLM's ``p / q >= u``
    (one-hot drafts), then FLy's deferrals (its entropy of the softmax of the processed logits)."""
    probs = step.logits[:-1].softmax(-1, dtype=torch.float32)
    base = probs.gather(-1, step.draft.unsqueeze(-1)).squeeze(-1) >= uniform
    candidates, _ = fly_candidates(base, step.logits, config(window, threshold), step.draft, SamplingConfig(1.0))
    return int(num_leading_true(base | candidates)), int(num_leading_true(base))


def v2_entropy(logits: torch.Tensor) -> torch.Tensor:
    return compute_fly_entropy(logits, 3, from_logits=True)  # V2's kernel: from the logits


def v2_accepted(step: Step, uniform: torch.Tensor, window: int, threshold: float) -> tuple[int, int]:
    """At T > 0 on V2: vLLM's ``log p > log u`` with V2's own uniforms, then FLy with V2's entropy."""
    log_probs = step.logits[:-1].log_softmax(-1)
    base = log_probs.gather(-1, step.draft.unsqueeze(-1)).squeeze(-1) > uniform.log()
    entropy = v2_entropy(step.logits[:-1])
    candidates, _ = fly_candidates(base, step.logits, config(window, threshold), step.draft, GREEDY, entropy)
    return int(num_leading_true(base | candidates)), int(num_leading_true(base))


def batch_settings(generator: torch.Generator, index: int) -> tuple[int, float]:
    return 1 + index % 4, float(torch.rand(1, generator=generator)) * 0.9


def test_v1_greedy_fly_commits_what_flyspec_commits() -> None:
    generator = torch.Generator().manual_seed(1)
    loose = 0
    for index in range(BATCHES):
        window, threshold = batch_settings(generator, index)
        steps = random_batch(generator, BATCH, [0.0])
        committed, _ = v1_verify(steps, window, threshold)
        for step, tokens in zip(steps, committed, strict=True):
            assert tokens == greedy_commit(step, window, threshold), (step, window, threshold)
            loose += tokens != exact_commit(step)
    assert loose > 50  # FLy changed the outcome of many steps: not only exact matches were compared


def test_v1_sampled_fly_accepts_what_flyspec_accepts() -> None:
    generator = torch.Generator().manual_seed(2)
    deferred = 0
    for index in range(BATCHES):
        window, threshold = batch_settings(generator, index)
        steps = random_batch(generator, BATCH, [1.0, 0.7])
        committed, uniforms = v1_verify(steps, window, threshold)
        for i, (step, tokens) in enumerate(zip(steps, committed, strict=True)):
            accepted, natively = v1_accepted(step, uniforms[i], window, threshold)
            assert len(tokens) - 1 == accepted and tokens[:accepted] == step.draft[:accepted].tolist()
            deferred += accepted > natively
    assert deferred > 30


def test_v2_greedy_fly_commits_what_flyspec_commits() -> None:
    generator = torch.Generator().manual_seed(3)
    loose = 0
    for index in range(BATCHES):
        window, threshold = batch_settings(generator, index)
        steps = random_batch(generator, BATCH, [0.0])
        for step, tokens in zip(steps, v2_verify(steps, window, threshold), strict=True):
            assert tokens == greedy_commit(step, window, threshold), (step, window, threshold)
            loose += tokens != exact_commit(step)
    assert loose > 50


def test_v2_sampled_fly_accepts_what_flyspec_accepts() -> None:
    generator = torch.Generator().manual_seed(4)
    deferred = 0
    for index in range(BATCHES):
        window, threshold = batch_settings(generator, index)
        steps = random_batch(generator, BATCH, [1.0, 0.7])
        batch = v2_batch(steps)
        uniforms = rejection_uniforms(batch.seed, batch.pos, batch.expanded_idx_mapping)
        start = 0
        for step, tokens in zip(steps, v2_verify(steps, window, threshold), strict=True):
            k = len(step.draft)
            accepted, natively = v2_accepted(step, uniforms[start : start + k], window, threshold)
            assert len(tokens) - 1 == accepted and tokens[:accepted] == step.draft[:accepted].tolist()
            deferred += accepted > natively
            start += k + 1
    assert deferred > 30


def boundary_threshold(steps: list[Step], window: int, entropy_of) -> float | None:  # noqa: ANN001
    """An entropy value, as the kernel computes it, at a mismatch FLy could defer (its window holds)."""
    for step in steps:
        base = step.draft == step.logits[:-1].argmax(-1)
        deferrable = deferred_window_mask(base, window, window)
        if bool(deferrable.any()):
            position = int(deferrable.nonzero()[0])
            return float(entropy_of(step.logits[:-1])[position])
    return None


def test_thresholds_equal_to_the_kernels_entropy_decide_as_the_kernels_do() -> None:
    """At ``threshold == entropy`` both runners defer (``>=``). The vllm variant computes V1's entropy as V1 does
    (softmax, then log) and takes V2's from the plugin (V2's own function), so it decides as each kernel does; the
    ``log_softmax`` entropy of flyspec's own variant differs from V1's in the last bits at some of these points."""
    generator = torch.Generator().manual_seed(6)
    v1_entropy = lambda rows: compute_fly_entropy(rows.softmax(-1, dtype=torch.float32), 3)  # noqa: E731
    checked = differs = 0
    for index in range(8):
        window = 1 + index % 3
        steps = random_batch(generator, BATCH, [0.0])
        threshold = boundary_threshold(steps, window, v1_entropy)
        assert threshold is not None
        committed, _ = v1_verify(steps, window, threshold)
        assert committed == [greedy_commit(step, window, threshold) for step in steps]
        threshold = boundary_threshold(steps, window, v2_entropy)
        assert threshold is not None
        for step, tokens in zip(steps, v2_verify(steps, window, threshold), strict=True):
            base = step.draft == step.logits[:-1].argmax(-1)
            candidates, _ = fly_candidates(
                base, step.logits, config(window, threshold), step.draft, GREEDY, v2_entropy(step.logits[:-1])
            )
            accepted = int(num_leading_true(base | candidates))
            assert tokens[:accepted] == step.draft[:accepted].tolist() and len(tokens) == accepted + 1
        for step in steps:
            rows = step.logits[:-1]
            ours, theirs = topk_entropy(rows, 3), v1_entropy(rows)
            differs += int((ours != theirs).sum())
            checked += rows.shape[0]
    assert differs > 0, checked  # the two formulas do differ: the boundary test above can fail
