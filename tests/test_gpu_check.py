"""``make gpu-check`` (``scripts/gpu_check.py``) and the cost measurement it runs (``scripts/gpu_bench.py``), in their
``--smoke`` mode on the CPU as the GPU machine runs them (bare tree, flyspec from ``src/``, no network), so the
prepared GPU check cannot rot between GPU sessions. No timing is asserted: only that every stage ran and passed, that
every measurement is there with the shape the reports promise, and that bad input fails in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_bench.py"
CHECK = REPO / "scripts" / "gpu_check.py"
CONFIGS = sorted((REPO / "benchmarks" / "gpu-configs").glob("*.json"))


def run_script(*options: str, script: Path = SCRIPT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("OUT", None)
    return subprocess.run(
        [sys.executable, str(script), *options], capture_output=True, text=True, env=env, cwd=REPO, timeout=900
    )


@pytest.fixture(scope="module")
def check(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, Path]:
    """``gpu_check.py --smoke`` (every stage small) on this machine: its results, its markdown, its folder."""
    out = tmp_path_factory.mktemp("gpu-check")
    done = run_script("--smoke", "--out", str(out), "--wheels", str(out / "no-wheels"), script=CHECK)
    assert (out / "gpu-check.json").is_file(), done.stderr
    return json.loads((out / "gpu-check.json").read_text()), (out / "gpu-check.md").read_text(), out


@pytest.fixture(scope="module")
def smoke(check: tuple[dict, str, Path]) -> tuple[dict, str]:
    """The cost stage's own results (``gpu_bench.py --smoke``, run by the check)."""
    out = check[2] / "cost"
    return json.loads((out / "results.json").read_text()), (out / "report.md").read_text()


def test_the_smoke_check_runs_every_stage(check: tuple[dict, str, Path]) -> None:
    results, report, _ = check
    stages = results["stages"]
    assert list(stages) == ["environment", "tests", "cost", "syncs", "end-to-end"]
    assert {name: stage["status"] for name, stage in stages.items()} == dict.fromkeys(stages, "passed"), report
    assert not any(where.startswith("missing") for where in stages["environment"]["packages"].values())
    assert stages["tests"]["counts"]["passed"] >= 1 and stages["tests"]["counts"]["failed"] == 0
    cuda = torch.cuda.is_available()
    assert (sum(stages["tests"]["cuda"].values()) > 0) == cuda  # the cuda cases exist exactly where a GPU does
    assert stages["syncs"]["device"] == stages["end-to-end"]["device"] == ("cuda" if cuda else "cpu")
    summary = stages["end-to-end"]["summary"]
    assert "exact = plain, FLy" in summary and "all explained" in summary
    for name in stages:
        assert f"| {name} | passed |" in report
    assert "| ngram + exact (T = 0.0) | 1 / 1 | 1 |" in report  # the sync table, at its budget


def test_without_a_gpu_the_cost_stage_says_it_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_check_stages

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = gpu_check_stages.cost(tmp_path, smoke=False)
    assert result["status"] == "skipped" and "no CUDA device" in result["reason"]


