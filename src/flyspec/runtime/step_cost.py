"""What one target forward costs by the number of tokens it scores: t(n), measured once and cached.

The cost-aware draft length (``decoding/draft_length.py``) verifies the draft length that maximises
expected committed tokens per second, so it needs t(n) for n = 1 .. k + 1. How t(n) grows with n
is a property of the model, dtype, device, thread count, kernels, compile state and machine: on a CPU
without native bf16 a 16-token bf16 forward costs ~7 one-token ones, with it ~1.5, and on a GPU
about 1. It is measured at start-up — a prefill of ``CONTEXT`` tokens, then forwards of each size
in :data:`SIZES` (interleaved over rounds, the first round a warm-up, the median kept) — and
cached in ``step-costs.json`` beside the dequantized models (``$FLYSPEC_CACHE``, default
``~/.cache/flyspec``; ``$FLYSPEC_STEP_COSTS`` names another file), keyed by a fingerprint of
everything above, so the next start on the same machine reads it instead of measuring.

It describes the machine, not any request, so sharing it between a server's requests leaks
nothing. A busy machine measures a noisy table; delete the file (or pass ``remeasure=True``)
to measure again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from flyspec.runtime.cached_model import CachedModel
from flyspec.runtime.clock import device_clock
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.loading import cache_root

log = logging.getLogger(__name__)

SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32, 48, 64)  # tokens per forward, measured up to k + 1
CONTEXT = 128  # cached tokens while measuring (the matmuls dominate; attention over more adds little)
ROUNDS = 4  # the first is a warm-up
CACHE_FILE = "step-costs.json"


@dataclass(frozen=True)
class StepCost:
    """Seconds of one cached target forward of ``n`` tokens, interpolated between measured sizes."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    context: int = CONTEXT

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) != len(self.seconds) or self.sizes[0] != 1:
            raise ValueError("a step cost needs one time per size, starting at 1 token")
        if list(self.sizes) != sorted(set(self.sizes)) or min(self.seconds) <= 0:
            raise ValueError("step cost sizes must increase and every time must be positive")

    def __call__(self, num_tokens: int) -> float:
        """t(num_tokens): linear between measured sizes, the last slope beyond the largest."""
        if num_tokens <= self.sizes[-1] or len(self.sizes) == 1:
            return float(np.interp(num_tokens, self.sizes, self.seconds))
        slope = (self.seconds[-1] - self.seconds[-2]) / (self.sizes[-1] - self.sizes[-2])
        return self.seconds[-1] + max(slope, 0.0) * (num_tokens - self.sizes[-1])

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def relative(self) -> dict[int, float]:
        """t(n) / t(1) at each measured size (what the draft length depends on)."""
        return {size: seconds / self.seconds[0] for size, seconds in zip(self.sizes, self.seconds, strict=True)}

    def to_dict(self) -> dict[str, Any]:
        return {"sizes": list(self.sizes), "seconds": list(self.seconds), "context": self.context}

    @staticmethod
    def from_dict(record: dict[str, Any]) -> StepCost:
        return StepCost(
            tuple(int(s) for s in record["sizes"]), tuple(float(t) for t in record["seconds"]), int(record["context"])
        )


def sizes_up_to(max_tokens: int) -> tuple[int, ...]:
    """The measured sizes: :data:`SIZES` below ``max_tokens``, and ``max_tokens`` itself."""
    return (*(size for size in SIZES if size < max_tokens), max_tokens)


