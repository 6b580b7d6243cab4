"""The plugin's counters, in-process and as Prometheus counters (``flyspec_vllm_*``).

They live in the process that verifies (vLLM's engine core / worker), created at 0 when its model runner starts
(:func:`register`). ``prometheus_client``'s default registry is the one vLLM's ``/metrics`` serves where they share a
process; across processes vLLM's ``/metrics`` reads them from a ``PROMETHEUS_MULTIPROC_DIR`` set before vLLM starts
(``flyspec serve --engine vllm`` makes a fresh one). The periodic log line and :func:`snapshot` work everywhere.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import asdict, dataclass

from flyspec_vllm.rule import BatchOutcome

logger = logging.getLogger(__name__)
LOG_EVERY_STEPS = 500


@dataclass
class Counters:
    steps: int = 0  # verification steps that had at least one FLy request
    fly_requests: int = 0  # request-steps verified with FLy
    candidates: int = 0  # mismatches FLy would keep before the guards, up to the first strict rejection
    vetoed: int = 0  # request-steps whose first candidate a guard refused
    loose_accepts: int = 0  # draft tokens kept loosely
    native_loose: int = 0  # vLLM's own FLy: the loose accepts it made, before the guards
    native_vetoed: int = 0  # vLLM's own FLy: of those, the ones the guards refused (verified strictly instead)
    verified_steps: int = 0  # steps whose drafts went through the plugin's verification hook
    faults: int = 0  # steps verified exactly because a plugin hook raised (fail closed)
    bypassed_steps: int = 0  # steps whose drafts vLLM verified without the plugin's hook (then: exact from there)
    sampled_undrafted: int = 0  # sampled request-steps decoded without drafts: the engine failed sampling_check
    greedy_undrafted: int = 0  # greedy request-steps that lost their drafts to a sampled request in the same step


HELP = {
    "loose_accepts": "draft tokens FLy kept although the target's argmax differs",
    "candidates": "mismatches FLy would keep before flyspec's trust guards",
    "vetoed": "request-steps whose FLy candidate a trust guard refused",
    "fly_requests": "request-steps verified with FLy",
    "native_loose": "loose accepts vLLM's own FLy made, before flyspec's trust guards",
    "native_vetoed": "loose accepts of vLLM's own FLy that flyspec's trust guards refused",
    "faults": "steps verified exactly (lossless) because a flyspec-vllm hook raised",
    "bypassed_steps": "steps vLLM verified without flyspec-vllm's hook (loose accepts refused from then on)",
    "sampled_undrafted": "request-steps at temperature > 0 sampled without drafts: the engine's speculative sampling "
    "failed flyspec-vllm's start-up check",
    "greedy_undrafted": "greedy request-steps sampled without drafts because a request at temperature > 0 shared "
    "the step on an engine that failed the check",
}

_lock = threading.Lock()
_counters = Counters()
_prometheus: dict[str, object] = {}


def _prometheus_counters() -> dict[str, object]:
    if not _prometheus:
        try:
            from prometheus_client import Counter  # optional at import time
        except ImportError:
            return _prometheus
        for name, help_text in HELP.items():
            _prometheus[name] = Counter(f"flyspec_vllm_{name}", help_text)
    return _prometheus


def register() -> None:
    """Create the Prometheus counters now (at 0), so that a scrape shows them before anything is counted: the model
    runner calls it at start-up. Never raises (:func:`add` with nothing to add)."""
    add()


def add(**increments: int) -> None:
    """Add to the named counters (in-process and Prometheus). Never raises: a counter that cannot count loses the
    count, not the step it counts (one warning)."""
    try:
        with _lock:
            for name, value in increments.items():
                setattr(_counters, name, getattr(_counters, name) + value)
        prometheus = _prometheus_counters()
        for name, value in increments.items():
            if name in prometheus and value:
                prometheus[name].inc(value)  # type: ignore[attr-defined]
    except Exception as error:  # noqa: BLE001 - counting is not worth a step
        _lost(error)


def record(outcome: BatchOutcome) -> None:
    """A batch's FLy outcome into the counters (and every ``LOG_EVERY_STEPS`` steps one log line). Never raises."""
    if not outcome.fly_requests:
        return
    add(
        fly_requests=outcome.fly_requests,
        candidates=outcome.candidates,
        vetoed=outcome.vetoed,
        loose_accepts=len(outcome.loose_positions),
    )
    try:
        with _lock:
            _counters.steps += 1
            if _counters.steps % LOG_EVERY_STEPS == 0:
                logger.info("flyspec-vllm: %s", asdict(_counters))
    except Exception as error:  # noqa: BLE001 - counting is not worth a step
        _lost(error)


_warned: list[bool] = []


def _lost(error: BaseException) -> None:
    if _warned:
        return
    _warned.append(True)
    with contextlib.suppress(Exception):  # nothing left to report with
        logger.warning("flyspec-vllm: a counter could not count (%s: %s); the steps go on, their counts may be short",
                       type(error).__name__, error)  # fmt: skip


def snapshot() -> dict[str, int]:
    with _lock:
        return asdict(_counters)


def reset() -> None:
    global _counters
    with _lock:
        _counters = Counters()
