"""The trust guards of the lossy verifiers: hand-built logit tables and contexts, token classes, plumbing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from scipy import stats as scipy_stats

from conftest import make_tiny_model
from flyspec.api import build_decoder
from flyspec.cli.app import main
from flyspec.config import (
    ConfigError,
    FlyConfig,
    GuardConfig,
    MarginConfig,
    SamplingConfig,
    SpeculationConfig,
    TypicalConfig,
)
from flyspec.decoding.speculative import SpeculativeDecoder
from flyspec.drafters.ngram import NgramDrafter
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.sampling import acceptance
from flyspec.sampling.coupled import Draws
from flyspec.types import CACHE, MODEL, OUTPUT_COPY, PROMPT_COPY, Draft, VerifyContext
from flyspec.verifiers import fly as fly_module
from flyspec.verifiers import guard as guard_module
from flyspec.verifiers.fly import FlyVerifier, topk_entropy
from flyspec.verifiers.margin import MarginVerifier
from flyspec.verifiers.tokens import (
    is_protected,
    looks_like_code,
    name_spans,
    protected_mask,
    vocabulary_of,
)
from flyspec.verifiers.typical import TypicalVerifier
from guard_words import (  # noqa: F401 - the word vocabulary, imported from here by other tests too
    ALICE,
    ASK,
    BOB,
    CAT,
    DOG,
    DOT,
    EOS,
    EQUALS,
    FENCE,
    ID,
    IS,
    MAT,
    N24,
    N42,
    NEWLINE,
    ON,
    SAID,
    SAT,
    THE,
    VOCAB,
    VOCABULARY,
    WORDS,
    WordTokenizer,
    X,
    Y,
)

GREEDY = SamplingConfig()
# No window, no entropy gate: FLy would keep every mismatch, so the guards are the only filter.
LOOSE_FLY = FlyConfig(window_size=0, entropy_threshold=0.0)


def logits_for(top: list[int], second: list[int] | None = None, gap: float = 0.1) -> torch.Tensor:
    """``[len(top), VOCAB]``: ``top[i]`` at 5, ``second[i]`` (where given) at 5 - gap, the rest 0."""
    logits = torch.zeros(len(top), VOCAB)
    for row, token in enumerate(top):
        logits[row, token] = 5.0
        if second is not None and row < len(second):
            logits[row, second[row]] = 5.0 - gap
    return logits


def context(prompt: list[int], output: list[int] = ()) -> VerifyContext:  # type: ignore[assignment]
    return VerifyContext([*prompt, *output], len(prompt), VOCABULARY)


def verify(draft: list[int], logits: torch.Tensor, ctx: VerifyContext | None, guard: GuardConfig | None = None,
           sources: tuple[str, ...] | None = None):  # fmt: skip
    verifier = FlyVerifier(LOOSE_FLY, guard=guard or GuardConfig())
    return verifier.verify(Draft(torch.tensor(draft), sources=sources), logits, GREEDY, None, ctx)


# --- always on: EOS and cache ------------------------------------------------------------------


@pytest.mark.parametrize("guard", [GuardConfig(), GuardConfig.bare()], ids=["default", "bare"])
def test_eos_is_never_loosely_accepted_nor_loosened_past(guard: GuardConfig) -> None:
    prompt = [THE, CAT]
    # draft EOS where the target wanted " the": would end the answer early
    early = verify([EOS], logits_for([THE, DOG], [EOS]), context(prompt), guard)
    assert early.tokens == [THE] and early.loose_positions == () and early.vetoes == ("eos",)
    # target wanted EOS, the draft writes on
    past = verify([THE], logits_for([EOS, DOG], [THE]), context(prompt), guard)
    assert past.tokens == [EOS] and past.vetoes == ("eos",)


@pytest.mark.parametrize("guard", [GuardConfig(), GuardConfig.bare()], ids=["default", "bare"])
def test_cache_tokens_are_never_loosely_accepted(guard: GuardConfig) -> None:
    logits = logits_for([CAT, DOG], [DOG])  # the cache proposes the target's close runner-up
    for ctx in (context([THE]), None):  # also without a context: provenance is in the draft itself
        verdict = verify([DOG], logits, ctx, guard, sources=(CACHE,))
        assert verdict.tokens == [CAT] and verdict.vetoes == ("cache",)
    assert verify([DOG], logits, context([THE]), guard, sources=(MODEL,)).tokens == [DOG, DOG]


# --- default guards, off in the bare rule ------------------------------------------------------


def test_top_k_guard_keeps_only_tokens_the_target_was_unsure_about() -> None:
    logits = logits_for([CAT, DOT], [DOG])
    logits[0, SAT] = 4.5  # third choice
    assert verify([SAT], logits, None).loose_positions == (0,)  # SAT is in the top 3
    logits[0, ON] = 4.8  # SAT is now fourth
    refused = verify([SAT], logits, None)
    assert refused.tokens == [CAT] and refused.vetoes == ("top-k",)
    assert verify([SAT], logits, None, GuardConfig.bare()).loose_positions == (0,)


@pytest.mark.parametrize(
    ("draft", "top", "guard", "vetoed"),
    [
        (N42, N24, GuardConfig(), True),  # a changed number
        (DOG, N24, GuardConfig(), True),  # the target wanted a number
        (N42, N24, GuardConfig.bare(), False),
        (N42, N24, GuardConfig(protect=("names",)), False),
        (DOG, CAT, GuardConfig(), False),  # prose: loosely acceptable
        (DOG, CAT, GuardConfig(protect=("identifiers",)), True),  # every word protected
    ],
)
def test_protected_classes(draft: int, top: int, guard: GuardConfig, vetoed: bool) -> None:
    verdict = verify([draft], logits_for([top, DOG], [draft]), context([THE, SAID]), guard)
    assert (verdict.loose_positions == ()) is vetoed
    assert (verdict.vetoes == ("protect",)) is vetoed


def test_names_of_the_prompt_are_protected_but_other_prose_is_not() -> None:
    prompt = [ASK, ALICE, IS, CAT, DOT]  # "Ask Alice is cat." : Alice is a name, not a sentence start
    assert VOCABULARY.prompt_names(prompt) == frozenset({ALICE})
    assert verify([ALICE], logits_for([BOB, DOG], [ALICE]), context(prompt)).vetoes == ("protect",)
    assert verify([BOB], logits_for([ALICE, DOG], [BOB]), context(prompt)).vetoes == ("protect",)  # target's top
    assert verify([DOG], logits_for([CAT, DOG], [DOG]), context(prompt)).loose_positions == (0,)


def test_identifiers_are_protected_inside_code_only() -> None:
    prompt = [ASK, DOT]
    logits = logits_for([X, DOG], [Y])
    assert verify([Y], logits, context(prompt, [THE])).loose_positions == (0,)  # prose: y for x is fine
    in_code = verify([Y], logits, context(prompt, [FENCE, NEWLINE, X, EQUALS]))
    assert in_code.loose_positions == () and in_code.vetoes == ("protect",)
    closed = verify([Y], logits, context(prompt, [FENCE, NEWLINE, X, FENCE, NEWLINE]))
    assert closed.loose_positions == (0,)
    # a fence opened earlier in the same draft counts too
    verdict = FlyVerifier(LOOSE_FLY).verify(
        Draft(torch.tensor([FENCE, NEWLINE, Y])), logits_for([FENCE, NEWLINE, X, DOG], [0, 0, Y]), GREEDY, None,
        context(prompt),
    )  # fmt: skip
    assert verdict.tokens == [FENCE, NEWLINE, X] and verdict.vetoes == ("protect",)


def test_loop_guard_refuses_a_loose_accept_that_repeats_the_output() -> None:
    output = [THE, CAT, SAT, ON, THE, MAT, DOT]
    # the draft copies the output again (" the cat sat on"); the target wanted " dog" instead of " cat"
    draft = [THE, CAT, SAT, ON]
    logits = logits_for([THE, DOG, SAT, ON, DOT], [0, CAT, 0, 0, 0])
    verdict = verify(draft, logits, context([ASK, DOT], output))
    assert verdict.tokens == [THE, DOG] and verdict.vetoes == ("loop",)
    assert verify(draft, logits, context([ASK, DOT], output), GuardConfig.bare()).tokens == [*draft, DOT]
    # the same tokens after an output that never said them are no loop
    assert verify(draft, logits, context([ASK, DOT], [MAT, DOT])).tokens == [*draft, DOT]


def test_loop_guard_lets_through_what_the_target_would_repeat_anyway() -> None:
    output = [THE, CAT, SAT, ON, THE, DOG, SAT, ON]
    # both " cat" (draft) and " dog" (target) continue an earlier " the X sat on": the target repeats anyway
    verdict = verify(
        [THE, CAT, SAT, ON], logits_for([THE, DOG, SAT, ON, DOT], [0, CAT, 0, 0, 0]), context([ASK], output)
    )
    assert verdict.loose_positions == (1,)


def test_copy_guard_needs_the_targets_near_agreement_to_keep_a_prompt_copy() -> None:
    prompt = [ASK, THE, CAT, SAT, ON, THE, MAT, DOT]
    output = [THE]
    # the draft copies " cat sat on" from the prompt; the target wanted " dog"
    far = logits_for([DOG, SAT, ON, THE], [CAT, 0, 0, 0], gap=2.0)  # p(cat)/p(dog) = e^-2 ≈ 0.14
    refused = verify([CAT, SAT, ON], far, context(prompt, output))
    assert refused.tokens == [DOG] and refused.vetoes == ("copy",)
    near = logits_for([DOG, SAT, ON, THE], [CAT, 0, 0, 0], gap=0.2)  # ratio e^-0.2 ≈ 0.82
    assert verify([CAT, SAT, ON], near, context(prompt, output)).vetoes == ("copy",)  # default 1.0: a tie only
    kept = verify([CAT, SAT, ON], near, context(prompt, output), GuardConfig(copy_ratio=0.5))
    assert kept.tokens == [CAT, SAT, ON, THE] and kept.loose[0].source == "unknown"
    assert verify([CAT, SAT, ON], far, context(prompt, output), GuardConfig(copy_ratio=0.0)).loose_positions == (0,)


def test_guards_only_remove_loose_accepts() -> None:
    """Tokens the target itself chose are accepted whatever their class; a guard never adds an accept."""
    logits = logits_for([N42, EOS, ALICE], [DOG, DOG, DOG])
    verdict = verify([N42, EOS], logits, context([ASK, ALICE, DOT]))
    assert verdict.tokens == [N42, EOS, ALICE] and verdict.loose_positions == ()


@pytest.mark.parametrize("seed", range(30))
def test_guarded_verdicts_are_bare_verdicts_cut_short(seed: int) -> None:
    """Property: the guarded verdict commits a prefix of the bare one, then the strict token there."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(9, VOCAB, generator=generator) * 2  # [k + 1, vocab]
    draft = torch.randint(0, VOCAB, (8,), generator=generator).tolist()
    ctx = context([ASK, ALICE, THE, CAT, SAT, DOT], [THE, CAT, SAT, ON, N42])
    bare = verify(draft, logits, ctx, GuardConfig.bare())
    guarded = verify(draft, logits, ctx)
    assert guarded.num_accepted <= bare.num_accepted
    assert guarded.tokens[:-1] == bare.tokens[: guarded.num_accepted]
    assert set(guarded.loose_positions) <= set(bare.loose_positions)
    if guarded.num_accepted < bare.num_accepted:
        assert guarded.tokens[-1] == int(logits[guarded.num_accepted].argmax()) and guarded.vetoes


