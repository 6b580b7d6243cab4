"""A server process run as a child in its own session (``flyspec serve --engine vllm``: vLLM's OpenAI server).

It forwards the child's log, waits until ``/health`` answers, turns a child that exits before that into a
:class:`ConfigError` carrying the child's last exception, and stops it once, gracefully, on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import IO, Any

from flyspec.config import ConfigError

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 60.0


class Supervisor:
    """vLLM's server as a child in its own session: a signal to this process stops it once, gracefully."""

    def __init__(self, command: list[str], environment: dict[str, str], url: str, prefix: str) -> None:
        self.command, self.environment, self.url, self.prefix = command, environment, url, prefix
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.stopping = threading.Event()

    def run(self) -> int:
        started = time.monotonic()
        process = subprocess.Popen(
            self.command,
            env={**os.environ, **self.environment},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,  # Ctrl-C reaches this process only: it forwards one SIGTERM
        )
        self.process = process
        assert process.stdout is not None
        forward = threading.Thread(target=self._forward, args=(process.stdout,), daemon=True)
        forward.start()
        previous = {number: signal.signal(number, self._stop) for number in (signal.SIGINT, signal.SIGTERM)}
        try:
            if not self._wait_ready(started):
                code = process.wait()
                forward.join(timeout=5)
                if self.stopping.is_set():
                    return 0
                raise ConfigError(f"vLLM's server exited ({code}) before it answered: {self._reason()}")
            logger.info("%sready in %.0f s at %s/v1", self.prefix, time.monotonic() - started, self.url)
            code = process.wait()
            forward.join(timeout=5)
            if self.stopping.is_set():
                logger.info("%sstopped", self.prefix)
                return 0
            logger.error("%svLLM's server exited (%d): %s", self.prefix, code, self._reason())
            return 1
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
            if process.poll() is None:
                self._terminate()

    def _stop(self, number: int, frame: Any) -> None:
        if self.stopping.is_set():
            return
        self.stopping.set()
        threading.Thread(target=self._terminate, daemon=True).start()

    def _terminate(self) -> None:
        process = self.process
        if process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _wait_ready(self, started: float) -> bool:
        while time.monotonic() - started < START_TIMEOUT_S:
            if self.process.poll() is not None or self.stopping.is_set():
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self._terminate()
        raise ConfigError(f"vLLM's server did not answer within {START_TIMEOUT_S:.0f} s: {self._reason()}")

    def _forward(self, stream: IO[str]) -> None:
        for line in stream:
            self.tail.append(line.rstrip())
            sys.stderr.write(line)
        sys.stderr.flush()

    def _reason(self) -> str:
        """The last exception vLLM logged (with the indented line that details it, as pydantic's errors have),
        else its last line; at most 500 characters."""
        lines = [line.rstrip() for line in self.tail if line.strip()]
        for index in range(len(lines) - 1, -1, -1):
            head = lines[index].split(":", 1)[0]
            if head.endswith(("Error", "Exception")) and not lines[index].startswith(" "):
                detail = lines[index + 1].strip() if index + 1 < len(lines) and lines[index + 1].startswith(" ") else ""
                return f"{lines[index].strip()} {detail}".strip()[:500]
        return lines[-1].strip()[:500] if lines else "no output"
