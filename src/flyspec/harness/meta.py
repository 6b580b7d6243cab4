"""What every harness run records about itself, so a result can be traced to how it was made."""

from __future__ import annotations

import datetime
import os
import platform
from typing import Any

from flyspec.models import LoadedModel, cpu_name


def run_metadata(target: LoadedModel, command: str | None) -> dict[str, Any]:
    """Command line, UTC date and time, machine, library versions, target model and dtype."""
    import torch
    import transformers

    from flyspec import __version__

    return {
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
        f"{platform.system()}",
        "versions": f"flyspec {__version__}, torch {torch.__version__}, transformers {transformers.__version__}",
        "target": target.name,
        "dtype": str(target.dtype).removeprefix("torch."),
    }