@pytest.mark.parametrize("seed", range(20))
def test_measures_at_the_needed_rows_only_give_the_same_verdicts(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU, FLy's entropy and the guards' top-k and argmax are computed only at the rows that can be
    kept (acceptance.where_needed); the verdicts are those of computing every row, as on a GPU."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(17, VOCAB, generator=generator) * 0.5  # [k + 1, vocab]: the target is unsure
    draft = logits[:16].argmax(-1)
    # mismatches far enough apart for their windows to hold, each the target's second choice (in its top 3)
    flips = torch.tensor([[2], [1, 8], [0, 7], [3, 5, 12]][seed % 4])
    draft[flips] = logits[flips].topk(2, dim=-1).indices[:, 1]
    ctx = context([ASK, ALICE, THE, CAT, SAT, DOT], [THE, CAT, SAT, ON, N42])
    verifier = FlyVerifier(FlyConfig(entropy_threshold=0.3))
    rows: list[int] = []
    measured = acceptance.where_needed

    def counted(needed, logits, measure, fill):  # type: ignore[no-untyped-def]
        out = measured(needed, logits, lambda some, positions: rows.append(len(some)) or measure(some, positions), fill)
        return out

    monkeypatch.setattr(fly_module, "where_needed", counted)
    monkeypatch.setattr(guard_module, "where_needed", counted)
    verdicts = []
    for devices in (frozenset(), frozenset({"cpu"})):  # every row, then the needed ones
        monkeypatch.setattr(acceptance, "SELECT_ROWS_ON", devices)
        rows.clear()
        verdicts.append(verifier.verify(Draft(draft.clone()), logits, GREEDY, None, ctx))
        if devices:
            assert sum(rows) < 16 * 3  # fewer rows than entropy, top-k and argmax over all of them
    assert verdicts[0] == verdicts[1]


# --- every loose accept explained --------------------------------------------------------------


def test_loose_accepts_are_explained() -> None:
    logits = logits_for([CAT, SAT, ON, DOT], [DOG])
    verdict = FlyVerifier(FlyConfig(window_size=2, entropy_threshold=0.0)).verify(
        Draft(torch.tensor([DOG, SAT, ON]), sources=(PROMPT_COPY, OUTPUT_COPY, OUTPUT_COPY)),
        logits,
        GREEDY,
        None,
        context([THE]),
    )
    assert verdict.tokens == [DOG, SAT, ON, DOT]
    (loose,) = verdict.loose
    assert (loose.position, loose.draft_token, loose.target_token, loose.source) == (0, DOG, CAT, PROMPT_COPY)
    assert loose.evidence == pytest.approx(float(topk_entropy(logits[:1], 3)))


def test_margin_and_typical_run_the_guards() -> None:
    logits = logits_for([N24, CAT, DOT], [N42, DOG, 0])
    for verifier in (MarginVerifier(MarginConfig()), TypicalVerifier(TypicalConfig())):
        verdict = verifier.verify(Draft(torch.tensor([N42, DOG])), logits, GREEDY, None, context([THE]))
        assert verdict.tokens == [N24] and verdict.vetoes == ("protect",), verifier.name
        bare = type(verifier)(verifier.config, guard=GuardConfig.bare())
        assert bare.verify(Draft(torch.tensor([N42, DOG])), logits, GREEDY, None, context([THE])).num_accepted == 2


# --- MARS at T > 0: the target's own top-1 is kept at a low-margin position --------------------


@pytest.mark.parametrize("draft_token", [0, 1])
def test_margin_keeps_top1_and_top2_at_low_margin_when_sampling(draft_token: int) -> None:
    """Logits 10 vs 9.5 (z2/z1 = 0.95 > 0.9), T = 1: both top-1 and top-2 drafts are kept every time."""
    logits = torch.full((2, 4), -10.0)
    logits[0, 0], logits[0, 1] = 10.0, 9.5
    sampling = SamplingConfig(temperature=1.0)
    verifier = MarginVerifier(MarginConfig(), guard=GuardConfig.bare())
    kept = sum(
        verifier.verify(Draft(torch.tensor([draft_token])), logits, sampling, Draws.seeded(seed)).num_accepted
        for seed in range(400)
    )
    assert kept == 400  # before the fix top-1 was kept only ~62% of the time (its rejection-sampling rate)


def test_margin_leaves_rejection_sampling_alone_at_a_high_margin() -> None:
    """Logits 10 vs 6 (not close): a top-1 draft is kept with probability p(top-1), as rejection sampling does
    (the strict rule: exact match on the coupled sample)."""
    logits = torch.full((2, 4), -10.0)
    logits[0, 0], logits[0, 1] = 10.0, 6.0  # exp(6 - 10) = 0.018 < 0.9 (both positive: 0.6 < 0.9)
    p_top1 = float(torch.softmax(logits[0], -1)[0])
    verifier = MarginVerifier(MarginConfig(), guard=GuardConfig.bare())
    trials = 4000
    kept = sum(
        verifier.verify(
            Draft(torch.tensor([0])), logits, SamplingConfig(temperature=1.0), Draws.seeded(seed)
        ).num_accepted
        for seed in range(trials)
    )
    observed = [kept, trials - kept]
    expected = [trials * p_top1, trials * (1 - p_top1)]
    assert scipy_stats.chisquare(observed, expected).pvalue > 1e-3


# --- FLy's window needs W + 1 draft tokens ----------------------------------------------------


def test_fly_needs_a_draft_longer_than_its_window(tiny_target: LoadedModel) -> None:
    assert FlyVerifier(FlyConfig(window_size=6)).min_draft_tokens == 7
    assert FlyVerifier(FlyConfig(window_size=0)).min_draft_tokens == 1
    with pytest.raises(ConfigError, match=r"needs at least 7 \(FLy: window_size \+ 1"):
        SpeculativeDecoder(
            tiny_target, NgramDrafter(), FlyVerifier(), speculation=SpeculationConfig(num_draft_tokens=6)
        )
    SpeculativeDecoder(tiny_target, NgramDrafter(), FlyVerifier(), speculation=SpeculationConfig(num_draft_tokens=7))


# --- token classes -----------------------------------------------------------------------------


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


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("Rename total_count to n in the loop.", {"total_count"}),
        ("Ask Alice whether the Python code works.", {"Alice", "Python"}),
        ("The cat sat. Then it slept.", set()),  # sentence starts are not names
        ("Use `count` and getValue and x1.", {"count", "getValue", "x1"}),
        ("```\nfor item in items:\n```", {"for", "item", "in", "items"}),
    ],
)
def test_name_spans(text: str, names: set[str]) -> None:
    assert {text[a:b] for a, b in name_spans(text)} == names


