"""How the examples of README.md and docs/ run in the test suite (``tests/test_docs.py``).

Sybil parses the Markdown: every ```` ```python ```` and ```` ```bash ```` block is an example, run in
document order with one namespace per page; a ``skip: next "reason"`` HTML comment skips the next one
(the reason is required), an ``invisible-code-block: python`` HTML comment is hidden setup.

- **Models.** The packaged names (``smollm2-135m-instruct``, ``gemma3-270m``) and the placeholders a
  reader fills in (``PATH_OR_NAME``, ``PATH``, ``SMALL_MODEL``, ``DIR``) resolve to tiny random models
  saved as Hugging Face directories, so no weights are read and no network is needed; the name a model
  was asked by stays its name. The real models are tested in ``tests/test_real_model.py``.
- **Shell.** Each command line of a ``bash`` block runs: ``flyspec ...`` in process through
  ``flyspec.cli.app`` (no interpreter start-up per command) with the limits of ``FAST_ARGUMENTS``
  appended (and two Spec-Bench categories for ``bench``, two kinds of edit for ``bench --workload``);
  ``python -m flyspec.integrations.lmeval`` through its ``main``; ``curl`` as itself against the server
  a page started; ``echo ... |``, ``< file``, ``export`` and ``VAR=value`` prefixes as in a shell
  (``$VAR`` and ``$(...)`` expanded by bash). ``flyspec serve`` runs until stopped, so its command lines
  are parsed and their settings checked, not served. Any other command is an error: mark it skipped.
- **Threads.** torch runs on one thread (a ``--threads N`` lasts one command): tiny models gain nothing
  from two, and on a busy 2-core machine two threads mostly wait for each other.
- **Server.** ``start_server(...)`` in hidden setup serves the tiny target on a free port; the
  examples' ``127.0.0.1:8000`` then means that port.
- Every page runs in a fresh working directory (``examples/`` is linked into it).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sybil import Document, Example
from sybil.evaluators.python import pad
from sybil.parsers.markdown import CodeBlockParser, SkipParser
from tokenizers import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

from conftest import CHAT_TEMPLATE, CORPUS, make_tiny_gemma3, make_tiny_model, noisy_copy

REPO = Path(__file__).resolve().parent.parent
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
EXAMPLE_LANGUAGES = ("python", "bash")  # fences in other languages (text, json, mermaid) are not examples
DOCS_PORT = "127.0.0.1:8000"

# Appended to a `flyspec COMMAND` line (the last value of a flag wins): the same code paths, a few tokens.
FAST_ARGUMENTS = {
    "generate": ["--max-new-tokens", "8"],
    "bench": ["--limit", "1", "--max-new-tokens", "8", "--repeats", "1", "--no-warmup", "--no-plots"],
    "eval": ["--limit", "1", "--max-new-tokens", "8", "--no-similarity", "--resamples", "100"],
    "calibrate": ["--limit", "4", "--grid", "quick", "--live-check", "0"],
}
PLACEHOLDERS = ("PATH_OR_NAME", "PATH", "SMALL_MODEL", "DIR")


def docs_tokenizer() -> PreTrainedTokenizerFast:
    """The tests' tiny byte-level BPE, trained also on the vendored Spec-Bench prompts: with a few thousand
    merges those prompts take a few hundred tokens instead of a few thousand, so `bench` stays quick."""
    import json

    import flyspec.bench

    lines = (Path(flyspec.bench.__file__).parent / "data" / "spec_bench" / "question.jsonl").read_text("utf-8")
    texts = [turn for line in lines.splitlines() for turn in json.loads(line)["turns"]]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([*CORPUS, *texts], vocab_size=4096, special_tokens=["<s>", "</s>"], show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_model_dirs(root: Path) -> dict[str, str]:
    """Model name (packaged or placeholder) → a tiny random Hugging Face directory under ``root``."""
    tokenizer = docs_tokenizer()
    target = make_tiny_model(tokenizer, seed=0, layers=4, name="docs-target")  # layer-skip calibrates on >= 3
    models = {
        "smollm2-135m-instruct": target,
        "gemma3-270m": make_tiny_gemma3(tokenizer, ["sliding_attention", "full_attention"], seed=2),
        "draft": noisy_copy(target, scale=0.3, seed=1),
    }
    dirs = {}
    for name, loaded in models.items():
        loaded.model.config.max_position_embeddings = 8192  # Spec-Bench's long prompts fit, as in the real models
        directory = root / name
        loaded.model.save_pretrained(directory)
        loaded.tokenizer.save_pretrained(directory)
        dirs[name] = str(directory)
    return {**dirs, **dict.fromkeys(PLACEHOLDERS, dirs["draft"])}


def resolve_to_tiny(monkeypatch: pytest.MonkeyPatch, dirs: dict[str, str]) -> None:
    """Make the model loader read ``dirs[name]`` for the names in ``dirs`` (every other name as before)."""
    import flyspec

    loading = sys.modules[flyspec.load_model.__module__]
    resolve = loading.hf_source

    def resolve_tiny(name_or_path: str) -> str:
        return resolve(dirs.get(name_or_path, name_or_path))

    monkeypatch.setattr(loading, "hf_source", resolve_tiny)


# --- evaluators ---------------------------------------------------------------------------------------


def rewrite(source: str, namespace: dict[str, Any]) -> str:
    """The example's source with the docs server's address replaced by the running one, if any."""
    server = namespace.get("_server")
    return source.replace(DOCS_PORT, f"127.0.0.1:{server.port}") if server else source


def one_thread() -> None:
    """torch on one thread: the suite shares 2 cores, and on a busy machine two torch threads spend more time
    waiting for each other than a tiny model's forward takes (a `--threads N` in an example lasts one command)."""
    import torch

    torch.set_num_threads(1)