@torch.inference_mode()
def measure(
    model: LoadedModel,
    max_tokens: int,
    rounds: int = ROUNDS,
    context: int | list[int] = CONTEXT,
    sizes: tuple[int, ...] | None = None,
) -> StepCost:
    """Time cached forwards of ``sizes`` tokens (default: :func:`sizes_up_to` ``max_tokens``) after a
    prefill of ``context`` (token ids, or a number of made-up ones), with the model's compiled step
    forward when it has one, as generation runs it. Sizes are interleaved over ``rounds``; the first
    round warms up and the median of the others is kept."""
    sizes = sizes or sizes_up_to(max_tokens)
    vocab = int(getattr(model.model.config, "vocab_size", 0) or 1000)
    if isinstance(context, int):
        context = [(7919 * index + 13) % vocab for index in range(context)]  # any tokens do for timing
    probe = [(7919 * index + 17) % vocab for index in range(max(sizes))]
    cached = CachedModel(model)
    cached.forward(context, logits_to_keep=1)
    prefix = len(context)
    times: dict[int, list[float]] = {size: [] for size in sizes}
    device = cached.device
    for round_index in range(max(rounds, 2)):
        for size in sizes:
            started = device_clock(device)
            cached.forward(probe[:size])
            if round_index > 0:  # the first round warms up (allocations, oneDNN primitives, kernels)
                times[size].append(device_clock(device) - started)
            cached.crop_to(prefix)
    return StepCost(sizes, tuple(statistics.median(times[size]) for size in sizes), prefix)


def fingerprint(model: LoadedModel) -> dict[str, Any]:
    """Everything t(n) depends on; a change in any of it means measuring again."""
    config = model.model.config
    device = model.device
    return {
        "model": model.name,
        "architecture": type(model.model).__name__,
        "shape": [
            getattr(config, name, None)
            for name in (
                "num_hidden_layers",
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "num_key_value_heads",
                "vocab_size",
            )
        ],
        "dtype": str(model.dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cpu": _cpu_model(),
        "threads": torch.get_num_threads(),
        "compiled": model.step_forward is not None,
        "kernels": model.kernels,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def _cpu_model() -> str:
    """The CPU's model name and a digest of its feature flags (the same name can mean other flags in a VM)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    for line in lines:  # the first processor's entries
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = hashlib.sha256(fields.get("flags", "").encode()).hexdigest()[:12]
    return f"{fields.get('model name', platform.machine())} flags:{flags}"


def cache_file() -> Path:
    """``$FLYSPEC_STEP_COSTS``, else ``step-costs.json`` in flyspec's cache directory."""
    explicit = os.environ.get("FLYSPEC_STEP_COSTS")
    return Path(explicit) if explicit else cache_root() / CACHE_FILE


def step_cost(model: LoadedModel, max_tokens: int, remeasure: bool = False) -> StepCost:
    """t(n) for n up to ``max_tokens``: from the cache file when it holds this model's fingerprint
    and sizes that far, else measured now (seconds on a small model) and written back."""
    key_fields = fingerprint(model)
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:20]
    path = cache_file()
    entries = _read(path)
    entry = entries.get(key)
    if not remeasure and isinstance(entry, dict):
        try:
            cost = StepCost.from_dict(entry)
        except (KeyError, TypeError, ValueError):
            cost = None
        if cost is not None and cost.max_tokens >= max_tokens:
            return cost
    started = time.perf_counter()
    cost = measure(model, max_tokens)
    log.info(
        "measured the step cost t(n) of %s up to %d tokens in %.1f s",
        model.name,
        max_tokens,
        time.perf_counter() - started,
    )
    entries[key] = {**cost.to_dict(), "fingerprint": key_fields, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    _write(path, entries)
    return cost


def _read(path: Path) -> dict[str, Any]:
    try:
        entries = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        log.warning("ignoring the unreadable step-cost cache %s (%s); measuring again", path, error)
        return {}
    return entries if isinstance(entries, dict) else {}


def _write(path: Path, entries: dict[str, Any]) -> None:
    """Atomically (a reader never sees half a file); a cache that cannot be written is only logged."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as handle:
            json.dump(entries, handle, indent=1)
        os.replace(handle.name, path)
    except OSError as error:
        log.warning("could not write the step-cost cache %s (%s); it will be measured again next time", path, error)
