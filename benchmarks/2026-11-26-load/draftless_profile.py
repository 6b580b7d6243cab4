"""Profile in one process: vLLM plain against flyspec's speculative engine told to draft nothing (k = 0 at every
batch size), runs alternating, each engine's generate calls under its own cProfile (issue 37, 2026-11-26).

    .venv-vllm/bin/python benchmarks/2026-11-26-load/draftless_profile.py MODEL_DIR 4 6 > draftless_profile.txt
    .venv-vllm/bin/python benchmarks/2026-11-26-load/draftless_profile_diff.py  # per function: speculative - plain

MODEL_DIR: the packaged SmolLM2 as an HF directory (``flyspec.runtime.loading.gguf_to_hf_dir``); then concurrency
and rounds. Spec-Bench first turns, 64 new tokens, greedy; each engine's profile to /tmp/prof/<method>.prof.
"""

import cProfile
import json
import os
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from flyspec_vllm import proposer, worker  # noqa: E402

from flyspec.config.schedule import BatchSchedule  # noqa: E402

QUESTIONS = Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench" / "question.jsonl"
METHODS = ("vllm-flyspec-ngram", "vllm-plain")


def engine(method: str, model: str):  # noqa: ANN201 - vllm.LLM
    worker._set_plugin_environment(method)
    return worker.start_engine(worker.parse_args(["--model", model, "--method", method, "--eager"]))


if __name__ == "__main__":
    from vllm import SamplingParams

    model, concurrency, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with QUESTIONS.open(encoding="utf-8") as lines:
        prompts = [json.loads(line)["turns"][0] for line in lines][:64]
    engines = {method: engine(method, model) for method in METHODS}
    tokenizer = engines[METHODS[0]].get_tokenizer()
    ids = [tokenizer(prompt)["input_ids"] for prompt in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    none = BatchSchedule.from_entries([[1, 1024, 0]])
    profiles = {method: cProfile.Profile() for method in METHODS}
    seconds: dict[str, list[float]] = {method: [] for method in METHODS}
    for r in range(rounds):
        for method in METHODS if r % 2 == 0 else METHODS[::-1]:
            llm = engines[method]
            start = r * concurrency % 48
            batch = [{"prompt_token_ids": x} for x in ids[start : start + concurrency]]
            llm.generate(batch[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # prefix cached
            with proposer.overriding(none if method != "vllm-plain" else None):
                started = time.perf_counter()
                profiles[method].enable()
                llm.generate(batch, params, use_tqdm=False)
                profiles[method].disable()
                seconds[method].append(time.perf_counter() - started)
    os.makedirs("/tmp/prof", exist_ok=True)
    for method in METHODS:
        print(method, "times", [round(x, 2) for x in seconds[method]], "sum", round(sum(seconds[method]), 2))
        profiles[method].dump_stats(f"/tmp/prof/{method}.prof")
