"""Compiled (no enforce_eager), one process: vLLM plain against flyspec's speculative engine told to draft
nothing, 8 Spec-Bench prompts x 64 tokens at once, 3 alternating rounds; prints tokens/s and the token counts of
every model forward (does the speculative engine pad a draftless batch?). 2026-11-26, issue 37.

    .venv-vllm/bin/python benchmarks/2026-11-26-load/compiled_draftless.py MODEL_DIR
"""

import collections
import json
import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from flyspec_vllm import proposer, worker  # noqa: E402

from flyspec.config.schedule import BatchSchedule  # noqa: E402


def engine(method: str, model: str):  # noqa: ANN201 - vllm.LLM
    worker._set_plugin_environment(method)
    return worker.start_engine(worker.parse_args(["--model", model, "--method", method]))  # compiled


if __name__ == "__main__":
    import vllm.v1.worker.gpu_model_runner as runner_module
    from vllm import SamplingParams

    shapes: collections.Counter = collections.Counter()
    original = runner_module.GPUModelRunner._model_forward

    def counted(self, input_ids=None, positions=None, *args, **kwargs):  # noqa: ANN001, ANN202 - vLLM's
        shapes[(input_ids if input_ids is not None else positions).shape[-1]] += 1
        return original(self, input_ids, positions, *args, **kwargs)

    runner_module.GPUModelRunner._model_forward = counted
    with open("../shared/data/spec_bench/question.jsonl", encoding="utf-8") as lines:
        prompts = [json.loads(line)["turns"][0] for line in lines][:8]
    engines = {method: engine(method, sys.argv[1]) for method in ("vllm-plain", "vllm-flyspec-ngram")}
    tokenizer = engines["vllm-plain"].get_tokenizer()
    batch = [{"prompt_token_ids": tokenizer(prompt)["input_ids"]} for prompt in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    none = BatchSchedule.from_entries([[1, 1024, 0]])
    for _ in range(3):
        for method, llm in engines.items():
            shapes.clear()
            started = time.perf_counter()
            with proposer.overriding(none if method != "vllm-plain" else None):
                llm.generate(batch, params, use_tqdm=False)
            rate = 8 * 64 / (time.perf_counter() - started)
            print(method, f"{rate:.1f} tok/s", "forwards (tokens, count):", sorted(shapes.items()), flush=True)
