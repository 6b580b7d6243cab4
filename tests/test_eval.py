"""`flyspec eval`: sandbox, answer parsing, bootstrap, data errors, and an end-to-end run on a tiny model."""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conftest import CORPUS, make_tiny_model
from flyspec.cli.app import main
from flyspec.config import ConfigError
from flyspec.eval.data import LoadReport, data_path, load_custom
from flyspec.eval.evaluation import EvalConfig, Evaluation, load_all_items
from flyspec.eval.sandbox import SandboxLimits, run_program
from flyspec.eval.scoring import (
    chrf,
    contains_answer,
    extract_code,
    humaneval_program,
    numeric_match,
    parse_final_number,
    rouge_l,
)
from flyspec.eval.stats import bootstrap_ratio_ci, rate, retention
from flyspec.eval.tasks import builtin_tasks, custom_task, resolve_tasks
from flyspec.harness.data import DataError, read_records
from flyspec.harness.methods import parse_method, parse_methods
from flyspec.runtime.loaded_model import LoadedModel

LIMITS = SandboxLimits(timeout_s=5.0, cpu_s=1, memory_bytes=512 << 20)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread, and a shared 2-core machine does not oversubscribe."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- sandbox ---------------------------------------------------------------------------------


def test_sandbox_passes_and_fails() -> None:
    assert run_program("assert sum([1, 2]) == 3", LIMITS).passed
    result = run_program("assert 1 == 2", LIMITS)
    assert result.status == "failed" and "AssertionError" in result.detail


def test_sandbox_kills_an_infinite_loop_within_its_cpu_limit() -> None:
    started = time.monotonic()
    result = run_program("while True:\n    pass\n", LIMITS)
    assert not result.passed and result.status in ("cpu-limit", "timeout")
    assert time.monotonic() - started < LIMITS.timeout_s + 1


def test_sandbox_stops_a_memory_bomb() -> None:
    limits = SandboxLimits(timeout_s=10.0, cpu_s=5, memory_bytes=256 << 20)
    started = time.monotonic()
    result = run_program("blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))\n", limits)
    assert not result.passed and result.status == "memory" and "MemoryError" in result.detail
    assert time.monotonic() - started < limits.timeout_s


def test_sandbox_wall_timeout_for_a_sleeper() -> None:
    result = run_program("import time\ntime.sleep(60)\n", SandboxLimits(timeout_s=1.0, cpu_s=5))
    assert result.status == "timeout"


def test_sandbox_fresh_directory_scrubbed_environment_file_limit() -> None:
    check = (
        "import os, sys\n"
        "assert 'flyspec-sandbox-' in os.getcwd() and os.listdir('.') == ['program.py'], os.listdir('.')\n"
        "assert set(os.environ) <= {'PATH', 'LANG', 'HOME', 'TMPDIR', 'LC_CTYPE'}, sorted(os.environ)\n"
        "assert sys.flags.isolated\n"
    )
    assert run_program(check, LIMITS).passed
    too_big = run_program("open('big', 'w').write('x' * (4 << 20))", LIMITS)
    assert too_big.status == "failed" and "File too large" in too_big.detail


def test_humaneval_sandbox_failure_is_a_failed_sample_not_an_error() -> None:
    task = builtin_tasks(SandboxLimits(timeout_s=3.0, cpu_s=1))["humaneval"]
    item = task.load(1, False, LoadReport())[0]
    looping = "```python\ndef has_close_elements(numbers, threshold):\n    while True:\n        pass\n```"
    score = task.score(item, looping)
    assert score.values == {"pass@1": 0.0} and score.detail.startswith(("cpu-limit", "timeout"))


def test_humaneval_canonical_solution_passes() -> None:
    with gzip.open(data_path("humaneval", "HumanEval.jsonl.gz"), "rt") as handle:
        problem = json.loads(handle.readline())
    fenced = f"Here you go:\n```python\n{problem['prompt']}{problem['canonical_solution']}```\nDone."
    assert run_program(humaneval_program(problem, fenced), LIMITS).passed
    body_only = problem["canonical_solution"]  # no fence, no def: appended to the prompt as the body
    assert run_program(humaneval_program(problem, body_only), LIMITS).passed
    assert not run_program(humaneval_program(problem, "    return True\n"), LIMITS).passed