def test_looks_like_code() -> None:
    assert looks_like_code("def f(x):\n    return x + 1\n")
    assert looks_like_code("Complete this:\n```python\ndef f(")
    assert not looks_like_code("Tell me about the weather in Paris.\nIs it sunny?")


def test_protected_mask_over_the_vocabulary(tiny_target: LoadedModel) -> None:
    tokenizer = tiny_target.tokenizer
    mask = protected_mask(tokenizer, ("digits",), vocab_size=len(tokenizer) + 4)
    assert mask.shape == (len(tokenizer) + 4,) and not mask[len(tokenizer) :].any()
    texts = tokenizer.batch_decode([[token_id] for token_id in range(len(tokenizer))])
    assert mask[: len(tokenizer)].tolist() == [any(c.isdigit() for c in text) for text in texts]
    assert mask.any()  # the corpus has "1" and "2"
    assert not protected_mask(tokenizer, ()).any()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"protect": ("numbers",)}, "unknown protected token class 'numbers'"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"repeat_ngram": 1}, "repeat_ngram must be 0"),
        ({"copy_ratio": 1.5}, r"copy_ratio must be in \[0, 1\]"),
    ],
)
def test_bad_guard_configs(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        GuardConfig(**kwargs)


def test_bare_is_the_papers_rule() -> None:
    assert GuardConfig.bare().is_bare and not GuardConfig().is_bare
    assert math.isclose(GuardConfig().copy_ratio, 1.0)


# --- plumbing ----------------------------------------------------------------------------------


def test_build_decoder_plumbs_the_guard(tiny_target: LoadedModel) -> None:
    assert build_decoder(tiny_target, SpeculationConfig(verifier="fly")).verifier.guard == GuardConfig()
    bare = build_decoder(tiny_target, SpeculationConfig(verifier="fly", guard=GuardConfig.bare()))
    assert bare.verifier.guard.is_bare
    assert not hasattr(build_decoder(tiny_target, SpeculationConfig(guard=GuardConfig())).verifier, "guard")


def test_generate_cli_guard_options(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "Speculative decoding drafts", "--target", str(tiny_model_dir), "--dtype", "float32"]
    options = ["--no-chat", "--json", "--max-new-tokens", "12", "--verifier", "fly"]
    assert main([*argv, *options, "--protect", "digits", "--protect", "identifiers"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["verifier"] == "fly" and not record["lossless"] and record["trust_guards"] == "on"
    assert isinstance(record["loose_accepts"], list) and isinstance(record["guard_vetoes"], dict)
    assert main([*argv, *options, "--bare-rule"]) == 0
    assert json.loads(capsys.readouterr().out)["trust_guards"] == "bare"
    bad_options = [
        (["--protect", "numbers"], "invalid choice: 'numbers'"),
        (["--bare-rule", "--protect", "digits"], "--bare-rule turns every trust guard off"),
    ]
    for bad, message in bad_options:
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, *options, *bad])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-6])
def test_tiny_temperatures_are_greedy(temperature: float) -> None:
    assert SamplingConfig(temperature=temperature).greedy
    assert not SamplingConfig(temperature=1e-3).greedy


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: SamplingConfig(temperature=float("inf")), "temperature must be a finite number"),
        (lambda: SamplingConfig(temperature=float("nan")), "temperature must be a finite number"),
        (lambda: FlyConfig(entropy_threshold=float("inf")), "entropy_threshold must be a finite number"),
        (lambda: FlyConfig(entropy_threshold=float("nan")), "entropy_threshold must be a finite number"),
    ],
)
def test_non_finite_settings_are_config_errors(build, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build()


def test_a_lossy_decoder_builds_the_guards_masks_before_generating(tokenizer) -> None:
    """The token-class masks scan the whole vocabulary (about a second for a real one): a lossy decoder
    builds them when it is made, so no timed step (a server's first request) pays for it; one decode
    of the vocabulary serves every class set, and a lossless decoder or the bare rule builds none."""

    def fresh() -> LoadedModel:  # its own Vocabulary, with nothing built yet
        return make_tiny_model(tokenizer, seed=0, name="fresh-vocabulary")

    lossless = fresh()
    build_decoder(lossless, SpeculationConfig(verifier="exact"))
    assert vocabulary_of(lossless)._masks == {}
    bare = fresh()
    build_decoder(bare, SpeculationConfig(verifier="fly", guard=GuardConfig.bare()))
    assert vocabulary_of(bare)._masks == {}
    guarded = fresh()
    build_decoder(guarded, SpeculationConfig(verifier="fly"))  # default protect: digits and names
    masks = vocabulary_of(guarded)._masks
    assert set(masks) == {("digits",), ("identifiers",)}
    assert torch.equal(masks[("digits",)], protected_mask(tokenizer, ("digits",), vocabulary_of(guarded).vocab_size))
    assert torch.equal(
        masks[("identifiers",)], protected_mask(tokenizer, ("identifiers",), vocabulary_of(guarded).vocab_size)
    )
