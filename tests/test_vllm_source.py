"""``scripts/vllm_source.py`` (``make vllm033-source``): a wheel's Python files and metadata, from the pinned wheel."""

from __future__ import annotations

import hashlib
import importlib.util
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("vllm_source", ROOT / "scripts" / "vllm_source.py")
assert spec is not None and spec.loader is not None
vllm_source = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vllm_source)


def wheel(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "vllm-9.9.9-cp38-abi3-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("vllm/__init__.py", "__version__ = '9.9.9'\n")
        archive.writestr("vllm/v1/fly.py", "KERNEL = 1\n")
        archive.writestr("vllm/_C.abi3.so", b"\x7fELF compiled")
        archive.writestr("vllm/kernels/config.json", "{}")
        archive.writestr("vllm-9.9.9.dist-info/METADATA", "Name: vllm\nVersion: 9.9.9\n")
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def test_only_the_python_source_and_the_metadata_are_extracted(tmp_path: Path) -> None:
    path, digest = wheel(tmp_path)
    assert vllm_source.main([str(path), digest, str(tmp_path / "out")]) == 0
    found = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert found == ["vllm-9.9.9.dist-info/METADATA", "vllm/__init__.py", "vllm/v1/fly.py"]


def test_a_wheel_of_another_hash_is_refused(tmp_path: Path, capsys) -> None:
    path, _ = wheel(tmp_path)
    assert vllm_source.main([str(path), "0" * 64, str(tmp_path / "out")]) == 1
    assert "expected 000" in capsys.readouterr().err and not (tmp_path / "out").exists()
