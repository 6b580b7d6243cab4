"""Adaptive draft length, draft-confidence stops, drafter stacks and the registry's drafter names.

Every speculative run here is checked token for token against plain greedy decoding (float32
tiny models), since the verifier is lossless: drafters may only change the cost.
"""

from __future__ import annotations

import pytest
import torch

from flyspec import DecodeConfig, PlainDecoder, SpeculativeDecoder, build_decoder, make_verifier
from flyspec.config import ConfigError, DraftLengthConfig, LayerSkipConfig, SamplingConfig, SpeculationConfig
from flyspec.decoding.draft_length import DraftLength
from flyspec.drafters import CrossTokenizerDrafter, DraftModelDrafter, NgramDrafter, make_drafter
from flyspec.drafters.draft_model import first_unsure
from flyspec.resources import Resources
from flyspec.runtime.loaded_model import LoadedModel

PROMPTS = ("The capital of", "def add(a, b):\n    return", "Once upon a time there was a small model that")


def plain_tokens(target: LoadedModel, prompt: str, config: DecodeConfig) -> list[int]:
    return PlainDecoder(target, config).generate(prompt, use_chat=False).token_ids


def drafter_of(target: LoadedModel, name: str, *models: LoadedModel, **fields):
    """``make_drafter`` for a SpeculationConfig of ``fields``, with ``models`` known by name."""
    return make_drafter(SpeculationConfig(drafter=name, **fields), target, Resources(models=(target, *models)))


def assert_lossless(
    target: LoadedModel, drafter, config: DecodeConfig, verifier: str = "exact", spec: SpeculationConfig | None = None
) -> list:
    """Generate every prompt with ``drafter``; each output must equal plain greedy decoding. Returns the stats."""
    decoder = SpeculativeDecoder(target, drafter, make_verifier(verifier), config, spec)
    stats = []
    for prompt in PROMPTS:
        result = decoder.generate(prompt, use_chat=False)
        assert result.token_ids == plain_tokens(target, prompt, config), (prompt, drafter.name)
        stats.append(result.stats)
    return stats


# ---- the draft-length policy ------------------------------------------------------------------


def test_fixed_length_never_changes() -> None:
    length = DraftLength(DraftLengthConfig(), num_draft_tokens=8)
    for proposed, accepted in ((8, 0), (8, 8), (3, 1)):
        length.observe(proposed, accepted)
        assert length.next() == 8


def test_adaptive_length_grows_by_two_shrinks_by_one_within_bounds() -> None:
    length = DraftLength(DraftLengthConfig(policy="heuristic", min_tokens=2), num_draft_tokens=8)
    history = []
    for proposed, accepted in ((8, 3), (7, 0), (6, 6), (8, 8), (8, 1), (7, 0), (6, 0), (5, 0), (4, 0), (3, 0), (2, 0)):
        length.observe(proposed, accepted)
        history.append(length.next())
    assert history == [7, 6, 8, 8, 7, 6, 5, 4, 3, 2, 2]
    length.observe(0, 0)  # nothing proposed: no evidence either way
    assert length.next() == 2


def test_adaptive_floor_keeps_fly_window_judgeable() -> None:
    length = DraftLength(DraftLengthConfig(policy="heuristic", min_tokens=1), num_draft_tokens=15, floor=6)
    for _ in range(20):
        length.observe(length.next(), 0)
    assert length.next() == 6
    capped = DraftLength(DraftLengthConfig(policy="heuristic", min_tokens=9), num_draft_tokens=4)
    capped.observe(4, 0)
    assert capped.next() == 4  # a floor above the maximum is the maximum


@pytest.mark.parametrize("drafter_name", ["ngram", "draft-model", "multilevel"])
def test_adaptive_length_is_lossless_and_reported(
    tiny_target: LoadedModel, tiny_draft: LoadedModel, drafter_name: str
) -> None:
    config = DecodeConfig(max_new_tokens=40)
    spec = SpeculationConfig(num_draft_tokens=8, draft_length=DraftLengthConfig(policy="heuristic"))
    drafter = drafter_of(tiny_target, drafter_name, tiny_draft, draft_model=tiny_draft.name, num_proposal_tokens=3)
    stats = assert_lossless(tiny_target, drafter, config, spec=spec)
    lengths = {length for stat in stats for length in stat.requested_draft_lengths}
    assert len(lengths) > 1, "the noisy draft is sometimes wrong, so the length must move"
    assert all(1 <= length <= 8 for length in lengths)
    summary = stats[0].to_dict()
    assert sum(summary["requested_draft_lengths"].values()) == stats[0].num_target_forwards - 1  # not the first
    assert 1 <= summary["mean_requested_draft_length"] <= 8


