"""The target's cached-step cost t(n) with transformers' stock modules and with flyspec's kernels
(kernels.py), eager and (bf16) compiled, measured interleaved in one process: SmolLM2-135M-Instruct,
bf16 and float32, after 200 and 800 cached tokens. Writes forward.json and prints a Markdown table.

Usage: PYTHONPATH=src .venv/bin/python benchmarks/2026-11-23-kernels/forward.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from flyspec.runtime.loading import load_model
from flyspec.runtime.step_cost import measure

SIZES = (1, 2, 4, 8, 16)
ROUNDS = 3  # per interleaved pass; 5 passes
out = Path(__file__).with_name("forward.json")
torch.set_num_threads(2)
rows = []
ENGINES = {"bfloat16": ("stock", "auto", "stock+compile", "auto+compile"), "float32": ("stock", "auto")}
for dtype, engines in ENGINES.items():
    models = {
        engine: load_model(
            "smollm2-135m-instruct", dtype=dtype, kernels=engine.split("+")[0], compile=engine.endswith("+compile")
        )
        for engine in engines
    }
    for context in (200, 800):
        samples: dict[str, list[tuple[float, ...]]] = {kernels: [] for kernels in models}
        for _ in range(5):  # alternate the two engines, so drift hits both
            for kernels, model in models.items():
                samples[kernels].append(measure(model, 16, rounds=ROUNDS, context=context, sizes=SIZES).seconds)
        for kernels, runs in samples.items():
            medians = [sorted(run[i] for run in runs)[len(runs) // 2] * 1000 for i in range(len(SIZES))]
            times = dict(zip(SIZES, medians, strict=True))
            rows.append({"dtype": dtype, "context": context, "kernels": kernels, "ms": times})
            print(rows[-1], file=sys.stderr)
json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}, out.open("w"), indent=1)
print("| dtype | cached tokens | engine | " + " | ".join(f"t({n}) ms" for n in SIZES) + " |")
print("|---|---:|---|" + "---:|" * len(SIZES))
for row in rows:
    times = " | ".join(f"{value:.1f}" for value in row["ms"].values())
    print(f"| {row['dtype']} | {row['context']} | {row['kernels']} | {times} |")
for dtype in ("bfloat16", "float32"):
    for context in (200, 800):
        found = {r["kernels"]: r for r in rows if r["dtype"] == dtype and r["context"] == context}
        for engine in ENGINES[dtype][1:]:
            ratios = " ".join(f"t({n}) {found['stock']['ms'][n] / found[engine]['ms'][n]:.2f}x" for n in SIZES)
            print(f"{dtype} @{context}: stock / {engine}: {ratios}")
