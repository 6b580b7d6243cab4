"""The maintained tools of ``benchmarks/`` that have no test of their own elsewhere, run small on the tiny model:
``kill9.py`` (``kill -9`` of ``flyspec serve`` mid-save of its cache file), ``server_load.py`` (concurrent streams,
malformed requests and disconnects), ``first_token.py`` (where the time to the first token goes) and ``ngram_rules.py``
(n-gram matching rules replayed on plain outputs). ``soak.py`` is
``tests/test_soak.py``'s. Their full runs (``docs/reliability.md``, ``docs/guides/serve.md``, BENCHMARKS.md) are
benchmarks, not tests: here each must run end to end and pass its own checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def run_tool(name: str, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / name), *options], capture_output=True, text=True, timeout=600, check=False
    )


@pytest.mark.heavy(seconds=27)
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


def test_first_token_breaks_every_turn_into_its_phases_and_compiles_nothing_after_load(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    rows_file = tmp_path / "rows.jsonl"  # (the tiny model's context window fits these categories' prompts)
    done = run_tool("first_token.py", "--model", str(tiny_model_dir), "--dtype", "float32", "--compile", "--limit",
                    "1", "--max-new-tokens", "4", "--categories", "mt_bench,translation,qa",
                    "--out", str(rows_file))  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert {row["method"] for row in rows} == {"plain", "ngram+exact"}
    assert len(rows) == 2 * len({(row["prompt"], row["turn"]) for row in rows}) > 2  # every turn, both methods
    for row in rows:
        phases = [row[f"{phase}_cpu_ms"] for phase in ("encode", "setup", "cache", "prefill", "first_step")]
        assert min(phases[:4]) >= 0 and row["prefill_cpu_ms"] > 0
        assert row["graphs_compiled"] == row["frames_compiled"] == 0  # the warm-up compiled every graph
        assert 0 < row["ttft_wall_ms"] <= row["total_wall_ms"]
    assert "plain: TTFT cpu" in done.stdout and "ngram+exact: TTFT cpu" in done.stdout


def test_ngram_rules_replays_every_rule_on_the_plain_outputs_it_wrote(tiny_model_dir: Path, tmp_path: Path) -> None:
    outputs = tmp_path / "outputs.jsonl"
    done = run_tool("ngram_rules.py", "--model", str(tiny_model_dir), "--limit", "1", "--max-new-tokens", "12",
                    "--categories", "mt_bench,translation", "--out", str(outputs))  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    cases = [json.loads(line) for line in outputs.read_text().splitlines()]
    assert {case["category"] for case in cases} == {"mt_bench", "translation"}
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and not line.startswith("| rule")]
    assert len(rows) == 4 and all(float(row.split("|")[2]) >= 1.0 for row in rows)
    again = run_tool("ngram_rules.py", "--out", str(outputs), "--from-outputs")
    assert again.returncode == 0 and again.stdout == done.stdout  # the same table from the outputs alone
