"""``kill -9`` of ``flyspec serve`` while it writes its n-gram cache file, again and again.

Seeds a large cache file (``--entries`` n-grams over ``--tenants`` API-key tenants, so each save
takes a while), then ``--runs`` times: starts the real ``flyspec serve`` on it (saving every
``--save-interval`` seconds), sends one request so the caches change, waits until a save has
begun (its temporary file appears beside the cache file), waits a random part of a save's
duration and sends SIGKILL. After each kill the file must parse as a whole cache file (the old
version or the new one, never a torn one), and the next start must load it (a corrupt file is a
start-up error, exit 2) and restore its n-grams; temporaries a kill left are removed at that start.
A kill that found no save under way is retried (it does not count towards ``--runs``).

Writes ``results.json`` and ``report.md`` into ``--out``; exit code 1 when any check failed.

    .venv/bin/python benchmarks/kill9.py --runs 50 --out benchmarks/DATE-kill9
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_load import free_port  # noqa: E402

from flyspec.server.cache_file import SECRET_ENV, CacheFile, SavedTenant, parse_cache_file  # noqa: E402
from flyspec.server.security import tenant_of  # noqa: E402


def seed(path: Path, secret: bytes, keys: list[str], entries: int, rng: random.Random) -> None:
    """A valid cache file of ``entries`` random n-grams (orders 1 to 4) spread over the keys' tenants."""
    per_tenant = entries // len(keys)
    tenants = {}
    for key in keys:
        grams = [(tuple(rng.randrange(49152) for _ in range(rng.randint(1, 4))), rng.randrange(49152))
                 for _ in range(per_tenant)]  # fmt: skip
        tenants[tenant_of(key, secret)] = SavedTenant(time.time(), {"seeded": grams})
    CacheFile(path, secret, max_entries=entries + 1).save(tenants)


def start(
    args: argparse.Namespace, port: int, key_file: Path, cache: Path, log: Path, secret: bytes
) -> subprocess.Popen:
    command = [
        sys.executable, "-c", "from flyspec.cli.app import main; raise SystemExit(main())", "serve",
        "--port", str(port), "--api-key-file", str(key_file), "--log-level", "warning", "--threads", "1",
        "--ngram-cache-file", str(cache), "--ngram-cache-save-interval", str(args.save_interval),
        "--ngram-cache-file-max-entries", str(args.entries * 2),
        *(["--target", args.target] if args.target else []),
    ]  # fmt: skip
    env = {**os.environ, SECRET_ENV: secret.decode()}
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "ab"))


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float = 600) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode} at start-up")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the server did not become healthy")