def test_extract_code_prefers_the_block_defining_the_entry_point() -> None:
    output = "```\nprint('usage')\n```\ntext\n```python\ndef f(x):\n    return x\n```"
    assert extract_code(output, "f") == "def f(x):\n    return x\n"
    assert extract_code("```python\ndef f(x):\n    return", "f") == "def f(x):\n    return"  # cut off: unclosed
    assert extract_code("def f(x): return x", "f") == "def f(x): return x"


# --- scoring -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("She sells 16 - 3 - 4 = 9 eggs for $2 each: 9 * 2 = $18.\nThe answer is $18.", "18"),
        ("The answer is 1,000.", "1000"),
        ("The answer is 18. Each of the 3 hens lays 6 eggs.", "18"),  # the marker beats the last number
        ("so x = 5\n#### 42", "42"),
        ("It drops to -5 degrees", "-5"),
        ("The total is $3.50", "3.50"),
        ("Final: \\boxed{12} (from 3 * 4)", "12"),
        ("1,2,3 and then 10", "10"),  # "1,2,3" is not a thousands-grouped number
        ("12,345,678 people", "12345678"),
        ("No number at all.", None),
    ],
)
def test_gsm8k_final_number(output: str, expected: str | None) -> None:
    parsed = parse_final_number(output)
    assert (None if parsed is None else str(parsed)) == expected


def test_gsm8k_numeric_match_normalises() -> None:
    assert numeric_match("The answer is 3.50", "3.5") == 1.0
    assert numeric_match("The answer is $1,234.", "1234") == 1.0
    assert numeric_match("The answer is 1234.5", "1234") == 0.0
    assert numeric_match("I don't know", "7") == 0.0


def test_text_metrics() -> None:
    assert chrf("The cat sat on the mat.", ["The cat sat on the mat."]) == pytest.approx(1.0)
    assert rouge_l("the cat sat", ["the cat sat on the mat"]) == pytest.approx(2 * 1.0 * 0.5 / 1.5)
    assert contains_answer("It was George Harrison, I think.", [["James Ray", "george harrison"]]) == 1.0
    assert contains_answer("Harrisonburg", [["Harrison"]]) == 0.0  # whole words only


# --- statistics ----------------------------------------------------------------------------


def test_bootstrap_identical_scores_give_exactly_one() -> None:
    scores = [0.0, 1.0, 1.0, 0.5, 0.25, 1.0]
    result = retention(scores, scores)
    assert (result.retention, result.low, result.high) == (1.0, 1.0, 1.0)


def test_bootstrap_constant_ratio_is_exact() -> None:
    baseline = [0.2, 0.4, 0.1, 0.3]
    low, high = bootstrap_ratio_ci([2 * s for s in baseline], baseline)
    assert low == pytest.approx(2.0) and high == pytest.approx(2.0)


def test_bootstrap_matches_the_binomial_interval() -> None:
    # baseline always right, method right on 300 of 400: ratio = p = 0.75, CI ≈ p ± 1.96 sqrt(p(1-p)/n)
    method = [1.0] * 300 + [0.0] * 100
    result = retention(method, [1.0] * 400, resamples=4000, seed=1)
    half_width = 1.96 * (0.75 * 0.25 / 400) ** 0.5
    assert result.retention == 0.75
    assert result.low == pytest.approx(0.75 - half_width, abs=0.01)
    assert result.high == pytest.approx(0.75 + half_width, abs=0.01)
    assert retention(method, [1.0] * 400, seed=1) == retention(method, [1.0] * 400, seed=1)  # seeded


def test_retention_below_floor_has_no_ratio() -> None:
    result = retention([0.0, 0.02], [0.01, 0.03], floor=0.05)
    assert result.below_floor and result.retention is None and result.baseline_score == pytest.approx(0.02)


# --- bad input -----------------------------------------------------------------------------


