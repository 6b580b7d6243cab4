"""Calibration: the fastest lossy operating point inside a user's quality budget (``flyspec calibrate``).

``calibrate(target, CalibrationConfig(...))`` runs a drafter's lossless baseline and a grid of lossy
settings on calibration prompts by replay (``replay.py``), judges every point against the budget
(``budget.py``), projects its speed from measured costs (``projection.py``), chooses one or none
(``frontier.py``) and writes a profile (``flyspec.profiles.profile``), a report and a plot (``report.py``).

The names are imported on first use (PEP 562): ``flyspec --help`` imports this package's command
module without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flyspec.calibration.api import CalibrationConfig, CalibrationResult, calibrate
    from flyspec.calibration.budget import Budget

_EXPORTS = {
    "CalibrationConfig": "flyspec.calibration.api",
    "CalibrationResult": "flyspec.calibration.api",
    "calibrate": "flyspec.calibration.api",
    "Budget": "flyspec.calibration.budget",
}
__all__ = ["Budget", "CalibrationConfig", "CalibrationResult", "calibrate"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
