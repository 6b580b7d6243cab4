"""OpenAI's ``prediction`` through vLLM 0.33's OpenAI request, response and serving code (``vllm_prediction_cases.py``;
0.32's: ``vllm_engine/test_prediction_server.py``). 0.33's serving modules need orjson: ``conftest.py`` gives 0.32's
venv a stand-in."""

from __future__ import annotations

import pytest

from vllm_prediction_cases import check_prediction_field


def test_vllm_033s_openai_server_takes_a_prediction_and_reports_its_usage(monkeypatch: pytest.MonkeyPatch) -> None:
    check_prediction_field(monkeypatch)