def evaluate_python(example: Example) -> None:
    one_thread()
    source = rewrite(str(example.parsed), example.namespace)
    code = compile(pad(source, example.line + example.parsed.line_offset), example.path, "exec")
    with in_directory(example.namespace["_cwd"]):
        exec(code, example.namespace)
    example.namespace.pop("__builtins__", None)


def evaluate_shell(example: Example) -> None:
    namespace = example.namespace
    with in_directory(namespace["_cwd"]):
        for line in command_lines(rewrite(str(example.parsed), namespace)):
            one_thread()
            run_command_line(line, namespace)


PARSERS = [
    CodeBlockParser("python", evaluator=evaluate_python),
    CodeBlockParser("bash", evaluator=evaluate_shell),
    SkipParser(),
]


def parse(path: Path) -> Document:
    return Document.parse(str(path), *PARSERS)


@contextlib.contextmanager
def in_directory(path: Path) -> Iterator[None]:
    previous = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# --- shell --------------------------------------------------------------------------------------------

_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def command_lines(source: str) -> list[str]:
    """The logical lines of a shell block: continuations joined, a quoted string may span lines, blank and
    comment-only lines left out."""
    lines: list[str] = []
    pending = ""
    for line in re.sub(r"\\\n", " ", source).splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        if pending.strip() and not pending.lstrip().startswith("#"):
            lines.append(pending)
        pending = ""
    assert not pending, f"unclosed quote in a shell example: {pending}"
    return lines


def substitute_commands(line: str, env: dict[str, str]) -> str:
    """``$(command)`` replaced by its output, as bash would (the docs use it for ``openssl rand``)."""
    return re.sub(r"\$\(([^()]*)\)", lambda match: expand(match.group(0), env), line)


