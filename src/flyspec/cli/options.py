"""Command-line options shared by ``generate``, ``bench``, ``eval`` and ``serve``.

Each subcommand lives in its own module and registers itself with ``add_parser(commands)``;
this module holds the option groups they share (the speculation flags: ``speculation.py``).
Errors are printed by ``main.py`` (one line, exit code 2, no traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Iterable
from typing import Any

from flyspec.config import (
    DEFAULT_DEVICE,
    DEFAULT_DTYPE,
    ConfigError,
    SamplingConfig,
    SpeculationConfig,
    check_device,
)
from flyspec.config.names import DEFAULT_MODEL, DTYPE_NAMES, KERNELS


def add_model_options(parser: argparse.ArgumentParser, *, chat: bool = True) -> None:
    """--model (or --target), --draft-model, --device, --dtype, --threads, --kernels, --compile and (optionally)
    --chat/--no-chat."""
    models = parser.add_argument_group("models")
    add_target_option(
        models,
        "the target model (vLLM's and transformers' --model; --target is the same): packaged name, .gguf file, "
        f"HF directory or hub id (default {DEFAULT_MODEL})",
    )
    models.add_argument(
        "--draft-model",
        help="draft model for --drafter draft-model/multilevel; a different tokenizer than the target's is "
        "fine (its draft text is re-tokenized)",
    )
    models.add_argument(
        "--device",
        default=DEFAULT_DEVICE,
        type=_device,
        help=f"where the models run: auto (CUDA when available, else the CPU), cpu, cuda or cuda:N "
        f"(default {DEFAULT_DEVICE}); draft models run on the target's device",
    )
    models.add_argument(
        "--dtype",
        default=DEFAULT_DTYPE,
        choices=sorted(DTYPE_NAMES),
        help="weights/compute dtype; auto = the dtype of the calibration profile that sets the lossy settings "
        "(--profile, or the shipped one), else bfloat16 on CUDA (float16 on GPUs without bf16), on the CPU "
        "bfloat16 where it has native bf16, else float32 ($FLYSPEC_AUTO_DTYPE forces it)",
    )
    models.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    models.add_argument(
        "--kernels",
        default="auto",
        choices=KERNELS,
        help="auto (default): on the CPU in float32 or bfloat16, flyspec's kernels for the cached steps "
        "(oneDNN-prepacked linears, siblings such as query/key/value sharing one, a decode attention; "
        "same math up to rounding) and glibc's malloc set to keep freed activation memory; "
        "stock: transformers' modules as loaded. The in-place KV cache is used "
        "either way, on every device. Plain decoding uses the same kernels (BENCHMARKS.md)",
    )
    models.add_argument(
        "--compile",
        action="store_true",
        help="compile the models' cached-step forward with torch.compile at load (takes minutes; nothing is "
        "compiled during generation); plain decoding uses it too, so speedups stay like for like (BENCHMARKS.md)",
    )
    if chat:
        group = models.add_mutually_exclusive_group()
        group.add_argument(
            "--chat",
            dest="use_chat",
            action="store_true",
            default=None,
            help="apply the chat template (default when the model has one)",
        )
        group.add_argument("--no-chat", dest="use_chat", action="store_false", help="feed the prompt as raw text")


def add_target_option(group: argparse.ArgumentParser | argparse._ArgumentGroup, help_text: str) -> None:
    """``--model`` (``--target`` is the same), into ``args.target``: every command's model."""
    group.add_argument("--model", "--target", dest="target", metavar="MODEL", default=DEFAULT_MODEL, help=help_text)


def add_sampling_options(parser: argparse.ArgumentParser, *, several: bool = False) -> None:
    """--temperature (a comma list with ``several``), --top-p, --top-k and --seeds: the sampling every output of
    ``eval`` / ``calibrate`` is decoded with, plain decoding and each method with the same seed (coupled:
    ``sampling/coupled.py``)."""
    group = parser.add_argument_group("sampling (default greedy)")
    temperature = "comma-separated temperatures, each measured (e.g. 0,0.7,1)" if several else "the temperature"
    group.add_argument(
        "--temperature",
        default="0",
        help=f"{temperature}; 0 = greedy (default). At T > 0 every output is compared with plain sampling's of the "
        "same seed, which a lossless method reproduces token for token",
    )
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus filter at T > 0 (1 = off, default)")
    group.add_argument("--top-k", type=int, default=0, help="top-k filter at T > 0 (0 = off, default)")
    group.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="at T > 0, decode each prompt under seeds 0 .. S-1 (default 1); rates are judged with prompts as "
        "clusters, so more seeds tighten a bound only as far as a prompt's seeds disagree",
    )


