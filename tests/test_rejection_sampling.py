"""Statistical: speculative rejection sampling commits tokens distributed as the target (χ² test).

For every trial (its own seed) the draft tokens are drawn from ``draft_probs`` with the trial's coupled noise,
as a draft model draws them (or fixed, for n-gram drafts), ``RejectionVerifier.verify`` runs with the same
draws, and the first committed token (accepted draft token or recovered token) is counted. Its distribution must
be the target's row 0, whatever the draft distribution: the acceptance uniform and the residual draw must be
independent of the noise that drew the draft. Two broken verifiers serve as negative controls: the same χ² test
rejects them, so it can fail.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from conftest import on_devices
from flyspec.config import FlyConfig, SamplingConfig
from flyspec.sampling.acceptance import draft_probs_or_one_hot, rejection_accept_mask
from flyspec.sampling.coupled import ACCEPT, TOKEN, Draws
from flyspec.sampling.sampler import logits_to_probs
from flyspec.types import Draft, Verdict
from flyspec.verifiers import ExactVerifier, FlyVerifier, RejectionVerifier, Verifier
from flyspec.verifiers.base import build_verdict

VOCAB = 6
NUM_SAMPLES = 5_000  # per case; ~0.2 ms per verify call keeps the file near 10 s
MIN_P_VALUE = 1e-3
TARGET_PROBS = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.10, 0.05])
DRAFT_PROBS = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])  # deliberately far from the target
OTHER_TARGET_PROBS = torch.tensor([0.05, 0.05, 0.10, 0.20, 0.25, 0.35])  # rows after the first
UNIT = SamplingConfig(temperature=1.0)


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    # Tens of thousands of tiny verify calls: intra-op threads only add jitter on a loaded box.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def target_logits(k: int, first_row: torch.Tensor = TARGET_PROBS) -> torch.Tensor:
    """``[k + 1, VOCAB]`` logits whose temperature-1 softmax is ``first_row``, then other rows."""
    return torch.stack([first_row.log()] + [OTHER_TARGET_PROBS.log()] * k)


def run_trials(
    verifier: Verifier,
    logits: torch.Tensor,  # [k + 1, VOCAB]
    sampling: SamplingConfig,
    draft_probs: torch.Tensor | None,  # [k, VOCAB]; None: the fixed n-gram draft ``fixed_draft``
    seed: int,
    fixed_draft: list[int] | None = None,
    num_samples: int = NUM_SAMPLES,
    device: str = "cpu",
) -> list[Verdict]:
    """The verdicts of ``num_samples`` drafts, each trial with its own seed's draws, every tensor on ``device``."""
    logits = logits.to(device)
    draft_probs = draft_probs.to(device) if draft_probs is not None else None
    k = logits.shape[0] - 1
    verdicts = []
    for trial in range(num_samples):
        draws = Draws.seeded(seed * 1_000_003 + trial, position=7, device=device)
        if draft_probs is None:
            assert fixed_draft is not None and len(fixed_draft) == k
            tokens = torch.tensor(fixed_draft, dtype=torch.long, device=device)
        else:  # row i drawn from draft_probs[i] with the position's token noise, as a draft model draws it
            tokens = draws.choose(draft_probs.log(), UNIT, TOKEN)
        verdicts.append(verifier.verify(Draft(tokens, draft_probs), logits, sampling, draws))
    return verdicts


def counts_of(tokens: list[int]) -> np.ndarray:
    return np.bincount(np.asarray(tokens, dtype=np.int64), minlength=VOCAB)


def chi2_p_value(counts: np.ndarray, probs: torch.Tensor | np.ndarray) -> float:
    expected = np.asarray(probs, dtype=np.float64)
    expected = expected / expected.sum() * counts.sum()
    return float(chisquare(counts, expected).pvalue)


def first_token_p_value(verdicts: list[Verdict], probs: torch.Tensor) -> float:
    return chi2_p_value(counts_of([v.tokens[0] for v in verdicts]), probs)


# --------------------------------------------------------------------------- lossless verifiers


