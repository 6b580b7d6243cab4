"""A/B in one process: vLLM plain against flyspec's speculative engine told to draft nothing (a batch schedule
of k = 0 at every batch size), the two engines' runs alternating (issue 37, 2026-11-26).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python benchmarks/2026-11-26-load/draftless_ab.py \\
        MODEL_DIR vllm-flyspec-ngram,vllm-plain 2,4 7 ../shared/data/spec_bench/question.jsonl

MODEL_DIR: the packaged SmolLM2 as an HF directory (``flyspec.runtime.loading.gguf_to_hf_dir``). Prints each
method's tokens/s per run, the medians and the ratio to plain. Spec-Bench first turns, 64 new tokens, greedy.
"""

import json
import os
import statistics
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from flyspec_vllm import proposer, worker  # noqa: E402

from flyspec.config.schedule import BatchSchedule  # noqa: E402


def engine(method: str, model: str):  # noqa: ANN201 - vllm.LLM
    worker._set_plugin_environment(method)
    return worker.start_engine(worker.parse_args(["--model", model, "--method", method, "--eager"]))


if __name__ == "__main__":
    from vllm import SamplingParams

    model, methods = sys.argv[1], sys.argv[2].split(",")
    concurrencies, rounds = [int(c) for c in sys.argv[3].split(",")], int(sys.argv[4])
    with open(sys.argv[5], encoding="utf-8") as lines:
        prompts = [json.loads(line)["turns"][0] for line in lines][:64]
    engines = {method: engine(method, model) for method in methods}
    tokenizer = engines[methods[0]].get_tokenizer()
    ids = [tokenizer(prompt)["input_ids"] for prompt in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    none = BatchSchedule.from_entries([[1, 1024, 0]])
    rates: dict[tuple[int, str], list[float]] = {}
    for c in concurrencies:
        for r in range(rounds):
            for method in methods:
                llm = engines[method]
                batch = [{"prompt_token_ids": x} for x in ids[r * c % 48 : r * c % 48 + c]]
                llm.generate(batch[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # prefix cached
                started = time.perf_counter()
                with proposer.overriding(none if method != "vllm-plain" else None):
                    llm.generate(batch, params, use_tqdm=False)
                rates.setdefault((c, method), []).append(64 * c / (time.perf_counter() - started))
        for method in methods:
            runs = rates[(c, method)]
            print(f"c={c} {method}: median {statistics.median(runs):.1f} tok/s  runs {[round(x, 1) for x in runs]}")
        plain = statistics.median(rates[(c, "vllm-plain")])
        for method in (m for m in methods if m != "vllm-plain"):
            print(f"c={c} {method} / plain = {statistics.median(rates[(c, method)]) / plain:.3f}", flush=True)
