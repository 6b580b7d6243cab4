"""End to end on tiny random Llama models (float32): lossless verifiers reproduce plain decoding.

Every lossless verifier × drafter must produce exactly the plain greedy tokens, across seeds,
prompt lengths, draft lengths, and EOS inside a draft; and the KV-cache invariant holds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import make_tiny_gemma3, make_tiny_model, noisy_copy
from flyspec import (
    DecodeConfig,
    DraftModelDrafter,
    FlyConfig,
    NgramDrafter,
    PlainDecoder,
    SamplingConfig,
    SpeculativeDecoder,
    make_verifier,
    multilevel_drafter,
)
from flyspec.config import ConfigError, SpeculationConfig
from flyspec.drafters.draft_model import check_proposal
from flyspec.drafters.ngram import ngram_lookup
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.sampling.coupled import Draws
from flyspec.types import Draft

LOSSLESS = ("exact", "rejection")
PROMPTS = ("The capital of", "def add(a, b):\n    return", "Once upon a time there was a small model that")


def make_drafter(name: str, draft: LoadedModel):
    if name == "ngram":
        return NgramDrafter()
    if name == "draft-model":
        return DraftModelDrafter(draft)
    return multilevel_drafter(draft, num_proposal_tokens=3)


def plain_tokens(target: LoadedModel, prompt: str | list[int], config: DecodeConfig) -> list[int]:
    return PlainDecoder(target, config).generate(prompt, use_chat=False).token_ids


@pytest.mark.parametrize("drafter_name", ["ngram", "draft-model", "multilevel"])
@pytest.mark.parametrize("verifier_name", LOSSLESS)
@pytest.mark.parametrize("num_draft_tokens", [1, 3, 8])
def test_lossless_matches_plain_greedy(
    tiny_target: LoadedModel, tiny_draft: LoadedModel, drafter_name: str, verifier_name: str, num_draft_tokens: int
) -> None:
    config = DecodeConfig(max_new_tokens=40, ignore_eos=True)
    for prompt in PROMPTS:
        expected = plain_tokens(tiny_target, prompt, config)
        decoder = SpeculativeDecoder(
            tiny_target,
            make_drafter(drafter_name, tiny_draft),
            make_verifier(verifier_name),
            config,
            SpeculationConfig(num_draft_tokens=num_draft_tokens),
        )
        result = decoder.generate(prompt, use_chat=False)
        assert result.token_ids == expected, (drafter_name, verifier_name, prompt)
        assert result.stats.num_new_tokens == 40
        assert result.stats.num_loose_accepts == 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_lossless_across_model_seeds_and_a_perfect_draft(tokenizer, seed: int) -> None:
    target = make_tiny_model(tokenizer, seed=10 + seed, layers=3)
    drafts = {"self": target, "noisy": noisy_copy(target, scale=0.5, seed=seed)}
    config = DecodeConfig(max_new_tokens=30, ignore_eos=True)
    expected = plain_tokens(target, PROMPTS[seed - 1], config)
    for label, draft in drafts.items():
        for drafter in (DraftModelDrafter(draft), multilevel_drafter(draft, num_proposal_tokens=2)):
            result = SpeculativeDecoder(
                target, drafter, make_verifier("exact"), config, SpeculationConfig(num_draft_tokens=4)
            ).generate(PROMPTS[seed - 1], use_chat=False)
            assert result.token_ids == expected, (label, drafter.name)
            if label == "self":  # the target drafting for itself: every draft token is accepted
                assert result.stats.num_accepted == result.stats.num_proposed
                assert result.stats.mean_acceptance_length > 4


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(st.integers(min_value=2, max_value=299), min_size=1, max_size=30),
    num_draft_tokens=st.integers(min_value=1, max_value=10),
    drafter_name=st.sampled_from(["ngram", "draft-model", "multilevel"]),
    max_new_tokens=st.integers(min_value=1, max_value=25),
)
def test_property_exact_matches_plain(
    tiny_target: LoadedModel, tiny_draft: LoadedModel, prompt, num_draft_tokens, drafter_name, max_new_tokens
) -> None:
    config = DecodeConfig(max_new_tokens=max_new_tokens, ignore_eos=True)
    expected = plain_tokens(tiny_target, prompt, config)
    decoder = SpeculativeDecoder(
        tiny_target,
        make_drafter(drafter_name, tiny_draft),
        make_verifier("exact"),
        config,
        SpeculationConfig(num_draft_tokens=num_draft_tokens),
    )
    result = decoder.generate(prompt)
    assert result.token_ids == expected
    assert len(result.token_ids) == max_new_tokens


def test_eos_inside_a_draft_stops_at_the_same_token(tokenizer) -> None:
    target = make_tiny_model(tokenizer, seed=5)
    free_run = plain_tokens(target, PROMPTS[2], DecodeConfig(max_new_tokens=30, ignore_eos=True))
    eos = free_run[12]  # a token the model really emits, made the EOS
    first_eos = free_run.index(eos)
    target.model.generation_config.eos_token_id = eos
    config = DecodeConfig(max_new_tokens=30)
    expected = plain_tokens(target, PROMPTS[2], config)
    assert expected == free_run[: first_eos + 1]
    for drafter in (NgramDrafter(), DraftModelDrafter(target), multilevel_drafter(target)):
        result = SpeculativeDecoder(
            target, drafter, make_verifier("exact"), config, SpeculationConfig(num_draft_tokens=8)
        ).generate(PROMPTS[2], use_chat=False)
        assert result.token_ids == expected, drafter.name
        assert result.finish_reason == "eos"
    # with the target drafting for itself, EOS really sits inside an accepted draft
    assert result.stats.num_accepted > 0


def test_stop_string_and_streaming_agree_with_plain(tiny_target: LoadedModel, tiny_draft: LoadedModel) -> None:
    free = PlainDecoder(tiny_target, DecodeConfig(max_new_tokens=30, ignore_eos=True)).generate(
        PROMPTS[0], use_chat=False
    )
    stop = free.text[16:19]
    assert stop.strip(), "the tiny model's text should have a usable stop string"
    config = DecodeConfig(max_new_tokens=30, stop_strings=(stop,), ignore_eos=True)
    plain = PlainDecoder(tiny_target, config).generate(PROMPTS[0], use_chat=False)
    stream = SpeculativeDecoder(
        tiny_target,
        DraftModelDrafter(tiny_draft),
        make_verifier("exact"),
        config,
        SpeculationConfig(num_draft_tokens=3),
    ).stream(PROMPTS[0], use_chat=False)
    pieces = list(stream)
    assert stream.result is not None
    assert stream.result.finish_reason == plain.finish_reason == "stop"
    assert stream.result.text == plain.text == free.text[: free.text.index(stop)]
    assert "".join(pieces) == stream.result.text
    assert len(pieces) > 1


def test_fly_with_unreachable_gate_is_lossless(tiny_target: LoadedModel, tiny_draft: LoadedModel) -> None:
    config = DecodeConfig(max_new_tokens=40, ignore_eos=True)
    expected = plain_tokens(tiny_target, PROMPTS[1], config)
    verifier = make_verifier("fly", SpeculationConfig(fly=FlyConfig(window_size=2, entropy_threshold=1e9)))
    result = SpeculativeDecoder(
        tiny_target, DraftModelDrafter(tiny_draft), verifier, config, SpeculationConfig(num_draft_tokens=8)
    ).generate(PROMPTS[1], use_chat=False)
    assert result.token_ids == expected


def test_lossy_verifiers_report_loose_accepts_consistently(tiny_target: LoadedModel, tiny_draft: LoadedModel) -> None:
    config = DecodeConfig(max_new_tokens=60, ignore_eos=True)
    expected = plain_tokens(tiny_target, PROMPTS[2], config)
    verifier = make_verifier(
        "fly", SpeculationConfig(fly=FlyConfig(window_size=0, entropy_threshold=0.0))
    )  # both ablations
    result = SpeculativeDecoder(
        tiny_target, DraftModelDrafter(tiny_draft), verifier, config, SpeculationConfig(num_draft_tokens=8)
    ).generate(PROMPTS[2], use_chat=False)
    stats = result.stats
    assert stats.num_loose_accepts == len(result.loose_token_indices) > 0
    assert result.token_ids != expected
    # the output agrees with plain decoding up to the first loose accept
    first = result.loose_token_indices[0]
    assert result.token_ids[:first] == expected[:first]
    assert stats.num_new_tokens == len(result.token_ids) == 60
    assert stats.mean_acceptance_length == pytest.approx(stats.num_new_tokens / stats.num_target_forwards)
    assert sum(stats.accepted_per_position) == stats.num_accepted


def test_sampling_is_reproducible_with_a_seeded_generator(tiny_target: LoadedModel, tiny_draft: LoadedModel) -> None:
    sampling = SamplingConfig(temperature=0.9, top_p=0.95)
    config = DecodeConfig(max_new_tokens=30, sampling=sampling, ignore_eos=True)
    outputs = []
    for seed in (7, 7, 8):
        decoder = SpeculativeDecoder(
            tiny_target,
            DraftModelDrafter(tiny_draft),
            make_verifier("rejection"),
            config,
            SpeculationConfig(num_draft_tokens=5),
        )
        outputs.append(decoder.generate(PROMPTS[0], use_chat=False, generator=torch.Generator().manual_seed(seed)))
    assert outputs[0].token_ids == outputs[1].token_ids
    assert outputs[0].token_ids != outputs[2].token_ids


def test_kv_cache_invariant_is_checked_every_step(tiny_target: LoadedModel) -> None:
    decoder = SpeculativeDecoder(tiny_target, NgramDrafter(), make_verifier("exact"), DecodeConfig(max_new_tokens=5))
    seen = []
    original = decoder.scorer.check_invariant

    def spy() -> None:
        seen.append((decoder.scorer.cached_model.cached_length, decoder.scorer.num_committed))
        original()

    decoder.scorer.check_invariant = spy  # type: ignore[method-assign]
    decoder.generate(PROMPTS[0], use_chat=False)
    # after the prefill the whole prompt is cached (its last token's logits wait for the first step); after each step
    # all committed tokens but the last
    prompt_length = len(tiny_target.encode_prompt(PROMPTS[0], use_chat=False))
    assert seen[0] == (prompt_length, prompt_length)
    assert len(seen) >= 3 and all(cached == committed - 1 for cached, committed in seen[1:])
    decoder.scorer.cached_model.crop_to(decoder.scorer.cached_model.cached_length - 1)  # break it on purpose
    with pytest.raises(RuntimeError, match="invariant"):
        original()


def test_multilevel_draft_equals_plain_draft_model_draft(tiny_target: LoadedModel, tiny_draft: LoadedModel) -> None:
    """Multi-level drafting is an acceleration: greedy, it proposes exactly the draft model's tokens."""
    context = tiny_target.encode_prompt(PROMPTS[2] + " " + PROMPTS[2], use_chat=False)
    greedy = SamplingConfig()
    plain, multi = DraftModelDrafter(tiny_draft), multilevel_drafter(tiny_draft, num_proposal_tokens=4)
    for drafter in (plain, multi):
        drafter.reset(context)
    plain_draft = plain.propose(context, 10, greedy, None)
    multi_draft = multi.propose(context, 10, greedy, None)
    assert multi_draft.tokens.tolist() == plain_draft.tokens.tolist()
    assert plain.num_forwards == 10
    assert multi.num_forwards <= plain.num_forwards