def test_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "a", "reference": "b"}\n{"prompt": "broken"\n{"prompt": "c"}\n')
    with pytest.raises(DataError, match=r"mine\.jsonl:2: invalid JSON"):
        load_custom(path, None, False, LoadReport())
    report = LoadReport()
    items = load_custom(path, None, True, report)
    assert [item.prompt for item in items] == ["a"]
    assert len(report.skipped) == 2 and "mine.jsonl:3: missing field(s) reference" in report.skipped[1]


def test_unknown_names_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown task 'mmlu'"):
        resolve_tasks(["gsm8k", "mmlu"])
    with pytest.raises(ConfigError, match="unknown method 'medusa'"):
        parse_methods("fly,medusa")
    with pytest.raises(ConfigError, match="lossless"):
        parse_method("exact+guard")
    with pytest.raises(ConfigError, match="unknown metric"):
        custom_task(Path("x.jsonl"), "accuracy")


def test_guard_method_protects_identifiers_only_on_code() -> None:
    method = parse_method("fly+guard")
    assert method.protect("code") == ("digits", "identifiers") and method.protect("text") == ("digits",)
    assert parse_method("margin+digits").protect("code") == ("digits",)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--tasks", "mmlu"], "unknown task 'mmlu'"),
        (["--methods", "fly,bogus"], "unknown method 'bogus'"),
        (["--task-file", "/nonexistent/tasks.jsonl"], "data file not found: /nonexistent/tasks.jsonl"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(
    options: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--out", str(tmp_path), "--tasks", "", *options])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1


# --- end to end ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_context_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_target: LoadedModel) -> Path:
    """The tiny target's weights with a 4096-token context (HumanEval prompts exceed 512 tiny-BPE tokens)."""
    loaded = make_tiny_model(tiny_target.tokenizer, seed=0, name="tiny-target")
    loaded.model.config.max_position_embeddings = 4096
    directory = tmp_path_factory.mktemp("tiny-long")
    loaded.model.save_pretrained(directory)
    loaded.tokenizer.save_pretrained(directory)
    return directory


def test_end_to_end_three_items_per_task(
    long_context_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    custom = tmp_path / "capitals.jsonl"
    # references made of the tiny tokenizer's corpus, so the tiny model's chrF is above 0 and retention is defined
    lines = [json.dumps({"prompt": f"Capital {i}?", "reference": " ".join(CORPUS[:4])}) for i in range(3)]
    custom.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    argv = ["eval", "--target", str(long_context_model_dir), "--dtype", "float32", "--limit", "3", "--out", str(out)]
    argv += [
        "--tasks",
        "humaneval,gsm8k,translation,summarization,rag,qa",
        "--task-file",
        str(custom),
        "--metric",
        "chrf",
    ]
    argv += ["--methods", "exact,fly,fly+bare,margin", "--max-new-tokens", "8", "--cache-dir", str(tmp_path / "c")]
    argv += ["--window-size", "0", "--entropy-threshold", "0", "--floor", "0"]  # FLy keeps every mismatch
    assert main(argv) == 0
    for name in ("records.jsonl", "summary.json", "report.md", "diffs.md", "meta.json"):
        assert (out / name).stat().st_size > 0
    for name in ("retention.png", "speed_vs_retention.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = read_records(out / "records.jsonl")
    assert len(records) == 7 * 3 * 5  # 7 tasks × 3 items × (plain + 4 methods)
    plain = {(r["task"], r["item_id"]): r for r in records if r["method"] == "plain"}
    for record in records:
        if record["method"] == "exact":  # lossless in float32: the same tokens, scores and similarity
            assert record["token_ids"] == plain[(record["task"], record["item_id"])]["token_ids"]
            assert record["scores"] == plain[(record["task"], record["item_id"])]["scores"]
            assert record["fidelity"]["identical"] and record["fidelity"]["similarity"] == 1.0
    fly = [r for r in records if r["method"] == "fly+bare"]  # the bare rule: a tiny random model loops
    assert any(r["loose_token_indices"] for r in fly) and "⟦" in (out / "diffs.md").read_text()
    differing = [r for r in fly if not r["fidelity"]["identical"]]
    assert differing and all(-1.0 <= r["fidelity"]["similarity"] <= 1.0 for r in differing)  # MiniLM ran
    summary = json.loads((out / "summary.json").read_text())
    chrf_exact = summary["tasks"]["capitals"]["methods"]["exact"]["scores"]["chrf"]
    assert (chrf_exact["retention"], chrf_exact["low"], chrf_exact["high"]) == (1.0, 1.0, 1.0)
    assert summary["tasks"]["qa"]["metrics"] == []
    report = (out / "report.md").read_text()
    assert "fly+bare vs fly" in report
    assert "guarded / unguarded" not in report  # fly+bare is the unguarded side of its row: columns say method / vs

    # a second run reuses every cached plain output
    assert main([*argv[:-6], "--tasks", "gsm8k", "--methods", "exact", "--out", str(tmp_path / "again")]) == 0
    again = read_records(tmp_path / "again" / "records.jsonl")
    assert all(r["baseline_cached"] for r in again if r["method"] == "plain")


def test_interrupted_run_keeps_partial_records_and_resumes(tiny_target: LoadedModel, tmp_path: Path) -> None:
    config = EvalConfig(
        tasks=tuple(resolve_tasks(["gsm8k", "translation"])),
        methods=tuple(parse_methods("exact,fly")),
        out_dir=tmp_path,
        limit=2,
        max_new_tokens=6,
        similarity=False,
    )
    items = load_all_items(config, LoadReport())
    calls = []

    def interrupt_after_four(description: str) -> None:
        calls.append(description)
        if len(calls) == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Evaluation(config, tiny_target, items).run(interrupt_after_four)
    partial = read_records(tmp_path / "records.jsonl")
    assert [(r["task"], r["method"]) for r in partial] == [("gsm8k", m) for m in ("plain", "exact", "fly", "plain")]
    resumed = EvalConfig(**{**config.__dict__, "resume": True})
    Evaluation(resumed, tiny_target, items).run()
    records = read_records(tmp_path / "records.jsonl")
    assert len(records) == 2 * 2 * 3
    assert len({(r["task"], r["method"], r["item_id"]) for r in records}) == len(records)  # nothing twice


def test_cli_interrupt_writes_partial_reports_and_report_only_rebuilds(
    long_context_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = Evaluation._write
    writes = []

    def write_then_interrupt(self: Evaluation, *args: object) -> None:
        original(self, *args)
        writes.append(args)
        if len(writes) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(Evaluation, "_write", write_then_interrupt)
    argv = ["eval", "--target", str(long_context_model_dir), "--dtype", "float32", "--out", str(tmp_path)]
    argv += ["--tasks", "gsm8k", "--limit", "2", "--methods", "exact,fly", "--max-new-tokens", "4", "--no-cache"]
    assert main([*argv, "--no-similarity"]) == 130
    assert len(read_records(tmp_path / "records.jsonl")) == 3
    assert "| gsm8k | exact | 1 |" in (tmp_path / "report.md").read_text()
    (tmp_path / "report.md").unlink()
    assert main(["eval", "--report-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "report.md").is_file()


def test_speedup_interval() -> None:
    from flyspec.eval.stats import bootstrap_speedup_ci

    tokens = [10.0, 20.0, 30.0, 40.0]
    low, high = bootstrap_speedup_ci(tokens, [1.0, 2.0, 3.0, 4.0], tokens, [2.0, 4.0, 6.0, 8.0])
    assert low == pytest.approx(2.0) and high == pytest.approx(2.0)  # twice as fast on every item
    low, high = bootstrap_speedup_ci(tokens, [1.0, 4.0, 3.0, 4.0], tokens, [2.0, 2.0, 6.0, 8.0])
    assert low < 1.6 < high  # mixed items: an interval around the pooled ratio 100/12 ÷ 100/18 = 1.5
    assert bootstrap_speedup_ci([], [], [], []) is None


# --- vLLM methods (the engine itself needs the vLLM venv; here a stand-in worker) ----------------


def test_vllm_methods_parse_with_the_guards_of_fly() -> None:
    from flyspec.eval.vllm import PEERS

    guarded, bare = parse_methods("vllm-ngram+fly,vllm-ngram+fly+bare", PEERS)
    assert (guarded.engine, guarded.verifier, guarded.modifier, guarded.lossless) == ("vllm", "fly", None, False)
    assert (bare.engine, bare.modifier) == ("vllm", "bare")
    assert guarded.guard_config("text") == parse_method("fly").guard_config("text")
    # the old eval spellings still work, under the one name bench and eval share
    assert [m.name for m in parse_methods("vllm-fly,vllm-fly+bare", PEERS)] == ["vllm-ngram+fly", "vllm-ngram+fly+bare"]
    with pytest.raises(ConfigError, match="vllm-ngram\\+fly"):
        parse_method("vllm-exact", PEERS)
    with pytest.raises(ConfigError, match="unknown method 'hf-lookup'"):  # a peer eval does not run
        parse_method("hf-lookup", PEERS)


def test_vllm_method_without_the_venv_is_a_config_error(tiny_target: LoadedModel, tmp_path: Path) -> None:
    from flyspec.eval.vllm import start_engine

    with pytest.raises(ConfigError, match="vllm-ngram\\+fly: no vLLM venv at"):
        start_engine(parse_method("vllm-ngram+fly"), tiny_target, 15, str(tmp_path / "none"))


def test_vllm_outputs_are_cut_where_flyspec_cuts_them(tiny_target: LoadedModel) -> None:
    from flyspec.bench.backends import TurnOutput
    from flyspec.config import DecodeConfig
    from flyspec.eval.vllm import VllmDecoder

    text_ids = tiny_target.tokenizer.encode(" the cat sat. the dog ran.", add_special_tokens=False)

    class Engine:  # what VllmBackend.generate returns: vLLM's tokens up to EOS or the limit, counters
        def generate(self, prompt_ids: list[int], max_new_tokens: int, seed: int) -> TurnOutput:
            ids = text_ids[:max_new_tokens]
            return TurnOutput(ids, "", 0.5, num_target_forwards=3, num_proposed=9, num_accepted=4, num_loose_accepts=1)

    decoder = VllmDecoder(Engine(), tiny_target, DecodeConfig(max_new_tokens=64, stop_strings=("dog",)))  # type: ignore[arg-type]
    result = decoder.generate([1, 2, 3])
    assert result.finish_reason == "stop" and result.text == tiny_target.decode(result.token_ids).split("dog")[0]
    assert "dog" not in result.text and "cat" in result.text
    assert result.stats.num_loose_accepts == 1 and result.loose_token_indices == []
    short = decoder.generate("Hello", config=DecodeConfig(max_new_tokens=2))
    assert short.finish_reason == "length" and len(short.token_ids) == 2


def test_similarity_mean_is_undefined_when_only_some_outputs_were_measured() -> None:
    # with --no-similarity only identical outputs get a similarity (1.0); a mean over them would read 1.000
    from flyspec.eval.summary import _method_summary

    def record(identical: bool, similarity: float | None) -> dict:
        return {
            "lossless": False,
            "protect": "digits",
            "baseline_cached": False,
            "score_detail": "",
            "stats": {"num_new_tokens": 10, "wall_time_s": 1.0, "num_target_forwards": 5, "num_loose_accepts": 0},
            "fidelity": {
                "identical": identical,
                "similarity": similarity,
                "token_agreement": 1.0,
                "log_likelihood": -1.0,
            },
        }

    plain = record(True, 1.0)
    partly = _method_summary([(plain, record(True, 1.0)), (plain, record(False, None))], [], 0.05, 50)
    assert partly["fidelity"]["similarity"] is None
    measured = _method_summary([(plain, record(True, 1.0)), (plain, record(False, 0.5))], [], 0.05, 50)
    assert measured["fidelity"]["similarity"] == pytest.approx(0.75)


# --- sampled (T > 0): each prompt under several seeds, scored against plain's output of the same seed ---------------


def test_sampled_eval_pairs_every_output_with_plains_of_the_same_seed(
    long_context_model_dir: Path, tmp_path: Path
) -> None:
    custom = tmp_path / "capitals.jsonl"
    lines = [json.dumps({"prompt": f"Capital {i}?", "reference": " ".join(CORPUS[:4])}) for i in range(3)]
    custom.write_text("\n".join(lines) + "\n")
    out = tmp_path / "sampled"
    argv = ["eval", "--target", str(long_context_model_dir), "--dtype", "float32", "--out", str(out), "--tasks", ""]
    argv += ["--task-file", str(custom), "--metric", "chrf", "--methods", "exact,fly+bare", "--max-new-tokens", "10"]
    argv += ["--temperature", "0.9", "--top-p", "0.95", "--seeds", "3", "--no-cache", "--no-similarity", "--floor", "0"]
    argv += ["--window-size", "0", "--entropy-threshold", "0"]  # the bare FLy keeps every mismatch it is shown
    assert main(argv) == 0
    records = read_records(out / "records.jsonl")
    assert len(records) == 3 * 3 * 3  # 3 items × 3 seeds × (plain + 2 methods)
    plain = {(r["item_id"], r["seed"]): r for r in records if r["method"] == "plain"}
    assert len({tuple(r["token_ids"]) for r in plain.values()}) > 3  # the seeds really sample different texts
    for record in (r for r in records if r["method"] == "exact"):  # coupled: plain sampling's own text, per seed
        assert record["token_ids"] == plain[(record["item_id"], record["seed"])]["token_ids"]
        assert record["fidelity"]["identical"]
    for record in (r for r in records if r["method"] == "fly+bare"):  # no loose accept: plain's text too
        assert record["fidelity"]["identical"] or record["loose_token_indices"]
    summary = json.loads((out / "summary.json").read_text())
    exact = summary["tasks"]["capitals"]["methods"]["exact"]
    assert (exact["num_items"], exact["num_outputs"], exact["seeds"]) == (3, 9, 3)
    assert exact["fidelity"]["identical"] == 1.0
    assert "sampled at temperature 0.9, top-p 0.95, 3 seed(s) per prompt" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--seeds", "2"], "--seeds needs --temperature > 0"),
        (["--temperature", "0.7", "--seeds", "0"], "--seeds must be >= 1"),
        (["--temperature", "hot"], "--temperature must be a number"),
        (["--temperature", "0.7,1.0"], "eval takes one --temperature per run"),
        (["--temperature", "0.7", "--engine", "vllm"], "vLLM's sampling is not coupled by seed"),
    ],
)
def test_sampled_eval_bad_input_exits_2_with_one_line(
    options: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--out", str(tmp_path), "--tasks", "numbers", "--limit", "1", *options])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1


def test_a_rate_over_seeds_counts_a_prompt_once_where_its_seeds_agree() -> None:
    """Prompts as clusters: one prompt's seeds that all change count little more than one output would."""
    independent = rate([True] * 4 + [False] * 396)  # 4 of 400 prompts, one output each
    clustered = rate([True] * 4 + [False] * 396, clusters=[0] * 4 + [1 + i // 4 for i in range(396)])  # 100 × 4 seeds
    assert clustered.rate == independent.rate == 0.01
    assert clustered.high > independent.high  # the 4 changes are one prompt's: the bound is wider
    # the same 4 changes on 4 prompts, one seed each (100 prompts × 4 seeds): as good as independent outputs
    spread = rate([i in (0, 4, 8, 12) for i in range(400)], clusters=[i // 4 for i in range(400)])
    assert spread.high == pytest.approx(independent.high) and spread.high < clustered.high
    none = rate([False] * 400, clusters=[i // 4 for i in range(400)])  # no event: as many as the prompts (100)
    assert none.high == pytest.approx(rate([False] * 100).high)
    assert rate([False] * 400, clusters=list(range(400))).high == rate([False] * 400).high  # one seed: greedy's
