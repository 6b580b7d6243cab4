"""``flyspec eval --engine vllm`` (issue 36): plain decoding and every method inside vLLM, batched, scored as on
flyspec's engine. Runs vLLM in its venv (``make vllm-setup``) on the packaged SmolLM2 in float32; skipped without."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_calibrate_vllm import PYTHON, REPO, needs_vllm
from test_cli import usage_error

COMMON = ["--target", "smollm2-135m-instruct", "--dtype", "float32", "--tasks", "extract,numbers", "--limit", "3",
          "--max-new-tokens", "48", "--no-similarity", "--no-cache", "--resamples", "100"]  # fmt: skip
VLLM = ["--engine", "vllm", "--vllm-venv", str(PYTHON.parent.parent), "--kv-cache-memory-bytes", str(512 << 20)]


def test_what_vllm_cannot_evaluate_is_refused_in_one_line(capsys, tmp_path) -> None:
    base = ["eval", *COMMON, *VLLM, "--out", str(tmp_path)]
    assert "drop vllm-ngram+fly" in usage_error(capsys, [*base, "--methods", "exact,vllm-ngram+fly"])
    assert "needs the n-gram drafter" in usage_error(capsys, [*base, "--methods", "layer-skip+fly"])
    assert "drafts a fixed length" in usage_error(capsys, [*base, "--methods", "fly@cost"])


def records(out: Path) -> dict[tuple[str, str, str], dict]:
    lines = (out / "records.jsonl").read_text().splitlines()
    return {(r["task"], r["method"], r["item_id"]): r for r in map(json.loads, lines)}


@pytest.mark.heavy(seconds=110)
@needs_vllm
def test_eval_on_vllm_scores_the_same_outputs_as_flyspecs_engine(tmp_path) -> None:
    methods = ["--methods", "exact,fly,fly+bare,margin", "--draft-length", "fixed"]
    script = str(Path(sys.executable).with_name("flyspec"))
    for name, engine in (("flyspec", []), ("vllm", VLLM)):
        completed = subprocess.run([script, "eval", *COMMON, *methods, *engine, "--out", str(tmp_path / name)],
                                   capture_output=True, text=True, timeout=900, cwd=REPO, check=False)  # fmt: skip
        assert completed.returncode == 0, completed.stderr[-2000:]
    on_flyspec, on_vllm = records(tmp_path / "flyspec"), records(tmp_path / "vllm")
    assert set(on_vllm) == set(on_flyspec) and len(on_vllm) == 2 * 3 * 5
    for key, record in on_vllm.items():
        if key[1] in ("plain", "exact"):  # lossless: float32 token identity with flyspec's plain decoding
            assert record["token_ids"] == on_flyspec[(key[0], "plain", key[2])]["token_ids"], key
            assert record["fidelity"]["identical"], key
        assert record["fidelity"]["log_likelihood"] is None  # the weights are in vLLM's process only
    bare = [record for key, record in on_vllm.items() if key[1] == "fly+bare"]
    assert sum(record["stats"]["num_loose_accepts"] for record in bare) > 0  # the paper's rule loosened something
    same = sum(record["token_ids"] == on_flyspec[key]["token_ids"] for key, record in on_vllm.items())
    assert same >= 0.8 * len(on_vllm)
    meta = json.loads((tmp_path / "vllm" / "meta.json").read_text())
    assert meta["device"].startswith("vLLM") and (tmp_path / "vllm" / "report.md").is_file()
