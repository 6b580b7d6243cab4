"""Fail closed, like an interlock: a guard that cannot run costs loose accepts, never the engine it guards.

Two failures, one answer (vLLM's exact verification, lossless):

* **Fault** — a plugin hook raises inside a step (a bug, a request the guards cannot read, a vLLM object of an
  unexpected shape). The hook catches it, that step's drafts are verified exactly (vLLM's own FLy switched off for
  the call where it runs), one error line names the hook, the error and the step's requests, and the
  ``flyspec_vllm_faults`` counter counts it. The engine keeps serving; the next step tries again.
* **Bypass** — vLLM verified a step's drafts and the plugin's verification hook did not run (a model runner or
  sampler the start-up checks did not foresee). Nothing the plugin wraps is on the path, so the plugin turns vLLM's
  own FLy off on that sampler (exact from then on), stops its own rules, and says so in one error line; the
  ``flyspec_vllm_bypassed_steps`` counter counts such steps. Never a line that says the guards veto while they do not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from flyspec_vllm import metrics

logger = logging.getLogger(__name__)
MAX_LOGGED_FAULTS = 20  # a fault that repeats every step is counted, not logged a thousand times a second
_logged = {"faults": 0, "bypass": 0}


def fault(
    hook: str,
    error: BaseException,
    request_ids: Iterable[str] | Callable[[], Iterable[str]],
    outcome: str = "verified exactly, lossless",
) -> None:
    """A hook raised during a step: count it and log one line saying what became of the step's drafts (``outcome``;
    the caller makes it so: exact verification, except where the caller says otherwise). Never raises: counting and
    logging cannot turn a handled fault into a crash."""
    try:
        metrics.add(faults=1)
        if _logged["faults"] >= MAX_LOGGED_FAULTS:
            return
        _logged["faults"] += 1
        last = _logged["faults"] == MAX_LOGGED_FAULTS
        logger.error(
            "flyspec-vllm: %s raised %s: %s; the step's drafts (requests %s) were %s%s",
            hook,
            type(error).__name__,
            " ".join(str(error).split())[:300],
            ", ".join(_ids(request_ids)) or "-",
            outcome,
            " (further faults are counted in flyspec_vllm_faults, not logged)" if last else "",
        )
    except Exception:  # noqa: BLE001 - the step goes on as the caller decided; only the report is lost
        return


def _ids(request_ids: Iterable[str] | Callable[[], Iterable[str]]) -> list[str]:
    try:
        return [str(req_id) for req_id in (request_ids() if callable(request_ids) else request_ids)]
    except Exception:  # noqa: BLE001 - the ids are for the log line; the runner may be what failed
        return ["(unknown)"]


def bypassed(runner_name: str, sampler: Any, exact: Callable[[Any], bool]) -> None:
    """vLLM verified drafts without the plugin's hook: vLLM's own FLy off on ``sampler`` (``exact(sampler)``, False
    where it cannot be switched off) and one error line. Never raises."""
    switched = False
    try:
        switched = exact(sampler)
    except Exception:  # noqa: BLE001 - reported below
        switched = False
    try:
        metrics.add(bypassed_steps=1)
        if _logged["bypass"]:
            return
        _logged["bypass"] += 1
        logger.error(
            "flyspec-vllm: the %s verified drafts without flyspec's hook (sampler %s): flyspec's rules and guards are "
            "not on its path; %s. Run the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0) or report this vLLM version",
            runner_name,
            type(sampler).__name__,
            "vLLM's own FLy is switched off on it, every step is verified exactly from now on"
            if switched
            else "its own loose acceptance, if any, could not be switched off and runs WITHOUT flyspec's guards",
        )
    except Exception:  # noqa: BLE001 - the caller turned loose acceptance off already; only the report is lost
        return


def warning(message: str, *args: Any) -> None:
    """One warning line (``flyspec-vllm: `` and ``message % args``) from a handler that must not raise. Never raises."""
    try:
        logger.warning("flyspec-vllm: " + message, *args)
    except Exception:  # noqa: BLE001 - nothing left to report with
        return


def reset_logging() -> None:
    """For tests: log the next fault and bypass again."""
    _logged.update(faults=0, bypass=0)
