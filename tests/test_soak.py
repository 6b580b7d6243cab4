"""The soak of ``flyspec serve`` (``benchmarks/soak.py``) for 60 seconds, as CI runs it (issue 31, item 1).

The real ``flyspec serve`` process, on the tiny random model saved as a model directory (the load
is the server's, not the model's: a tiny model sends more requests through it per second), with
three API-key tenants and the whole mix: chat and completions, streamed and not, lossless and
lossy, slow readers, clients that leave while queued or mid-stream or never read, malformed,
oversized and wrong-key requests; then SIGTERM under load and a restart on the cache file.

Asserted: no 5xx, no lost or unexpected answer, a clean shutdown, the caches restored. Memory
growth is asserted only loosely (< 25 %): in one minute the allocator and the caches are still
warming up, so the 5 % goal is for the 30-minute run (``make soak``; benchmarks/2026-11-25-soak).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_soak() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("soak", BENCHMARKS / "soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.heavy(seconds=76)
def test_a_minute_of_mixed_hostile_traffic_loses_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    soak = load_soak()
    out = tmp_path / "soak"
    args = soak.parse_args([
        "--duration", "60", "--out", str(out), "--target", str(tiny_model_dir), "--warmup", "20", "--window", "10",
        "--sample-interval", "2", "--stall-s", "5", "--request-timeout", "60", "--save-interval", "5",
    ])  # fmt: skip
    result = soak.run(args)
    counts = result["counts"]
    assert counts["answered"] > 50 and counts["expected_4xx"] > 20, counts
    assert counts["5xx"] == counts["lost"] == counts["unexpected"] == 0, result["problems"][:10]
    assert result["server_5xx"] == 0 and result["healthy_after"]
    assert result["sigterm"]["lost"] == 0 and result["sigterm"]["exit_code"] in (0, -15), result["sigterm"]
    assert result["restored"] > 0 and result["cache_file"]["mode"] == "0o600"
    assert result["memory"]["growth_pct"] < 25, result["memory"]
    assert result["passed"]
    assert json.loads((out / "results.json").read_text())["passed"]
    assert (out / "report.md").exists() and (out / "soak.png").stat().st_size > 0
