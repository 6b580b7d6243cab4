"""``flyspec bench``: dataset reading, method parsing, summary arithmetic, and a quick end-to-end run.

The end-to-end run uses the tiny random model saved as a directory (float32), 2 categories × 2
prompts (one of them a two-turn chat), and checks the three outputs and their consistency.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flyspec.bench.data import SPEC_BENCH_CATEGORIES, load_prompts
from flyspec.bench.loop import bench_methods, method_order, run_order
from flyspec.bench.report import overall_table
from flyspec.bench.summary import OVERALL, summarize
from flyspec.cli.app import main
from flyspec.config import ConfigError, SamplingConfig
from flyspec.harness.data import DataError, spec_bench_path

PROMPTS = [
    {"id": "a1", "category": "alpha", "prompt": "The capital of France is Paris. The capital of"},
    {"id": "a2", "category": "alpha", "prompt": "def add(a, b):\n    return a + b\n\nprint(add("},
    {"id": "b1", "category": "beta", "turns": ["Speculative decoding drafts tokens", "Once upon a time there"]},
    {"id": "b2", "category": "beta", "prompt": "Once upon a time there was a small model that"},
]
METHODS = "plain,ngram+exact,ngram+fly,ngram+rejection,hf-plain,hf-lookup"


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def usage_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flyspec: error: "), lines
    return lines[0]


# --- data -----------------------------------------------------------------------------------


def test_vendored_spec_bench_has_six_categories_of_80() -> None:
    prompts = load_prompts()
    assert len(prompts) == 480
    counts = {category: sum(p.category == category for p in prompts) for category in SPEC_BENCH_CATEGORIES}
    assert counts == dict.fromkeys(SPEC_BENCH_CATEGORIES, 80)
    assert {len(p.turns) for p in prompts if p.category == "mt_bench"} == {2}
    assert (spec_bench_path().parent / "LICENSE").is_file()


def test_limit_per_category_and_category_filter() -> None:
    prompts = load_prompts(categories=("qa", "rag"), limit=3)
    assert [p.category for p in prompts] == ["qa"] * 3 + ["rag"] * 3


def test_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [PROMPTS[0], "{not json", {"text": "no prompt"}, PROMPTS[1]])
    with pytest.raises(DataError, match=r"p\.jsonl:2: .*--skip-bad-lines"):
        load_prompts(path)
    kept = load_prompts(path, skip_bad_lines=True)
    assert [p.id for p in kept] == ["a1", "a2"]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"turns": []}, "non-empty list"),
        ({"prompt": ""}, "non-empty string"),
        ({"prompt": 3}, "non-empty string"),
        ([1, 2], "JSON object"),
        ({"prompt": "x", "category": ""}, "category"),
    ],
)
def test_bad_records_are_reported(tmp_path: Path, row: object, message: str) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [row])
    with pytest.raises(DataError, match=message):
        load_prompts(path)


def test_missing_file_unknown_category_bad_limit(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        load_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="unknown category poetry.*it has: mt_bench"):
        load_prompts(categories=("poetry",))
    with pytest.raises(DataError, match="--limit"):
        load_prompts(limit=0)


# --- methods ----------------------------------------------------------------------------------


def test_methods_parse_and_plain_is_always_first() -> None:
    methods = bench_methods("ngram+fly,hf-lookup", has_draft_model=False)
    assert [m.name for m in methods] == ["plain", "ngram+fly", "hf-lookup"]
    assert methods[1].drafter == "ngram" and methods[1].verifier == "fly" and not methods[1].lossless
    assert bench_methods("draft+exact", has_draft_model=True)[1].drafter == "draft-model"
    defaults = [m.name for m in bench_methods(None, has_draft_model=True)]
    assert "multilevel+fly" in defaults and "hf-assisted" in defaults
    # the old name of plain still works; duplicates run once
    assert [m.name for m in bench_methods("ngram+exact,baseline,ngram+exact", has_draft_model=False)] == [
        "plain",
        "ngram+exact",
    ]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("ngram+nope", "unknown method 'ngram\\+nope'"),
        ("speedy", "unknown method"),
        ("draft+fly", "need\\(s\\) a draft model"),
        ("hf-assisted", "need\\(s\\) a draft model"),
        ("ngram+exact+bare", "lossless"),
        (" , ", "no methods given"),
    ],
)
def test_bad_methods(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        bench_methods(spec, has_draft_model=False)


# --- summary arithmetic -------------------------------------------------------------------------


def _record(method: str, category: str, repeat: int, tokens: int, seconds: float, forwards: int | None) -> dict:
    return {
        "prompt_id": category + str(tokens),
        "category": category,
        "method": method,
        "lossless": True,
        "repeat": repeat,
        "num_new_tokens": tokens,
        "wall_time_s": seconds,
        "num_target_forwards": forwards,
        "num_loose_accepts": 0 if forwards else None,
        "identical_to_baseline": True,
        "accepted_per_position": [],
        "proposed_per_position": [],
        "target_time_s": None,
        "draft_time_s": None,
        "prefill_time_s": None,
    }


def test_speedup_is_the_median_over_repeats_of_rate_ratios() -> None:
    records = []
    # repeat 0: baseline 100 tok / 10 s, fast 100 tok / 4 s → 2.5x; repeat 1: 10 s vs 5 s → 2x; repeat 2: 3x
    for repeat, (base_s, fast_s) in enumerate([(10.0, 4.0), (10.0, 5.0), (9.0, 3.0)]):
        records.append(_record("plain", "c", repeat, 100, base_s, 100))
        records.append(_record("ngram+exact", "c", repeat, 100, fast_s, 40))
    summary = summarize(records, {1: 0.05, 16: 0.1}, num_draft_tokens=15)
    fast = summary[OVERALL]["ngram+exact"]
    assert fast["speedup_per_repeat"] == pytest.approx([2.5, 2.0, 3.0])
    assert fast["speedup"] == pytest.approx(2.5)
    assert (fast["speedup_min"], fast["speedup_max"]) == pytest.approx((2.0, 3.0))
    assert fast["tau"] == pytest.approx(300 / 120)
    assert fast["tau_limit"] == pytest.approx(2.5 * 0.05 / 0.1)
    assert fast["fraction_of_limit"] == pytest.approx(2.5 / 1.25)
    assert summary["c"]["ngram+exact"]["speedup"] == pytest.approx(2.5)
    # no drafts recorded → every step a 1-token forward → cost limit = tokens / forwards
    assert fast["cost_limit"] == pytest.approx(300 / 120)


def test_cost_limit_charges_each_step_its_actual_forward_size() -> None:
    base = _record("plain", "c", 0, 10, 1.0, 10)
    # 4 forwards: drafts proposed 2, 2, 1, 0 → forward sizes 3, 3, 2, 1; 10 tokens committed
    fast = _record("ngram+exact", "c", 0, 10, 0.5, 4) | {"proposed_per_position": [3, 2]}
    times = {1: 0.010, 2: 0.012, 3: 0.015, 16: 0.05}
    figures = summarize([base, fast], times, num_draft_tokens=15)[OVERALL]["ngram+exact"]
    assert figures["cost_limit"] == pytest.approx(10 * 0.010 / (2 * 0.015 + 0.012 + 0.010))
    assert figures["tau_limit"] == pytest.approx(2.5 * 0.010 / 0.05)
    assert figures["drafts_per_step"] == pytest.approx((3 + 2) / 4)  # 2 + 2 + 1 + 0 drafts over 4 forwards


def test_cost_limit_counts_each_sides_prefill_as_timed_in_the_run() -> None:
    """The speedup is over wall time, prefill included, so its bound charges the prefill too: with
    equal steps the limit falls toward 1 as the prefill grows; without prefill times it is the
    per-step bound."""
    times = {1: 0.010, 2: 0.012, 3: 0.015, 16: 0.05}

    def limit(prefill: float | None) -> float:
        base = _record("plain", "c", 0, 10, 1.0, 10) | {"prefill_time_s": prefill}
        fast = _record("ngram+exact", "c", 0, 10, 0.5, 4) | {"proposed_per_position": [3, 2], "prefill_time_s": prefill}
        return summarize([base, fast], times, num_draft_tokens=15)[OVERALL]["ngram+exact"]["cost_limit"]

    steps = 2 * 0.015 + 0.012 + 0.010
    assert limit(None) == pytest.approx(10 * 0.010 / steps)
    assert limit(0.2) == pytest.approx((10 / (0.2 + steps)) / (10 / (0.2 + 10 * 0.010)))
    assert 1 < limit(5.0) < limit(0.2) < limit(None)


def test_time_to_first_token_is_the_median_and_p90_over_every_turn() -> None:
    """Each turn is a request of its own: a two-turn record gives two times. A method that did not measure
    every turn (None) reports none rather than a figure over some of them."""
    base = _record("plain", "c", 0, 10, 1.0, 10) | {"time_to_first_token_s": [0.5, 0.1]}
    other = _record("plain", "d", 0, 11, 1.0, 10) | {"time_to_first_token_s": [0.2]}
    peer = _record("llamacpp-plain", "c", 0, 10, 1.0, None) | {"time_to_first_token_s": [None, 0.3]}
    summary = summarize([base, other, peer], None, num_draft_tokens=15)[OVERALL]
    assert summary["plain"]["ttft_median_s"] == pytest.approx(0.2)
    assert summary["plain"]["ttft_p90_s"] == pytest.approx(0.5)
    assert summary["llamacpp-plain"]["ttft_median_s"] is None and summary["llamacpp-plain"]["ttft_p90_s"] is None
    ten = [_record("plain", "c", 0, 10 + i, 1.0, 10) | {"time_to_first_token_s": [i / 10]} for i in range(1, 11)]
    figures = summarize(ten, None, num_draft_tokens=15)[OVERALL]["plain"]
    assert (figures["ttft_median_s"], figures["ttft_p90_s"]) == pytest.approx((0.55, 0.9))
    lines = overall_table(summarize([base, other, peer], None, num_draft_tokens=15)[OVERALL])
    assert "TTFT median / p90 ms" in lines[0]
    assert "| 200 / 500 |" in lines[2] and "| – / – |" in lines[3]


# --- end to end -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    directory = tmp_path_factory.mktemp("bench")
    dataset = write_jsonl(directory / "prompts.jsonl", PROMPTS)
    out = directory / "out"
    argv = [
        "bench",
        "--quick",
        "--dataset",
        str(dataset),
        "--target",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--methods",
        METHODS,
        "--max-new-tokens",
        "20",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    return out


def test_quick_bench_writes_all_outputs(bench_run: Path) -> None:
    for name in (
        "results.json",
        "report.md",
        "records.jsonl",
        "speedup_by_category.png",
        "tau_by_method.png",
        "acceptance_by_position.png",
    ):
        assert (bench_run / name).stat().st_size > 0, name
    report = (bench_run / "report.md").read_text()
    assert "| ngram+fly | no |" in report and "| ngram+exact | yes |" in report
    assert "## Speedup by category" in report and "alpha" in report and "beta" in report
    # the memory floor of a one-token step, measured at the run's start, beside t(1)
    meta = json.loads((bench_run / "results.json").read_text())["meta"]
    floor, t1 = meta["memory_floor"], meta["forward_times_ms"]["1"]
    assert floor["floor_ms"] == pytest.approx(floor["weight_mb"] / floor["read_gb_s"])
    assert f"{floor['weight_mb']:.0f} MB of weights ÷ {floor['read_gb_s']:.1f} GB/s" in report
    assert f"= {floor['floor_ms']:.1f} ms; t(1) is {t1 / floor['floor_ms']:.2f}x it" in report


def test_quick_bench_records_are_consistent(bench_run: Path) -> None:
    results = json.loads((bench_run / "results.json").read_text())
    records = results["records"]
    lines = (bench_run / "records.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == records  # the incremental file has everything
    methods = METHODS.split(",")
    assert len(records) == len(PROMPTS) * len(methods)
    assert {r["method"] for r in records} == set(methods)
    assert results["meta"]["dtype"] == "float32" and results["meta"]["categories"] == ["alpha", "beta"]
    assert {r["num_turns"] for r in records if r["prompt_id"] == "b1"} == {2}
    overall = results["summary"][OVERALL]
    base_rate = sum(r["num_new_tokens"] for r in records if r["method"] == "plain") / sum(
        r["wall_time_s"] for r in records if r["method"] == "plain"
    )
    for method in methods:
        mine = [r for r in records if r["method"] == method]
        rate = sum(r["num_new_tokens"] for r in mine) / sum(r["wall_time_s"] for r in mine)
        figures = overall[method]
        assert figures["tokens_per_s"] == pytest.approx(rate)
        assert figures["speedup"] == pytest.approx(rate / base_rate)
        assert figures["speedup"] == pytest.approx(figures["tokens_per_s"] / overall["plain"]["tokens_per_s"])
        for record in mine:
            assert record["tokens_per_s"] == pytest.approx(record["num_new_tokens"] / record["wall_time_s"])
            if record["num_target_forwards"] is not None:
                assert record["mean_acceptance_length"] == pytest.approx(
                    record["num_new_tokens"] / record["num_target_forwards"]
                )
    # lossless methods reproduce plain decoding token for token in float32 (peers included)
    for record in records:
        if record["lossless"]:
            assert record["identical_to_baseline"], (record["method"], record["prompt_id"])
    # every turn of flyspec's engine and of transformers' generate has its time to first token, within the turn
    for record in records:
        ttft = record["time_to_first_token_s"]
        assert len(ttft) == record["num_turns"] and all(seconds is not None and seconds > 0 for seconds in ttft)
        assert sum(ttft) <= record["wall_time_s"]
    for method in methods:
        assert 0 < overall[method]["ttft_median_s"] <= overall[method]["ttft_p90_s"]
    assert overall["ngram+exact"]["tau"] > 1.0  # the tiny model repeats itself: some drafts are accepted
    assert overall["plain"]["tau"] == pytest.approx(1.0)
    assert overall["hf-lookup"]["speedup_vs_own_plain"] is not None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--methods", "ngram+wrong"], "unknown method"),
        (["--methods", "draft+fly"], "draft model"),
        (["--categories", "nope"], "unknown category"),
        (["--dataset", "/nonexistent/prompts.jsonl"], "data file not found"),
        (["--repeats", "0"], "must be >= 1"),
        (["--window-size", "-1"], "window_size"),
        (["--methods", "llamacpp-lookup"], "llama"),
    ],
)
def test_bad_bench_input_exits_2(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path, extra: list[str], message: str
) -> None:
    argv = [
        "bench",
        "--target",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--limit",
        "1",
        "--out",
        str(tmp_path / "out"),
        *extra,
    ]
    assert message in usage_error(capsys, argv)


def test_malformed_dataset_line_exits_2_with_line_number(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "bad.jsonl", [PROMPTS[0], "{oops"])
    line = usage_error(capsys, ["bench", "--dataset", str(dataset), "--out", str(tmp_path / "out")])
    assert "bad.jsonl:2" in line


def test_draft_model_methods_and_hf_assisted(tmp_path: Path, tiny_model_dir: Path, tiny_draft) -> None:
    draft_dir = tmp_path / "draft"
    tiny_draft.model.save_pretrained(draft_dir)
    tiny_draft.tokenizer.save_pretrained(draft_dir)
    dataset = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS[:2])
    out = tmp_path / "out"
    argv = [
        "bench",
        "--dataset",
        str(dataset),
        "--target",
        str(tiny_model_dir),
        "--draft-model",
        str(draft_dir),
        "--dtype",
        "float32",
        "--methods",
        "baseline,draft+exact,multilevel+exact,draft+fly,hf-assisted",
        "--max-new-tokens",
        "16",
        "--no-plots",
        "--no-warmup",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    records = json.loads((out / "results.json").read_text())["records"]
    assert len(records) == 2 * 5
    for record in records:
        if record["lossless"]:
            assert record["identical_to_baseline"], (record["method"], record["prompt_id"])
    assert not (out / "tau_by_method.png").exists()


def test_a_failing_peer_is_dropped_and_the_run_completes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model_dir: Path
) -> None:
    from flyspec.bench.backends import HFGenerateBackend

    original = HFGenerateBackend.generate
    calls = {"n": 0}

    def flaky(self, prompt_ids, max_new_tokens, seed):  # hf-lookup fails on its third call (2nd real prompt)
        if self.method.name == "hf-lookup":
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("peer exploded")
        return original(self, prompt_ids, max_new_tokens, seed)

    monkeypatch.setattr(HFGenerateBackend, "generate", flaky)
    dataset = write_jsonl(tmp_path / "prompts.jsonl", [PROMPTS[0], PROMPTS[1], PROMPTS[3]])
    out = tmp_path / "out"
    argv = [
        "bench",
        "--dataset",
        str(dataset),
        "--target",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--methods",
        "plain,ngram+exact,hf-lookup",
        "--max-new-tokens",
        "12",
        "--no-plots",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert "peer exploded" in results["meta"]["failed_peers"]["hf-lookup"]
    methods = [r["method"] for r in results["records"]]
    assert methods.count("plain") == 3 and methods.count("ngram+exact") == 3 and methods.count("hf-lookup") == 1
    # the dropped peer's speedup is over the one prompt it completed
    records = results["records"]
    first = records[0]["prompt_id"]
    lookup = next(r for r in records if r["method"] == "hf-lookup")
    base = next(r for r in records if r["method"] == "plain" and r["prompt_id"] == first)
    assert lookup["prompt_id"] == first
    assert results["summary"][OVERALL]["hf-lookup"]["speedup"] == pytest.approx(
        lookup["tokens_per_s"] / base["tokens_per_s"]
    )


def test_in_run_limit_uses_the_forward_costs_measured_in_the_run() -> None:
    timing = {"prefill_time_s": 0.1, "draft_time_s": 0.0}
    base = _record("plain", "c", 0, 100, 5.1, 100) | timing | {"target_time_s": 5.0}  # 50 ms per step
    fast = _record("ngram+exact", "c", 0, 100, 4.1, 40) | timing | {"target_time_s": 4.0}  # 100 ms per step
    figures = summarize([base, fast], None, num_draft_tokens=15)[OVERALL]["ngram+exact"]
    assert figures["target_ms_per_step"] == pytest.approx(100.0)
    # compute time (prefill + target forwards): baseline 5.1 s, method 4.1 s for the same 100 tokens
    assert figures["in_run_limit"] == pytest.approx(5.1 / 4.1)
    assert figures["fraction_of_in_run_limit"] == pytest.approx(1.0)  # no drafting or engine time recorded
    assert figures["other_ms_per_step"] == pytest.approx(0.0, abs=1e-9)


# --- vLLM peers (the real run needs the vLLM venv: `make test-vllm`, and is a measurement) ---------


def test_vllm_methods_parse_as_peers_measured_against_vllm_plain() -> None:
    from flyspec.harness.methods import PEER_PLAIN

    methods = bench_methods("vllm-plain,vllm-ngram,vllm-ngram+fly,vllm-ngram+fly+bare", has_draft_model=False)
    by_name = {m.name: m for m in methods}
    assert [m.name for m in methods][0] == "plain" and all(by_name[n].peer for n in list(by_name)[1:])
    assert by_name["vllm-plain"].lossless and by_name["vllm-ngram"].lossless
    assert not by_name["vllm-ngram+fly"].lossless and not by_name["vllm-ngram+fly"].bare
    assert by_name["vllm-ngram+fly+bare"].bare and not by_name["vllm-ngram+fly+bare"].lossless
    assert {PEER_PLAIN[n] for n in ("vllm-ngram", "vllm-ngram+fly", "vllm-ngram+fly+bare")} == {"vllm-plain"}
    with pytest.raises(ConfigError, match="unknown method"):
        bench_methods("vllm-ngram+exact", has_draft_model=False)


def test_vllm_ngrams_tau_counts_the_steps_inside_the_output_not_its_counter() -> None:
    """vLLM's accepted-token counter also counts draft tokens its last step accepted past ``max_tokens``; the bench
    replays vLLM's own n-gram (earliest match, no extension) on the output instead, and keeps the counter where
    the replay disagrees with vLLM's draft counts."""
    from flyspec.bench.vllm import VllmBackend
    from flyspec.harness.methods import parse_method

    backend = object.__new__(VllmBackend)
    backend.method, backend.sampling, backend.num_draft_tokens = parse_method("vllm-ngram"), SamplingConfig(), 15
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    # the prefill commits 4; then the earliest match of the 4-gram 1 2 3 4 drafts 5 1 2 3 4 (no extension): the
    # output keeps 5 1 2 and ends there, though vLLM's target went on to accept 3 as well (its counter: 4)
    reply = {"outputs": [[4, 5, 1, 2]], "drafts": 1, "draft_tokens": 5, "accepted": 4}
    assert backend.counted([prompt], reply) == (3, 2)  # the prefill and one step (the counter: 4 kept, 1 forward)
    recent = {**reply, "draft_tokens": 3}  # counts the replay does not give: not vLLM's own n-gram, keep the counter
    assert backend.counted([prompt], recent) == (4, 1)
    backend.method = parse_method("vllm-ngram+fly")
    assert backend.counted([prompt], reply) == (4, 1)
    # a prediction drafts 2 3 4 5 after the prefill's 1; the output keeps 2 3 and ends (vLLM's target kept 4 too)
    backend.method = parse_method("vllm-prediction")
    predicted = {"outputs": [[1, 2, 3]], "drafts": 1, "draft_tokens": 4, "accepted": 3}
    assert backend.counted([[7, 8]], predicted, [1, 2, 3, 4, 5]) == (2, 2)


