"""``flyspec generate`` end to end, in-process on the tiny target saved as a model directory.

One test runs the installed console script in a subprocess, to prove a bad option exits with
code 2 and a one-line message instead of a traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

from conftest import CORPUS, make_tiny_model
from flyspec.cli.app import main
from flyspec.config.names import DISTRIBUTION_VERIFIERS, LOSSLESS_VERIFIERS
from flyspec.verifiers.registry import VERIFIERS

# A prompt on which the tiny target runs past 40 tokens without EOS and the n-gram drafter
# gets some drafts accepted (τ > 1).
PROMPT = "Speculative decoding drafts"
MAX_NEW_TOKENS = 24
RECORD_KEYS = {
    "text",
    "num_new_tokens",
    "num_target_forwards",
    "mean_acceptance_length",
    "num_loose_accepts",
    "wall_time_s",
    "tokens_per_s",
    "lossless",
}
COMPARE_KEYS = {"baseline_text", "baseline_tokens_per_s", "speedup", "identical_to_baseline"}


@pytest.fixture(scope="module")
def other_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose tokenizer has another vocabulary (280 tokens, not 300)."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        CORPUS, vocab_size=280, min_frequency=1, special_tokens=["<s>", "</s>"], show_progress=False
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>")
    loaded = make_tiny_model(tokenizer, seed=5, name="other-vocab")
    directory = tmp_path_factory.mktemp("other-vocab-model")
    loaded.model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def run_cli(
    capsys: pytest.CaptureFixture[str], model_dir: Path, *options: str, prompt: str = PROMPT
) -> tuple[str, str]:
    """Run ``flyspec generate`` on the tiny model (float32, raw text prompt); return stdout, stderr."""
    argv = ["generate", prompt, "--target", str(model_dir), "--dtype", "float32", "--no-chat", *options]
    assert main(argv) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def run_json(capsys: pytest.CaptureFixture[str], model_dir: Path, *options: str) -> dict:
    out, _ = run_cli(capsys, model_dir, "--json", "--max-new-tokens", str(MAX_NEW_TOKENS), *options)
    lines = out.splitlines()
    assert len(lines) == 1, f"--json must print exactly one line, got {out!r}"
    record = json.loads(lines[0])
    assert isinstance(record, dict)
    return record


def pick_stop_string(text: str) -> str:
    """Two printable ASCII characters from the middle of ``text``, to use as a stop string."""
    for start in range(3, len(text) - 1):
        candidate = text[start : start + 2]
        if all(c.isascii() and c.isprintable() and not c.isspace() for c in candidate):
            return candidate
    raise AssertionError(f"no usable stop string in {text!r}")


def usage_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``main(argv)`` expecting a usage error; return its one stderr line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {captured.err!r}"
    assert lines[0].startswith("flyspec: error: ")
    return lines[0]


@pytest.mark.parametrize("verifier", VERIFIERS)
def test_json_record_is_consistent(capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, verifier: str) -> None:
    drafter = ["--drafter", "draft-model", "--draft-model", str(tiny_model_dir)]  # fsd, cascade: a distribution
    record = run_json(
        capsys, tiny_model_dir, "--verifier", verifier, *(drafter if verifier in DISTRIBUTION_VERIFIERS else [])
    )
    assert record.keys() >= RECORD_KEYS
    assert record["verifier"] == verifier
    assert record["dtype"] == "float32"
    assert record["lossless"] is (verifier in LOSSLESS_VERIFIERS)
    assert 1 <= record["num_new_tokens"] <= MAX_NEW_TOKENS
    assert record["wall_time_s"] > 0
    assert record["tokens_per_s"] == pytest.approx(record["num_new_tokens"] / record["wall_time_s"])
    assert record["mean_acceptance_length"] == pytest.approx(record["num_new_tokens"] / record["num_target_forwards"])
    assert 0 <= record["num_accepted"] <= record["num_proposed"]
    if record["lossless"]:
        assert record["num_loose_accepts"] == 0


def test_auto_dtype_follows_the_machine(capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, auto_dtype) -> None:
    """``--dtype auto`` (the default) is what the machine computes natively: run both, whichever this one is."""
    assert main(["generate", PROMPT, "--target", str(tiny_model_dir), "--max-new-tokens", "4", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["dtype"] == auto_dtype and 0 < record["num_new_tokens"] <= 4


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5])
def test_max_new_tokens_is_exact_limit(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, max_new_tokens: int
) -> None:
    # k = 15 drafts per forward must still not overshoot a small limit
    out, _ = run_cli(capsys, tiny_model_dir, "--json", "--max-new-tokens", str(max_new_tokens))
    record = json.loads(out)
    assert record["num_new_tokens"] == max_new_tokens
    assert record["finish_reason"] == "length"


@pytest.mark.parametrize("verifier", ["exact", "rejection"])
def test_compare_reports_speedup_and_identity(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, verifier: str
) -> None:
    record = run_json(capsys, tiny_model_dir, "--compare", "--verifier", verifier)
    assert record.keys() >= RECORD_KEYS | COMPARE_KEYS
    assert record["speedup"] == pytest.approx(record["tokens_per_s"] / record["baseline_tokens_per_s"])
    assert record["identical_to_baseline"] is True
    assert record["text"] == record["baseline_text"]
    assert record["baseline_num_new_tokens"] == record["num_new_tokens"] == MAX_NEW_TOKENS


def test_compare_without_json_prints_both_summaries(capsys: pytest.CaptureFixture[str], tiny_model_dir: Path) -> None:
    out, err = run_cli(capsys, tiny_model_dir, "--compare", "--max-new-tokens", "8")
    expected = run_json(capsys, tiny_model_dir, "--max-new-tokens", "8")["text"]
    assert out == expected + "\n"
    assert "ngram + exact (lossless)" in err
    assert "identical to plain decoding: yes" in err


@pytest.mark.parametrize("use_stop", [False, True])
def test_stream_prints_the_same_text(capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, use_stop: bool) -> None:
    full_text = run_json(capsys, tiny_model_dir)["text"]
    options = ["--stop", pick_stop_string(full_text)] if use_stop else []
    streamed, _ = run_cli(capsys, tiny_model_dir, "--stream", "--max-new-tokens", str(MAX_NEW_TOKENS), *options)
    printed, _ = run_cli(capsys, tiny_model_dir, "--max-new-tokens", str(MAX_NEW_TOKENS), *options)
    assert streamed == printed
    assert printed == run_json(capsys, tiny_model_dir, *options)["text"] + "\n"


def test_stop_string_truncates(capsys: pytest.CaptureFixture[str], tiny_model_dir: Path) -> None:
    full = run_json(capsys, tiny_model_dir)
    assert full["finish_reason"] == "length"
    stop = pick_stop_string(full["text"])
    cut = run_json(capsys, tiny_model_dir, "--stop", stop)
    assert cut["text"] == full["text"][: full["text"].index(stop)]
    assert cut["finish_reason"] == "stop"
    assert cut["num_new_tokens"] < full["num_new_tokens"]


@pytest.mark.parametrize("verifier", ["exact", "rejection", "fly"])
def test_seeded_sampling_is_reproducible(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, verifier: str
) -> None:
    def sample(seed: int) -> str:
        return run_json(capsys, tiny_model_dir, "--verifier", verifier, "--temperature", "0.8", "--seed", str(seed))[
            "text"
        ]

    first = sample(3)
    assert sample(3) == first
    assert any(sample(seed) != first for seed in (4, 5)), "the seed has no effect"


@pytest.mark.parametrize("drafter", ["draft-model", "multilevel"])
def test_target_drafting_for_itself_is_fully_accepted(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, drafter: str
) -> None:
    record = run_json(capsys, tiny_model_dir, "--drafter", drafter, "--draft-model", str(tiny_model_dir), "--compare")
    assert record["drafter"] == drafter
    assert record["num_proposed"] > 0
    assert record["num_accepted"] == record["num_proposed"]
    assert record["mean_acceptance_length"] > 1
    assert record["identical_to_baseline"] is True


def test_threads_option_sets_torch_threads(capsys: pytest.CaptureFixture[str], tiny_model_dir: Path) -> None:
    before = torch.get_num_threads()
    wanted = 2 if before == 1 else 1
    try:
        run_cli(capsys, tiny_model_dir, "--threads", str(wanted), "--max-new-tokens", "2")
        assert torch.get_num_threads() == wanted
    finally:
        torch.set_num_threads(before)


BAD_OPTIONS = [
    pytest.param(["--verifier", "nope"], "invalid choice: 'nope'", id="unknown-verifier"),
    pytest.param(["--drafter", "nope"], "invalid choice: 'nope'", id="unknown-drafter"),
    pytest.param(["--dtype", "int3"], "invalid choice: 'int3'", id="unknown-dtype"),
    pytest.param(["-k", "0"], "num_draft_tokens must be >= 1", id="k-zero"),
    pytest.param(
        ["--verifier", "fly", "-k", "4", "--window-size", "6"],
        "num_draft_tokens (4) is too short for verifier 'fly'",
        id="window-above-k",
    ),
    pytest.param(
        ["--verifier", "fly", "-k", "6", "--window-size", "6"],
        "it needs at least 7 (FLy: window_size + 1",
        id="window-equals-k",
    ),
    pytest.param(["--temperature", "-0.5"], "temperature must be a finite number >= 0", id="negative-temperature"),
    pytest.param(["--top-p", "0"], "top_p must be in (0, 1]", id="top-p-zero"),
    pytest.param(["--max-new-tokens", "0"], "max_new_tokens must be >= 1", id="max-new-tokens-zero"),
    pytest.param(["--threads", "0"], "threads must be >= 1", id="threads-zero"),
    pytest.param(["--stop", ""], "stop strings must be non-empty", id="empty-stop"),
    pytest.param(["--drafter", "draft-model"], "needs a draft model", id="draft-model-without-model"),
    pytest.param(["--drafter", "multilevel"], "needs a draft model", id="multilevel-without-model"),
    pytest.param(["--drafter", "stack"], "needs its levels", id="stack-without-levels"),
    pytest.param(["--drafter", "stack", "--stack", "layer-skip,ngram"], "must be the bottom", id="ngram-on-top"),
    pytest.param(
        ["--drafter", "stack", "--stack", "ngram,no-such-model"], "'no-such-model' not found", id="stack-unknown-model"
    ),
    pytest.param(["--skip-layers", "1,x"], "--skip-layers must be 'auto' or", id="skip-layers-garbage"),
    pytest.param(["--drafter", "layer-skip", "--skip-layers", "7"], "7", id="skip-layer-out-of-range"),
    pytest.param(["--min-draft-tokens", "0"], "min draft tokens must be >= 1", id="min-draft-zero"),
    pytest.param(
        ["--draft-confidence", "1.5"], "draft confidence threshold must be in [0, 1)", id="confidence-above-one"
    ),
    pytest.param(["--ngram-cache-entries", "0"], "max_entries must be >= 1", id="cache-entries-zero"),
    pytest.param(["--target", "{missing}"], "{missing}", id="missing-model-path"),
    pytest.param(["--target", "no-such-model"], "'no-such-model' not found", id="unknown-model-name"),
]


@pytest.mark.parametrize("options, message", BAD_OPTIONS)
def test_bad_option_is_one_line_usage_error(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    tiny_model_dir: Path,
    other_tokenizer_dir: Path,
    options: list[str],
    message: str,
) -> None:
    places = {"other": str(other_tokenizer_dir), "missing": str(tmp_path / "no-such-model")}
    options = [option.format(**places) for option in options]
    # a later --target overrides this one
    argv = ["generate", PROMPT, "--target", str(tiny_model_dir), "--dtype", "float32", "--no-chat", *options]
    assert message.format(**places) in usage_error(capsys, argv)


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t"])
def test_empty_prompt_is_usage_error(capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, prompt: str) -> None:
    argv = ["generate", prompt, "--target", str(tiny_model_dir), "--dtype", "float32"]
    assert "the prompt is empty" in usage_error(capsys, argv)


def test_missing_prompt_is_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert "prompt" in usage_error(capsys, ["generate"])


def test_console_script_bad_option_exits_2_without_traceback(tiny_model_dir: Path) -> None:
    script = Path(sys.executable).with_name("flyspec")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "flyspec"]
    completed = subprocess.run(
        [*command, "generate", PROMPT, "--target", str(tiny_model_dir), "--dtype", "float32", "-k", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 2
    assert completed.stdout == ""
    assert "Traceback" not in completed.stderr
    assert completed.stderr.splitlines() == [
        "flyspec: error: num_draft_tokens must be >= 1 (got 0); use plain decoding for 0"
    ]


def test_the_console_script_exits_with_mains_code_after_freezing_the_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    """``flyspec`` is :func:`run`: main's exit code, the heap frozen first so that the interpreter's exit does not
    sweep it; main alone (what in-process callers use) leaves the caller's heap alone."""
    from importlib.metadata import entry_points

    from flyspec.cli import app

    assert [entry.value for entry in entry_points(group="console_scripts", name="flyspec")] == ["flyspec.cli:run"]
    calls: list[str] = []
    monkeypatch.setattr(app, "main", lambda: calls.append("main") or 3)
    monkeypatch.setattr(app.gc, "freeze", lambda: calls.append("freeze"))
    with pytest.raises(SystemExit) as exited:
        app.run()
    assert exited.value.code == 3 and calls == ["main", "freeze"]
    monkeypatch.setitem(sys.modules, "triton", object())  # Triton's bindings would report the frozen heap as leaks
    with pytest.raises(SystemExit):
        app.run()
    assert calls == ["main", "freeze", "main"]


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--help"], id="flyspec"),
        pytest.param(["generate", "--help"], id="flyspec-generate"),
    ],
)
def test_help_names_every_verifier(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: flyspec")
    missing = [name for name in VERIFIERS if name not in out]
    assert not missing, f"help does not mention {missing}"


def test_compare_shows_plain_text_when_a_lossy_output_differs(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    lossy = ["--verifier", "fly", "--window-size", "0", "--entropy-threshold", "0", "--max-new-tokens", "30"]
    lossy.append("--bare-rule")  # a tiny random model repeats itself: the loop guard would refuse most loose accepts
    record = run_json(capsys, tiny_model_dir, "--compare", *lossy)
    assert record["num_loose_accepts"] > 0 and not record["identical_to_baseline"]
    out, err = run_cli(capsys, tiny_model_dir, "--compare", *lossy)
    header = "--- plain decoding (differs from the fly output above) ---"
    assert out == f"{record['text']}\n\n{header}\n{record['baseline_text']}\n"
    assert "LOSSY" in err and "identical to plain decoding: no" in err


@pytest.mark.parametrize("drafter", ["draft-model", "multilevel"])
def test_draft_model_with_another_tokenizer(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, other_tokenizer_dir: Path, drafter: str
) -> None:
    record = run_json(
        capsys,
        tiny_model_dir,
        "--drafter",
        drafter,
        "--draft-model",
        str(other_tokenizer_dir),
        "-k",
        "4",
        "--compare",
        "--adaptive-draft",
    )
    assert record["identical_to_baseline"] is True
    assert record["drafter_stats"]["inner"]["draft_forwards"] > 0
    assert sum(record["requested_draft_lengths"].values()) == record["num_target_forwards"] - 1  # not the first


def test_cost_aware_draft_length_from_the_command_line(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    record = run_json(capsys, tiny_model_dir, "--draft-length", "cost", "-k", "6", "--compare")
    assert record["identical_to_baseline"] is True and record["draft_length"] == "cost"
    assert record["speculative_config"]["draft_length"]["policy"] == "cost"
    assert sum(record["requested_draft_lengths"].values()) == record["num_target_forwards"] - 1  # not the first
    assert "--draft-length: invalid choice: 'fast'" in usage_error(
        capsys, ["generate", "x", "--target", str(tiny_model_dir), "--draft-length", "fast"]
    )


def test_new_drafters_from_the_command_line(capsys: pytest.CaptureFixture[str], tiny_model_dir: Path) -> None:
    for options in (
        ["--drafter", "ngram-cache"],
        ["--drafter", "layer-skip", "--skip-layers", "1"],
        ["--drafter", "stack", "--stack", f"ngram,{tiny_model_dir}"],
    ):
        record = run_json(capsys, tiny_model_dir, *options, "--compare")
        assert record["identical_to_baseline"] is True, options


@pytest.mark.parametrize("command", ["generate", "bench", "eval", "calibrate", "serve", "demo"])
def test_every_command_takes_model_as_vllm_does_and_target_still(command: str) -> None:
    """``--model`` (vLLM's, transformers' and lm-eval's name) wherever ``--target`` is accepted; both set one value."""
    from flyspec.cli import build_parser

    parser = build_parser()
    extra = ["hello"] if command == "generate" else []
    by_model = parser.parse_args([command, *extra, "--model", "some-model"])
    by_target = parser.parse_args([command, *extra, "--target", "other-model"])
    assert (by_model.target, by_target.target) == ("some-model", "other-model")
    assert parser.parse_args([command, *extra]).target == "smollm2-135m-instruct"