def test_check_proposal_keeps_the_agreeing_prefix_and_adds_the_models_token() -> None:
    logits = torch.full((4, 6), -5.0)
    for position, token in enumerate([2, 3, 1, 4]):
        logits[position, token] = 5.0

    def proposal(tokens: list[int]) -> Draft:
        return Draft(torch.tensor(tokens, dtype=torch.long))

    assert check_proposal(proposal([2, 3, 0]), logits, SamplingConfig(), None) == ([2, 3, 1], None)
    assert check_proposal(proposal([2, 3, 1]), logits, SamplingConfig(), None) == ([2, 3, 1, 4], None)
    assert check_proposal(Draft.empty(), logits[:1], SamplingConfig(), None) == ([2], None)


@pytest.mark.parametrize(
    ("context", "expected"),
    [
        ([1, 2, 3, 9, 1, 2, 3], [9, 1, 2]),  # 3-gram match, continuation
        ([5, 1, 2, 7, 8, 1, 2], [7, 8, 1]),  # latest occurrence of the 2-gram
        ([1, 2, 5, 5, 5, 1, 2, 7, 1, 2], [7, 1, 2]),  # continuation copied on past the end (period 3)
        ([1, 2, 6, 3, 1, 2, 4, 3], [1, 2, 4]),  # falls back to a 1-gram, most recent match
        ([1, 2, 3], []),  # nothing to match
        ([4, 4, 4, 4], [4, 4, 4]),  # overlapping repetition (period 1)
        ([1, 2, 1, 2], [1, 2, 1]),  # period 2
    ],
)
def test_ngram_lookup(context: list[int], expected: list[int]) -> None:
    assert ngram_lookup(context, 3, max_ngram=4, min_ngram=1) == expected


