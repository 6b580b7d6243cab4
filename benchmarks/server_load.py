"""Load test of ``flyspec serve`` on 127.0.0.1: concurrent streams, malformed requests and disconnects.

Starts ``flyspec serve`` (the packaged default model unless ``--target``) with an API key on a
free port, then for ``--duration`` seconds keeps ``--streams`` chat streams running back to
back, sends ``--malformed-rate`` malformed requests and ``--disconnect-rate`` streams that the
client abandons (while queued or mid-stream) per second. Then it stops starting requests, lets
the ones in flight finish (``--drain-timeout``), checks ``/health`` and ``/metrics``, stops the
server with SIGTERM and reports. Bounded and self-stopping; exit code 1 when a request was lost
(no complete answer), a 5xx was sent, or the server was unhealthy after the run.

    .venv/bin/python benchmarks/server_load.py                  # 32 streams, 10 malformed/s, 2 disconnects/s, 60 s
    .venv/bin/python benchmarks/server_load.py --duration 10 --target PATH --json load.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from flyspec.bench.online import sse_event, sse_lines
from flyspec.runtime.loading import cpu_name

PROMPTS = (
    "Name three colors.",
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Explain what a KV cache is, briefly.",
    "Count from one to five.",
    "Give me a short tip for writing clean code.",
)


def malformed_requests(key: str) -> list[tuple[str, dict[str, str], bytes]]:
    """(name, headers, body) of each malformed request; every one must get a 4xx in the OpenAI shape."""
    auth = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return [
        ("bad JSON", auth, b'{"messages": '),
        ("lone surrogate", auth, b'{"messages": [{"role": "user", "content": "x \\ud800"}]}'),
        ("nested 200 000 levels", auth, b'{"metadata": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"),
        ("5 000-digit max_tokens", auth, b'{"messages": [], "max_tokens": ' + b"9" * 5000 + b"}"),
        ("NaN temperature", auth, json.dumps({**chat, "temperature": float("nan")}).encode()),
        ("Infinity threshold", auth, b'{"prompt": "x", "speculative": {"entropy_threshold": Infinity}}'),
        ("unknown field", auth, json.dumps({**chat, "frobnicate": 1}).encode()),
        ("lossy verifier", auth, json.dumps({**chat, "speculative": {"verifier": "fly"}}).encode()),
        ("unknown model", auth, json.dumps({**chat, "model": "gpt-4"}).encode()),
        ("no API key", {"content-type": "application/json"}, json.dumps(chat).encode()),
        ("wrong API key", {**auth, "authorization": "Bearer wrong"}, json.dumps(chat).encode()),
        ("text/plain body", {**auth, "content-type": "text/plain"}, json.dumps(chat).encode()),
        ("DNS-rebinding host", {**auth, "host": "attacker.example"}, json.dumps(chat).encode()),
        ("prompt too long", auth, json.dumps({"messages": [{"role": "user", "content": "word " * 180_000}]}).encode()),
    ]


@dataclass
class Tally:
    """What happened to every request the load test sent."""

    streams_ok: int = 0
    streams_lost: list[str] = field(default_factory=list)
    stream_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    stream_s: list[float] = field(default_factory=list)
    malformed: Counter = field(default_factory=Counter)  # (name, status) → count
    malformed_lost: list[str] = field(default_factory=list)
    disconnects: int = 0
    mid_stream_disconnects: int = 0
    disconnect_statuses: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(args: argparse.Namespace, port: int, key: str) -> subprocess.Popen:
    command = [
        sys.executable, "-c", "from flyspec.cli.app import main; raise SystemExit(main())", "serve",
        "--port", str(port), "--max-queue", str(args.streams + 32), "--log-level", "warning",
        *(["--target", args.target] if args.target else []),
        *(["--threads", str(args.threads)] if args.threads else []),
    ]  # fmt: skip
    return subprocess.Popen(command, env={**os.environ, "FLYSPEC_API_KEY": key})


async def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise SystemExit(f"the server exited with code {server.returncode} before it was ready")
            try:
                if (await client.get(f"{url}/health", timeout=2)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.5)
    raise SystemExit(f"the server was not ready within {timeout_s:.0f} s")


async def stream_once(client: httpx.AsyncClient, url: str, body: dict[str, Any], tally: Tally) -> None:
    started = time.perf_counter()
    first: float | None = None
    events: list[Any] = []
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            tally.statuses[response.status_code] += 1
            if response.status_code != 200:
                tally.streams_lost.append(f"status {response.status_code}: {(await response.aread())[:200]!r}")
                return
            async for line in sse_lines(response):
                if (event := sse_event(line)) is not None:
                    events.append(event)
                    if first is None and event != "[DONE]" and event.get("choices"):
                        first = time.perf_counter() - started
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        tally.streams_lost.append(f"{type(error).__name__}: {error}")
        return
    if not events or events[-1] != "[DONE]" or any("error" in event for event in events[:-1]):
        tally.streams_lost.append(f"incomplete stream: last event {str(events[-1] if events else None)[:300]}")
        return
    tally.streams_ok += 1
    tally.stream_tokens += next(event["usage"]["completion_tokens"] for event in events[:-1] if event.get("usage"))
    tally.ttft_s.append(first or 0.0)
    tally.stream_s.append(time.perf_counter() - started)


async def streamer(client: httpx.AsyncClient, url: str, args: argparse.Namespace, stop: float, tally: Tally) -> None:
    rng = random.Random()
    while time.monotonic() < stop:
        body = {
            "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "max_tokens": args.max_tokens,
            "temperature": rng.choice((0, 0.7)),
            "seed": rng.randrange(1 << 30),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        await stream_once(client, url, body, tally)


async def malformed_once(client: httpx.AsyncClient, url: str, case: tuple[str, dict, bytes], tally: Tally) -> None:
    name, headers, content = case
    try:
        response = await client.post(f"{url}/v1/chat/completions", content=content, headers=headers)
        tally.statuses[response.status_code] += 1
        error = response.json()["error"]
        if not (400 <= response.status_code < 500 and error["code"] and error["message"]):
            tally.malformed_lost.append(f"{name}: {response.status_code} {response.text[:200]}")
        tally.malformed[f"{name} → {response.status_code} {error['code']}"] += 1
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
        tally.malformed_lost.append(f"{name}: {type(error).__name__}: {error}")


async def disconnect_once(
    client: httpx.AsyncClient, url: str, args: argparse.Namespace, tally: Tally, mid_stream: bool
) -> None:
    """A stream the client abandons: after 0.05-1 s (while queued), or once its first text arrives."""
    body = {"messages": [{"role": "user", "content": random.choice(PROMPTS)}], "max_tokens": args.max_tokens,
            "temperature": 0, "stream": True}  # fmt: skip

    async def read() -> None:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            tally.disconnect_statuses[response.status_code] += 1
            async for line in sse_lines(response):
                if mid_stream and '"content": "' in line and '"content": ""' not in line:
                    tally.mid_stream_disconnects += 1
                    return  # leaving the block closes the connection mid-stream

    with contextlib.suppress(TimeoutError, httpx.HTTPError):
        await asyncio.wait_for(read(), timeout=None if mid_stream else random.uniform(0.05, 1.0))
    tally.disconnects += 1


async def every(rate: float, stop: float, launch: Any, tasks: set[asyncio.Task]) -> None:
    """Start ``launch()`` ``rate`` times a second until ``stop``, without waiting for the ones started."""
    if rate <= 0:
        return
    next_at = time.monotonic()
    while next_at < stop:
        task = asyncio.ensure_future(launch())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        next_at += 1 / rate
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))


async def load(args: argparse.Namespace, url: str, key: str) -> Tally:
    tally = Tally()
    stop = time.monotonic() + args.duration
    limits = httpx.Limits(max_connections=args.streams + 200, max_keepalive_connections=args.streams + 50)
    headers = {"authorization": f"Bearer {key}"}
    cases = malformed_requests(key)
    malformed_count, disconnect_count = iter(range(1 << 30)), iter(range(1 << 30))
    # clients wait longer than the server's deadline (--request-timeout, 300 s): its answer comes first
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=330) as client:
        raw = httpx.AsyncClient(limits=limits, timeout=30)  # malformed requests carry their own headers
        side_tasks: set[asyncio.Task] = set()
        streams = [asyncio.ensure_future(streamer(client, url, args, stop, tally)) for _ in range(args.streams)]

        def malformed() -> Any:
            return malformed_once(raw, url, cases[next(malformed_count) % len(cases)], tally)

        def disconnect() -> Any:
            return disconnect_once(client, url, args, tally, mid_stream=next(disconnect_count) % 4 == 0)

        launchers = [
            every(args.malformed_rate, stop, malformed, side_tasks),
            every(args.disconnect_rate, stop, disconnect, side_tasks),
        ]
        await asyncio.gather(*launchers)
        pending = [*streams, *side_tasks]
        _, not_done = await asyncio.wait(pending, timeout=args.drain_timeout)
        for task in not_done:
            task.cancel()
        await raw.aclose()
    if not_done:
        tally.streams_lost.append(f"{len(not_done)} request tasks still running after the drain timeout")
    return tally


def server_view(url: str, key: str) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {key}"}
    health = httpx.get(f"{url}/health", timeout=10).json()
    completion = httpx.post(
        f"{url}/v1/chat/completions", headers=headers, timeout=120,
        json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "temperature": 0},
    )  # fmt: skip
    metrics = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    samples: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("flyspec_") and " " in line:
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return {"health": health, "after_load_status": completion.status_code, "metrics": samples}


def percentile(values: list[float], fraction: float) -> float:
    return sorted(values)[min(len(values) - 1, int(fraction * len(values)))] if values else 0.0


def report(
    args: argparse.Namespace, tally: Tally, wall_s: float, view: dict[str, Any], shutdown: dict[str, Any]
) -> dict[str, Any]:
    metrics = view["metrics"]
    server_5xx = sum(value for name, value in metrics.items() if name.startswith("flyspec_requests_total{")
                     and 'status="5' in name)  # fmt: skip
    client_5xx = sum(count for status, count in tally.statuses.items() if status >= 500)
    lost = len(tally.streams_lost) + len(tally.malformed_lost)
    healthy = view["health"].get("status") == "ok" and view["after_load_status"] == 200
    return {
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {cpu_name()}",
        "wall_s": round(wall_s, 1),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "streams_completed": tally.streams_ok,
        "stream_tokens": tally.stream_tokens,
        "tokens_per_s": round(tally.stream_tokens / wall_s, 1),  # load and drain: the worker never idled
        "ttft_s_p50_p95": [round(percentile(tally.ttft_s, 0.5), 2), round(percentile(tally.ttft_s, 0.95), 2)],
        "stream_s_p50_p95": [round(percentile(tally.stream_s, 0.5), 2), round(percentile(tally.stream_s, 0.95), 2)],
        "stream_s_mean": round(statistics.fmean(tally.stream_s), 2) if tally.stream_s else 0.0,
        "malformed_sent": sum(tally.malformed.values()) + len(tally.malformed_lost),
        "malformed_answers": dict(sorted(tally.malformed.items())),
        "disconnects": tally.disconnects,
        "mid_stream_disconnects": tally.mid_stream_disconnects,
        "disconnect_statuses": dict(tally.disconnect_statuses),
        "client_statuses": dict(sorted(tally.statuses.items())),
        "lost": lost,
        "lost_examples": (tally.streams_lost + tally.malformed_lost)[:10],
        "5xx_seen_by_clients": client_5xx,
        "5xx_in_server_metrics": server_5xx,
        "cancelled_in_server_metrics": metrics.get("flyspec_cancelled_requests_total", 0.0),
        "healthy_after": healthy,
        "health": view["health"],
        "shutdown": shutdown,
        "passed": lost == 0 and client_5xx == 0 and server_5xx == 0 and healthy and shutdown["exit_code"] in (0, -15),
    }


def stop_server(server: subprocess.Popen, timeout_s: float) -> dict[str, Any]:
    started = time.monotonic()
    server.send_signal(signal.SIGTERM)
    try:
        code = server.wait(timeout_s)
    except subprocess.TimeoutExpired:
        server.kill()
        code = server.wait()
    return {"exit_code": code, "seconds": round(time.monotonic() - started, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    parser.add_argument("--streams", type=int, default=32, help="concurrent streaming clients (default 32)")
    parser.add_argument("--malformed-rate", type=float, default=10.0, help="malformed requests per second")
    parser.add_argument("--disconnect-rate", type=float, default=2.0, help="abandoned streams per second")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each stream (default 32)")
    parser.add_argument("--drain-timeout", type=float, default=300.0, help="wait for requests in flight (s)")
    parser.add_argument("--target", help="model to serve (default: flyspec serve's default)")
    parser.add_argument("--threads", type=int, default=1, help="server torch threads (default 1: best on a shared CPU)")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    port, key = free_port(), secrets.token_urlsafe(24)
    url = f"http://127.0.0.1:{port}"
    server = start_server(args, port, key)
    try:
        asyncio.run(wait_healthy(url, server, timeout_s=300))
        started = time.monotonic()
        tally = asyncio.run(load(args, url, key))
        wall_s = time.monotonic() - started
        view = server_view(url, key)
        shutdown = stop_server(server, timeout_s=60)
    finally:
        if server.poll() is None:
            server.kill()
    result = report(args, tally, wall_s, view, shutdown)
    print(json.dumps(result, indent=2, default=str, ensure_ascii=False))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump({**result, "lost_all": tally.streams_lost + tally.malformed_lost}, file, indent=2, default=str)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
