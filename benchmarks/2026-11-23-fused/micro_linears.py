"""The 30 layers' linears of SmolLM2-135M (bf16, random weights of the real shapes, packed by oneDNN),
one call per linear (7 a layer: q, k, v, o, gate, up, down) against sibling linears fused (4 a layer:
qkv, o, gate+up, down), for 1, 4 and 16 rows, interleaved over 15 passes (median, ms).

Usage: .venv/bin/python benchmarks/2026-11-23-fused/micro_linears.py
"""

from __future__ import annotations

import time

import torch

torch.set_num_threads(2)
torch.manual_seed(0)
LAYERS = 30
linear = torch.ops.mkldnn._linear_pointwise


def pack(out_features: int, in_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(
        torch.randn(out_features, in_features, dtype=torch.bfloat16) * 0.02, 4
    )


# per layer: (packed weight, reads the 1536-wide MLP activation)
SEPARATE = [
    [(pack(576, 576), False), (pack(192, 576), False), (pack(192, 576), False), (pack(576, 576), False)]
    + [(pack(1536, 576), False), (pack(1536, 576), False), (pack(576, 1536), True)]
    for _ in range(LAYERS)
]
FUSED = [
    [(pack(960, 576), False), (pack(576, 576), False), (pack(3072, 576), False), (pack(576, 1536), True)]
    for _ in range(LAYERS)
]


def run(layers: list, rows: int) -> float:
    hidden, wide = torch.randn(rows, 576, dtype=torch.bfloat16), torch.randn(rows, 1536, dtype=torch.bfloat16)
    started = time.perf_counter()
    for layer in layers:
        for weight, reads_wide in layer:
            linear(wide if reads_wide else hidden, weight, None, "none", [], "")
    return time.perf_counter() - started


with torch.inference_mode():
    for rows in (1, 4, 16):
        times: dict[str, list[float]] = {"separate": [], "fused": []}
        for _ in range(15):
            times["separate"].append(run(SEPARATE, rows))
            times["fused"].append(run(FUSED, rows))
        medians = {name: sorted(values)[7] * 1000 for name, values in times.items()}
        print(f"{rows} rows: separate {medians['separate']:.1f} ms, fused {medians['fused']:.1f} ms")