def test_ngram_lookup_respects_min_ngram_and_budget() -> None:
    assert ngram_lookup([1, 2, 6, 3, 1, 2, 4, 3], 3, max_ngram=4, min_ngram=2) == []
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3], 0, max_ngram=4, min_ngram=1) == []
    assert ngram_lookup([1, 2, 3, 9, 8, 7, 1, 2, 3], 2, max_ngram=4, min_ngram=1) == [9, 8]


@pytest.mark.parametrize(
    ("match", "extend", "expected"),
    [
        ("recent", True, [5, 7, 1, 2, 5, 7]),  # the latest "1 2", copied on past the end
        ("recent", False, [5, 7, 1, 2]),  # ... stopping at the end of the context
        ("earliest", True, [3, 1, 2, 4, 1, 2]),  # transformers' prompt lookup: the first "1 2"
        ("frequent", True, [3, 9, 1, 2, 5, 7]),  # "3" follows "1 2" twice; then the tie goes to the recent one
    ],
)
def test_ngram_match_variants(match: str, extend: bool, expected: list[int]) -> None:
    context = [1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 1, 2, 5, 7, 1, 2]
    assert ngram_lookup(context, 6, max_ngram=2, min_ngram=1, match=match, extend=extend) == expected


def test_ngram_frequent_follows_the_majority_then_copies_on() -> None:
    # "a b" is followed by "c d" three times and by "x" once (most recently): the majority wins
    context = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 9, 1, 2]
    assert ngram_lookup(context, 4, max_ngram=2, min_ngram=1, match="frequent") == [3, 4, 1, 2]
    assert ngram_lookup(context, 4, max_ngram=2, min_ngram=1, match="recent") == [9, 1, 2, 9]