def test_adaptive_length_with_fly_stays_at_or_above_the_window(tiny_target: LoadedModel) -> None:
    spec = SpeculationConfig(verifier="fly", num_draft_tokens=10, draft_length=DraftLengthConfig(policy="heuristic"))
    decoder = build_decoder(tiny_target, spec, DecodeConfig(max_new_tokens=40))
    result = decoder.generate(PROMPTS[2], use_chat=False)
    assert min(result.stats.requested_draft_lengths) >= decoder.verifier.config.window_size


# ---- stopping on low draft confidence -------------------------------------------------------


def test_first_unsure_row() -> None:
    logits = torch.tensor([[9.0, 0.0, 0.0], [1.0, 0.9, 0.8], [9.0, 0.0, 0.0]])
    assert first_unsure(logits, 0.0) is None
    assert first_unsure(logits, 0.5) == 1
    assert first_unsure(logits[:1], 0.5) is None


def test_confidence_threshold_shortens_drafts_and_stays_lossless(
    tiny_target: LoadedModel, tiny_draft: LoadedModel
) -> None:
    config = DecodeConfig(max_new_tokens=40)
    spec = SpeculationConfig(num_draft_tokens=8)
    full = assert_lossless(tiny_target, DraftModelDrafter(tiny_draft), config, spec=spec)
    unsure = assert_lossless(tiny_target, DraftModelDrafter(tiny_draft, confidence_threshold=0.6), config, spec=spec)
    assert sum(s.num_proposed for s in unsure) < sum(s.num_proposed for s in full)
    assert sum(s.drafter["confidence_stops"] for s in unsure) > 0


# ---- stacks ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bottom_draft(tiny_target: LoadedModel) -> LoadedModel:
    from conftest import noisy_copy

    return noisy_copy(tiny_target, scale=0.5, seed=3)


def test_three_level_stack_drafts_like_its_top_model(
    tiny_target: LoadedModel, tiny_draft: LoadedModel, bottom_draft: LoadedModel
) -> None:
    """n-gram → bottom model → top model: greedy, the stack proposes exactly the top model's draft."""
    top = DraftModelDrafter(tiny_draft)
    middle = DraftModelDrafter(bottom_draft, proposer=NgramDrafter(), num_proposal_tokens=3)
    stack = DraftModelDrafter(tiny_draft, proposer=middle, num_proposal_tokens=4)
    context = tiny_target.tokenizer.encode(PROMPTS[2])
    greedy = DecodeConfig().sampling
    for drafter in (top, stack):
        drafter.reset(context)
    for _ in range(3):  # several rounds, with partial "acceptance" in between
        expected = top.propose(context, 8, greedy, None).tokens.tolist()
        assert stack.propose(context, 8, greedy, None).tokens.tolist() == expected
        context = context + expected[:3] + [expected[3] ^ 1]
        top.rollback(len(context))
        stack.rollback(len(context))
    assert stack.report()["proposer"]["draft_forwards"] > 0
    assert stack.report()["proposer"]["proposer"]["name"] == "ngram"


def test_stack_through_the_registry_is_lossless(
    tiny_target: LoadedModel, tiny_draft: LoadedModel, bottom_draft: LoadedModel
) -> None:
    config = DecodeConfig(max_new_tokens=40)
    levels = ("ngram", bottom_draft.name, tiny_draft.name)
    drafter = drafter_of(tiny_target, "stack", bottom_draft, tiny_draft, stack=levels, num_proposal_tokens=3)
    assert drafter.name == "stack"
    spec = SpeculationConfig(num_draft_tokens=8)
    assert_lossless(tiny_target, drafter, config, spec=spec)
    assert_lossless(tiny_target, drafter, config, verifier="rejection", spec=spec)


def test_stack_at_temperature_is_seeded_and_reproducible(
    tiny_target: LoadedModel, tiny_draft: LoadedModel, bottom_draft: LoadedModel
) -> None:
    outputs = []
    for _ in range(2):
        levels = ("ngram", bottom_draft.name, tiny_draft.name)
        spec = SpeculationConfig(drafter="stack", verifier="rejection", stack=levels, num_draft_tokens=6)
        decode = DecodeConfig(max_new_tokens=30, sampling=SamplingConfig(1.0))
        resources = Resources(models=(tiny_target, bottom_draft, tiny_draft))
        decoder = build_decoder(tiny_target, spec, decode, resources=resources)
        generator = torch.Generator().manual_seed(7)
        outputs.append(decoder.generate(PROMPTS[0], generator=generator, use_chat=False).token_ids)
    assert outputs[0] == outputs[1] and len(outputs[0]) > 0


