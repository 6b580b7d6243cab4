"""Issue 52: the plugin's records, counters and per-call draft caps through vLLM's worker extension, without vLLM
(the real engine, in one process and in worker processes with two tensor-parallel ranks:
``tests/vllm_engine/test_worker_processes.py``)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations" / "vllm" / "src"))

from flyspec_vllm import patch, records, worker  # noqa: E402
from flyspec_vllm.gather import EXTENSION, GatherError, Ranks, WorkerExtension  # noqa: E402
from flyspec_vllm.proposer import NgramProposer  # noqa: E402

from flyspec.config import ConfigError, GuardConfig  # noqa: E402
from flyspec.harness.vllm_session import check_record  # noqa: E402
from test_vllm_plugin import proposer_config  # noqa: E402


class Rank(WorkerExtension):
    """A worker of one rank as vLLM builds it: its own class with the extension mixed in."""

    def __init__(self, rank: int, installed: bool = True, records_seen: dict[str, Any] | None = None) -> None:
        self.rank, self.installed, self.records_seen = rank, installed, records_seen

    def flyspec_status(self) -> dict[str, Any]:
        return {**super().flyspec_status(), "installed": self.installed}

    def flyspec_take(self, keys: list[str]) -> dict[str, Any]:
        answer = super().flyspec_take(keys)
        return answer if self.records_seen is None else {**answer, "records": self.records_seen}


class Engine:
    """``LLM.collective_rpc`` by name, as vLLM's executors run it: each worker's method, in rank order."""

    def __init__(self, *workers: Rank) -> None:
        self.workers = workers
        self.calls: list[str] = []
        shutdown = types.SimpleNamespace(shutdown=lambda: self.calls.append("shutdown"))
        self.llm_engine = types.SimpleNamespace(engine_core=shutdown)  # LLM.llm_engine.engine_core.shutdown()

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = ()) -> list[Any]:
        self.calls.append(method)
        return [getattr(worker, method)(*args) for worker in self.workers]


def test_the_records_and_counters_come_from_the_workers() -> None:
    records.clear()
    records.add_cut("k", 3)
    ranks = Ranks(Engine(Rank(0)))
    assert (ranks.size, ranks.installed) == (1, [True])
    taken, counters = ranks.take(["k", "never"])
    assert taken["k"]["cut"] == 3 and taken["never"]["steps"] == 0
    assert set(counters) >= {"loose_accepts", "steps"} and ranks.metrics() == counters
    assert ranks.take(["k"])[0]["k"]["cut"] == 0  # taken once: forgotten in the worker


def test_ranks_that_disagree_or_cannot_be_reached_are_an_error() -> None:
    other = {"k": {"loose_accepts": [{"index": 1}], "steps": 1}}
    ranks = Ranks(Engine(Rank(0), Rank(1, records_seen=other)))
    with pytest.raises(GatherError, match=r"rank\(s\) \[1\] recorded otherwise than rank 0"):
        ranks.take(["k"])

    class Old(Engine):  # a vLLM started without the extension: vLLM's own message
        def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = ()) -> list[Any]:
            raise NotImplementedError(f"Method {method!r} is not implemented.")

    with pytest.raises(GatherError, match=f"not implemented.*worker_extension_cls='{EXTENSION}'"):
        Ranks(Old())
    with pytest.raises(GatherError, match=r"answered as ranks \[0, 0\]"):
        Ranks(Engine(Rank(0), Rank(0)))


def test_a_calls_draft_cap_reaches_every_workers_proposer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLYSPEC_VLLM_SCHEDULE", raising=False)
    proposer = NgramProposer(proposer_config())
    engine = Engine(Rank(0), Rank(1))
    ranks = Ranks(engine)
    with ranks.schedule(worker.call_schedule({"num_draft_tokens": 0})):
        assert proposer.draft_limit(1) == 0
    assert proposer.draft_limit(1) == 4  # the configured k after the call
    with ranks.schedule(worker.call_schedule({"schedule": [[1, 1, 2], [2, 9, 1]]})):
        assert (proposer.draft_limit(1), proposer.draft_limit(5)) == (2, 1)
    assert engine.calls.count("flyspec_schedule") == 4  # set and reset, per call (each reaching both ranks)
    with ranks.schedule(worker.call_schedule({})):
        pass
    assert engine.calls.count("flyspec_schedule") == 4  # no cap: nothing sent


def test_the_worker_refuses_to_start_where_a_rank_has_no_plugin(monkeypatch, capsys) -> None:
    """calibrate's and eval's engine (``vllm-flyspec-rules``) is refused in one line when the plugin's rule is not in
    every worker process; ``VllmWorker`` turns the line into a ConfigError (exit 2)."""
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.0-test"))
    monkeypatch.setattr(worker, "_set_plugin_environment", lambda method: None)
    engine = Engine(Rank(0), Rank(1, installed=False))
    monkeypatch.setattr(worker, "start_engine", lambda args: engine)
    assert worker.main(["--model", "m", "--method", "vllm-flyspec-rules"]) == 1
    error = json.loads(capsys.readouterr().out)["error"]
    assert error.startswith("GatherError: the flyspec-vllm plugin did not install in rank(s) [1]")
    monkeypatch.setattr(sys, "stdin", [])  # a bench method runs without the plugin: reported, not refused
    assert worker.main(["--model", "m", "--method", "vllm-plain"]) == 0
    ready = json.loads(capsys.readouterr().out)
    assert (ready["plugin"], ready["ranks"]) == ("not installed", 2)
    assert engine.calls[-1] == "shutdown"  # its input ended: the engine is stopped before the worker exits
    # the program's own run freezes what its imports made before the engine starts; an in-process caller's heap is
    # left alone (both runs above)
    frozen: list[list[str]] = []
    monkeypatch.setattr(worker.gc, "freeze", lambda: frozen.append(list(engine.calls)))
    monkeypatch.setattr(worker, "start_engine", lambda args: engine.calls.append("start") or engine)
    assert worker.main(["--model", "m", "--method", "vllm-plain"]) == 0 and frozen == []
    engine.calls.clear()
    assert worker.main(["--model", "m", "--method", "vllm-plain"], freeze_imports=True) == 0
    assert frozen == [[]] and engine.calls[0] == "start"  # frozen before the engine started
    monkeypatch.setattr(patch, "STATE", patch.PluginState(switch="request", guard=GuardConfig()))
    assert Ranks(Engine(WorkerExtension())).installed == [True]  # the real status reads the plugin's state


def test_a_record_missing_steps_is_refused() -> None:
    """A recorded request judged at fewer steps than verified a draft (a rule refused or disabled in the engine,
    records read where the rule does not run) is refused: never an incomplete calibration."""
    request = {"extra_args": {"flyspec_record": "k", "flyspec_shadow": [[{"verifier": "typical"}]]}}
    check_record(request, {"record": {"steps": 5}}, 5)
    with pytest.raises(ConfigError, match="judged 0 of the 5 verification steps of request 'k'"):
        check_record(request, {"record": {"steps": 0}}, 5)
    check_record({"extra_args": {"flyspec_record": "k"}}, {"record": None}, 5)  # no rule, no shadow: nothing judged
