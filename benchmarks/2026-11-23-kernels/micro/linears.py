"""Microbenchmark: 30 layers of SmolLM2-135M-shaped linears plus the 49152x576 head, bf16, 2 threads.

Distinct weights per layer, so they stream from memory as in a real step. Compares ``F.linear``
with oneDNN-prepacked weights (``torch.ops.mkldnn._reorder_linear_weight``, batch-size hint 4, as
``packed_linears.PackedLinear`` uses) for 1..16 rows; prints ms per pass (layers, head).
Usage: .venv/bin/python benchmarks/2026-11-23-kernels/micro/linears.py
"""

import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
LAYERS = 30
SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
weights = [[torch.randn(out, inp, dtype=torch.bfloat16) * 0.02 for out, inp in SHAPES] for _ in range(LAYERS)]
head = torch.randn(49152, 576, dtype=torch.bfloat16) * 0.02
packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 4) for w in row] for row in weights]
packed_head = torch.ops.mkldnn._reorder_linear_weight(head, 4)


def stock(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def prepacked(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def one_pass(linear, layer_weights, head_weight, rows: int, reps: int = 7) -> tuple[float, float]:
    inputs = {width: torch.randn(rows, width, dtype=torch.bfloat16) for width in (576, 1536)}
    times = []
    with torch.inference_mode():
        for _ in range(reps):
            start = time.perf_counter()
            for row in layer_weights:
                for (_, width), weight in zip(SHAPES, row, strict=True):
                    linear(inputs[width], weight)
            middle = time.perf_counter()
            linear(inputs[576], head_weight)
            times.append((middle - start, time.perf_counter() - middle))
    layers, head_time = sorted(times)[reps // 2]
    return layers * 1e3, head_time * 1e3


for rows in (1, 2, 4, 8, 16):
    a, b = one_pass(stock, weights, head, rows), one_pass(prepacked, packed, packed_head, rows)
    print(f"rows {rows:2d}: F.linear {a[0]:.1f} + {a[1]:.1f} ms   prepacked {b[0]:.1f} + {b[1]:.1f} ms")