def test_vllm_venv_from_option_then_environment_then_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from flyspec.bench.vllm import venv_python

    monkeypatch.setenv("FLYSPEC_VLLM_VENV", "/opt/env-vllm")
    assert venv_python("/x/venv") == Path("/x/venv/bin/python")
    assert venv_python(None) == Path("/opt/env-vllm/bin/python")
    monkeypatch.delenv("FLYSPEC_VLLM_VENV")
    assert venv_python(None) == Path(".venv-vllm/bin/python")


def test_vllm_methods_are_skipped_with_a_reason_without_the_venv(tmp_path: Path, tiny_model_dir: Path) -> None:
    dataset = write_jsonl(tmp_path / "prompts.jsonl", [PROMPTS[0]])
    out = tmp_path / "out"
    argv = ["bench", "--dataset", str(dataset), "--target", str(tiny_model_dir), "--dtype", "float32",
            "--methods", "plain,vllm-plain,vllm-ngram+fly", "--max-new-tokens", "8", "--no-plots", "--no-warmup",
            "--vllm-venv", str(tmp_path / "no-such-venv"), "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    skipped = results["meta"]["skipped_peers"]
    assert set(skipped) == {"vllm-plain", "vllm-ngram+fly"}
    assert "no vLLM venv at" in skipped["vllm-plain"] and "make vllm-setup" in skipped["vllm-plain"]
    assert "\n" not in skipped["vllm-plain"]
    assert {r["method"] for r in results["records"]} == {"plain"}
    assert "skipped vllm-plain: no vLLM venv" in (out / "report.md").read_text()


def test_the_method_order_puts_every_method_first_and_after_different_neighbours() -> None:
    names = ["plain", "ngram+exact", "vllm-plain", "vllm-ngram"]
    orders = [method_order(names, round_) for round_ in range(2 * len(names))]
    assert all(sorted(order) == sorted(names) for order in orders)
    assert {order[0] for order in orders} == set(names)  # each first at some point
    # consecutive methods, across the rounds' boundaries too, as they ran one after another
    sequence = [name for order in orders for name in order]
    before_plain = {earlier for earlier, later in zip(sequence, sequence[1:], strict=False) if later == "plain"}
    assert len(before_plain) >= 2  # rotation alone: always right after vllm-ngram


def test_the_blocks_order_runs_each_method_back_to_back_and_every_pair_once() -> None:
    names = ["plain", "ngram+exact", "vllm-plain"]
    order = run_order(5, 2, names, "blocks")
    assert sorted(order) == sorted((i, r, name) for i in range(5) for r in range(2) for name in names)
    runs = [name for index, (_, _, name) in enumerate(order) if index == 0 or order[index - 1][2] != name]
    # one block per method and half, the second half in reverse (the last method's two blocks run back to back)
    assert runs == [*names, *names[-2::-1]]
    assert {i for i, _, name in order[:6]} == {0, 1, 2} and order[-1] == (4, 1, "plain")
    interleaved = run_order(5, 2, names, "interleaved")
    assert [name for _, _, name in interleaved[:3]] == method_order(names, 0)
    assert sorted(interleaved) == sorted(order)
    with pytest.raises(ConfigError, match="unknown bench order 'random'"):
        run_order(5, 1, names, "random")


def test_a_bench_in_blocks_records_what_the_interleaved_one_did(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The same outputs and records (float32, greedy) whatever the order; the report says which order ran."""
    dataset = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    out = tmp_path / "out"
    argv = ["bench", "--quick", "--dataset", str(dataset), "--target", str(tiny_model_dir), "--dtype", "float32",
            "--methods", "plain,ngram+exact,ngram+fly", "--max-new-tokens", "12", "--no-plots", "--order", "blocks",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    blocks = json.loads((out / "results.json").read_text())["records"]
    assert main([*argv[:-4], "--out", str(tmp_path / "interleaved")]) == 0
    interleaved = json.loads((tmp_path / "interleaved" / "results.json").read_text())["records"]
    key = lambda record: (record["prompt_id"], record["method"])  # noqa: E731
    assert len(blocks) == len(interleaved) == len(PROMPTS) * 3
    for field in ("texts", "identical_to_baseline", "num_new_tokens", "num_proposed", "num_accepted"):
        assert {key(r): r[field] for r in blocks} == {key(r): r[field] for r in interleaved}, field
    assert "methods in blocks" in (out / "report.md").read_text()
    assert "methods interleaved per prompt" in (tmp_path / "interleaved" / "report.md").read_text()
