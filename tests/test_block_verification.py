"""Block verification (verifiers/block.py): lossless at T > 0, keeps at least as much as rejection sampling.

The models here are tables: the target's distribution at output position j is ``TARGET[j]`` and the drafter's
``DRAFT[j]``, whatever came before (a valid pair of language models). A small decoding loop drafts ``K`` tokens from
the drafter's tables, verifies them and commits the verdict, until two output tokens exist; the pair's distribution
must be ``TARGET[0] ⊗ TARGET[1]`` (χ²). A verifier that accepts every draft token is the negative control.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from flyspec.config import SamplingConfig
from flyspec.sampling.coupled import Draws
from flyspec.types import Draft, Verdict
from flyspec.verifiers.base import build_verdict
from flyspec.verifiers.block import BlockVerifier
from flyspec.verifiers.exact import ExactVerifier
from flyspec.verifiers.rejection import RejectionVerifier

VOCAB, K = 5, 3
UNIT = SamplingConfig(temperature=1.0)
TARGET = torch.tensor(
    [
        [0.40, 0.25, 0.15, 0.15, 0.05],
        [0.05, 0.10, 0.45, 0.20, 0.20],
        [0.30, 0.30, 0.10, 0.10, 0.20],
        [0.10, 0.20, 0.30, 0.20, 0.20],
        [0.25, 0.25, 0.25, 0.15, 0.10],
        [0.20, 0.20, 0.20, 0.20, 0.20],
    ]
)
DRAFT = torch.tensor(
    [
        [0.10, 0.40, 0.10, 0.30, 0.10],
        [0.10, 0.10, 0.20, 0.50, 0.10],
        [0.50, 0.10, 0.10, 0.10, 0.20],
        [0.20, 0.20, 0.20, 0.20, 0.20],
        [0.10, 0.10, 0.60, 0.10, 0.10],
        [0.20, 0.20, 0.20, 0.20, 0.20],
    ]
)


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


class AcceptAll:
    """Negative control: keeps every draft token (not lossless)."""

    def verify(self, draft, target_logits, sampling, draws, context=None) -> Verdict:
        accept = torch.ones(draft.num_tokens, dtype=torch.bool)
        return build_verdict(draft.tokens, accept, torch.zeros_like(accept), lambda n: 0)


def first_two(verifier, draws: Draws, one_hot: bool = False) -> tuple[tuple[int, int], int]:
    """The first two output tokens of a table-driven decode (one generation's draws), and the tokens the first step
    accepted."""
    output: list[int] = []
    first_accepted = -1
    while len(output) < 2:
        start = len(output)
        rows = DRAFT[start : start + K]
        tokens = torch.multinomial(rows, 1, generator=draws.generator).squeeze(-1)
        draft = Draft(tokens, None if one_hot else rows)
        verdict = verifier.verify(draft, TARGET[start : start + K + 1].log(), UNIT, draws.at(start))
        first_accepted = verdict.num_accepted if first_accepted < 0 else first_accepted
        output += verdict.tokens
    return (output[0], output[1]), first_accepted


def pair_p_value(verifier, seed: int, trials: int, one_hot: bool = False) -> tuple[float, float]:
    counts = np.zeros((VOCAB, VOCAB))
    accepted = []
    for trial in range(trials):
        (first, second), kept = first_two(verifier, Draws.seeded(seed * 100_003 + trial), one_hot)
        counts[first, second] += 1
        accepted.append(kept)
    expected = np.outer(TARGET[0].numpy(), TARGET[1].numpy()).astype(np.float64)
    expected = expected / expected.sum() * trials
    return float(chisquare(counts.ravel(), expected.ravel()).pvalue), float(np.mean(accepted))


@pytest.mark.parametrize("one_hot", [False, True], ids=["model-draft", "one-hot-draft"])
def test_block_verification_commits_the_targets_distribution(one_hot: bool) -> None:
    p_value, _ = pair_p_value(BlockVerifier(), seed=11 + one_hot, trials=4000, one_hot=one_hot)
    assert p_value > 1e-3
    control, _ = pair_p_value(AcceptAll(), seed=3, trials=2000, one_hot=one_hot)
    assert control < 1e-9  # the same test rejects a lossy verifier: it can fail


def test_block_verification_keeps_more_than_rejection_sampling() -> None:
    _, block = pair_p_value(BlockVerifier(), seed=21, trials=6000)
    _, token_by_token = pair_p_value(RejectionVerifier(), seed=22, trials=6000)
    assert block >= token_by_token - 0.02  # the paper's guarantee, up to sampling noise (about 0.01 here)
    assert block > token_by_token + 0.1  # and on these tables it keeps more: measured 1.64 against 1.40 tokens


def test_greedy_block_verification_is_exact_match_and_draws_nothing() -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(K + 1, VOCAB, generator=generator)
        tokens = torch.randint(0, VOCAB, (K,), generator=generator)
        tokens[0] = logits[0].argmax()
        draws = Draws.seeded(1)
        state = draws.generator.get_state()
        verdict = BlockVerifier().verify(Draft(tokens), logits, SamplingConfig(), draws)
        assert torch.equal(draws.generator.get_state(), state) and draws.noise.num_rows_drawn == 0
        assert verdict == ExactVerifier().verify(Draft(tokens), logits, SamplingConfig(), None)
