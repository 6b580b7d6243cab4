"""What every harness run records about itself, so a result can be traced to how it was made."""

from __future__ import annotations

import datetime
import os
import platform
from typing import Any

from flyspec.runtime.loaded_model import LoadedModel, ServedModel
from flyspec.runtime.loading import cpu_name, device_name


def run_metadata(target: LoadedModel | ServedModel, command: str | None) -> dict[str, Any]:
    """Command line, UTC date and time, machine (the GPU first when the target runs on one), library
    versions, target model, dtype, device and kernels."""
    import torch
    import transformers

    from flyspec.config.names import VERSION

    if not isinstance(target, LoadedModel):  # --engine vllm: the model runs in vLLM's process, not here
        engine = {"device": "vLLM's (--engine vllm)", "kernels": "vLLM's"}
        target_device = None
    else:
        engine = {"device": str(target.device), "kernels": "flyspec" if target.kernels else "stock"}
        target_device = target.device
    gpu = f"{device_name(target_device)}; " if target_device is not None and target_device.type == "cuda" else ""
    return {
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{gpu}{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
        f"{platform.system()}",
        "versions": f"flyspec {VERSION}, torch {torch.__version__}, transformers {transformers.__version__}",
        "target": target.name,
        "dtype": str(target.dtype).removeprefix("torch."),
        **engine,  # kernels: installed (runtime/kernels.py), not just asked for
    }
