"""The protected-token guard: hand-built logit tables, the vocabulary mask, and its plumbing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flyspec.api import build_decoder
from flyspec.cli import main
from flyspec.config import ConfigError, FlyConfig, GuardConfig, MarginConfig, SamplingConfig, TypicalConfig
from flyspec.models import LoadedModel
from flyspec.types import Draft
from flyspec.verifiers.fly import FlyVerifier
from flyspec.verifiers.guard import guard_loose_mask, is_protected, protected_mask
from flyspec.verifiers.margin import MarginVerifier
from flyspec.verifiers.typical import TypicalVerifier

GREEDY = SamplingConfig()
VOCAB = 8


def table(top_tokens: list[int], runner_up: list[int] | None = None) -> torch.Tensor:
    """``[len(top_tokens), VOCAB]`` logits: ``top_tokens[i]`` at 5.0, the runner-up at 4.9, the rest 0."""
    logits = torch.zeros(len(top_tokens), VOCAB)
    for row, token in enumerate(top_tokens):
        logits[row, token] = 5.0
        if runner_up is not None:
            logits[row, runner_up[row]] = 4.9
    return logits


def draft(tokens: list[int]) -> Draft:
    return Draft(torch.tensor(tokens, dtype=torch.long))


def mask_of(*tokens: int) -> torch.Tensor:
    mask = torch.zeros(VOCAB, dtype=torch.bool)
    mask[list(tokens)] = True
    return mask


# FLy with no window and no entropy gate keeps every mismatch: the guard is then the only filter.
LOOSE_FLY = FlyConfig(window_size=0, entropy_threshold=0.0)
# draft:  1 3 2 4    target argmax: 1 2 2 5    → mismatches at positions 1 (3 vs 2) and 3 (4 vs 5)
DRAFT_TOKENS = [1, 3, 2, 4]
TARGET_LOGITS = table([1, 2, 2, 5, 6])  # [k + 1, vocab]; row 4 gives the bonus token 6


@pytest.mark.parametrize(
    ("protected", "tokens", "loose"),
    [
        (None, [1, 3, 2, 4, 6], (1, 3)),  # no guard: both mismatches loosely accepted, bonus 6
        (mask_of(3), [1, 2], ()),  # draft token 3 protected: strict at 1, recovered = target's 2
        (mask_of(2), [1, 2], ()),  # target top token 2 protected: vetoed the same way
        (mask_of(4), [1, 3, 2, 5], (1,)),  # only position 3 vetoed: recovered = target's 5
        (mask_of(5), [1, 3, 2, 5], (1,)),
        (mask_of(0, 7), [1, 3, 2, 4, 6], (1, 3)),  # protected tokens not involved: unchanged
    ],
)
def test_fly_guard_vetoes_exactly_protected_mismatches(
    protected: torch.Tensor | None, tokens: list[int], loose: tuple[int, ...]
) -> None:
    verdict = FlyVerifier(LOOSE_FLY, protected=protected).verify(draft(DRAFT_TOKENS), TARGET_LOGITS, GREEDY, None)
    assert verdict.tokens == tokens
    assert verdict.loose_positions == loose


def test_guard_never_touches_base_rule_accepts() -> None:
    """A protected token the target itself chose is accepted as usual (the guard only removes loose accepts)."""
    verdict = FlyVerifier(LOOSE_FLY, protected=mask_of(1, 2)).verify(draft([1, 2]), table([1, 2, 6]), GREEDY, None)
    assert verdict.tokens == [1, 2, 6]
    assert verdict.loose_positions == ()


def test_guard_loose_mask_is_a_pure_filter() -> None:
    loose = torch.tensor([False, True, False, True])
    kept = guard_loose_mask(loose, torch.tensor(DRAFT_TOKENS), TARGET_LOGITS, mask_of(4))
    assert kept.tolist() == [False, True, False, False]
    assert guard_loose_mask(loose, torch.tensor(DRAFT_TOKENS), TARGET_LOGITS, None) is loose


def test_margin_guard() -> None:
    # draft token 3 is the target's close runner-up at both positions; 3 protected → strict at position 0
    logits = table([2, 2, 6], runner_up=[3, 3, 0])
    assert MarginVerifier(MarginConfig()).verify(draft([3, 3]), logits, GREEDY, None).tokens == [3, 3, 6]
    guarded = MarginVerifier(MarginConfig(), protected=mask_of(3)).verify(draft([3, 3]), logits, GREEDY, None)
    assert guarded.tokens == [2]
    assert guarded.loose_positions == ()


def test_typical_guard() -> None:
    # at T=1 the draft token 3 (logit 4.9 vs 5.0) passes the typical threshold
    logits = table([2, 2, 6], runner_up=[3, 3, 0])
    plain = TypicalVerifier(TypicalConfig()).verify(draft([3, 3]), logits, GREEDY, None)
    assert plain.tokens == [3, 3, 6] and plain.loose_positions == (0, 1)
    guarded = TypicalVerifier(TypicalConfig(), protected=mask_of(2)).verify(draft([3, 3]), logits, GREEDY, None)
    assert guarded.tokens == [2]


@pytest.mark.parametrize("seed", range(20))
def test_no_guard_and_empty_mask_change_nothing(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(7, VOCAB, generator=generator) * 2  # [k + 1, vocab]
    tokens = draft(torch.randint(0, VOCAB, (6,), generator=generator).tolist())
    empty = torch.zeros(VOCAB, dtype=torch.bool)
    for config in (FlyConfig(window_size=2, entropy_threshold=0.1), LOOSE_FLY):
        assert FlyVerifier(config).verify(tokens, logits, GREEDY, None) == FlyVerifier(config, protected=empty).verify(
            tokens, logits, GREEDY, None
        )
    assert MarginVerifier().verify(tokens, logits, GREEDY, None) == MarginVerifier(protected=empty).verify(
        tokens, logits, GREEDY, None
    )
    assert TypicalVerifier().verify(tokens, logits, GREEDY, None) == TypicalVerifier(protected=empty).verify(
        tokens, logits, GREEDY, None
    )


@pytest.mark.parametrize(
    ("text", "classes", "protected"),
    [
        (" 42", ("digits",), True),
        ("x1", ("digits",), True),
        (" answer", ("digits",), False),
        (" answer", ("identifiers",), True),
        ("_", ("identifiers",), True),
        (" (", ("identifiers",), False),
        ("):\n", ("identifiers",), False),
        ("7", ("identifiers",), True),  # identifiers include digits
        (" 42", (), False),
    ],
)
def test_token_classes(text: str, classes: tuple[str, ...], protected: bool) -> None:
    assert is_protected(text, classes) is protected


def test_protected_mask_over_the_vocabulary(tiny_target: LoadedModel) -> None:
    tokenizer = tiny_target.tokenizer
    mask = protected_mask(tokenizer, ("digits",), vocab_size=len(tokenizer) + 4)
    assert mask.shape == (len(tokenizer) + 4,) and not mask[len(tokenizer) :].any()
    texts = tokenizer.batch_decode([[token_id] for token_id in range(len(tokenizer))])
    assert mask[: len(tokenizer)].tolist() == [any(c.isdigit() for c in text) for text in texts]
    assert mask.any()  # the corpus has "1" and "2"
    assert not protected_mask(tokenizer, ()).any()


def test_unknown_class_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown protected token class 'numbers'"):
        GuardConfig(("numbers",))


def test_build_decoder_plumbs_the_guard(tiny_target: LoadedModel) -> None:
    guarded = build_decoder(tiny_target, "ngram", "fly", guard=GuardConfig(("digits",)))
    assert guarded.verifier.protected is not None
    assert guarded.verifier.protected.shape[0] == tiny_target.model.config.vocab_size
    assert build_decoder(tiny_target, "ngram", "fly").verifier.protected is None
    assert not hasattr(
        build_decoder(tiny_target, "ngram", "exact", guard=GuardConfig(("digits",))).verifier, "protected"
    )


def test_generate_cli_accepts_protect(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "Speculative decoding drafts", "--target", str(tiny_model_dir), "--dtype", "float32"]
    options = ["--no-chat", "--json", "--max-new-tokens", "12", "--verifier", "fly", "--protect", "digits"]
    assert main([*argv, *options, "--protect", "identifiers"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["verifier"] == "fly" and not record["lossless"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, *options, "--protect", "numbers"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'numbers'" in capsys.readouterr().err
