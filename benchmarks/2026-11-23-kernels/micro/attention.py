"""Microbenchmark: attention of 1, 4, 8 or 16 queries (9 heads, 3 key/value heads, head dim 64, bf16,
2 threads) against 300 or 800 cached keys held as a view of a longer buffer (as
``kernels.GrowingLayer`` hands them over): torch SDPA, bf16 bmm, float32 bmm (what
``kernels.decode_attention`` does), and bf16 bmm on contiguous keys. Prints µs per call.
Usage: .venv/bin/python benchmarks/2026-11-23-kernels/micro/attention.py
"""

import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
KV, GROUPS, DIM = 3, 3, 64


def microseconds(call, *args, reps: int = 300) -> float:
    for _ in range(20):
        call(*args)
    start = time.perf_counter()
    for _ in range(reps):
        call(*args)
    return (time.perf_counter() - start) / reps * 1e6


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def matmul_attention(q, k, v, dtype):
    queries = q.shape[2]
    scores = torch.bmm(q.reshape(KV, GROUPS * queries, DIM).to(dtype), k[0].transpose(1, 2).to(dtype)).float()
    weights = torch.softmax(scores, -1).to(dtype)
    return torch.bmm(weights, v[0].to(dtype))


for keys in (300, 800):
    for queries in (1, 4, 8, 16):
        k = torch.randn(1, KV, 1024, DIM, dtype=torch.bfloat16)[:, :, :keys]
        v = torch.randn(1, KV, 1024, DIM, dtype=torch.bfloat16)[:, :, :keys]
        q = torch.randn(1, queries, KV * GROUPS, DIM, dtype=torch.bfloat16).transpose(1, 2)
        k_contiguous, v_contiguous = k.contiguous(), v.contiguous()
        with torch.inference_mode():
            results = {
                "sdpa": microseconds(sdpa, q, k, v),
                "bmm bf16": microseconds(matmul_attention, q, k, v, torch.bfloat16),
                "bmm float32": microseconds(matmul_attention, q, k, v, torch.float32),
                "bmm bf16, contiguous": microseconds(matmul_attention, q, k_contiguous, v_contiguous, torch.bfloat16),
            }
        print(f"{keys} keys, {queries} queries: " + ", ".join(f"{name} {us:.0f} µs" for name, us in results.items()))
