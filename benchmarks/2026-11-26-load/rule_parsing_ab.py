"""A/B in one process and one engine: guarded FLy requests with their options parsed every step (as before
2026-11-26) against once per request, the two alternating (issue 37).

    .venv-vllm/bin/python benchmarks/2026-11-26-load/rule_parsing_ab.py MODEL_DIR 16,64 3 \\
        ../shared/data/spec_bench/question.jsonl

MODEL_DIR: the packaged SmolLM2 as an HF directory (``flyspec.runtime.loading.gguf_to_hf_dir``). flyspec's n-gram
drafter, k = 4, every request ``rejection_sample_method=fly``; Spec-Bench first turns, 64 new tokens, greedy.
Prints tokens/s per run, the medians and their ratio.
"""

import json
import os
import statistics
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from flyspec_vllm import patch, worker  # noqa: E402
from flyspec_vllm.options import request_options  # noqa: E402

NUM_DRAFT_TOKENS = 4


def every_step(state, req_id, params):  # noqa: ANN001, ANN201 - patch._options's signature, parsed every step
    greedy = params.temperature < patch.GREEDY_TEMPERATURE_EPSILON
    return request_options(params.extra_args, greedy, state.switch, state.profile, state.guard, state.trusted)


if __name__ == "__main__":
    from vllm import SamplingParams

    model, concurrencies, rounds = sys.argv[1], [int(c) for c in sys.argv[2].split(",")], int(sys.argv[3])
    with open(sys.argv[4], encoding="utf-8") as lines:
        prompts = [json.loads(line)["turns"][0] for line in lines][:80]
    method = "vllm-flyspec-ngram"
    worker._set_plugin_environment(method)
    args = ["--model", model, "--method", method, "--eager", "--num-draft-tokens", str(NUM_DRAFT_TOKENS)]
    llm = worker.start_engine(worker.parse_args(args))
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer(prompt)["input_ids"] for prompt in prompts]
    params = SamplingParams(
        temperature=0.0, max_tokens=64, ignore_eos=True, extra_args={"rejection_sample_method": "fly"}
    )
    modes = {"parsed every step": every_step, "parsed once per request": patch._options}
    rates: dict[tuple[int, str], list[float]] = {}
    for c in concurrencies:
        for r in range(rounds):
            for name, options in modes.items() if r % 2 == 0 else reversed(modes.items()):
                patch._options = options
                batch = [{"prompt_token_ids": x} for x in ids[r * 7 % 16 : r * 7 % 16 + c]]
                llm.generate(batch, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # prefixes cached
                started = time.perf_counter()
                llm.generate(batch, params, use_tqdm=False)
                rates.setdefault((c, name), []).append(64 * c / (time.perf_counter() - started))
        for name in modes:
            runs = rates[(c, name)]
            print(f"c={c} {name}: median {statistics.median(runs):.1f} tok/s  runs {[round(x, 1) for x in runs]}")
        ratio = statistics.median(rates[(c, "parsed once per request")]) / statistics.median(
            rates[(c, "parsed every step")]
        )
        print(f"c={c} once / every step = {ratio:.3f}", flush=True)
