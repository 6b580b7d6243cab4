"""The maintained tools of ``benchmarks/`` that have no test of their own elsewhere, run small on the tiny model:
``kill9.py`` (``kill -9`` of ``flyspec serve`` mid-save of its cache file) and ``server_load.py`` (concurrent streams,
malformed requests and disconnects). ``soak.py`` is ``tests/test_soak.py``'s. Their full runs (``docs/reliability.md``,
``docs/guides/serve.md``) are benchmarks, not tests: here each must run end to end and pass its own checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def run_tool(name: str, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / name), *options], capture_output=True, text=True, timeout=600, check=False
    )


def test_kill9_leaves_a_whole_cache_file_after_a_kill_mid_save(tiny_model_dir: Path, tmp_path: Path) -> None:
    done = run_tool("kill9.py", "--runs", "1", "--entries", "100000", "--out", str(tmp_path), "--target",
                    str(tiny_model_dir))  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["passed"] and result["kills_mid_save"] >= 1 and result["failures"] == []
    assert result["valid_after_every_kill"] == len([run for run in result["runs"] if "failed" not in run])
    assert result["final_restored"] > 0
    assert "PASSED" in (tmp_path / "report.md").read_text()


def test_server_load_loses_nothing_on_a_short_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    report = tmp_path / "load.json"
    done = run_tool("server_load.py", "--duration", "5", "--streams", "3", "--malformed-rate", "3",
                    "--disconnect-rate", "1", "--max-tokens", "8", "--target", str(tiny_model_dir), "--json",
                    str(report))  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(report.read_text())
    assert result["passed"] and result["lost_all"] == []
