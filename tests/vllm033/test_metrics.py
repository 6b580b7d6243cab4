"""The plugin's counters on vLLM 0.33's ``/metrics`` (issue 72), read through 0.33's own route.

The plugin counts in the process that verifies (the engine core, a worker); vLLM's API server serves ``/metrics``
from another. vLLM 0.33's route (``entrypoints/serve/instrumentator/metrics.attach_router``) reads every process's
counters only where ``PROMETHEUS_MULTIPROC_DIR`` is set (``v1/metrics/prometheus.get_prometheus_registry``), which
``flyspec serve --engine vllm`` sets before vLLM starts. Here the counting process is a subprocess that counts as the
plugin does at runner start and in a step, and the route is 0.33's, on a FastAPI app of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fastapi import FastAPI
from fastapi.testclient import TestClient

from conftest import PLUGIN

COUNT = "from flyspec_vllm import metrics; metrics.register(); metrics.add(loose_accepts=7919, vetoed=13)"


def count_in_another_process(directory: Path | None) -> None:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLUGIN), os.environ.get("PYTHONPATH", "")])}
    environment.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if directory is not None:
        environment["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    subprocess.run([sys.executable, "-c", COUNT], env=environment, check=True, timeout=120)


def scrape(monkeypatch, directory: Path | None) -> str:
    from vllm.entrypoints.serve.instrumentator.metrics import attach_router

    if directory is None:
        monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    else:
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
    app = FastAPI()
    attach_router(app)
    return TestClient(app).get("/metrics").text


def test_counters_of_the_verifying_process_reach_vllm_033s_metrics_route(tmp_path: Path, monkeypatch) -> None:
    count_in_another_process(tmp_path)
    text = scrape(monkeypatch, tmp_path)
    assert "flyspec_vllm_loose_accepts_total 7919.0" in text
    assert "flyspec_vllm_vetoed_total 13.0" in text
    assert "flyspec_vllm_faults_total 0.0" in text  # created at 0 by register(): there before anything counts


def test_without_the_directory_the_route_shows_none_of_them(monkeypatch) -> None:
    """Why the launcher sets it: without it the API server's registry is its own process's only."""
    count_in_another_process(None)
    assert "7919.0" not in scrape(monkeypatch, None)
