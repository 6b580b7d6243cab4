"""flyspec's n-gram proposer against vLLM's own, per engine step, on the same contexts (issue 37, item 3).

Run in the vLLM venv: ``.venv-vllm/bin/python benchmarks/2026-11-25-load/proposer_cost.py``. No model runs:
each context is a Spec-Bench first turn (SmolLM2's tokenizer) repeated to ``CONTEXT`` tokens, copy-rich as
an n-gram proposer sees it mid-answer.
Both proposers get k = 15, n-grams 1-4, the same token table; the figure is the median time of one
``propose`` call for the whole batch (vLLM's is numba-compiled; its first call, the JIT, is excluded).
"""

from __future__ import annotations

import json
import statistics
import time
from types import SimpleNamespace

import numpy as np

CONTEXT = 400
K = 15
MAX_MODEL_LEN = 4096


def contexts(batch: int) -> tuple[np.ndarray, np.ndarray]:
    from transformers import AutoTokenizer

    from flyspec.bench.data import load_prompts
    from flyspec.runtime.loading import find_gguf, gguf_to_hf_dir

    tokenizer = AutoTokenizer.from_pretrained(gguf_to_hf_dir(find_gguf("smollm2-135m-instruct")))
    prompts = load_prompts(None)[: batch]
    table = np.zeros((batch, MAX_MODEL_LEN), dtype=np.int32)
    for row, prompt in enumerate(prompts):
        ids = tokenizer(prompt.turns[0])["input_ids"]
        ids = (ids * (1 + CONTEXT // max(len(ids), 1)))[:CONTEXT]
        table[row, :CONTEXT] = ids
    return table, np.full(batch, CONTEXT, dtype=np.int32)


def timed(propose, repeats: int = 30) -> float:
    propose()  # JIT / first-call costs
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        propose()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    from flyspec_vllm.proposer import NgramProposer as FlyspecNgram
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer as VllmNgram

    speculative = SimpleNamespace(num_speculative_tokens=K, prompt_lookup_max=4, prompt_lookup_min=1,
                                  num_speculative_tokens_per_batch_size=None)
    config = SimpleNamespace(speculative_config=speculative, model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN),
                             scheduler_config=SimpleNamespace(max_num_seqs=64),
                             parallel_config=SimpleNamespace(tensor_parallel_size=1))
    ours = FlyspecNgram(config)
    try:
        theirs = VllmNgram(config)
    except Exception as error:  # noqa: BLE001 - report which constructor this vLLM has
        raise SystemExit(f"vLLM's NgramProposer did not build from a stand-in config: {error}") from error
    rows = []
    for batch in (1, 8, 32):
        table, lengths = contexts(batch)
        sampled = [[int(table[row, CONTEXT - 1])] for row in range(batch)]
        ours_s = timed(lambda s=sampled, n=lengths, t=table: ours.propose(s, n, t))
        theirs_s = timed(lambda s=sampled, n=lengths, t=table: theirs.propose(K, s, n, t))
        drafted = {"flyspec_draft_tokens": sum(map(len, ours.propose(sampled, lengths, table))),
                   "vllm_draft_tokens": sum(map(len, theirs.propose(K, sampled, lengths, table)))}  # fmt: skip
        rows.append({"batch": batch, "flyspec_ms": 1000 * ours_s, "vllm_ms": 1000 * theirs_s, **drafted})
        print(json.dumps(rows[-1]))


if __name__ == "__main__":
    main()
