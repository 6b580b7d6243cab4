"""vLLM's Python and Triton source from its pinned wheel, for tests that run vLLM's real code on a CPU.

``python scripts/vllm_source.py WHEEL SHA256 DEST`` checks the wheel against its pinned hash and extracts its
``.py`` files and its metadata (``vllm-X.dist-info``: vLLM reads its own version from it) into ``DEST``; nothing
compiled (no CUDA kernels, no ``_C``). ``make vllm033-source`` runs it for vLLM 0.33.0, whose model runners and
Triton kernels ``tests/vllm033`` runs under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import hashlib
import sys
import zipfile
from pathlib import Path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def source_members(names: list[str]) -> list[str]:
    """The wheel's Python files and its metadata, nothing compiled."""
    return [name for name in names if name.endswith(".py") or ".dist-info/" in name]


def checked(argv: list[str], usage: str) -> tuple[Path, Path] | int:
    """``ARCHIVE SHA256 DEST`` from the command line: the archive and the destination where the archive's hash is the
    pinned one, else the exit code (2: a usage error; 1: another hash, said on stderr)."""
    if len(argv) != 3:
        print(f"usage: {usage}", file=sys.stderr)
        return 2
    archive, expected, dest = Path(argv[0]), argv[1], Path(argv[2])
    found = sha256(archive)
    if found != expected:
        print(f"{archive}: sha256 {found}, expected {expected} (delete it to download it again)", file=sys.stderr)
        return 1
    return archive, dest


def main(argv: list[str]) -> int:
    paths = checked(argv, "vllm_source.py WHEEL SHA256 DEST")
    if isinstance(paths, int):
        return paths
    wheel, dest = paths
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(dest, source_members(archive.namelist()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
