"""No tracked file holds a package file's address: pip finds a file through the index it is configured with, and an
address of one registry's file breaks on every mirror and private index (``scripts/index_download.py`` asks the
index). A project's page or an index (PyPI's ``/project/vllm/``, ``/simple/``) is documentation, not a file."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# what makes an address a package file's (the host and folder names are split so that this file holds none):
PACKAGE_FILE = re.compile(
    "|".join(
        (
            re.escape("files." + "pythonhosted.org"),  # PyPI's file host: every address on it is a file
            r"/packages/[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{60}/",  # PyPI's file layout, as its mirrors copy it
            r"/" + r"packages/\S+\.(?:whl|tar\.gz|tgz|tar\.bz2|zip|egg)\b",  # PyPI's older and legacy file addresses
            r"\bhttps?://[^\s\"'<>()]+\.whl\b",  # a wheel: only ever a package file, on any host
        )
    ),
    re.IGNORECASE,
)
WORDS = ("pythonhosted", "packages/", ".whl")  # one of these is in every address that PACKAGE_FILE matches

# the examples are joined from pieces, so that this file holds no package file's address itself
HOST, FOLDER, SDIST, WHEEL = "files." + "pythonhosted.org", "packages", "vllm-0.32.0.tar.gz", "linux_x86_64.whl"
FILE_ADDRESSES = (
    f"https://{HOST}/{FOLDER}/d5/df/{'0' * 60}/{SDIST}",
    f"curl -O https://pypi.org/{FOLDER}/source/v/vllm/{SDIST}",
    f"https://mirror.example/pypi/web/{FOLDER}/ab/cd/{'e' * 60}/{SDIST}",
    f"pip install https://download.example/whl/cpu/torch-2.13.0%2Bcpu-cp311-cp311-{WHEEL}#sha256=00",
)
NOT_FILE_ADDRESSES = (
    "https://pypi.org/project/vllm/",
    "https://pypi.org/simple/vllm/",
    "pip download --no-deps -d cache vllm==0.33.0",
    "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",  # a file's name, found through the index
    "https://github.com/vllm-project/vllm/tree/main/tests/v1/sample",
    "site-packages/vllm/__init__.py",
)


@pytest.mark.parametrize("text", FILE_ADDRESSES)
def test_the_matcher_finds_a_package_files_address(text: str) -> None:
    assert PACKAGE_FILE.search(text)


@pytest.mark.parametrize("text", NOT_FILE_ADDRESSES)
def test_the_matcher_leaves_pages_indexes_and_file_names_alone(text: str) -> None:
    assert not PACKAGE_FILE.search(text)


def addresses(root: Path, paths: list[str]) -> list[str]:
    """``path:line: text`` of each line that holds a package file's address, in the text files among ``paths``."""
    found = []
    for path in paths:
        data = (root / path).read_bytes() if (root / path).is_file() else b""  # a deleted, not yet committed file
        if b"\0" in data[:8192]:  # a binary file
            continue
        text = data.decode("utf-8", errors="replace")
        if not any(word in text.lower() for word in WORDS):  # a fast pass over the 40 MB first
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if PACKAGE_FILE.search(line):
                found.append(f"{path}:{number}: {line.strip()[:160]}")
    return found


def test_the_scan_reports_each_line_of_a_tracked_file_that_holds_one(tmp_path: Path) -> None:
    lines = [f"ok := {NOT_FILE_ADDRESSES[0]}", *(f"url := {address}" for address in FILE_ADDRESSES)]
    (tmp_path / "Makefile").write_text("\n".join(lines) + "\n")
    (tmp_path / "logo.png").write_bytes(b"\x89PNG\0" + FILE_ADDRESSES[0].encode())  # binary: not read
    found = addresses(tmp_path, ["Makefile", "logo.png", "removed.md"])
    assert found == [f"Makefile:{number}: {line}" for number, line in enumerate(lines, 1)][1:]


def test_no_tracked_file_holds_a_package_files_address() -> None:
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    paths = [path for path in tracked.decode().split("\0") if path]
    assert len(paths) > 100, "git ls-files listed too few files to be this repository"
    assert addresses(ROOT, paths) == [], "ask the configured index instead (scripts/index_download.py)"