def restored_entries(url: str, key: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {key}"}, timeout=30).text
    line = next((line for line in text.splitlines() if line.startswith('flyspec_ngram_cache{quantity="entries"}')), "")
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def temporaries(cache: Path) -> list[Path]:
    return list(cache.parent.glob(f".{cache.name}.*.tmp"))


def one_run(args: argparse.Namespace, rng: random.Random, url: str, keys: list[str], server: subprocess.Popen,
            cache: Path) -> dict[str, Any]:  # fmt: skip
    """Change the caches, wait for a save to begin, SIGKILL somewhere inside it; what the file is afterwards."""
    before = digest(cache)
    key = rng.choice(keys)
    body = {"prompt": f"Request {rng.randrange(1 << 30)}: count to five.", "max_tokens": 4, "temperature": 0,
            "speculative": {"drafter": "ngram-cache"}}  # fmt: skip
    status = httpx.post(f"{url}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=120)
    deadline = time.monotonic() + 30
    while not temporaries(cache):
        if time.monotonic() > deadline:
            raise RuntimeError("no save began within 30 s")
        time.sleep(0.0005)
    time.sleep(rng.uniform(0, args.kill_window))
    mid_save = bool(temporaries(cache))
    server.send_signal(signal.SIGKILL)
    server.wait(30)
    parsed = parse_cache_file(cache)  # raises if torn: the run fails loudly
    after = digest(cache)
    return {
        "request_status": status.status_code,
        "mid_save": mid_save,
        "file": "old" if after == before else "new",
        "entries": sum(tenant.size() for tenant in parsed.tenants.values()),
        "temporaries_left": len(temporaries(cache)),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="kills inside a save (default 50)")
    parser.add_argument("--out", required=True, help="directory for results.json and report.md")
    parser.add_argument("--target", help="model to serve (default: flyspec serve's default, the packaged model)")
    parser.add_argument("--entries", type=int, default=600_000, help="n-grams seeded into the file (default 600000)")
    parser.add_argument("--tenants", type=int, default=3, help="API keys (default 3)")
    parser.add_argument("--save-interval", type=float, default=0.5, help="the server's save interval (default 0.5 s)")
    parser.add_argument("--kill-window", type=float, default=0.6, help="kill within this many s of a save's start")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="flyspec-kill9-"))
    keys = [secrets.token_urlsafe(24) for _ in range(args.tenants)]
    secret = secrets.token_hex(32).encode()
    key_file, cache, log = work / "keys.txt", work / "caches.json", work / "server.log"
    key_file.write_text("\n".join(keys) + "\n")
    seed(cache, secret, keys, args.entries, rng)
    seeded_bytes = cache.stat().st_size
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    runs: list[dict[str, Any]] = []
    failures: list[str] = []
    attempts = 0
    started = time.monotonic()
    while sum(run["mid_save"] for run in runs) < args.runs and attempts < 3 * args.runs:
        attempts += 1
        left_before = set(temporaries(cache))
        server = start(args, port, key_file, cache, log, secret)
        try:
            start_s = wait_healthy(url, server)
            restored = restored_entries(url, keys[0])
            removed = bool(left_before) and not left_before & set(temporaries(cache))  # new saves make new ones
            run = {"attempt": attempts, "start_s": round(start_s, 2), "restored": restored,
                   "temporaries_before_start": len(left_before), "temporaries_removed_at_start": removed}  # fmt: skip
            run.update(one_run(args, rng, url, keys, server, cache))
        except Exception as error:  # a torn file, a failed start: recorded, and the script goes on
            failures.append(f"attempt {attempts}: {type(error).__name__}: {error}")
            run = {"attempt": attempts, "failed": str(error)}
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        runs.append(run)
        print(json.dumps(run), flush=True)
    final = start(args, port, key_file, cache, log, secret)
    try:
        wait_healthy(url, final)
        final_restored = restored_entries(url, keys[0])
    finally:
        final.send_signal(signal.SIGTERM)
        final.wait(60)
    killed = [run for run in runs if "failed" not in run]
    mid = [run for run in killed if run["mid_save"]]
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "seeded_entries": args.entries,
        "seeded_bytes": seeded_bytes,
        "attempts": attempts,
        "kills_mid_save": len(mid),
        "kills_between_saves": len(killed) - len(mid),
        "file_after_kill_mid_save": {state: sum(run["file"] == state for run in mid) for state in ("old", "new")},
        "valid_after_every_kill": len(killed),
        "restarts_healthy": sum(1 for run in runs if "start_s" in run),
        "restored_min": min((run["restored"] for run in killed), default=0),
        "temporaries_left_by_kills": sum(run["temporaries_left"] for run in killed),
        "temporaries_removed_at_next_start": sum(bool(run["temporaries_removed_at_start"]) for run in killed),
        "start_s_median": sorted(run["start_s"] for run in killed)[len(killed) // 2] if killed else None,
        "final_restored": final_restored,
        "failures": failures,
        "wall_s": round(time.monotonic() - started, 1),
        "runs": runs,
    }
    result["passed"] = not failures and len(mid) >= args.runs and final_restored > 0
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    summary = {name: value for name, value in result.items() if name != "runs"}
    report = [f"# kill -9 while saving the n-gram cache file, {result['date']}", "", f"`{result['command']}`", "",
              f"**{'PASSED' if result['passed'] else 'FAILED'}**", "", "| figure | value |", "| --- | --- |",
              *(f"| {name} | {value} |" for name, value in summary.items())]  # fmt: skip
    (out / "report.md").write_text("\n".join(report) + "\n", encoding="utf-8")
    print(json.dumps(summary, indent=2))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