def test_ngram_match_option_reaches_the_drafter_through_the_config() -> None:
    spec = SpeculationConfig.from_dict({"ngram": {"match": "earliest", "extend": False}})
    assert (spec.ngram.match, spec.ngram.extend) == ("earliest", False)
    drafter = NgramDrafter(spec.ngram)
    drafter.reset([1, 2, 3, 1, 2, 4, 1, 2])
    draft = drafter.propose([1, 2, 3, 1, 2, 4, 1, 2], 5, SamplingConfig(), None)
    assert draft.tokens.tolist() == [3, 1, 2, 4, 1]
    assert draft.match_length == 2  # the evidence the cost-aware draft length weighs
    with pytest.raises(ConfigError, match="match must be one of recent, earliest, frequent"):
        SpeculationConfig.from_dict({"ngram": {"match": "best"}})


def test_draft_shapes(tiny_target: LoadedModel, tiny_draft: LoadedModel) -> None:
    context = tiny_target.encode_prompt(PROMPTS[0], use_chat=False)
    sampled = SamplingConfig(temperature=1.0)
    drafter = DraftModelDrafter(tiny_draft)
    drafter.reset(context)
    draft = drafter.propose(context, 5, sampled, Draws.seeded(0, position=len(context)))
    assert isinstance(draft, Draft) and draft.num_tokens == 5
    assert draft.draft_probs is not None and draft.draft_probs.shape == (5, len(tiny_target.tokenizer))
    assert torch.allclose(draft.draft_probs.sum(-1), torch.ones(5))
    chosen = draft.draft_probs.gather(-1, draft.tokens.unsqueeze(-1))
    assert (chosen > 0).all()
    drafter.rollback(len(context) + 2)
    assert drafter.cached_model.cached_length == len(context) + 1
    assert dataclasses.is_dataclass(draft)


def test_sliding_window_caches_roll_back_losslessly(tokenizer) -> None:
    """Gemma-3-style sliding-window layers (window 8 ≪ context) keep the cache invariant and identity."""
    import copy

    target = make_tiny_gemma3(tokenizer, layer_types=["sliding_attention"] * 3 + ["full_attention"])
    window = target.model.config.sliding_window
    # a different sliding-window draft: rejections roll its cache back across several draft forwards
    torch.manual_seed(1)
    other = copy.deepcopy(target.model)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(0.3 * parameter.std() * torch.randn_like(parameter))
    draft = LoadedModel(model=other, tokenizer=tokenizer, name="tiny-gemma3-noisy")
    config_decode = DecodeConfig(max_new_tokens=40, ignore_eos=True)
    prompt = PROMPTS[2] + " " + PROMPTS[0]  # longer than the window
    assert len(target.encode_prompt(prompt, use_chat=False)) > 2 * window
    expected = plain_tokens(target, prompt, config_decode)
    for drafter in (
        NgramDrafter(),
        DraftModelDrafter(target),
        multilevel_drafter(target),
        DraftModelDrafter(draft),
        multilevel_drafter(draft),
    ):
        result = SpeculativeDecoder(
            target, drafter, make_verifier("exact"), config_decode, SpeculationConfig(num_draft_tokens=6)
        ).generate(prompt, use_chat=False)
        assert result.token_ids == expected, drafter.name
    assert 0 < result.stats.num_accepted < result.stats.num_proposed  # the noisy draft is partly rejected
