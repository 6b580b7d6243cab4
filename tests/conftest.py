"""Shared fixtures: tiny random Llama models with a small byte-level BPE tokenizer, built offline.

Device-dependent tests run on every device in ``DEVICES``: the CPU always, CUDA when
``torch.cuda.is_available()``. Parametrise them with ``@on_devices`` and put models there with
``on_device(loaded, device)``; the same suite then passes on CPU in CI and on a GPU machine.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

# Before transformers/huggingface_hub are imported: they read these once, at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# measured step costs go to a fresh file, never the user's (subprocesses inherit it)
os.environ["FLYSPEC_STEP_COSTS"] = os.path.join(tempfile.mkdtemp(prefix="flyspec-test-"), "step-costs.json")

import pytest
import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from flyspec.runtime.loaded_model import LoadedModel
from pinning import order_heavy_first, pin_xdist_worker

pin_xdist_worker()  # under pytest-xdist, this worker on its own core(s): tests/pinning.py


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order_heavy_first(items)  # under pytest-xdist, the ``heavy`` tests first in the workers' shares: tests/pinning.py


def pytest_collection_finish(session: pytest.Session) -> None:
    """What the imports made (torch, transformers, the test modules) is frozen, as vLLM's ``freeze_gc_heap`` does
    after start-up: the cyclic collector stops walking it at every full collection (~1/3 of its time); objects the
    tests make are collected as before. Not where Triton is loaded (the vLLM venv): its bindings would report the
    frozen objects as leaks at exit."""
    if "triton" not in sys.modules:
        gc.collect()
        gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    if "triton" not in sys.modules:
        gc.freeze()  # the process is ending: its exit need not sweep the heap (~1-3 s of a worker's)


# What ``--dtype auto`` means differs between machines (bfloat16 where the CPU computes it natively, else float32).
# Tests whose outcome depends on it take the ``auto_dtype`` fixture and run under both, forced through
# $FLYSPEC_AUTO_DTYPE, so a machine of either class runs what the other would.
AUTO_DTYPES = ("float32", "bfloat16")
DEVICES = ("cpu", *(("cuda",) if torch.cuda.is_available() else ()))
on_devices = pytest.mark.parametrize("device", DEVICES)
_MOVED: dict[tuple[int, str], LoadedModel] = {}


def on_device(loaded: LoadedModel, device: str) -> LoadedModel:
    """``loaded`` on ``device`` (itself on the CPU); a copy moved there once per session, under the same name."""
    if torch.device(device) == loaded.device:
        return loaded
    key = (id(loaded), device)
    if key not in _MOVED:
        config = loaded.model.config
        copy = type(loaded.model)(config).to(loaded.dtype).eval()
        copy.load_state_dict(loaded.model.state_dict())
        _MOVED[key] = LoadedModel(model=copy.to(device), tokenizer=loaded.tokenizer, name=loaded.name)
    return _MOVED[key]


CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Speculative decoding drafts tokens cheaply and verifies them in one forward pass.",
    "Once upon a time there was a small model that liked to repeat itself again and again.",
] * 4
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def make_tokenizer(chat: bool = True) -> PreTrainedTokenizerFast:
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        CORPUS, vocab_size=300, min_frequency=1, special_tokens=["<s>", "</s>"], show_progress=False
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>")
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_model(
    tokenizer: PreTrainedTokenizerFast, seed: int, *, layers: int = 2, hidden: int = 32, name: str = "tiny"
) -> LoadedModel:
    """A random float32 Llama with the tokenizer's vocabulary. Same seed → same weights."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    # Larger logits than the default init, so greedy decoding has clear (non-tied) argmaxes.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return LoadedModel(model=model, tokenizer=tokenizer, name=f"{name}-seed{seed}")


def make_tiny_gemma3(
    tokenizer: PreTrainedTokenizerFast, layer_types: list[str], seed: int = 0, window: int = 8
) -> LoadedModel:
    """A random float32 Gemma-3 text model with sliding-window layers (``window``) where ``layer_types`` says."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=window,
        layer_types=list(layer_types),
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = Gemma3ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return LoadedModel(model=model, tokenizer=tokenizer, name=f"tiny-gemma3-seed{seed}")


def noisy_copy(loaded: LoadedModel, scale: float, seed: int) -> LoadedModel:
    """The same architecture and tokenizer with perturbed weights: a draft that is often right."""
    torch.manual_seed(seed)
    copy = LlamaForCausalLM(loaded.model.config).to(torch.float32).eval()
    copy.load_state_dict(loaded.model.state_dict())
    with torch.no_grad():
        for parameter in copy.parameters():
            parameter.add_(scale * parameter.std() * torch.randn_like(parameter))
    return LoadedModel(model=copy, tokenizer=loaded.tokenizer, name=f"{loaded.name}-noisy{scale}")


@pytest.fixture(autouse=True)
def flyspec_log_level() -> Iterator[None]:
    """Put the ``flyspec`` logger's level back after each test: a command run in-process sets it (``--log-level``)."""
    logger = logging.getLogger("flyspec")
    level = logger.level
    yield
    logger.setLevel(level)


@pytest.fixture(params=AUTO_DTYPES)
def auto_dtype(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """What ``auto`` resolves to during the test: each of ``AUTO_DTYPES`` in turn (subprocesses inherit it)."""
    monkeypatch.setenv("FLYSPEC_AUTO_DTYPE", request.param)
    return request.param


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_target(tokenizer: PreTrainedTokenizerFast) -> LoadedModel:
    return make_tiny_model(tokenizer, seed=0, name="tiny-target")


@pytest.fixture(scope="session")
def tiny_draft(tiny_target: LoadedModel) -> LoadedModel:
    return noisy_copy(tiny_target, scale=0.3, seed=1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_target: LoadedModel) -> Path:
    """The tiny target saved as a Hugging Face model directory (for CLI and loader tests)."""
    directory = tmp_path_factory.mktemp("tiny-model")
    tiny_target.model.save_pretrained(directory)
    tiny_target.tokenizer.save_pretrained(directory)
    return directory
