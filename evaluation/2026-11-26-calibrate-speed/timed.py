"""``flyspec calibrate`` with every vLLM submission, the cost fit and the live check timed (printed to stderr).

Usage (repository root): ``.venv/bin/python evaluation/2026-11-26-calibrate-speed/timed.py calibrate ARGS...``;
``NO_CUT=1``: the baselines' drafts are not cut to what their shadows read (the A/B of the cut).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import Counter
from typing import Any

from flyspec.calibration import vllm_engine
from flyspec.cli.main import main
from flyspec.harness import vllm_session

log: list[tuple[str, object, float]] = []


def timed(name: str, function: Any, describe: Any) -> Any:
    def wrapper(self: Any, argument: Any) -> Any:
        started = time.perf_counter()
        result = function(self, argument)
        log.append((name, describe(argument), round(time.perf_counter() - started, 1)))
        return result

    return wrapper


def kinds(requests: list[dict[str, Any]]) -> dict[str, int]:
    """plain / base / cont(inuation) requests in a submission."""
    tail = (request["key"].rsplit("|", 1)[-1] for request in requests)
    return dict(Counter(kind if kind in ("plain", "base") else "cont" for kind in tail))


vllm_session.VllmSession.submit = timed("submit", vllm_session.VllmSession.submit, kinds)
vllm_engine.VllmEngine.live = timed("live", vllm_engine.VllmEngine.live, len)
vllm_engine.VllmEngine.measure_costs = timed("costs", vllm_engine.VllmEngine.measure_costs, len)
if os.environ.get("NO_CUT"):
    initial = vllm_engine.VllmEngine.__init__

    def uncut(self: Any, *args: Any, **kwargs: Any) -> None:
        initial(self, *args, **kwargs)
        self.cut_drafts = False

    vllm_engine.VllmEngine.__init__ = uncut

if __name__ == "__main__":
    start = time.perf_counter()
    with contextlib.suppress(SystemExit):
        main(sys.argv[1:])
    log.append(("total", 0, round(time.perf_counter() - start, 1)))
    for entry in log:
        print(*entry, file=sys.stderr)
