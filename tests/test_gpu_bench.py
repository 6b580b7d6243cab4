"""``scripts/gpu_bench.py --smoke`` runs on the CPU as the GPU machine runs it (bare tree, ``PYTHONPATH=src``),
so the scripted GPU measurement cannot rot between GPU sessions. No timing is asserted: only that every
measurement is there, has the shape the report promises, and that bad input fails in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_bench.py"
CONFIGS = sorted((REPO / "benchmarks" / "gpu-configs").glob("*.json"))


def run_script(*options: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("OUT", None)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *options], capture_output=True, text=True, env=env, cwd=REPO, timeout=600
    )


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu-bench")
    done = run_script("--smoke", "--device", "cpu", "--dtype", "float32", "--out", str(out))
    assert done.returncode == 0, done.stderr
    return json.loads((out / "results.json").read_text()), (out / "report.md").read_text()


def test_smoke_measures_every_part(smoke: tuple[dict, str]) -> None:
    results, report = smoke
    meta = results["meta"]
    assert meta["device"] == "cpu" and meta["dtype"] == "float32" and meta["random_weights"] is True
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
    assert results["acceptance"]["source"].endswith("results.json")
    assert "**Projected** speedup (not measured)" in report and "| t(n) ms |" in report


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