def expand(word: str, env: dict[str, str]) -> str:
    """``$(...)``, ``$VAR`` and ``${VAR}`` as bash expands them (with the page's exported variables)."""
    if "$" not in word:
        return word
    quoted = '"' + word.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`") + '"'
    result = subprocess.run(
        ["bash", "-c", f"printf %s {quoted}"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=True,
    )
    return result.stdout


def run_command_line(line: str, namespace: dict[str, Any]) -> None:
    env: dict[str, str] = namespace.setdefault("_env", {})
    lexer = shlex.shlex(substitute_commands(line, env), posix=True, punctuation_chars="|<")
    lexer.whitespace_split = True
    words = list(lexer)
    stdin = None
    if "|" in words:  # `echo TEXT | COMMAND`: the only pipe the docs use
        cut = words.index("|")
        assert words[0] == "echo", f"only `echo ... | COMMAND` pipes are supported: {line}"
        stdin = " ".join(expand(word, env) for word in words[1:cut]) + "\n"
        words = words[cut + 1 :]
    if "<" in words:
        cut = words.index("<")
        stdin = Path(words[cut + 1]).read_text(encoding="utf-8")
        words = words[:cut]
    exported = words[0] == "export"
    words = words[1:] if exported else words
    assignments = {}
    while words and _ASSIGNMENT.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        assignments[name] = expand(value, {**env, **assignments})
    if exported or not words:
        env.update(assignments)
        return
    argv = [expand(word, {**env, **assignments}) for word in words]
    with environment({**env, **assignments}):
        run_command(argv, stdin, namespace)


def run_command(argv: list[str], stdin: str | None, namespace: dict[str, Any]) -> None:
    if argv[0] == "flyspec":
        run_flyspec(argv[1:], stdin)
    elif argv[:3] == ["python", "-m", "flyspec.integrations.lmeval"]:
        from flyspec.integrations.lmeval import main

        run_main(main, argv[3:], stdin)
    elif argv[0] == "curl":
        assert namespace.get("_server"), "curl needs a server: start_server() in hidden setup before it"
        result = subprocess.run(
            ["curl", "--silent", "--show-error", "--fail-with-body", "--max-time", "60", *argv[1:]],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, f"{shlex.join(argv)}\n{result.stdout}{result.stderr}"
    else:
        raise AssertionError(
            f"no way to run {argv[0]!r} in a docs example; mark the block with a skip comment and a reason"
        )


def run_flyspec(argv: list[str], stdin: str | None) -> None:
    from flyspec.cli.app import build_parser, main

    command = argv[0] if argv else ""
    if command == "serve":
        check_serve(build_parser().parse_args(argv))
        return
    fast = FAST_ARGUMENTS.get(command, [])
    if command == "bench" and "--workload" in argv:  # the edit workload: the requests the tiny models' 512 hold
        fast = [*fast, "--categories", "docstring,regenerate"]
    elif command == "bench" and "--dataset" not in argv:
        fast = [*fast, "--categories", "mt_bench,qa"]  # two turns (prefix reuse) and a short prompt
    run_main(main, [*argv, *fast], stdin)


def run_main(main: Callable[[list[str]], Any], argv: list[str], stdin: str | None) -> None:
    out, err = io.StringIO(), io.StringIO()
    saved_stdin = sys.stdin
    sys.stdin = io.StringIO(stdin) if stdin is not None else io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exit_:
                code = exit_.code
    finally:
        sys.stdin = saved_stdin
    assert code in (0, None), f"exit {code}: {shlex.join(argv)}\n{err.getvalue()[-2000:]}"


def check_serve(args: argparse.Namespace) -> None:
    """What ``flyspec serve`` checks before it loads a model, without serving."""
    from flyspec.server.command import security_from_args, settings_from_args
    from flyspec.verifiers.registry import checked_verifier

    defaults, _ = settings_from_args(args)
    security_from_args(args)
    checked_verifier(defaults)


# --- server -------------------------------------------------------------------------------------------


def server_starter(namespace: dict[str, Any], cleanups: list[Callable[[], None]]) -> Callable[..., Any]:
    def start_server(*options: str, **flags: Any) -> Any:
        """Serve the tiny target as ``flyspec serve OPTIONS --FLAG VALUE`` would, on a free loopback port."""
        import flyspec
        from flyspec.cli.app import build_parser
        from flyspec.server.app import create_app
        from flyspec.server.command import security_from_args, settings_from_args
        from server_helpers import RunningServer

        flag_words = [word for name, value in flags.items() for word in (f"--{name.replace('_', '-')}", str(value))]
        args = build_parser().parse_args(["serve", *options, *flag_words])
        defaults, limits = settings_from_args(args)
        target = flyspec.load_model(args.target, dtype=args.dtype)
        app = create_app(target, defaults, limits, security_from_args(args))
        server = RunningServer(app).__enter__()
        cleanups.append(lambda: server.__exit__(None, None, None))
        namespace["_server"] = server
        return server

    return start_server
