"""The plugin's per-step work to find each request's rule (``flyspec_vllm.patch.batch_rules``) at batch 8 and 64:
parsing every request's options every step (as before 2026-11-26) against once per request (its memo).

Run from the repository root: ``.venv/bin/python benchmarks/2026-11-26-load/rule_parsing.py``. No vLLM: a stand-in
model runner with the attributes ``batch_rules`` reads, and test_guard's word vocabulary.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "integrations" / "vllm" / "src"), str(ROOT / "tests")]

from flyspec_vllm import patch  # noqa: E402
from flyspec_vllm.options import request_options  # noqa: E402

from flyspec.config import GuardConfig  # noqa: E402
from test_guard import VOCABULARY  # noqa: E402

STEPS = 50
REQUESTS = {
    "rejection_sample_method=fly": {"rejection_sample_method": "fly"},
    'flyspec_rule {"verifier": "margin"}': {"flyspec_rule": {"verifier": "margin", "margin": {"logit_ratio": 0.9}}},
}


def runner(size: int, extra: dict[str, Any]) -> SimpleNamespace:
    ids = [f"r{index}" for index in range(size)]
    batch = SimpleNamespace(req_ids=ids, num_tokens_no_spec=np.full(size, 200), num_prompt_tokens=np.full(size, 100),
                            token_ids_cpu=np.zeros((size, 1024), dtype=np.int64))  # fmt: skip
    params = {req_id: SimpleNamespace(sampling_params=SimpleNamespace(temperature=0.0, extra_args=dict(extra)))
              for req_id in ids}  # fmt: skip
    return SimpleNamespace(input_batch=batch, requests=params)


def every_step(state, req_id, params):  # noqa: ANN001, ANN201 - patch._options's signature, parsed every step
    greedy = params.temperature < patch.GREEDY_TEMPERATURE_EPSILON
    return request_options(params.extra_args, greedy, state.switch, state.profile, state.guard, state.trusted)


def per_step_ms(model_runner: SimpleNamespace) -> float:
    state = patch.PluginState(switch="request", guard=GuardConfig())
    patch.batch_rules(model_runner, state)  # the request's first step
    started = time.perf_counter()
    for _ in range(STEPS):
        patch.batch_rules(model_runner, state)
    return 1000 * (time.perf_counter() - started) / STEPS


def main() -> None:
    patch.vocabulary_of = lambda runner, state: VOCABULARY
    once = patch._options
    print("| request | batch | parsed every step (ms/step) | once per request (ms/step) |\n|---|---:|---:|---:|")
    for label, extra in REQUESTS.items():
        for size in (8, 64):
            model_runner = runner(size, extra)
            patch._options = every_step
            before = per_step_ms(model_runner)
            patch._options = once
            print(f"| `{label}` | {size} | {before:.2f} | {per_step_ms(model_runner):.2f} |")


if __name__ == "__main__":
    main()
