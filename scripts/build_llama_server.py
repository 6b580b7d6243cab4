"""Build llama.cpp's ``llama-server`` from the packaged ``llama-cpp-python`` source (its vendored llama.cpp).

``python scripts/build_llama_server.py SDIST SHA256 OUT`` checks the sdist's sha256, extracts its
``vendor/llama.cpp``, configures it with CMake (Release, this CPU's instructions: ``GGML_NATIVE``; no web UI
download, no OpenSSL, no tests or examples) and builds the ``llama-server`` target into ``OUT/bin/llama-server``
with every core. ``make llama-server`` fetches the sdist through pip's configured index (``scripts/index_download.py``)
and calls this; ``flyspec bench --online --methods llama-server,llama-server-ngram`` starts the result. Tens of
minutes on 2 cores.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
           "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF")  # fmt: skip


def build(sdist: Path, sha256: str, out: Path) -> Path:
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != sha256:
        raise SystemExit(f"{sdist}: sha256 {digest}, not the pinned {sha256}")
    with tempfile.TemporaryDirectory(prefix="llama-server-") as scratch:
        with tarfile.open(sdist) as archive:
            archive.extractall(scratch, filter="data")
        (source,) = Path(scratch).glob("*/vendor/llama.cpp")
        work = Path(scratch) / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(["cmake", "-S", str(source), "-B", str(work), *generator, *OPTIONS], check=True)
        jobs = str(len(os.sched_getaffinity(0)))
        subprocess.run(["cmake", "--build", str(work), "--target", "llama-server", "-j", jobs], check=True)
        (out / "bin").mkdir(parents=True, exist_ok=True)
        binary = out / "bin" / "llama-server"
        shutil.copy2(work / "bin" / "llama-server", binary)
    return binary


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: build_llama_server.py SDIST SHA256 OUT", file=sys.stderr)
        return 2
    print(build(Path(argv[0]), argv[1], Path(argv[2])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