@pytest.mark.parametrize(("k", "num_samples"), [(1, 10_000), (3, 5_000)])
@on_devices
def test_rejection_first_token_follows_target(k: int, num_samples: int, device: str) -> None:
    draft_probs = DRAFT_PROBS.expand(k, -1).clone()
    verdicts = run_trials(
        RejectionVerifier(), target_logits(k), UNIT, draft_probs, seed=k, num_samples=num_samples, device=device
    )
    assert first_token_p_value(verdicts, TARGET_PROBS) > MIN_P_VALUE
    # Sanity: the draft distribution really differs, and some drafts really were rejected.
    assert first_token_p_value(verdicts, DRAFT_PROBS) < 1e-12
    acceptance = np.mean([v.num_accepted >= 1 for v in verdicts])
    assert acceptance == pytest.approx(float(torch.minimum(TARGET_PROBS, DRAFT_PROBS).sum()), abs=0.02)

    if k == 1:  # the bonus token, given that d_0 was accepted, follows row k = 1
        bonus_tokens = [v.tokens[1] for v in verdicts if v.bonus]
        assert chi2_p_value(counts_of(bonus_tokens), OTHER_TARGET_PROBS) > MIN_P_VALUE


@pytest.mark.parametrize("draft_token", [0, 5])
@on_devices
def test_rejection_with_ngram_draft_follows_target(draft_token: int, device: str) -> None:
    # draft_probs=None: the draft is deterministic (one-hot); accepted w.p. target_probs[d].
    verdicts = run_trials(
        RejectionVerifier(),
        target_logits(2),
        UNIT,
        None,
        seed=20 + draft_token,
        fixed_draft=[draft_token, 1],
        num_samples=4_000,
        device=device,
    )
    assert first_token_p_value(verdicts, TARGET_PROBS) > MIN_P_VALUE
    acceptance = np.mean([v.num_accepted >= 1 for v in verdicts])
    assert acceptance == pytest.approx(float(TARGET_PROBS[draft_token]), abs=0.02)


def test_fly_rejection_rule_without_judgeable_positions_is_lossless() -> None:
    # k=3 <= W: no position can be loosely accepted, so FLy is plain rejection sampling.
    draft_probs = DRAFT_PROBS.expand(3, -1).clone()
    verifier = FlyVerifier(FlyConfig(window_size=6, entropy_threshold=0.0))
    verdicts = run_trials(verifier, target_logits(3), UNIT, draft_probs, seed=30, num_samples=3_000)
    assert first_token_p_value(verdicts, TARGET_PROBS) > MIN_P_VALUE
    assert all(v.loose_positions == () for v in verdicts)


@on_devices
def test_exact_match_at_positive_temperature_follows_target(device: str) -> None:
    draft_probs = DRAFT_PROBS.expand(2, -1).clone()
    verdicts = run_trials(
        ExactVerifier(), target_logits(2), UNIT, draft_probs, seed=40, num_samples=3_000, device=device
    )
    assert first_token_p_value(verdicts, TARGET_PROBS) > MIN_P_VALUE


# --------------------------------------------------------------------------- filtered targets


RAW_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.0, -0.5])


def softmax(values: np.ndarray) -> np.ndarray:
    shifted = np.exp(values - values.max())
    return shifted / shifted.sum()


