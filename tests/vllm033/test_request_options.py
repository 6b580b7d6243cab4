"""Request options through vLLM 0.33's OpenAI request model (``vllm_request_cases.py``; 0.32's: ``vllm_engine``)."""

from __future__ import annotations

import pytest

from vllm_request_cases import check_request_options


def test_vllm_033s_openai_request_carries_flyspecs_options_and_400s(monkeypatch: pytest.MonkeyPatch) -> None:
    check_request_options(monkeypatch)
