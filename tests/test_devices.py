"""``--device`` / ``device=``: parsing, resolution, the ``auto`` dtype per device, and the clear errors.

These run on any machine: CUDA's presence is faked with ``monkeypatch`` where a test is about the
decision, not the GPU. Tests that run on every available device are parametrised over ``DEVICES``
(``conftest.py``) in the test files of what they check.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import on_device, on_devices
from flyspec.api import build_decoder, generate
from flyspec.cli.app import build_parser, main
from flyspec.config import (
    DEFAULT_DEVICE,
    ConfigError,
    DecodeConfig,
    LayerSkipConfig,
    SamplingConfig,
    SpeculationConfig,
    check_device,
)
from flyspec.config.names import DISTRIBUTION_DRAFTERS, DISTRIBUTION_VERIFIERS, VERIFIERS
from flyspec.decoding.plain import PlainDecoder
from flyspec.decoding.speculative import SpeculativeDecoder
from flyspec.drafters.ngram import NgramDrafter
from flyspec.resources import Resources
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.loading import default_dtype, load_model, resolve_device, resolve_dtype
from flyspec.runtime.target import Target
from flyspec.sampling import acceptance
from flyspec.sampling.coupled import Draws
from flyspec.sampling.sampler import make_generator, same_device
from flyspec.types import Draft
from flyspec.verifiers.registry import make_verifier


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


@on_devices
def test_a_generator_made_from_the_device_name_is_accepted(tiny_target: LoadedModel, device: str) -> None:
    """``make_generator(seed, "cuda")`` reports ``cuda`` with no index; the target is on ``cuda:0``: one device."""
    decode = DecodeConfig(max_new_tokens=4, sampling=SamplingConfig(temperature=0.8))
    decoder = build_decoder(on_device(tiny_target, device), SpeculationConfig(drafter="ngram"), decode)
    assert len(decoder.generate([1, 2, 3], generator=make_generator(0, device)).token_ids) == 4


def test_cuda_without_an_index_is_the_current_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert same_device("cuda", torch.device("cuda", 1)) and same_device(torch.device("cuda:1"), "cuda")
    assert not same_device("cuda", "cuda:0") and not same_device("cpu", "cuda:1") and same_device("cpu", "cpu")


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


# --- every tensor of a step on the target's device -------------------------------------------------
#
# Without a GPU a forgotten ``device=`` is invisible: the tensor lands on the CPU like the model.
# With the default device set to ``meta`` it lands on ``meta`` instead, where it has no data, so
# the first comparison with a real (CPU) tensor or the first ``.tolist()`` fails. Every tensor the
# step needs must therefore be made where the target (or the draft model) is, as on a GPU.

STEP_DRAFTERS = {
    "ngram": {},
    "ngram-cache": {"drafter": "ngram-cache"},
    "multilevel": {"drafter": "multilevel"},
    "layer-skip": {"drafter": "layer-skip", "layer_skip": LayerSkipConfig(skip_layers=(1,))},
}


@contextmanager
def default_device_meta() -> Iterator[None]:
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def run_on_meta_default(decoder: SpeculativeDecoder | PlainDecoder, prompt_ids: list[int]) -> list[int]:
    generator = make_generator(0, decoder.device)
    with default_device_meta():
        return decoder.generate(prompt_ids, generator=generator).token_ids


@pytest.mark.parametrize(
    ("drafter", "verifier"),
    [  # fsd and cascade read a draft model's distribution: only with one (refused otherwise: test_relaxed_rules.py)
        (drafter, verifier)
        for drafter in STEP_DRAFTERS
        for verifier in VERIFIERS
        if verifier not in DISTRIBUTION_VERIFIERS or drafter in DISTRIBUTION_DRAFTERS
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_step_tensor_is_made_off_the_target_device(
    tiny_target: LoadedModel, tiny_draft: LoadedModel, drafter: str, verifier: str, temperature: float
) -> None:
    fields = {**STEP_DRAFTERS[drafter], "verifier": verifier, "num_draft_tokens": 8}
    if drafter == "multilevel":
        fields["draft_model"] = tiny_draft.name
    spec = SpeculationConfig(**fields)
    decode = DecodeConfig(max_new_tokens=10, sampling=SamplingConfig(temperature=temperature))

    def fresh() -> SpeculativeDecoder:  # own resources: the n-gram cache learns from every generation
        return build_decoder(tiny_target, spec, decode, resources=Resources(models=(tiny_target, tiny_draft)))

    prompt_ids = tiny_target.encode_prompt("The capital of France is Paris. The capital of", use_chat=False)
    expected = fresh().generate(prompt_ids, generator=make_generator(0)).token_ids
    assert run_on_meta_default(fresh(), prompt_ids) == expected  # same tokens, and nothing landed on meta


def test_plain_decoding_makes_no_tensor_off_the_target_device(tiny_target: LoadedModel) -> None:
    decoder = PlainDecoder(tiny_target, DecodeConfig(max_new_tokens=6, sampling=SamplingConfig(temperature=1.0)))
    assert len(run_on_meta_default(decoder, [5, 6, 7])) == 6


@dataclass
class DeviceBlindDrafter(NgramDrafter):
    """An n-gram drafter that forgets ``device=``: the bug the meta default device must catch."""

    def propose(self, token_ids, num_draft_tokens, sampling, generator) -> Draft:  # type: ignore[no-untyped-def]
        draft = super().propose(token_ids, num_draft_tokens, sampling, generator)
        return Draft(torch.tensor(draft.tokens.tolist(), dtype=torch.long), sources=draft.sources)


def test_the_meta_check_catches_a_tensor_made_without_device(tiny_target: LoadedModel) -> None:
    decoder = SpeculativeDecoder(
        tiny_target, DeviceBlindDrafter(), make_verifier("exact"), DecodeConfig(max_new_tokens=8)
    )
    prompt_ids = tiny_target.encode_prompt("The capital of France is Paris. The capital of", use_chat=False)
    decoder.generate(prompt_ids)  # fine where everything is on the CPU anyway
    with pytest.raises((NotImplementedError, RuntimeError)):
        run_on_meta_default(decoder, prompt_ids)


# --- host syncs: one transfer per step for the lossless rules ---------------------------------------

HOST_CALLS = {"tolist", "item", "__int__", "__bool__", "__float__", "__index__", "cpu", "numpy", "nonzero"}


class HostCalls(TorchFunctionMode):
    """Counts the tensor calls that copy to the host (each one a device sync on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "__name__", "") in HOST_CALLS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("verifier", "temperature", "most"),
    [
        ("exact", 0.0, 1),
        ("exact", 1.0, 1),
        ("rejection", 0.0, 1),
        ("rejection", 1.0, 2),  # the residual sample is drawn once the rejected position is known
        ("fly", 0.0, 2),  # + the trust guards' one transfer
        ("margin", 0.0, 2),
        ("typical", 1.0, 3),  # + the loose accepts' explanation (at T > 0 argmax drafts the samples differ from)
        ("bild", 0.0, 2),
        ("bild", 1.0, 3),  # + the residual draw at a rejection the rule does not keep
    ],
)
def test_verifiers_copy_to_the_host_once_per_step_not_per_token(
    verifier: str, temperature: float, most: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # as on a GPU: the lossy rules compute their measures on every row rather than find the rows first
    monkeypatch.setattr(acceptance, "SELECT_ROWS_ON", frozenset())
    torch.manual_seed(0)
    target_logits = torch.randn(9, 50)  # [k + 1, vocab]
    draft_tokens = target_logits.argmax(-1)[:8].clone()
    draft_tokens[5] = (draft_tokens[5] + 1) % 50  # five accepted, a rejection, two more after it
    rule = make_verifier(verifier, SpeculationConfig(num_draft_tokens=8))
    draws = Draws.seeded(0)  # its key drawn here, once per generation, not per step
    with HostCalls() as counted:
        rule.verify(Draft(draft_tokens), target_logits, SamplingConfig(temperature=temperature), draws)
    assert len(counted.calls) <= most, counted.calls


def test_scoring_a_draft_copies_nothing_to_the_host(tiny_target: LoadedModel) -> None:
    target = Target(tiny_target)
    target.start([5, 6, 7, 8])
    with HostCalls() as counted:
        logits = target.score(8, torch.tensor([9, 10, 11]))
    assert logits.shape[0] == 4
    assert counted.calls == []


@on_devices
def test_generate_runs_on_every_available_device(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, device: str
) -> None:
    argv = ["generate", "Once upon a time", "--target", str(tiny_model_dir), "--device", device, "--json"]
    options = ["--dtype", "float32", "--no-chat", "--max-new-tokens", "8", "--temperature", "0.8", "--seed", "3"]
    assert main([*argv, *options]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["device"].startswith(device) and record["num_new_tokens"] == 8
