"""``--device`` / ``device=``: parsing, resolution, the ``auto`` dtype per device, and the clear errors.

These run on any machine: CUDA's presence is faked with ``monkeypatch`` where a test is about the
decision, not the GPU. Tests that run on every available device are parametrised over ``DEVICES``
(``conftest.py``) in the test files of what they check.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flyspec.api import build_decoder, generate
from flyspec.cli import build_parser, main
from flyspec.config import DEFAULT_DEVICE, ConfigError, DecodeConfig, check_device
from flyspec.models import LoadedModel, default_dtype, load_model, resolve_device, resolve_dtype
from flyspec.resources import Resources
from flyspec.sampling import make_generator


def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def fake_cuda(monkeypatch: pytest.MonkeyPatch, count: int = 1, bf16: bool = True) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)


@pytest.mark.parametrize(
    ("given", "expected"), [("auto", "auto"), ("CPU", "cpu"), ("cuda", "cuda"), ("cuda:1", "cuda:1")]
)
def test_device_names_are_checked_for_their_form(given: str, expected: str) -> None:
    assert check_device(given) == expected


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:x", "cuda:-1", "mps0", ""])
def test_unknown_device_names_are_config_errors(bad: str) -> None:
    with pytest.raises(ConfigError, match="use auto, cpu, cuda or cuda:N"):
        check_device(bad)


def test_auto_is_the_cpu_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    no_cuda(monkeypatch)
    assert resolve_device("auto") == torch.device("cpu")


def test_auto_is_cuda_when_available(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch)
    assert resolve_device("auto") == torch.device("cuda")


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_is_a_config_error(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    no_cuda(monkeypatch)
    with pytest.raises(ConfigError, match="use --device cpu"):
        resolve_device(device)


def test_a_gpu_index_past_the_visible_ones_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, count=2)
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ConfigError, match=r"only 2 CUDA GPU\(s\)"):
        resolve_device("cuda:2")


@pytest.mark.parametrize(("bf16", "expected"), [(True, torch.bfloat16), (False, torch.float16)])
def test_auto_dtype_on_cuda_is_bf16_else_fp16(
    monkeypatch: pytest.MonkeyPatch, bf16: bool, expected: torch.dtype
) -> None:
    fake_cuda(monkeypatch, bf16=bf16)
    assert default_dtype(torch.device("cuda")) == expected
    assert resolve_dtype("auto", torch.device("cuda:0")) == expected
    assert resolve_dtype("float32", torch.device("cuda")) == torch.float32  # an explicit dtype wins


def cpu_rule() -> torch.dtype:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return torch.bfloat16 if ("avx512_bf16" in flags or "amx_bf16" in flags) else torch.float32


def test_a_gpu_in_the_machine_does_not_change_the_cpu_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old rule picked bf16 whenever CUDA was present, though the model stayed on the CPU."""
    fake_cuda(monkeypatch, bf16=True)
    assert default_dtype(torch.device("cpu")) == cpu_rule()
    assert default_dtype() == cpu_rule()


def test_load_model_puts_the_model_on_the_device(tiny_model_dir: Path) -> None:
    loaded = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    assert loaded.device == torch.device("cpu")
    assert {parameter.device for parameter in loaded.model.parameters()} == {torch.device("cpu")}


def test_load_model_refuses_cuda_before_reading_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    no_cuda(monkeypatch)
    with pytest.raises(ConfigError, match="'cuda' asked for"):
        load_model("/no/such/model", device="cuda")  # the device error comes first, not "not found"


def test_api_device_reaches_the_loader(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> None:
    no_cuda(monkeypatch)
    with pytest.raises(ConfigError, match="'cuda:0' asked for"):
        generate("Hello", str(tiny_model_dir), device="cuda:0", max_new_tokens=2)
    result = generate("Hello", str(tiny_model_dir), device="cpu", dtype="float32", max_new_tokens=2, use_chat=False)
    assert result.num_new_tokens == 2


def test_draft_models_load_on_the_resources_device(tiny_model_dir: Path) -> None:
    resources = Resources("float32", device="cpu")
    assert resources.isolated().device == "cpu"
    assert resources.model(str(tiny_model_dir)).device == torch.device("cpu")


def test_a_generator_on_another_device_is_refused(tiny_target: LoadedModel) -> None:
    decoder = build_decoder(tiny_target, decode=DecodeConfig(max_new_tokens=2))
    elsewhere = SimpleNamespace(device=torch.device("cuda", 0))  # what a CUDA generator reports
    with pytest.raises(ConfigError, match="make_generator"):
        decoder.stream([1, 2, 3], generator=elsewhere)  # type: ignore[arg-type]
    assert make_generator(0, decoder.device).device == decoder.device


def test_cli_cuda_without_a_gpu_exits_2_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    no_cuda(monkeypatch)
    with pytest.raises(SystemExit) as raised:
        main(["generate", "Hello", "--target", str(tiny_model_dir), "--device", "cuda"])
    assert raised.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flyspec: error: device 'cuda' asked for") and "\n" not in err


def test_cli_rejects_a_malformed_device(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        main(["generate", "Hello", "--device", "gpu"])
    assert raised.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "unknown device 'gpu'" in err and "\n" not in err


@pytest.mark.parametrize("command", ["generate", "bench", "eval", "serve"])
def test_every_command_has_the_device_option(command: str) -> None:
    parser = build_parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    device = next(action for action in commands.choices[command]._actions if "--device" in action.option_strings)
    assert device.default == DEFAULT_DEVICE == "auto"
    assert device.type("cuda:1") == "cuda:1"
