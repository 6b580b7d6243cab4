"""The edit workload (``harness/edits.py``): its generated data, the ``prediction+...`` methods, the bench's edit
workload and prediction figures, the eval's edit task, and the demo's edit table — on values, offline, on the tiny
models of ``conftest.py``."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from flyspec.bench.data import load_edit_prompts, load_prompts
from flyspec.bench.demo_edit import DEMO_EDIT_KINDS, edit_prompts, edit_verdict
from flyspec.bench.loop import EDIT_METHODS, bench_methods
from flyspec.bench.report import prediction_section
from flyspec.bench.summary import OVERALL, summarize
from flyspec.cli.app import main
from flyspec.config import ConfigError, SpeculationConfig
from flyspec.decoding.generation import Decoder
from flyspec.eval.data import load_edit
from flyspec.eval.evaluation import check_vllm_methods
from flyspec.eval.scoring import edit_exact, edit_lines
from flyspec.eval.tasks import resolve_tasks
from flyspec.harness.data import DataError
from flyspec.harness.edits import KIND_COUNTS, KINDS, MAX_LINES, edits_path, load_edits, make_items, renamed, render
from flyspec.harness.methods import context_twin, parse_method

# --- the data ---------------------------------------------------------------------------------------


def test_the_shipped_file_is_what_the_generator_makes() -> None:
    """``python -m flyspec.harness.edits`` rebuilds the shipped file byte for byte from the vendored HumanEval."""
    assert edits_path().read_text(encoding="utf-8") == render(make_items())


def test_the_items_cover_every_kind_each_function_once() -> None:
    items = load_edits()
    assert [item.kind for item in items] == [kind for kind, count in KIND_COUNTS.items() for _ in range(count)]
    assert len(items) == 34 and len({item.id for item in items}) == 34
    assert len({item.source for item in items}) == 34  # each HumanEval problem used once
    for item in items:
        assert item.prediction != item.expected, item.id
        assert item.prediction_in_prompt == (item.kind != "regenerate"), item.id
        assert item.expected not in item.prompt, item.id  # the answer is never given away
        for code in (item.prediction, item.expected):
            tree = ast.parse(code)
            assert isinstance(tree.body[0], ast.FunctionDef) and len(tree.body) == 1, item.id
        assert 2 <= item.prediction.count("\n") + 1 <= MAX_LINES, item.id


def _changed_lines(item_id: str) -> tuple[list[str], list[str]]:
    item = next(item for item in load_edits() if item.id == item_id)
    before, after = item.prediction.split("\n"), item.expected.split("\n")
    return [line for line in before if line not in after], [line for line in after if line not in before]


def test_each_kind_makes_the_edit_it_asks_for() -> None:
    assert _changed_lines("rename/HumanEval-7") == (
        ["    return [x for x in strings if substring in x]"],
        ["    return [item for item in strings if substring in item]"],
    )
    assert _changed_lines("comment/HumanEval-13") == ([], ["    # repeat until the condition fails"])
    assert _changed_lines("constant/HumanEval-24") == (["        if n % i == 0:"], ["        if n % i == 1:"])
    assert _changed_lines("docstring/HumanEval-30") == ([], ['    """Return only positive numbers in the list."""'])
    removed, added = _changed_lines("delete/HumanEval-23")
    assert added == [] and removed[0] == '    """ Return length of given string' and removed[-1] == '    """'
    regenerate = next(item for item in load_edits() if item.id == "regenerate/HumanEval-35")
    assert "use the name `m_value` for the local variable you would otherwise call `m`" in regenerate.prompt
    assert "    m_value = l[0]" in regenerate.expected.split("\n")


def test_a_rename_touches_names_only() -> None:
    code = "def f(y):\n    x = y.x + 'x'\n    return [x for _ in x]"
    assert renamed(code, "x", "value") == "def f(y):\n    value = y.x + 'x'\n    return [value for _ in value]"


def test_a_malformed_edit_file_names_the_line(tmp_path: Path) -> None:
    good = json.loads(edits_path().read_text(encoding="utf-8").splitlines()[0])
    path = tmp_path / "edits.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "kind": "reformat"}) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"edits\.jsonl:2: unknown edit kind 'reformat'"):
        load_edits(path)
    path.write_text(json.dumps({"id": "x"}) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"edits\.jsonl:1: not an edit item"):
        load_edits(path)


# --- methods and bench data -------------------------------------------------------------------------


def test_prediction_methods_parse_with_their_context_twin() -> None:
    method = parse_method("prediction+exact")
    assert (method.prediction, method.drafter, method.verifier) == (True, None, "exact")
    assert method.context_twin == "ngram+exact"
    method = parse_method("prediction+draft+fly+bare")
    assert (method.drafter, method.modifier, method.context_twin) == ("draft-model", "bare", "draft+fly+bare")
    assert parse_method("prediction+exact@cost").context_twin == "ngram+exact@cost"
    assert parse_method("ngram+exact").prediction is False and context_twin("ngram+exact") is None
    assert context_twin("hf-lookup") is None and context_twin("plain") is None
    # a prediction is given to flyspec's engine only: its drafter stays the run's
    assert parse_method("prediction+exact").speculation(SpeculationConfig()).drafter == "ngram"
    for name in ("prediction", "prediction+vllm-ngram", "prediction+plain"):
        with pytest.raises(ConfigError, match="unknown method"):
            parse_method(name)


def test_the_edit_workload_as_bench_prompts() -> None:
    prompts = load_edit_prompts()
    assert [prompt.category for prompt in prompts] == [item.kind for item in load_edits()]
    assert all(prompt.prediction and len(prompt.turns) == 1 for prompt in prompts)
    chosen = load_edit_prompts(categories=("regenerate", "delete"), limit=2)
    assert [prompt.id for prompt in chosen] == [
        "delete/HumanEval-16", "delete/HumanEval-20", "regenerate/HumanEval-31", "regenerate/HumanEval-32",
    ]  # fmt: skip
    with pytest.raises(DataError, match="unknown category poetry in the edit workload"):
        load_edit_prompts(categories=("poetry",))
    assert [m.name for m in bench_methods(None, has_draft_model=False, workload="edit")] == list(EDIT_METHODS)


def test_a_dataset_may_carry_predictions_on_single_turn_prompts(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "edit it", "prediction": "def f(): pass"}) + "\n", encoding="utf-8")
    assert load_prompts(path)[0].prediction == "def f(): pass"
    path.write_text(json.dumps({"turns": ["a", "b"], "prediction": "x"}) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match="single-turn"):
        load_prompts(path)
    path.write_text(json.dumps({"prompt": "a", "prediction": 3}) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match="'prediction' must be a non-empty string"):
        load_prompts(path)


# --- summary and report -----------------------------------------------------------------------------


def _record(method: str, prompt: str, tokens: int, seconds: float, counts: tuple[int, int] | None = None) -> dict:
    accepted, rejected = counts if counts is not None else (None, None)
    return {
        "prompt_id": prompt, "category": "rename", "method": method, "lossless": True, "repeat": 0,
        "num_new_tokens": tokens, "wall_time_s": seconds, "num_target_forwards": tokens // 2,
        "identical_to_baseline": True, "num_loose_accepts": 0, "proposed_per_position": [],
        "accepted_per_position": [], "target_time_s": None, "draft_time_s": None, "prefill_time_s": None,
        "time_to_first_token_s": [None], "num_accepted_prediction_tokens": accepted,
        "num_rejected_prediction_tokens": rejected,
    }  # fmt: skip


def test_the_summary_gives_speedup_over_context_drafts_and_prediction_counts() -> None:
    records = [
        _record("plain", "a", 100, 10.0), _record("plain", "b", 100, 10.0),
        _record("ngram+exact", "a", 100, 4.0), _record("ngram+exact", "b", 100, 6.0),
        _record("prediction+exact", "a", 100, 2.0, (80, 7)), _record("prediction+exact", "b", 100, 3.0, (70, 5)),
    ]  # fmt: skip
    overall = summarize(records, None, 5)[OVERALL]
    prediction = overall["prediction+exact"]
    assert prediction["speedup"] == pytest.approx(4.0)  # 200 / 5 s against 200 / 20 s
    assert prediction["speedup_vs_context"] == pytest.approx(2.0)  # against 200 / 10 s
    assert prediction["context_method"] == "ngram+exact"
    assert (prediction["num_accepted_prediction_tokens"], prediction["num_rejected_prediction_tokens"]) == (150, 12)
    assert overall["ngram+exact"]["num_accepted_prediction_tokens"] is None
    assert "speedup_vs_context" not in overall["ngram+exact"]
    lines = prediction_section(overall)
    assert "| prediction+exact | yes | 40.0 | 4.00x | ngram+exact | 2.00x | 2.00 | 2/2 | 150 / 12 |" in lines
    assert prediction_section(summarize(records[:4], None, 5)[OVERALL]) == []  # no prediction method: no section


# --- bench, end to end ------------------------------------------------------------------------------


@pytest.fixture
def predictions(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str | None]]:
    """Every generation's decoder class and the prediction it was given (``Decoder.stream``, which ``generate``
    calls), warm-ups included."""
    given: list[tuple[str, str | None]] = []
    stream = Decoder.stream

    def spy(self: Decoder, prompt: object, *args: object, **options: object) -> object:
        prediction = options.get("prediction")
        given.append((type(self).__name__, prediction if isinstance(prediction, str) else None))
        return stream(self, prompt, *args, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(Decoder, "stream", spy)
    return given


def _bench(tiny_model_dir: Path, out: Path, *extra: str) -> None:
    argv = ["bench", "--workload", "edit", "--categories", "docstring", "--limit", "2", "--target",
            str(tiny_model_dir), "--dtype", "float32", "--max-new-tokens", "12", "--no-plots", "--out", str(out),
            *extra]  # fmt: skip
    assert main(argv) == 0


def test_the_edit_workload_bench_runs_plain_context_and_prediction_drafts(
    tmp_path: Path, tiny_model_dir: Path, predictions: list[tuple[str, str | None]]
) -> None:
    _bench(tiny_model_dir, tmp_path / "out", "--methods", "plain,ngram+exact,prediction+exact")
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["meta"]["workload"] == "edit" and results["meta"]["categories"] == ["docstring"]
    records = results["records"]
    items = {item.id: item for item in load_edits()}
    assert {(r["method"], r["prompt_id"]) for r in records} == {
        (method, prompt) for method in ("plain", "ngram+exact", "prediction+exact")
        for prompt in ("docstring/HumanEval-11", "docstring/HumanEval-26")
    }  # fmt: skip
    # the warm-up, then each item: only prediction+exact's generations were given a prediction, the item's own
    given = [prediction for _, prediction in predictions if prediction is not None]
    assert given == [items["docstring/HumanEval-11"].prediction, items["docstring/HumanEval-26"].prediction]
    assert len(predictions) == 3 * (1 + 2)
    for record in records:
        assert record["identical_to_baseline"], record["method"]  # exact, float32: plain's tokens, prediction or not
        counts = (record["num_accepted_prediction_tokens"], record["num_rejected_prediction_tokens"])
        assert (None not in counts) == (record["method"] == "prediction+exact")
    overall = results["summary"][OVERALL]
    assert overall["prediction+exact"]["context_method"] == "ngram+exact"
    assert overall["prediction+exact"]["speedup_vs_context"] is not None
    assert "## Predictions: drafts from the text the client expects" in (tmp_path / "out" / "report.md").read_text()


def test_a_prediction_method_without_predictions_is_refused(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    argv = ["bench", "--target", str(tiny_model_dir), "--limit", "1", "--categories", "qa", "--methods",
            "prediction+exact", "--out", str(tmp_path)]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "a prediction+... method needs prompts with a prediction" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--workload", "edit", "--dataset", "x.jsonl", "--target", str(tiny_model_dir)])
    assert "--workload edit brings its own prompts" in capsys.readouterr().err


# --- eval -------------------------------------------------------------------------------------------


def test_the_edit_metrics_grade_the_answers_code() -> None:
    expected = "def f(x):\n    value = x\n    return value"
    fenced = "Here it is:\n```python\ndef f(x):   \n    value = x\n    return value\n```\nDone."
    assert (edit_exact(fenced, expected), edit_lines(fenced, expected)) == (1.0, 1.0)
    copied = "```python\ndef f(x):\n    y = x\n    return y\n```"  # the edit not made: one line of three right
    assert (edit_exact(copied, expected), edit_lines(copied, expected)) == (0.0, pytest.approx(1 / 3))
    cut = "```python\ndef f(x):\n    value = x"  # an unclosed block, cut by the length limit
    assert edit_lines(cut, expected) == pytest.approx(2 * 2 / 5)
    assert edit_exact(expected, [expected + "\n\n", "other"]) == 1.0  # a bare answer, the first of two references


def test_the_edit_task_takes_the_kinds_in_turn_with_predictions() -> None:
    (task,) = resolve_tasks(["edit"])
    assert (task.kind, task.metrics, task.stop) == ("code", ("edit-lines", "edit-exact"), ("\n```\n",))
    items = load_edit(7)
    assert [item.extra["kind"] for item in items] == [*KINDS, "rename"]
    first = next(item for item in load_edits() if item.id == items[0].id)
    assert (items[0].prompt, items[0].reference, items[0].extra["prediction"]) == (
        first.prompt, first.expected, first.prediction,
    )  # fmt: skip
    assert task.score(items[0], f"```python\n{first.expected}\n```").values == {"edit-lines": 1.0, "edit-exact": 1.0}
    with pytest.raises(ConfigError, match="vLLM has no prediction"):
        check_vllm_methods((parse_method("prediction+exact"),), SpeculationConfig())


def test_eval_gives_the_prediction_to_prediction_methods_only(
    tmp_path: Path, tiny_model_dir: Path, predictions: list[tuple[str, str | None]]
) -> None:
    out = tmp_path / "eval"
    argv = ["eval", "--tasks", "edit", "--limit", "6", "--methods", "ngram+exact,prediction+exact", "--target",
            str(tiny_model_dir), "--dtype", "float32", "--max-new-tokens", "10", "--no-similarity", "--no-cache",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    ran = sorted({record["item_id"] for record in records})  # the tiny model's 512 positions hold the short ones
    assert ran and {r["method"] for r in records} == {"plain", "ngram+exact", "prediction+exact"}
    items = {item.id: item for item in load_edits()}
    assert sorted(prediction for _, prediction in predictions if prediction) == sorted(
        items[item_id].prediction for item_id in ran
    )  # once per item that ran, to prediction+exact alone
    for record in records:
        assert set(record["scores"]) == {"edit-lines", "edit-exact"}
        if record["method"] != "prediction+exact":
            assert record["stats"]["num_accepted_prediction_tokens"] == 0
            assert record["stats"]["num_rejected_prediction_tokens"] == 0


# --- demo -------------------------------------------------------------------------------------------


def test_the_demo_edits_take_the_kinds_in_turn_shortest_first() -> None:
    prompts = edit_prompts(len(DEMO_EDIT_KINDS) + 1)
    assert [prompt.category for prompt in prompts] == [*DEMO_EDIT_KINDS, "rename"]
    assert [prompt.id for prompt in prompts[:2]] == ["rename/HumanEval-7", "regenerate/HumanEval-35"]
    with pytest.raises(ConfigError, match="--edit-prompts 99: the edit workload has 34 requests"):
        edit_prompts(99)


def _edit_row(name: str, tokens_per_s: float, identical: int | None, vs_context: float | None = None) -> dict:
    return {"row": name, "tokens_per_s": tokens_per_s, "speedup": tokens_per_s / 10, "identical": identical,
            "speedup_vs_context": vs_context}  # fmt: skip


def test_the_edit_verdict_names_the_fastest_row_and_what_the_prediction_added() -> None:
    rows = [_edit_row("plain", 10.0, None), _edit_row("lossless", 25.0, 2), _edit_row("prediction", 40.0, 2, 1.6)]
    assert edit_verdict(rows, 2) == (
        "Edits: prediction was fastest (4.00x plain); the prediction ran at 1.60x lossless's speed; both matched "
        "plain on every request."
    )
    rows[0]["tokens_per_s"], rows[2]["identical"] = 50.0, 1
    assert edit_verdict(rows, 2) == (
        "Edits: plain was fastest: speculation did not pay off in this run; the prediction ran at 1.60x lossless's "
        "speed; lossless matched plain on 2/2, prediction on 1/2 (rounding: not float32?)."
    )


def test_vllm_prediction_sends_each_requests_prediction_to_the_plugin() -> None:
    """vllm-prediction: the plugin's proposer, the prediction's ids in the request's extra_args, its draft counts
    reported as the prediction's (on vLLM such a request drafts from its prediction alone)."""
    from types import SimpleNamespace

    from flyspec.bench.vllm import PREDICTION_KEY, VllmBackend
    from flyspec.config import SamplingConfig

    method = parse_method("vllm-prediction")
    assert method.engine == "vllm" and method.prediction and method.context_twin == "vllm-ngram"
    assert context_twin("vllm-prediction") == "vllm-ngram" and context_twin("vllm-ngram") is None
    lines: list[dict] = []

    class Worker:
        def request(self, line: dict) -> dict:
            lines.append(line)
            # with the prediction "abcd": the prefill commits a, the step drafts b c d and the output ends after b;
            # vLLM counts b and c kept (its target went on with c past max_tokens), the replay b alone
            drafts = (1, 3, 2) if "extra_args" in line else (0, 0, 0)
            counts = dict(zip(("drafts", "draft_tokens", "accepted"), drafts, strict=True))
            return {"outputs": [[97, 98]], "seconds": 1.0, "loose_accepts": 0, **counts}

    tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens: [ord(c) for c in text])
    backend = VllmBackend.__new__(VllmBackend)
    backend.method, backend.sampling, backend.worker = method, SamplingConfig(), Worker()
    backend.num_draft_tokens = 3
    backend.target = SimpleNamespace(tokenizer=tokenizer, decode=lambda ids: "x" * len(ids))
    output = backend.generate([1, 2], 16, 0, prediction="abcd")
    assert lines[0]["extra_args"] == {PREDICTION_KEY: [97, 98, 99, 100]} and lines[0]["prompts"] == [[1, 2]]
    assert (output.num_accepted_prediction_tokens, output.num_rejected_prediction_tokens) == (1, 2)
    assert output.num_target_forwards == 2  # the prefill and one step
    plain = backend.generate([1, 2], 16, 0)
    assert "extra_args" not in lines[1] and plain.num_accepted_prediction_tokens is None
