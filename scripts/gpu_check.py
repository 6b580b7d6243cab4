"""The prepared GPU check: one command on a bare, offline GPU machine, done in under 8 minutes.

    make gpu-check                                     # on the GPU machine: results into $OUT (or gpu-check-out/)
    make gpu-wheels                                    # beforehand, where there is a network: gpu-wheels/
    python scripts/gpu_check.py --smoke --out DIR      # any machine: every stage small, on the CPU without a GPU

The machine needs only Python 3.12, torch (CUDA), transformers, pytest, hypothesis, scipy and numpy; flyspec runs
from ``src/`` and whatever else it needs travels as wheels in ``gpu-wheels/`` (``requirements-gpu-check.txt``),
installed offline into ``$OUT/site`` (nothing is installed into the machine's Python). No stage touches the network
(``HF_HUB_OFFLINE=1``). Each stage runs in its own process with its own time limit, so a failure or a hang costs
that stage only:

1. ``environment``: Python, torch, CUDA and the GPU, transformers, the packages the check imports.
2. ``tests``: the device-parametrised tests (a ``cuda`` case beside each ``cpu`` one where a GPU is visible:
   ``tests/conftest.py``'s ``DEVICES``) and the sync budgets (``tests/test_syncs.py``), as JUnit counts.
3. ``cost``: t(n) for n = 1..64 on a random-weight model of Llama-3.1-8B's shape in bfloat16, and flyspec's and
   transformers' decoders on a few prompts (``scripts/gpu_bench.py``, its own results.json and report.md).
4. ``syncs``: host-device syncs per decode step on the device, by flyspec's counter (``runtime/syncs.py``,
   the budgets of ``tests/test_syncs.py``) and by CUDA's own (``torch.cuda.set_sync_debug_mode``).
5. ``end-to-end``: ``flyspec generate --compare`` and exact and FLy decoders on a small random-weight model
   (``scripts/gpu_check_stages.py``).

Without a GPU the cost stage is skipped (``--smoke`` runs it on a tiny config), the others run on the CPU, and the
results say so. Results: ``gpu-check.json`` and ``gpu-check.md`` in ``--out``, written after every stage.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
STAGES = ("environment", "tests", "cost", "syncs", "end-to-end")
# seconds per stage on the GPU machine: together under 8 minutes with the start-up and the wheels' install
# (measured on H100 hosts, 2026-11-27: environment 8-12 s, tests 52-67, cost 122 with a 4-token warm-up and 148
# with one full warm pass per engine, syncs 14-20, end-to-end 46-53; the whole check 243 and 281 s). The cost stage
# now warms each engine until two passes agree (gpu_bench.WARM_UP, at most 45 s each): up to ~90 s more.
LIMITS = {"environment": 30, "tests": 150, "cost": 290, "syncs": 50, "end-to-end": 70}
SMOKE_LIMITS = {"environment": 30, "tests": 120, "cost": 120, "syncs": 60, "end-to-end": 60}
TOTAL_LIMIT_S = 480
CPU_SLACK = 5  # without a GPU the stages run on the CPU, and slower
WHEELS = REPO / "gpu-wheels"
# what the check imports that a bare machine may lack (besides torch, transformers, pytest, hypothesis, scipy, numpy)
NEEDED = ("torch", "transformers", "tokenizers", "safetensors", "pytest", "hypothesis", "scipy", "numpy")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out", help="results folder ($OUT)")
    parser.add_argument("--smoke", action="store_true", help="every stage small: seconds on a CPU (the suite's test)")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of: {', '.join(STAGES)}")
    parser.add_argument("--wheels", type=Path, default=WHEELS, help="wheels to install offline first (gpu-wheels/)")
    parser.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)  # one stage, in a child process
    args = parser.parse_args(argv)
    unknown = [stage for stage in args.stages.split(",") if stage not in STAGES]
    if unknown:
        print(f"gpu_check: error: unknown stage(s) {', '.join(unknown)}; known: {', '.join(STAGES)}", file=sys.stderr)
        sys.exit(2)
    return args


def offline_environment(site: Path | None) -> dict[str, str]:
    """The children's environment: no network, flyspec and the tests from the tree, the carried wheels' folder."""
    paths = [str(REPO / "src"), str(REPO / "tests"), *([str(site)] if site else []), os.environ.get("PYTHONPATH", "")]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path for path in paths if path),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def install_wheels(wheels: Path, out: Path) -> dict[str, Any]:
    """``pip install --no-index --no-deps --target out/site`` of every wheel in ``wheels`` (none: nothing to do)."""
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        return {"site": None, "wheels": [], "note": f"no wheels in {wheels}: the machine's own packages only"}
    site = out / "site"
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target", str(site)]
    done = subprocess.run([*command, *map(str, found)], capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        return {"site": None, "wheels": [path.name for path in found], "error": done.stderr.strip()[-500:]}
    return {"site": str(site), "wheels": [path.name for path in found]}


def environment() -> dict[str, Any]:
    """What the machine holds: versions, the GPU, and which of the needed packages import (and from where)."""
    import importlib

    import torch

    packages: dict[str, str] = {}
    for name in NEEDED:
        try:
            module = importlib.import_module(name)
            packages[name] = f"{getattr(module, '__version__', '?')} ({Path(module.__file__ or '').parent})"
        except ImportError as error:
            packages[name] = f"missing: {error}"
    cuda = torch.cuda.is_available()
    gpu = None
    if cuda:
        properties = torch.cuda.get_device_properties(0)
        gpu = {"name": properties.name, "memory_gib": round(properties.total_memory / 2**30, 1),
               "capability": list(torch.cuda.get_device_capability(0)), "count": torch.cuda.device_count(),
               "bf16": torch.cuda.is_bf16_supported()}  # fmt: skip
    missing = [name for name, where in packages.items() if where.startswith("missing")]
    device = f"{gpu['name']} ({gpu['memory_gib']} GiB)" if gpu else "no CUDA device"
    return {
        "ok": not missing,
        "summary": f"Python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{packages['transformers'].split()[0]}, {device}" + (f"; missing: {', '.join(missing)}" if missing else ""),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cuda_available": cuda,
        "gpu": gpu,
        "cpu_cores": os.cpu_count(),
        "packages": packages,
        "offline": os.environ.get("HF_HUB_OFFLINE") == "1",
        **({"error": f"missing packages: {', '.join(missing)}"} if missing else {}),
    }


def run_stage(stage: str, args: argparse.Namespace, env: dict[str, str], limit: float) -> dict[str, Any]:
    """One stage in its own process; its result from ``stage-NAME.json`` (written by the child)."""
    out = Path(args.out)
    result_file = out / f"stage-{stage}.json"
    result_file.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--stage", stage, "--out", str(out)]
    started = time.monotonic()
    log = out / f"stage-{stage}.log"
    with log.open("w") as handle:  # its own process group: a stage past its limit is killed with what it started
        process = subprocess.Popen([*command, *(["--smoke"] if args.smoke else [])], stdout=handle,
                                   stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)  # fmt: skip
        try:
            returncode: int | None = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = None
    seconds = round(time.monotonic() - started, 1)
    result = json.loads(result_file.read_text()) if result_file.is_file() else {}
    if returncode is None:
        result.update(status="timed out", error=f"past its {limit:.0f} s limit")
    elif "status" not in result:
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
        result.update(status="failed", error=f"exit {returncode}: {tail}")
    return {**result, "seconds": seconds, "log": log.name}


def child(stage: str, args: argparse.Namespace) -> int:
    """Run one stage here; write its result (``status``: passed / failed / skipped) to ``stage-NAME.json``."""
    sys.path[:0] = [str(REPO / "scripts")]
    import gpu_check_stages as stages

    out = Path(args.out)
    if stage == "environment":
        result = environment()
    else:
        result = {"tests": stages.tests, "cost": stages.cost, "syncs": stages.syncs,
                  "end-to-end": stages.end_to_end}[stage](out, args.smoke)  # fmt: skip
    if "status" not in result:
        result["status"] = "passed" if result.pop("ok") else "failed"
    (out / f"stage-{stage}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


def report(results: dict[str, Any]) -> str:
    """The short markdown beside gpu-check.json: one line per stage, then each stage's headline figures."""
    meta = results["meta"]
    environment = results["stages"].get("environment", {})
    gpu = environment.get("gpu") or {}
    lines = [
        "# flyspec GPU check",
        "",
        f"- Date: {meta['date']}; command: `{meta['command']}`; total {meta['seconds']:.0f} s",
        f"- Device: {gpu.get('name') or 'no CUDA device (CPU only: the GPU parts are skipped or run on the CPU)'}; "
        f"torch {environment.get('torch')} (CUDA {environment.get('cuda_runtime')}), "
        f"Python {environment.get('python')}; {meta.get('limits') or 'the GPU machine’s time limits'}",
        f"- Wheels carried: {', '.join(meta['wheels'].get('wheels') or []) or 'none'}",
        "",
        "| stage | status | seconds | summary |",
        "|---|---|---:|---|",
    ]
    for stage, result in results["stages"].items():
        summary = result.get("summary") or result.get("reason") or result.get("error") or ""
        lines.append(f"| {stage} | {result.get('status')} | {result.get('seconds', 0):.0f} | {summary} |")
    for stage, result in results["stages"].items():
        if result.get("details"):
            lines += ["", f"## {stage}", "", *result["details"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.out = str(out)
    if args.stage:
        return child(args.stage, args)
    started = time.monotonic()
    wheels = install_wheels(args.wheels, out)
    env = offline_environment(Path(wheels["site"]) if wheels.get("site") else None)
    limits = dict(SMOKE_LIMITS if args.smoke else LIMITS)
    total_limit = TOTAL_LIMIT_S
    results: dict[str, Any] = {
        "meta": {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "smoke": args.smoke, "wheels": wheels,
                 "command": "python scripts/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv)},
        "stages": {},
    }  # fmt: skip
    for stage in args.stages.split(","):
        left = total_limit - (time.monotonic() - started)
        if left < 10:
            results["stages"][stage] = {"status": "skipped", "reason": f"the check's {total_limit:.0f} s are spent"}
        else:
            print(f"gpu_check: {stage} ...", file=sys.stderr, flush=True)
            results["stages"][stage] = run_stage(stage, args, env, min(limits[stage], left))
            print(f"gpu_check: {stage}: {results['stages'][stage]['status']}", file=sys.stderr, flush=True)
        if stage == "environment" and not results["stages"][stage].get("cuda_available"):
            # a rehearsal on a CPU (the GPU parts skipped or on the CPU): the limits are the GPU machine's, x CPU_SLACK
            limits = {name: limit * CPU_SLACK for name, limit in limits.items()}
            total_limit *= CPU_SLACK
            results["meta"]["limits"] = f"no GPU: every time limit x {CPU_SLACK}"
        results["meta"]["seconds"] = round(time.monotonic() - started, 1)
        (out / "gpu-check.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        (out / "gpu-check.md").write_text(report(results))
    failed = [stage for stage, result in results["stages"].items() if result["status"] in ("failed", "timed out")]
    print(f"gpu_check: wrote {out / 'gpu-check.json'} and gpu-check.md; failed: {', '.join(failed) or 'none'}",
          file=sys.stderr)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
