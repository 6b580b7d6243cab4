"""How much do two engines of the same configuration differ when each runs in a process of its own? (issue 37)

The bench runs every method in a worker process of its own, and its verdict compares them. Here two ``vllm-plain``
workers and one speculative worker told to draft nothing (``vllm-ngram+fly``, a k = 0 schedule) decode the same
prompts, round-robin, several rounds per concurrency: plain B / plain A is the spread between processes alone.

    .venv/bin/python benchmarks/2026-11-26-load/twin_plain.py MODEL_DIR 4,8 6 > twin_plain.txt

MODEL_DIR: the packaged SmolLM2 as an HF directory (``flyspec.runtime.loading.gguf_to_hf_dir``); then
concurrencies and rounds. Spec-Bench first turns, 64 new tokens, greedy, float32, ``enforce_eager``.
"""

import json
import statistics
import sys
from pathlib import Path

from transformers import AutoTokenizer

from flyspec.bench.load import measure
from flyspec.bench.vllm import KV_CACHE_BYTES
from flyspec.harness.vllm_worker import VllmOptions, VllmWorker, venv_python

QUESTIONS = Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench" / "question.jsonl"
NONE = [[1, 1024, 0]]  # a schedule of no drafts at any batch size

if __name__ == "__main__":
    model, concurrencies, rounds = sys.argv[1], [int(c) for c in sys.argv[2].split(",")], int(sys.argv[3])
    tokenizer = AutoTokenizer.from_pretrained(model)
    with QUESTIONS.open(encoding="utf-8") as lines:
        ids = [tokenizer(json.loads(line)["turns"][0])["input_ids"] for line in lines][:16]
    options = VllmOptions(kv_cache_memory_bytes=KV_CACHE_BYTES, eager=True)
    python = venv_python(None)
    engines = {
        "plain A": (VllmWorker(python, model, "vllm-plain", "float32", 15, options), {}),
        "plain B": (VllmWorker(python, model, "vllm-plain", "float32", 15, options), {}),
        "fly k=0": (VllmWorker(python, model, "vllm-ngram+fly", "float32", 15, options), {"schedule": NONE}),
    }
    try:
        for concurrency in concurrencies:
            prompts = ids[: max(concurrency, 4)]
            for worker, call in engines.values():
                measure(worker, prompts, concurrency, 1, **call)  # prefill cached, untimed
            runs: dict[str, list[float]] = {label: [] for label in engines}
            for _ in range(rounds):
                for label, (worker, call) in engines.items():
                    runs[label].append(measure(worker, prompts, concurrency, 64, **call)["tokens_per_s"])
            for label, figures in runs.items():
                rounded = [round(x, 1) for x in figures]
                print(f"c={concurrency} {label}: median {statistics.median(figures):.1f}  {rounded}")
            for label in ("plain B", "fly k=0"):
                shares = [x / a for x, a in zip(runs[label], runs["plain A"], strict=True)]
                print(f"c={concurrency} {label} / plain A paired: median {statistics.median(shares):.3f}  "
                      f"{[round(x, 3) for x in shares]}", flush=True)  # fmt: skip
    finally:
        for worker, _ in engines.values():
            worker.close()
