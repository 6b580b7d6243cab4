"""Peer: llama.cpp's own OpenAI-compatible server (``llama-server``), in ``flyspec bench --concurrency ... --online``.

``llama-server`` serves the packaged GGUF file itself (its own quantization: the bytes it reads per token are the
file's tensors, not the dequantized float weights flyspec and vLLM read), greedy, with as many slots as the largest
concurrency measured and the bench's thread count. Two methods:

* ``llama-server``: plain decoding;
* ``llama-server-ngram``: llama.cpp's n-gram speculation from the context (``--spec-type ngram-simple``, with
  llama.cpp's own n-gram and draft sizes, as its user would start it), its counterpart of flyspec's default.

The binary is ``--llama-server PATH``, else ``$FLYSPEC_LLAMA_SERVER``, else what ``make llama-server`` builds from the
packaged ``llama-cpp-python`` source (its vendored llama.cpp, pinned by sha256: ``scripts/build_llama_server.py``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flyspec.config import ConfigError

PLAIN = "llama-server"
NGRAM = "llama-server-ngram"
METHODS = (PLAIN, NGRAM)
VARIABLE = "FLYSPEC_LLAMA_SERVER"
BUILT = Path("build") / "llama-server" / "bin" / "llama-server"  # make llama-server (from the repository root)
CONTEXT = 4096  # tokens per slot, as the vLLM servers' --max-model-len


def binary(given: str | None = None) -> Path:
    """The ``llama-server`` executable: ``given``, else ``$FLYSPEC_LLAMA_SERVER``, else ``make llama-server``'s."""
    path = Path(given or os.environ.get(VARIABLE) or BUILT).expanduser()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ConfigError(
            f"llama-server: no executable at {path}; build it with `make llama-server` (from the packaged "
            f"llama-cpp-python source), or name one with --llama-server PATH or ${VARIABLE}"
        )
    return path


def command(method: str, executable: Path, gguf: Path, port: int, threads: int, parallel: int) -> list[str]:
    """The command line that starts ``method``'s server on ``port``."""
    if method not in METHODS:
        raise ConfigError(f"{method} is not a llama-server method ({', '.join(METHODS)})")
    line = [str(executable), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--alias", "bench", "--threads", str(threads), "--parallel", str(parallel),
            "--ctx-size", str(CONTEXT * parallel), "--no-webui", "--log-disable"]  # fmt: skip
    if method == NGRAM:
        line += ["--spec-type", "ngram-simple"]
    return line


class LlamaPeer:
    """llama.cpp's server for the llama-server methods: its executable, the target's GGUF file, threads and slots."""

    def __init__(self, executable: Path, gguf: Path, threads: int, parallel: int) -> None:
        self.executable, self.gguf, self.threads, self.parallel = executable, gguf, threads, parallel

    @classmethod
    def of(cls, args: Any, names: Sequence[str], concurrency: int) -> LlamaPeer | None:
        """The peer when ``names`` hold a llama-server method; a :class:`ConfigError` when it cannot run."""
        if not any(name in METHODS for name in names):
            return None
        from flyspec.runtime.loading import find_gguf

        gguf = find_gguf(args.target)
        if gguf is None:
            raise ConfigError(
                f"llama-server serves a GGUF file: --model {args.target} is neither one nor a packaged model"
            )
        threads = args.threads or len(os.sched_getaffinity(0))
        return cls(binary(getattr(args, "llama_server", None)), gguf, threads, concurrency)

    def command(self, method: str, port: int) -> list[str]:
        return command(method, self.executable, self.gguf, port, self.threads, self.parallel)


def weights_read(names: Sequence[str], target: Any, model: str, llama: LlamaPeer | None) -> dict[str, int]:
    """Bytes of weights each server reads per token: llama.cpp its GGUF file's tensors (metadata and vocabulary left
    out), the others the parameters in the bench's dtype, counted from the GGUF file behind the model (none: {})
    (``runtime/memory_floor.step_weight_bytes`` counts a loaded model's; the online bench loads none here)."""
    import torch

    from flyspec.runtime.loading import find_gguf

    gguf = llama.gguf if llama is not None else find_gguf(model)
    if gguf is None:
        return {}
    from gguf import GGUFReader

    tensors = GGUFReader(gguf).tensors  # read once
    quantized = sum(int(tensor.n_bytes) for tensor in tensors)
    size = sum(int(tensor.n_elements) for tensor in tensors) * getattr(torch, target.dtype_name).itemsize
    return {name: quantized if name in METHODS else size for name in names}