def sampling_configs(args: argparse.Namespace) -> list[SamplingConfig]:
    """The sampling configurations of ``--temperature`` (one per listed temperature), ``--top-p`` and ``--top-k``;
    a bad value is a :class:`ConfigError` naming the flag."""
    try:
        temperatures = [float(part) for part in str(args.temperature).split(",") if part.strip()]
    except ValueError as error:
        raise ConfigError(
            f"--temperature must be a number or a comma-separated list (got {args.temperature!r})"
        ) from error
    if not temperatures:
        raise ConfigError("--temperature needs a value; 0 is greedy")
    if len(set(temperatures)) != len(temperatures):
        raise ConfigError(f"--temperature lists a value twice ({args.temperature})")
    if args.seeds < 1:
        raise ConfigError(f"--seeds must be >= 1 (got {args.seeds})")
    return [SamplingConfig(temperature, args.top_k, args.top_p) for temperature in sorted(temperatures)]


def engine_options(args: argparse.Namespace, specs: Iterable[SpeculationConfig] = ()) -> dict[str, Any]:
    """How every model of a command loads (``Resources`` and ``load_model`` keywords): the
    --dtype, --device, --compile and --kernels that :func:`add_model_options` defines.

    A profile brings its dtype: with --dtype auto, the models load in the dtype of the calibration
    profile that decides one of ``specs``' lossy settings (``profile.load_dtype``), said in one line on stderr.
    """
    dtype = args.dtype
    if dtype == DEFAULT_DTYPE:
        from flyspec.profiles import load_dtype  # torch: only when a command runs, never for --help

        choice = load_dtype(specs, args.target, dtype, args.device)
        if choice.note is not None:
            print(f"[profile] {choice.note}", file=sys.stderr)
        dtype = choice.dtype
    return {"dtype": dtype, "device": args.device, "compile": args.compile, "kernels": args.kernels}


def _device(text: str) -> str:
    """``--device``: checked for its form here (argparse reports the error); for a GPU when a model loads."""
    try:
        return check_device(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def quiet_transformers() -> None:
    """Silence the libraries' info logs, deprecation warnings and progress bars (``-v`` keeps them): transformers'
    own, and the tqdm bars it draws directly (dequantizing a GGUF file). tqdm reads ``TQDM_DISABLE`` when it is
    first imported, so this runs before anything imports transformers; a vLLM worker started from here inherits it."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):  # the libraries', not the user's
        warnings.filterwarnings("ignore", category=category)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


ENGINE_NAMES = ("flyspec", "vllm")


def add_engine_options(parser: argparse.ArgumentParser, what: str, *, engine_help: str | None = None) -> None:
    """``--engine`` and how a vLLM engine runs (``flyspec calibrate``, ``flyspec eval``; ``flyspec serve`` with its
    own ``engine_help`` and no ``--wave``)."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--engine",
        choices=ENGINE_NAMES,
        default="flyspec",
        help=engine_help
        or f"flyspec (default): {what} on flyspec's own engine, one prompt at a time; vllm: on vLLM with the "
        "flyspec-vllm plugin (its venv: --vllm-venv), every prompt and setting of a wave batched, the model "
        "loaded only there (here only its tokenizer): what a vLLM deployment runs, on a CPU or a GPU cluster",
    )
    group.add_argument("--vllm-venv", help="the vLLM venv (default: $FLYSPEC_VLLM_VENV, else .venv-vllm)")
    group.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM's tensor_parallel_size (default 1)")
    group.add_argument("--max-model-len", type=int, default=4096, help="vLLM's max_model_len (default 4096)")
    memory = group.add_mutually_exclusive_group()
    memory.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        help="vLLM's KV cache in bytes (default 1 GiB): the same on every machine",
    )
    memory.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="size vLLM's KV cache as this fraction of the device's memory instead (on a GPU cluster)",
    )
    group.add_argument("--max-num-seqs", type=int, help="vLLM's max_num_seqs: the most requests in one batch")
    if engine_help is None:
        group.add_argument(
            "--wave", type=int, default=64, help="--engine vllm: prompts submitted together (vLLM's batch; default 64)"
        )
    group.add_argument(
        "--no-vllm-eager",
        dest="vllm_eager",
        action="store_false",
        help="let vLLM compile its model (slower to start; default: enforce_eager, which starts ~3x faster on a CPU)",
    )


def vllm_options(args: argparse.Namespace) -> Any:
    """The :class:`~flyspec.harness.vllm_worker.VllmOptions` of :func:`add_engine_options`' flags."""
    from flyspec.harness.vllm_worker import VllmOptions

    return VllmOptions(
        venv=args.vllm_venv,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        eager=args.vllm_eager,
    )