def expected_top_k(logits: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    kept = np.argsort(-logits)[:top_k]
    probs = np.zeros_like(logits)
    probs[kept] = softmax(logits[kept] / temperature)
    return probs


def expected_top_p(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    probs = softmax(logits / temperature)
    order = np.argsort(-probs)
    mass_before = np.cumsum(probs[order]) - probs[order]
    kept = order[mass_before < top_p]
    filtered = np.zeros_like(probs)
    filtered[kept] = probs[kept]
    return filtered / filtered.sum()


@pytest.mark.parametrize(
    ("sampling", "expected"),
    [
        (SamplingConfig(temperature=0.7, top_k=4), expected_top_k(RAW_LOGITS.double().numpy(), 0.7, 4)),
        (SamplingConfig(temperature=1.3, top_p=0.8), expected_top_p(RAW_LOGITS.double().numpy(), 1.3, 0.8)),
    ],
    ids=["T0.7-top_k4", "T1.3-top_p0.8"],
)
def test_rejection_reproduces_filtered_target(sampling: SamplingConfig, expected: np.ndarray) -> None:
    kept = expected > 0
    assert 2 <= kept.sum() < VOCAB  # the filter really removes tokens
    assert logits_to_probs(RAW_LOGITS, sampling).double().numpy() == pytest.approx(expected, abs=1e-6)

    logits = torch.stack([RAW_LOGITS, RAW_LOGITS])  # [k + 1 = 2, VOCAB]
    draft_probs = torch.full((1, VOCAB), 1.0 / VOCAB)  # proposes filtered tokens too
    verdicts = run_trials(RejectionVerifier(), logits, sampling, draft_probs, seed=50)
    counts = counts_of([v.tokens[0] for v in verdicts])
    assert counts[~kept].sum() == 0
    assert chi2_p_value(counts[kept], expected[kept]) > MIN_P_VALUE


# --------------------------------------------------------------------------- negative controls


class AcceptAllVerifier:
    """Broken on purpose: keeps every draft token (commits the draft distribution)."""

    name = "accept-all"
    lossless = False

    def verify(
        self,
        draft: Draft,
        target_logits: torch.Tensor,
        sampling: SamplingConfig,
        draws: Draws | None,
    ) -> Verdict:
        tokens = draft.tokens.tolist()
        return Verdict(tokens + [int(target_logits[-1].argmax())], len(tokens), bonus=True)


class TargetResampleVerifier:
    """Broken on purpose: correct acceptance test, but recovers from target_probs, not the residual."""

    name = "target-resample"
    lossless = False

    def verify(
        self,
        draft: Draft,
        target_logits: torch.Tensor,
        sampling: SamplingConfig,
        draws: Draws | None,
    ) -> Verdict:
        assert draws is not None
        target_probs = logits_to_probs(target_logits, sampling)
        draft_probs = draft_probs_or_one_hot(draft, VOCAB)
        uniforms = draws.uniforms(draft.num_tokens, ACCEPT)
        accept = rejection_accept_mask(draft.tokens, draft_probs, target_probs, uniforms)
        return build_verdict(
            draft.tokens, accept, torch.zeros_like(accept), self.next_token(draft, target_probs, draft_probs, draws)
        )

    @staticmethod
    def next_token(draft: Draft, target_probs: torch.Tensor, draft_probs: torch.Tensor, draws: Draws) -> Any:
        return lambda n: draws.sample(target_probs[n], n, ACCEPT + 10)


class SharedNoiseResidualVerifier(TargetResampleVerifier):
    """Broken on purpose: rejection sampling whose residual token reuses the noise that drew the draft token."""

    name = "shared-noise-residual"

    @staticmethod
    def next_token(draft: Draft, target_probs: torch.Tensor, draft_probs: torch.Tensor, draws: Draws) -> Any:
        residual = (target_probs[: draft.num_tokens] - draft_probs).clamp_min(0)
        residual = residual / residual.sum(-1, keepdim=True)
        return lambda n: draws.sample(residual[n] if n < draft.num_tokens else target_probs[n], n, TOKEN)


@pytest.mark.parametrize(
    ("verifier", "committed_probs"),
    [
        (AcceptAllVerifier(), DRAFT_PROBS),
        # min(target, draft) + P(reject) * target = [0.185, 0.2125, 0.24, 0.145, 0.145, 0.0725]
        (TargetResampleVerifier(), torch.minimum(TARGET_PROBS, DRAFT_PROBS) + 0.45 * TARGET_PROBS),
        (SharedNoiseResidualVerifier(), None),
    ],
    ids=["accept-all", "target-resample", "shared-noise-residual"],
)
def test_chi2_rejects_broken_verifiers(verifier: Verifier, committed_probs: torch.Tensor | None) -> None:
    draft_probs = DRAFT_PROBS.unsqueeze(0)
    # the shared noise's bias is smaller (about 0.03 on a token's probability): it takes more samples to show
    num_samples = NUM_SAMPLES if committed_probs is not None else 4 * NUM_SAMPLES
    verdicts = run_trials(verifier, target_logits(1), UNIT, draft_probs, seed=60, num_samples=num_samples)
    assert first_token_p_value(verdicts, TARGET_PROBS) < 1e-12
    if committed_probs is not None:
        assert first_token_p_value(verdicts, committed_probs) > MIN_P_VALUE  # ... and this is why
