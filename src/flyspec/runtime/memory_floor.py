"""The memory floor of a one-token step: what no engine's batch-1 decode step can go below on this machine.

A one-token step reads every weight of the model once (the input embedding's table only one row) and does little
arithmetic with each, so at batch 1 it is bound by how fast the device streams memory: its floor is the bytes of
those weights divided by the device's read bandwidth. ``flyspec bench`` measures the bandwidth at start-up and reports
t(1) against the floor (BENCHMARKS.md): a step near it has nothing left to gain in the same dtype, in flyspec or in
any other engine, and what remains between two engines there is the machine's drift, not their code.

The bandwidth is what the device streams while summing a buffer larger than any cache (:data:`BUFFER_BYTES`), with the
threads torch uses, best of :data:`ROUNDS`: a read, like a step's weights. It describes the machine at that minute;
a VM's neighbours move it by tens of per cent (83 against 53 GB/s three minutes apart on a 2-core EPYC VM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flyspec.runtime.clock import device_clock

BUFFER_BYTES = 512 << 20  # larger than the last-level cache of any CPU flyspec runs on, small beside a GPU's memory
ROUNDS = 5  # timed reads after one untimed (which also faults the buffer's pages in)


@dataclass(frozen=True)
class MemoryFloor:
    """``weight_bytes`` a one-token step reads, at ``bandwidth`` bytes per second."""

    weight_bytes: int
    bandwidth: float

    @property
    def seconds(self) -> float:
        return self.weight_bytes / self.bandwidth

    def as_dict(self) -> dict[str, float]:
        return {"weight_mb": self.weight_bytes / 1e6, "read_gb_s": self.bandwidth / 1e9, "floor_ms": 1e3 * self.seconds}


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a one-token step of ``model`` reads: every parameter once (a tied one once), but of an input
    embedding table that is not also the output head only the token's row. Taken from the parameters, so before
    flyspec's kernels pack the linears (``loading.load_model`` keeps it on the ``LoadedModel``)."""
    total = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    get_input, get_output = (getattr(model, name, None) for name in ("get_input_embeddings", "get_output_embeddings"))
    table = get_input() if callable(get_input) else None
    head = get_output() if callable(get_output) else None
    weight = getattr(table, "weight", None)
    if isinstance(weight, torch.Tensor) and weight is not getattr(head, "weight", None):
        total -= weight.numel() * weight.element_size() - weight[0].numel() * weight.element_size()
    return total


def read_bandwidth(device: torch.device | str, buffer_bytes: int = BUFFER_BYTES, rounds: int = ROUNDS) -> float:
    """Bytes per second ``device`` reads while summing a float32 buffer of ``buffer_bytes``: the best of ``rounds``."""
    if buffer_bytes < 4 or rounds < 1:
        raise ValueError("a bandwidth measurement needs a buffer of at least one float and one round")
    buffer = torch.ones(buffer_bytes // 4, dtype=torch.float32, device=device)
    buffer.sum()  # untimed: the first read (and, on the CPU, the pages' first touch)
    best = float("inf")
    for _ in range(rounds):
        start = device_clock(device)
        buffer.sum()
        best = min(best, device_clock(device) - start)
    return buffer.numel() * 4 / best


def memory_floor(model: torch.nn.Module, device: torch.device | str, weight_bytes: int | None = None) -> MemoryFloor:
    """``model``'s one-token step floor on ``device``, measured now (``weight_bytes``: counted before packing)."""
    return MemoryFloor(weight_bytes if weight_bytes is not None else step_weight_bytes(model), read_bandwidth(device))