def test_multilevel_is_the_two_level_stack(tiny_target: LoadedModel, tiny_draft: LoadedModel) -> None:
    drafter = drafter_of(tiny_target, "multilevel", tiny_draft, draft_model=tiny_draft.name, num_proposal_tokens=3)
    assert isinstance(drafter, DraftModelDrafter) and isinstance(drafter.proposer, NgramDrafter)
    assert drafter.name == "multilevel" and drafter.num_proposal_tokens == 3


@pytest.mark.parametrize(
    ("levels", "message"),
    [
        ((), "needs its levels"),
        (("draft", "ngram"), "must be the bottom"),
        (("ngram", "ngram-cache"), "must be the bottom"),
        (("nonsense",), "model 'nonsense' not found"),  # a level that is no keyword is a model name
    ],
)
def test_bad_stacks_are_refused(
    tiny_target: LoadedModel, tiny_draft: LoadedModel, levels: tuple[str, ...], message: str
) -> None:
    named = tuple(tiny_draft.name if level == "draft" else level for level in levels)
    with pytest.raises(ConfigError, match=message):
        drafter_of(tiny_target, "stack", tiny_draft, stack=named)


def test_unknown_drafter_lists_the_choices(tiny_target: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="ngram-cache.*layer-skip.*stack"):
        drafter_of(tiny_target, "nope")


# ---- mixed tokenizers and self-speculation inside stacks ------------------------------------


@pytest.fixture(scope="module")
def other_vocab_draft() -> LoadedModel:
    """A draft model with another vocabulary (byte-level BPE with 280 tokens, not 300)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from conftest import CORPUS, make_tiny_model

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        CORPUS, vocab_size=280, min_frequency=1, special_tokens=["<s>", "</s>"], show_progress=False
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>")
    return make_tiny_model(tokenizer, seed=5, name="other-vocab")


def test_draft_model_with_another_tokenizer_is_translated(
    tiny_target: LoadedModel, other_vocab_draft: LoadedModel
) -> None:
    config = DecodeConfig(max_new_tokens=30)
    for name in ("draft-model", "multilevel"):
        drafter = drafter_of(
            tiny_target, name, other_vocab_draft, draft_model=other_vocab_draft.name, num_proposal_tokens=3
        )
        assert isinstance(drafter, CrossTokenizerDrafter) and drafter.name == name
        stats = assert_lossless(tiny_target, drafter, config, spec=SpeculationConfig(num_draft_tokens=6))
        assert sum(stat.drafter["inner"]["draft_forwards"] for stat in stats) > 0


def test_stack_mixing_tokenizers_and_layer_skip_is_lossless(
    tiny_target: LoadedModel, tiny_draft: LoadedModel, other_vocab_draft: LoadedModel
) -> None:
    config = DecodeConfig(max_new_tokens=30)
    # n-gram → other-vocabulary model → (re-tokenized) → same-vocabulary model → target
    levels = ("ngram", other_vocab_draft.name, tiny_draft.name)
    mixed = drafter_of(tiny_target, "stack", other_vocab_draft, tiny_draft, stack=levels)
    assert isinstance(mixed, DraftModelDrafter) and isinstance(mixed.proposer, CrossTokenizerDrafter)
    spec = SpeculationConfig(num_draft_tokens=6)
    assert_lossless(tiny_target, mixed, config, spec=spec)
    # n-gram → the target itself with its last layer skipped → target
    skipping = drafter_of(tiny_target, "stack", stack=("ngram-cache", "layer-skip"), layer_skip=LayerSkipConfig((1,)))
    stats = assert_lossless(tiny_target, skipping, config, spec=spec)
    assert stats[0].drafter["skip_layers"] == [1]


def test_bench_gives_ngram_cache_methods_a_private_cache(tiny_target: LoadedModel) -> None:
    """Sharing the run's cache, a method would find this very prompt's answer left by the others."""
    from flyspec.bench.backends import BackendSettings, FlyspecBackend
    from flyspec.harness.methods import parse_method

    settings = BackendSettings(SamplingConfig(), resources=Resources(models=(tiny_target,)))
    backends = [FlyspecBackend(parse_method(name), tiny_target, None, settings) for name in ("ngram-cache+exact",) * 2]
    caches = [backend.decoder.drafter.cache for backend in backends]
    assert caches[0] is not caches[1]
    assert all(cache is not settings.resources.ngram_cache(tiny_target.name, None, None) for cache in caches)
