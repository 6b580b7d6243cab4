"""Run untrusted generated code in a limited subprocess (HumanEval).

Each program runs in a fresh ``python -I -B`` process (isolated mode: no user site-packages, no
``PYTHON*`` variables, the script's directory not on ``sys.path``), in a new temporary directory
that is also its ``HOME`` and ``TMPDIR``, with a scrubbed environment (``PATH``, ``LANG`` only),
no stdin, its own session (so the whole process group can be killed), and resource limits set
inside the child before the program runs:

* ``RLIMIT_AS``: address space (a memory bomb gets ``MemoryError`` or is killed);
* ``RLIMIT_CPU``: CPU seconds (an infinite loop gets ``SIGXCPU``/``SIGKILL``);
* ``RLIMIT_FSIZE``: largest file it may write; ``RLIMIT_CORE`` = 0: no core dumps.

A wall-clock timeout (for programs that sleep or wait) kills the process group. Every outcome,
timeouts and crashes included, is a :class:`SandboxResult`; nothing raises into the evaluator.
This contains accidents (loops, bombs, stray files), not a determined attacker: there is no
network or filesystem namespace isolation.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Sets the limits in the child, then runs the program; argv: program, address space, cpu s, file size.
_LAUNCHER = """
import resource, runpy, sys
program, memory, cpu, fsize = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
sys.argv = [program]
runpy.run_path(program, run_name="__main__")
"""
_OUTPUT_LIMIT = 4000  # characters of stderr kept for the report


@dataclass(frozen=True)
class SandboxLimits:
    """Per-program limits. Defaults suit HumanEval tests (each runs in well under a second)."""

    timeout_s: float = 10.0
    memory_bytes: int = 1 << 30
    cpu_s: int = 10
    file_size_bytes: int = 1 << 20


@dataclass(frozen=True)
class SandboxResult:
    """``status``: passed | failed (an exception or non-zero exit) | timeout | memory | cpu-limit | crashed."""

    status: str
    returncode: int | None
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_program(source: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``source`` as ``__main__`` under the limits; passed means it exited with status 0."""
    limits = limits or SandboxLimits()
    with tempfile.TemporaryDirectory(prefix="flyspec-sandbox-") as directory:
        program = Path(directory) / "program.py"
        program.write_text(source, encoding="utf-8")
        command = [
            sys.executable,
            "-I",
            "-B",
            "-c",
            _LAUNCHER,
            str(program),
            str(limits.memory_bytes),
            str(limits.cpu_s),
            str(limits.file_size_bytes),
        ]
        env = {"PATH": os.defpath, "LANG": "C.UTF-8", "HOME": directory, "TMPDIR": directory}
        try:
            process = subprocess.Popen(
                command,
                cwd=directory,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as error:
            return SandboxResult("crashed", None, f"could not start the sandbox: {error}")
        return _wait(process, limits.timeout_s)


def _wait(process: subprocess.Popen[bytes], timeout_s: float) -> SandboxResult:
    try:
        _, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        process.communicate()
        return SandboxResult("timeout", None, f"killed after {timeout_s:g} s wall time")
    finally:
        _kill_group(process)  # children it may have left behind
    text = stderr.decode("utf-8", errors="replace")[-_OUTPUT_LIMIT:]
    return SandboxResult(_classify(process.returncode, text), process.returncode, text.strip())


def _classify(returncode: int, stderr: str) -> str:
    if returncode == 0:
        return "passed"
    if "MemoryError" in stderr:
        return "memory"
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL) and "Traceback" not in stderr:
        return "cpu-limit"
    if returncode < 0:
        return "crashed"
    return "failed"


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
