"""``flyspec generate``: the prompt from stdin or ``--prompt-file``, and errors that come before any model loads."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

import flyspec.resources
from flyspec.cli.app import main

PROMPT = "Speculative decoding drafts"
OPTIONS = ["--dtype", "float32", "--no-chat", "--json", "--max-new-tokens", "12"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _generate(capsys: pytest.CaptureFixture[str], model_dir: Path, *argv: str) -> dict:
    assert main(["generate", *argv, "--target", str(model_dir), *OPTIONS]) == 0
    return json.loads(capsys.readouterr().out)


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and captured.err.startswith("flyspec: error: ")
    return captured.err


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any model load fail loudly: the errors under test must come first."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a model was loaded: {args}")

    monkeypatch.setattr(flyspec.resources, "load_model", refuse)


def test_stdin_and_prompt_file_give_the_argument_s_output(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, tmp_path: Path
) -> None:
    expected = _generate(capsys, tiny_model_dir, PROMPT)
    assert expected["num_prompt_tokens"] > 0 and expected["text"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT + "\n"))  # `echo ... |`: the newline is dropped
    from_dash = _generate(capsys, tiny_model_dir, "-")
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT))  # piped in, no positional prompt
    from_pipe = _generate(capsys, tiny_model_dir)
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT + "\n", encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", _Terminal())  # a file wins even when stdin is a terminal
    from_file = _generate(capsys, tiny_model_dir, "--prompt-file", str(prompt_file))
    for record in (from_dash, from_pipe, from_file):
        assert (record["text"], record["num_prompt_tokens"]) == (expected["text"], expected["num_prompt_tokens"])


def test_a_prompt_file_keeps_inner_newlines(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    prompt = "def f(x):\n    return"
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(prompt, encoding="utf-8")
    from_file = _generate(capsys, tiny_model_dir, "--prompt-file", str(prompt_file))
    from_argument = _generate(capsys, tiny_model_dir, prompt)
    assert from_file["text"] == from_argument["text"]
    assert from_file["num_prompt_tokens"] == from_argument["num_prompt_tokens"]


@pytest.mark.parametrize(
    ("argv", "stdin", "message"),
    [
        pytest.param([], "", "no prompt: give it as an argument, with --prompt-file PATH, or on stdin", id="none"),
        pytest.param(
            [PROMPT, "--prompt-file", "{file}"],
            "",
            "give the prompt once: as an argument or with --prompt-file, not both",
            id="argument-and-file",
        ),
        pytest.param(
            ["-", "--prompt-file", "{file}"],
            "",
            "give the prompt once: on stdin (-) or with --prompt-file",
            id="stdin-and-file",
        ),
        pytest.param(
            ["--prompt-file", "{missing}"],
            "",
            "cannot read the prompt from --prompt-file {missing}: No such file",
            id="missing-file",
        ),
        pytest.param(
            ["--prompt-file", "{tmp}"],
            "",
            "cannot read the prompt from --prompt-file {tmp}: Is a directory",
            id="directory",
        ),
        pytest.param(["--prompt-file", "{binary}"], "", "is not UTF-8 text", id="not-utf8"),
        pytest.param(["--prompt-file", "{empty}"], "", "the prompt is empty (--prompt-file {empty})", id="empty-file"),
        pytest.param(["-"], " \n", "the prompt is empty (stdin)", id="empty-stdin"),
        pytest.param(["   "], "", "the prompt is empty (the prompt argument)", id="blank-argument"),
    ],
)
def test_prompt_errors_are_one_line_before_any_model_loads(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    no_loading: None,
    argv: list[str],
    stdin: str,
    message: str,
) -> None:
    places = {name: str(tmp_path / name) for name in ("file", "missing", "binary", "empty")} | {"tmp": str(tmp_path)}
    (tmp_path / "file").write_text(PROMPT)
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00prompt")
    (tmp_path / "empty").write_text("\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin) if stdin else _Terminal())
    argv = [part.format(**places) for part in argv]
    assert message.format(**places) in _error(capsys, ["generate", *argv, "--target", "never-loaded"])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        pytest.param(
            ["--verifier", "fly", "-k", "4"],
            "num_draft_tokens (4) is too short for verifier 'fly'",
            id="fly-k-below-window",
        ),
        pytest.param(["--verifier", "fly", "-k", "8", "--window-size", "8"], "it needs at least 9", id="window-is-k"),
        pytest.param(["-k", "0"], "num_draft_tokens must be >= 1", id="k-zero"),
        pytest.param(["--drafter", "draft-model"], "needs a draft model", id="draft-model-without-model"),
        pytest.param(["--temperature", "-1"], "temperature must be", id="negative-temperature"),
        pytest.param(["--ngram-match", "latest"], "--ngram-match: invalid choice", id="unknown-ngram-match"),
    ],
)
def test_bad_speculation_options_fail_before_any_model_loads(
    capsys: pytest.CaptureFixture[str], no_loading: None, options: list[str], message: str
) -> None:
    assert message in _error(capsys, ["generate", PROMPT, "--target", "never-loaded", *options])


def test_ngram_match_reaches_the_drafter_and_keeps_the_text(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--ngram-match earliest`` (vLLM's rule) drafts from the earliest occurrence; lossless, the same text."""
    import flyspec.drafters.ngram as ngram

    seen: list[str] = []
    lookup = ngram.longest_match
    monkeypatch.setattr(ngram, "longest_match", lambda *args: seen.append(args[4]) or lookup(*args))
    prompt = "one two three one two three one two"
    expected = _generate(capsys, tiny_model_dir, prompt)["text"]
    assert set(seen) == {"recent"}
    seen.clear()
    assert _generate(capsys, tiny_model_dir, prompt, "--ngram-match", "earliest")["text"] == expected
    assert set(seen) == {"earliest"}


def test_piped_prompt_through_the_console_entry(capsys: pytest.CaptureFixture[str], tiny_model_dir: Path) -> None:
    """`echo … | python -m flyspec generate -` in a real pipe gives the argument's output."""
    done = subprocess.run(
        [sys.executable, "-m", "flyspec", "generate", "-", "--target", str(tiny_model_dir), *OPTIONS],
        input=PROMPT + "\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    piped, expected = json.loads(done.stdout), _generate(capsys, tiny_model_dir, PROMPT)
    assert (piped["text"], piped["num_prompt_tokens"]) == (expected["text"], expected["num_prompt_tokens"])


def test_serve_loads_in_a_thread_that_ends_and_its_errors_still_reach_the_user(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The main thread runs no torch code before serving (two threads owning OpenMP teams made every step of the
    engine thread twice as slow); an error while loading is still the CLI's one line, exit 2."""
    import threading

    import flyspec.runtime.loading
    from flyspec.config import ConfigError

    seen: list[threading.Thread] = []

    def load(*args: object, **kwargs: object) -> None:
        seen.append(threading.current_thread())
        raise ConfigError("stopped while loading")

    monkeypatch.setattr(flyspec.runtime.loading, "load_model", load)
    assert "stopped while loading" in _error(capsys, ["serve", "--target", "never-loaded"])
    assert len(seen) == 1 and seen[0] is not threading.main_thread() and not seen[0].is_alive()


def test_serve_checks_the_draft_length_before_loading(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, no_loading: None
) -> None:
    import flyspec.runtime.loading

    monkeypatch.setattr(flyspec.runtime.loading, "load_model", flyspec.resources.load_model)  # the refusing one
    message = _error(capsys, ["serve", "--target", "never-loaded", "--verifier", "fly", "-k", "4"])
    assert "num_draft_tokens (4) is too short for verifier 'fly'" in message
