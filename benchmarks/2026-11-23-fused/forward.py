"""The target's cached-step cost t(n) with flyspec's kernels, sibling linears fused (query/key/value and
gate/up share one packed weight, the default) against unfused (every linear packed alone, as before),
eager and compiled, measured interleaved in one process: SmolLM2-135M-Instruct, bf16 and float32,
after 200 and 800 cached tokens. The unfused engine is made by turning the sibling probe off
(``packed_linears._siblings`` returns no groups). Writes forward.json and prints a Markdown table.

Usage: PYTHONPATH=src .venv/bin/python benchmarks/2026-11-23-fused/forward.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

import flyspec.runtime.packed_linears as packed_linears
from flyspec.runtime.loading import load_model
from flyspec.runtime.step_cost import measure

SIZES = (1, 2, 4, 8, 16)
ROUNDS = 3  # per interleaved pass; 5 passes
out = Path(__file__).with_name("forward.json")
torch.set_num_threads(2)
find_siblings = packed_linears._siblings


def load(dtype: str, engine: str):  # noqa: ANN201
    packed_linears._siblings = find_siblings if engine.startswith("fused") else (lambda model: [])
    try:
        return load_model("smollm2-135m-instruct", dtype=dtype, compile=engine.endswith("+compile"))
    finally:
        packed_linears._siblings = find_siblings


rows = []
ENGINES = {"bfloat16": ("unfused", "fused", "unfused+compile", "fused+compile"), "float32": ("unfused", "fused")}
for dtype, engines in ENGINES.items():
    models = {engine: load(dtype, engine) for engine in engines}
    for context in (200, 800):
        samples: dict[str, list[tuple[float, ...]]] = {engine: [] for engine in models}
        for _ in range(5):  # alternate the engines, so drift hits all of them
            for engine, model in models.items():
                samples[engine].append(measure(model, 16, rounds=ROUNDS, context=context, sizes=SIZES).seconds)
        for engine, runs in samples.items():
            medians = [sorted(run[i] for run in runs)[len(runs) // 2] * 1000 for i in range(len(SIZES))]
            rows.append(
                {"dtype": dtype, "context": context, "engine": engine, "ms": dict(zip(SIZES, medians, strict=True))}
            )
            print(rows[-1], file=sys.stderr)
json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}, out.open("w"), indent=1)
print("| dtype | cached tokens | engine | " + " | ".join(f"t({n}) ms" for n in SIZES) + " |")
print("|---|---:|---|" + "---:|" * len(SIZES))
for row in rows:
    times = " | ".join(f"{value:.1f}" for value in row["ms"].values())
    print(f"| {row['dtype']} | {row['context']} | {row['engine']} | {times} |")
for dtype, engines in ENGINES.items():
    for context in (200, 800):
        found = {r["engine"]: r for r in rows if r["dtype"] == dtype and r["context"] == context}
        for unfused, fused in zip(engines[::2], engines[1::2], strict=True):
            ratios = " ".join(f"t({n}) {found[unfused]['ms'][n] / found[fused]['ms'][n]:.2f}x" for n in SIZES)
            print(f"{dtype} @{context}: {unfused} / {fused}: {ratios}")
