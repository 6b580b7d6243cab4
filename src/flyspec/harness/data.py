"""Data files of the harnesses: vendored dataset paths, JSONL in (with ``file:line`` errors) and out.

A malformed line is a :class:`DataError` naming the file and line, or with ``skip_bad_lines`` a
logged warning handed to ``on_skip`` (for the run's summary). Records a run writes are appended
and flushed one line at a time (:class:`JsonlWriter`), so an interrupted run keeps what it
measured; :func:`read_records` reads them back, ignoring a torn last line.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from flyspec.config import ConfigError

logger = logging.getLogger(__name__)

RECORDS_FILE = "records.jsonl"  # the file in --out that eval, calibrate and bench write their records to


class DataError(ConfigError):
    """A data file that is missing or malformed; the message names the file (and line)."""


def vendored_path(package: str, *parts: str) -> Path:
    """A file shipped in ``package``'s ``data`` folder (e.g. ``("flyspec.eval", "gsm8k", "test.jsonl")``)."""
    return Path(str(resources.files(package).joinpath("data", *parts)))


def spec_bench_path() -> Path:
    """The vendored Spec-Bench ``question.jsonl`` (benchmark prompts, and four evaluation tasks)."""
    return vendored_path("flyspec.bench", "spec_bench", "question.jsonl")


def bad_line(message: str, skip_bad_lines: bool, on_skip: Callable[[str], None] | None = None) -> None:
    """Raise :class:`DataError` for ``message`` (``file:line: problem``), or warn and skip the line."""
    if not skip_bad_lines:
        raise DataError(f"{message} (fix the line, or pass --skip-bad-lines to skip it)")
    logger.warning("skipping malformed line %s", message)
    if on_skip is not None:
        on_skip(message)


def read_jsonl(
    path: Path, *, skip_bad_lines: bool, on_skip: Callable[[str], None] | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, JSON object)`` for each non-blank line; ``.gz`` files are decompressed."""
    if not path.is_file():
        raise DataError(f"data file not found: {path} (give a JSONL file)")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:  # bytes, decoded line by line: a bad line names its number
            for line_number, raw in enumerate(handle, start=1):
                yield from _parse_line(path, line_number, raw, skip_bad_lines, on_skip)
    except (OSError, EOFError) as error:  # unreadable, or a corrupt or truncated .gz
        raise DataError(f"cannot read the data file {path}: {error}") from error


def _parse_line(
    path: Path, line_number: int, raw: bytes, skip_bad_lines: bool, on_skip: Callable[[str], None] | None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """The line's JSON object (none for a blank line, or a bad one that is skipped)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        reason = f"not UTF-8 text ({error.reason} at byte {error.start})"
        bad_line(f"{path}:{line_number}: {reason}", skip_bad_lines, on_skip)
        return
    if not line.strip():
        return
    try:
        record = json.loads(line)
    except ValueError as error:
        bad_line(f"{path}:{line_number}: invalid JSON ({error})", skip_bad_lines, on_skip)
        return
    if not isinstance(record, dict):
        bad_line(f"{path}:{line_number}: expected a JSON object, got {type(record).__name__}", skip_bad_lines, on_skip)
        return
    yield line_number, record


def read_records(path: Path) -> list[dict[str, Any]]:
    """Records of a (possibly interrupted) run; a torn last line is ignored."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_bytes().splitlines():  # bytes: a line torn inside a character is one more torn line
        try:
            records.append(json.loads(line.decode("utf-8")))
        except ValueError:  # UnicodeDecodeError included
            logger.warning("ignoring an incomplete line in %s", path)
    return records


class JsonlWriter:
    """Appends one JSON object per line and flushes each, so nothing measured is lost."""

    def __init__(self, path: Path, *, append: bool) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = path.open("a" if append else "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
