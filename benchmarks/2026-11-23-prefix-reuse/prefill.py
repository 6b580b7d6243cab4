"""Prefill after a reused prefix vs a fresh prefill (SmolLM2-135M-Instruct, bf16, flyspec's kernels, eager prefill).

The longest of the first 4 Spec-Bench prompts per category, cut to 700 tokens. For each reused prefix P:
the time to prefill the other 700 - P tokens after P cached ones, against a fresh prefill of all 700
(and, for reference, a fresh prefill of 700 - P tokens alone). Best of 3, ms. The rule in target.py
(reuse only when at least half of the prompt is cached) comes from these figures. Run it on an idle machine.

    cd benchmarks/2026-11-23-prefix-reuse && PYTHONPATH=../../src ../../.venv/bin/python prefill.py > prefill.txt
"""

from __future__ import annotations

import time
from collections.abc import Callable

from flyspec.bench.data import load_prompts
from flyspec.resources import Resources
from flyspec.runtime.cached_model import CachedModel

LENGTH = 700


def best_ms(run: Callable[[], object], times: int = 3) -> float:
    seconds = []
    for _ in range(times):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return min(seconds) * 1000


def main() -> None:
    target = Resources("bfloat16").model("smollm2-135m-instruct")
    cached = CachedModel(target)
    ids = max((target.encode_prompt(p.turns[0], None) for p in load_prompts(limit=4)), key=len)[:LENGTH]
    assert len(ids) == LENGTH, len(ids)

    def fresh(tokens: list[int]) -> Callable[[], object]:
        return lambda: (cached.reset(), cached.forward(tokens, logits_to_keep=1))

    whole = best_ms(fresh(ids))
    print(f"fresh prefill of {LENGTH} tokens: {whole:.1f} ms")
    print("| reused | prefilled after them | ms | vs fresh 700 | fresh prefill of the same tokens alone, ms |")
    print("|---:|---:|---:|---:|---:|")
    for reused in (24, 100, 350, 600, 680):
        cached.reset()
        cached.forward(ids[:reused], logits_to_keep=1)

        def rest(reused: int = reused) -> None:
            cached.crop_to(reused)
            cached.forward(ids[reused:], logits_to_keep=1)

        after = best_ms(rest)
        alone = best_ms(fresh(ids[reused:]))
        print(f"| {reused} | {LENGTH - reused} | {after:.1f} | {after / whole - 1:+.0%} | {alone:.1f} |")


if __name__ == "__main__":
    main()
