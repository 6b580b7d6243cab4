"""t(n) of the compiled bf16 engine (SmolLM2, --kernels auto) after 100, 400 and 1,000 cached tokens,
median of 25 steps each; one JSON line per run. Run once per code version, alternately: the lines in
ab_tn.jsonl come from the commit before this section's changes ("base", 1bb4d1d, in a git worktree)
and from this section's code ("new"), two runs each, in the order base, new, base, new.

Usage: PYTHONPATH=src .venv/bin/python benchmarks/2026-11-23-inplace/ab_tn.py LABEL
"""

from __future__ import annotations

import json
import sys
import time

import torch

from flyspec.runtime.cached_model import CachedModel
from flyspec.runtime.loading import load_model

torch.set_num_threads(2)
model = load_model("smollm2-135m-instruct", dtype="bfloat16", compile=True)


def step_ms(context: int, size: int, steps: int = 25) -> float:
    """Median ms of a ``size``-token step after ``context`` cached tokens, each step rolled back to one new token."""
    cached = CachedModel(model)
    cached.forward(list(range(100, 100 + context)), logits_to_keep=1)
    times = []
    for _ in range(steps):
        length = cached.cached_length
        started = time.perf_counter()
        cached.forward(list(range(500, 500 + size)))
        times.append(time.perf_counter() - started)
        cached.crop_to(length + 1)
    return sorted(times)[len(times) // 2] * 1000


figures = {f"{context}/{size}": step_ms(context, size) for context in (100, 400, 1000) for size in (1, 4, 16)}
print(json.dumps({"version": sys.argv[1], **figures}))
