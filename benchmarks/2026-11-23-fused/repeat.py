"""A focused repeat of forward.py's compiled bf16 rows: t(1) and t(4) after 200 cached tokens, unfused
against fused, 11 interleaved passes (median), because forward.py's 5 passes left t(1) within noise.

Usage: PYTHONPATH=src .venv/bin/python benchmarks/2026-11-23-fused/repeat.py
"""

from __future__ import annotations

import torch

import flyspec.runtime.packed_linears as packed_linears
from flyspec.runtime.loading import load_model
from flyspec.runtime.step_cost import measure

torch.set_num_threads(2)
find_siblings = packed_linears._siblings
packed_linears._siblings = lambda model: []
unfused = load_model("smollm2-135m-instruct", dtype="bfloat16", compile=True)
packed_linears._siblings = find_siblings
fused = load_model("smollm2-135m-instruct", dtype="bfloat16", compile=True)
SIZES = (1, 4)
runs: dict[str, list[tuple[float, ...]]] = {"unfused+compile": [], "fused+compile": []}
for _ in range(11):
    for engine, model in (("unfused+compile", unfused), ("fused+compile", fused)):
        runs[engine].append(measure(model, 16, rounds=3, context=200, sizes=SIZES).seconds)
for engine, samples in runs.items():
    medians = [sorted(sample[i] for sample in samples)[len(samples) // 2] * 1000 for i in range(len(SIZES))]
    print(engine, " ".join(f"t({n}) {ms:.1f} ms" for n, ms in zip(SIZES, medians, strict=True)))