def test_a_stage_past_its_limit_is_stopped_and_said_so(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_check

    args = gpu_check.parse_args(["--out", str(tmp_path), "--smoke"])
    result = gpu_check.run_stage("tests", args, gpu_check.offline_environment(None), limit=0.5)
    assert result["status"] == "timed out" and "limit" in result["error"]
    done = run_script("--stages", "tests,gpu", "--out", str(tmp_path), script=CHECK)
    assert done.returncode == 2 and done.stderr.strip() == (
        "gpu_check: error: unknown stage(s) gpu; known: environment, tests, cost, syncs, end-to-end"
    )


def test_smoke_measures_every_part(smoke: tuple[dict, str]) -> None:
    results, report = smoke
    meta = results["meta"]
    assert meta["device"].startswith("cuda" if torch.cuda.is_available() else "cpu") and meta["dtype"] == "float32"
    assert meta["random_weights"] is True
    model = results["models"]["smoke-tiny"]
    assert list(model["t_ms"]) == [str(n) for n in range(1, 17)] and all(t > 0 for t in model["t_ms"].values())
    expected_tokens = meta["num_prompts"] * meta["max_new_tokens"]
    assert set(model["flyspec"]) == {"plain", "ngram+exact", "ngram+fly"}
    for row in model["flyspec"].values():
        assert row["num_new_tokens"] == expected_tokens  # EOS ignored: every prompt runs to the limit
        assert row["target_ms_per_step"] > 0 and row["tokens_per_s"] > 0
    assert model["flyspec"]["plain"]["mean_draft_tokens"] == 0
    assert {name: row["num_new_tokens"] for name, row in model["transformers"].items()} == {
        "hf-plain": expected_tokens,
        "hf-lookup": expected_tokens,
    }
    assert set(model["projected"]) == {"ngram+exact", "ngram+fly"}
    for engine in ("flyspec", "transformers"):  # each engine warmed by at least two full passes, each reported
        passes = model["warm_up_ms_per_token"][engine]
        assert len(passes) >= 2 and all(t > 0 for t in passes)
        assert f"Warm-up, {engine}: {len(passes)} untimed passes" in report
    assert results["acceptance"]["source"].endswith("results.json")
    assert "**Projected** speedup (not measured)" in report and "| t(n) ms |" in report


def test_the_warm_up_repeats_passes_until_two_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_bench

    def passes(per_token_ms: Iterable[float]) -> Callable[[], tuple[int, float]]:  # one token per pass
        seconds = iter(per_token_ms)
        return lambda: (1, next(seconds) / 1000)

    # as on the H100: 78, 33, 34, 26, then 22 ms per step for the same method on the same prompts
    assert gpu_bench.warm_up(passes([78, 33, 34, 26, 22, 22.2, 22])) == pytest.approx([78, 33, 34])  # agree in 5 %
    times = gpu_bench.warm_up(passes([78, 40, 30, 26, 22, 22.2, 22]))
    assert times == pytest.approx([78, 40, 30, 26, 22, 22.2])
    never = passes(100 / n for n in range(1, 100))  # never settles: stops at the most passes allowed
    assert len(gpu_bench.warm_up(never)) == gpu_bench.WARM_MAX_PASSES
    clock = iter(range(0, 1000, 30))  # each pass "takes" 30 s: a pass starts at 0 and 30 s, none at 60 (past 45)
    monkeypatch.setattr(gpu_bench.time, "monotonic", lambda: next(clock))
    assert len(gpu_bench.warm_up(passes(100 / n for n in range(1, 100)), limit_s=45)) == 2


@pytest.mark.parametrize("path", CONFIGS, ids=[path.stem for path in CONFIGS])
def test_gpu_configs_build_the_published_shapes(path: Path) -> None:
    """Each committed config is a valid transformers config with the parameter count of its model."""
    from transformers import AutoConfig

    published = {  # parameters (billions) as published on each model card, rounded to 0.01
        "smollm2-1.7b": 1.71,
        "llama-3.2-1b": 1.24,
        "llama-3.2-3b": 3.21,
        "llama-3.1-8b": 8.03,
    }
    values = {key: value for key, value in json.loads(path.read_text()).items() if not key.startswith("_")}
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    head_dim = config.head_dim
    attention = config.hidden_size * head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    layer = attention + 3 * config.hidden_size * config.intermediate_size + 2 * config.hidden_size
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    total = config.num_hidden_layers * layer + embeddings + config.hidden_size
    assert round(total / 1e9, 2) == published[path.stem]


def test_unknown_config_and_missing_gpu_fail_in_one_line(tmp_path: Path) -> None:
    done = run_script("--models", "no-such-model", "--device", "cpu", "--out", str(tmp_path))
    assert done.returncode != 0 and "no config no-such-model.json" in done.stderr
    assert "Traceback" not in done.stderr
    if not __import__("torch").cuda.is_available():
        done = run_script("--device", "cuda", "--out", str(tmp_path))
        assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "use --device cpu" in done.stderr
