"""OpenAI's ``prediction`` through vLLM 0.33's OpenAI request, response and serving code (``vllm_prediction_cases.py``;
0.32's: ``vllm_engine/test_prediction_server.py``)."""

from __future__ import annotations

import importlib.util
import json
import sys
from types import SimpleNamespace

import pytest

from vllm_prediction_cases import check_prediction_field


def test_vllm_033s_openai_server_takes_a_prediction_and_reports_its_usage(monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("orjson") is None:
        # vLLM 0.33's serving modules import orjson (a dependency 0.32's venv lacks) for a response class these checks
        # never build: a stand-in lets vLLM's own serving code import; nothing of vLLM is replaced
        stand_in = SimpleNamespace(dumps=lambda value, option=0: json.dumps(value).encode(), loads=json.loads,
                                   OPT_NON_STR_KEYS=1, OPT_SERIALIZE_NUMPY=2)  # fmt: skip
        monkeypatch.setitem(sys.modules, "orjson", stand_in)
    check_prediction_field(monkeypatch)
