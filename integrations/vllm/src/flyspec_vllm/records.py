"""What the plugin recorded of trusted requests (``flyspec_record``): their loose accepts and their shadow rules'
divergences, kept in the process that verifies (a vLLM worker: one per tensor-parallel rank) until the caller takes
them (``flyspec calibrate``/``eval``'s worker asks every worker process: ``gather.py``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

MAX_RECORDS = 100_000  # a caller that never takes its records must not grow the process without bound


@dataclass
class RequestRecord:
    """One recorded request: its committed loose accepts (output index, tokens, the rule's evidence), the guards'
    refusals, and for each shadow rule (flat index) the output index where its step began when it left the path."""

    loose_accepts: list[dict[str, Any]] = field(default_factory=list)
    vetoes: dict[str, int] = field(default_factory=dict)
    diverged: dict[int, int] = field(default_factory=dict)
    cut: int = 0  # draft tokens the proposer withheld (reference.py)
    departed: int | None = None  # the output index where the output left its reference (reference.py)
    judged: set[int] = field(default_factory=set)  # the steps (their output index) the rule or the shadows judged

    def to_dict(self) -> dict[str, Any]:
        return {
            "loose_accepts": list(self.loose_accepts),
            "vetoes": dict(self.vetoes),
            "diverged": {str(index): start for index, start in sorted(self.diverged.items())},
            "cut": self.cut,
            "departed": self.departed,
            "steps": len(self.judged),  # the caller checks it against the steps vLLM ran (vllm_session.py)
        }


_lock = threading.Lock()
_records: dict[str, RequestRecord] = {}


def _record(key: str) -> RequestRecord:
    record = _records.get(key)
    if record is None:
        if len(_records) >= MAX_RECORDS:
            _records.pop(next(iter(_records)))
        record = _records[key] = RequestRecord()
    return record


def diverged(key: str) -> set[int]:
    with _lock:
        record = _records.get(key)
        return set(record.diverged) if record else set()


def add_divergences(key: str, indices: list[int], start: int) -> None:
    with _lock:
        record = _record(key)
        record.judged.add(start)
        for index in indices:
            record.diverged.setdefault(index, start)


def add_cut(key: str, tokens: int) -> None:
    with _lock:
        _record(key).cut += tokens


def add_departure(key: str, index: int) -> None:
    with _lock:
        record = _record(key)
        if record.departed is None:
            record.departed = index


def add_judgement(key: str, judgement: Any, start: int, draft: list[int]) -> None:
    """A step's loose accepts (output indices from ``start``); a loose accept past the end of the output (the
    request stopped inside the step) is dropped by the caller, who knows the output's length."""
    with _lock:
        record = _record(key)
        record.judged.add(start)
        for position, evidence, target in zip(
            judgement.loose, judgement.evidence, judgement.target_tokens, strict=True
        ):
            record.loose_accepts.append(
                {"index": start + position, "draft_token": draft[position], "target_token": target,
                 "evidence": evidence}
            )  # fmt: skip
        for reason in judgement.vetoes:
            record.vetoes[reason] = record.vetoes.get(reason, 0) + 1


def take(key: str) -> dict[str, Any]:
    """The record of ``key`` (empty if nothing was recorded), forgotten here."""
    with _lock:
        record = _records.pop(key, None)
    return (record or RequestRecord()).to_dict()


def clear() -> None:
    with _lock:
        _records.clear()
