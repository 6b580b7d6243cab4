"""The plugin's records and counters, gathered from every process that verifies (vLLM's worker extension).

The plugin's rule runs where vLLM's model runner samples: in a worker, which is the caller's own process only
with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and one device. With the engine core in its own process (vLLM's
default) or with tensor parallelism (a worker process per rank), what the rule recorded (``records.py``) and
counted (``metrics.py``) lives there, and the caller's memory holds nothing of it. So flyspec's worker starts
vLLM with ``worker_extension_cls=EXTENSION`` (vLLM mixes :class:`WorkerExtension` into its worker class, in every
rank) and asks every rank through ``LLM.collective_rpc``, which reaches the workers wherever they run.

With tensor parallelism every rank samples the same batch from the same gathered logits, so every rank runs the
rule and records the same: :class:`Ranks` compares the ranks' answers and returns rank 0's. Ranks that disagree or
that cannot be reached are a :class:`GatherError`, and so, for flyspec's worker, is a rank without the plugin:
never an empty record.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

EXTENSION = "flyspec_vllm.gather.WorkerExtension"


class GatherError(RuntimeError):
    """The records cannot be gathered from the engine's workers (the message says why, in one line)."""


class WorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``): what ``collective_rpc`` calls by name in each rank.

    Names start with ``flyspec_``: vLLM refuses an extension whose attributes its worker class already has."""

    def flyspec_status(self) -> dict[str, Any]:
        """This rank, its process and whether the plugin's rule is installed and enabled here."""
        from flyspec_vllm import patch

        state = patch.STATE
        return {"rank": int(getattr(self, "rank", 0)), "pid": os.getpid(),
                "installed": state is not None and state.enabled}  # fmt: skip

    def flyspec_take(self, keys: list[str]) -> dict[str, Any]:
        """The records of ``keys`` (each forgotten here) and this process's counters."""
        from flyspec_vllm import metrics, records

        return {"records": {key: records.take(key) for key in keys}, "metrics": metrics.snapshot()}

    def flyspec_metrics(self) -> dict[str, int]:
        from flyspec_vllm import metrics

        return metrics.snapshot()

    def flyspec_schedule(self, entries: list[list[int]] | None) -> None:
        """Every proposer of this process follows this batch schedule from now on (None: the configured one)."""
        from flyspec_vllm import proposer
        from flyspec_vllm._flyspec import BatchSchedule

        proposer.override(None if entries is None else BatchSchedule.from_entries(entries))


class Ranks:
    """An engine's workers, through ``collective_rpc``: every rank must answer at construction (``installed``: where
    the plugin's rule is, by rank), then each is asked for records, counters and per-call schedules."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        statuses = sorted(self._answers("flyspec_status"), key=lambda status: status["rank"])
        if [status["rank"] for status in statuses] != list(range(len(statuses))):
            raise GatherError(f"the workers answered as ranks {[status['rank'] for status in statuses]}")
        self.size = len(statuses)
        self.pids = [status["pid"] for status in statuses]
        self.installed = [bool(status["installed"]) for status in statuses]

    def _answers(self, method: str, *args: Any) -> list[Any]:
        try:
            answers = list(self.llm.collective_rpc(method, args=args))
        except Exception as error:  # noqa: BLE001 - whatever vLLM raises, the caller gets one line
            message = " ".join(str(error).split()) or type(error).__name__
            raise GatherError(
                f"cannot reach the engine's workers through collective_rpc({method!r}): {message} (this vLLM needs "
                f"worker_extension_cls={EXTENSION!r})"
            ) from error
        if not answers:
            raise GatherError(f"collective_rpc({method!r}) reached no worker")
        return answers

    def _agreed(self, method: str, *args: Any) -> Any:
        """Rank 0's answer, after checking that every rank answered the same."""
        first, *others = self._answers(method, *args)
        disagreeing = [rank for rank, answer in enumerate(others, 1) if answer != first]
        if disagreeing:
            raise GatherError(
                f"{method}: rank(s) {disagreeing} recorded otherwise than rank 0 (the ranks no longer sample the "
                "same batch)"
            )
        return first

    def take(self, keys: list[str]) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
        """The records of ``keys`` and the counters, from every rank (rank 0's, checked equal on the others)."""
        answer = self._agreed("flyspec_take", list(keys))
        return answer["records"], answer["metrics"]

    def metrics(self) -> dict[str, int]:
        return dict(self._agreed("flyspec_metrics"))

    @contextlib.contextmanager
    def schedule(self, entries: list[list[int]] | None) -> Iterator[None]:
        """Within the block every rank's proposer follows ``entries`` (None: nothing changes)."""
        if entries is None:
            yield
            return
        self._answers("flyspec_schedule", [list(entry) for entry in entries])
        try:
            yield
        finally:
            self._answers("flyspec_schedule", None)
