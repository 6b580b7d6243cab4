"""Soak test of ``flyspec serve``: hours of mixed, hostile traffic; 5xx, lost requests and memory growth.

Starts the real ``flyspec serve`` process (the packaged default model unless ``--target``) with an
API key per tenant, an n-gram cache file and request-chosen speculation, then for ``--duration``
seconds keeps ``--clients`` clients sending a mix of chat and completions, streamed and not,
lossless (exact, rejection, with the ngram and ngram-cache drafters) and lossy (fly: refused with
403 unless the server runs ``--allow-request-speculative all``), some of them read slowly. Beside
them it sends, at fixed rates: streams abandoned while queued and mid-stream, streams whose client
never reads, malformed and oversized bodies, and wrong API keys. Every few seconds it samples the
server's RSS, open file descriptors and threads (psutil, else /proc).

At the end it lets the requests in flight finish, checks ``/health`` and the server's own 5xx
count, then sends SIGTERM under load (each stream in flight must end with its answer or a clear
error), restarts the server on the same cache file and checks the n-grams came back.

Outcome of every request: answered (a complete 200), left (the client went away, as planned),
expected 4xx (a bad request refused in the OpenAI error shape), throttled (429), 5xx, unexpected
(any other status), or lost (no complete answer: transport error, torn stream, timeout). Passes
when 5xx, unexpected and lost are all 0.
Writes ``results.json``, ``report.md`` and ``soak.png`` into ``--out``.

    .venv/bin/python benchmarks/soak.py --duration 60 --out /tmp/soak           # the CI-sized run
    nohup .venv/bin/python benchmarks/soak.py --duration 1800 --out benchmarks/DATE-soak &
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
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_load import every, free_port, malformed_requests, percentile, wait_healthy  # noqa: E402

from flyspec.bench.online import sse_event, sse_lines  # noqa: E402

PROMPTS = (
    "Name three colors.",
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Explain what a KV cache is, briefly.",
    "Count from one to five.",
    "Write a Python function that adds two numbers.",
)
SPECULATIVE = (  # what the good requests ask for; None = the server's defaults
    None,
    {"verifier": "exact", "drafter": "ngram-cache"},
    {"verifier": "rejection", "drafter": "ngram"},
    {"verifier": "exact", "drafter": "ngram", "draft_length": "heuristic"},
    {"verifier": "fly"},  # lossy: 403 unless --allow-request-speculative all
)
OUTCOMES = ("answered", "left", "expected_4xx", "throttled", "5xx", "unexpected", "lost")


@dataclass
class Tally:
    """Every request's outcome, by kind, and the answered ones' latencies."""

    started: float = field(default_factory=time.monotonic)
    outcomes: Counter = field(default_factory=Counter)  # (kind, outcome) → count
    statuses: Counter = field(default_factory=Counter)
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, latency s)
    problems: list[str] = field(default_factory=list)
    samples: list[dict[str, float]] = field(default_factory=list)

    def record(self, kind: str, outcome: str, detail: str = "") -> None:
        self.outcomes[(kind, outcome)] += 1
        if outcome in ("5xx", "unexpected", "lost") and len(self.problems) < 200:
            self.problems.append(f"{kind}: {outcome}: {detail[:300]}")

    def total(self, outcome: str) -> int:
        return sum(count for (_, which), count in self.outcomes.items() if which == outcome)


def is_openai_error(response: httpx.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and bool(error.get("message")) and bool(error.get("code")) and "type" in error


def classify(response: httpx.Response, expected: tuple[int, ...]) -> str:
    status = response.status_code
    if status >= 500:
        return "5xx"
    if status == 429:
        return "throttled"
    if status in expected and 400 <= status < 500:
        return "expected_4xx" if is_openai_error(response) else "unexpected"
    return "answered" if status in expected else "unexpected"


class Traffic:
    """The request kinds; each sends one request and records its outcome."""

    def __init__(self, args: argparse.Namespace, url: str, keys: list[str], tally: Tally) -> None:
        self.args, self.url, self.keys, self.tally = args, url, keys, tally
        self.rng = random.Random(args.seed)
        self.lossy_allowed = args.allow_request_speculative == "all"

    def _headers(self, key: str | None = None) -> dict[str, str]:
        return {"authorization": f"Bearer {key or self.rng.choice(self.keys)}"}

    def _body(self, chat: bool, stream: bool) -> tuple[dict[str, Any], tuple[int, ...]]:
        prompt = self.rng.choice(PROMPTS)
        body: dict[str, Any] = {"max_tokens": self.args.max_tokens, "temperature": self.rng.choice((0, 0.7))}
        body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
        speculative = self.rng.choice(SPECULATIVE)
        if speculative is not None:
            body["speculative"] = speculative
        if body["temperature"]:
            body["seed"] = self.rng.randrange(1 << 30)
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        lossy = speculative is not None and speculative["verifier"] == "fly"
        return body, ((403,) if lossy and not self.lossy_allowed else (200,))

    async def good(self, client: httpx.AsyncClient, slow: bool = False) -> None:
        chat, stream = self.rng.random() < 0.5, slow or self.rng.random() < 0.5
        body, expected = self._body(chat, stream)
        kind = f"{'chat' if chat else 'completion'}-{'slow-stream' if slow else 'stream' if stream else 'json'}"
        path = "/v1/chat/completions" if chat else "/v1/completions"
        started = time.monotonic()
        try:
            if stream:
                outcome, detail = await self._stream(client, path, body, expected, slow)
            else:
                response = await client.post(f"{self.url}{path}", json=body, headers=self._headers())
                self.tally.statuses[response.status_code] += 1
                outcome, detail = classify(response, expected), response.text
                if outcome == "answered" and not response.json().get("choices"):
                    outcome = "lost"
        except (httpx.HTTPError, ValueError) as error:
            outcome, detail = "lost", f"{type(error).__name__}: {error}"
        self.tally.record(kind, outcome, detail)
        if outcome == "answered":
            self.tally.latencies.append((time.monotonic() - self.tally.started, time.monotonic() - started))

    async def _stream(
        self, client: httpx.AsyncClient, path: str, body: dict[str, Any], expected: tuple[int, ...], slow: bool
    ) -> tuple[str, str]:
        events: list[Any] = []
        async with client.stream("POST", f"{self.url}{path}", json=body, headers=self._headers()) as response:
            self.tally.statuses[response.status_code] += 1
            if response.status_code != 200:
                await response.aread()
                return classify(response, expected), response.text
            async for line in sse_lines(response):
                if slow:
                    await asyncio.sleep(self.args.slow_read_s)
                if (event := sse_event(line)) is not None:
                    events.append(event)
        if 200 not in expected:
            return "unexpected", "a refused request was answered"
        complete = events and events[-1] == "[DONE]" and not any("error" in event for event in events[:-1])
        return ("answered", "") if complete else ("lost", f"torn stream, last event {str(events[-1:])[:200]}")

    async def abandon(self, client: httpx.AsyncClient, mid_stream: bool) -> None:
        """A stream the client leaves: after 20-500 ms (queued or prefilling), or at its first text."""
        body, _ = self._body(chat=self.rng.random() < 0.5, stream=True)
        body["speculative"] = {"verifier": "exact"}
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"

        async def read() -> None:
            async with client.stream("POST", f"{self.url}{path}", json=body, headers=self._headers()) as response:
                self.tally.statuses[response.status_code] += 1
                async for line in sse_lines(response):
                    if mid_stream and line.startswith("data: {") and '"finish_reason": null' in line:
                        return  # leaving the block closes the connection mid-stream

        timeout = None if mid_stream else self.rng.uniform(0.02, 0.5)
        with contextlib.suppress(TimeoutError, httpx.HTTPError):
            await asyncio.wait_for(read(), timeout=timeout)
        self.tally.record("abandoned-mid-stream" if mid_stream else "abandoned-queued", "left")

    async def never_reads(self) -> None:
        """A raw socket with a tiny receive buffer: sends a stream request, never reads, leaves after a while."""
        body = json.dumps({"prompt": self.rng.choice(PROMPTS), "max_tokens": self.args.max_tokens, "stream": True})
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {self.rng.choice(self.keys)}\r\nContent-Length: {len(body)}\r\n\r\n{body}"
        ).encode()
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", int(self.url.rsplit(":", 1)[1])))
            await loop.sock_sendall(sock, head)
            await asyncio.sleep(self.args.stall_s)
            self.tally.record("never-reads", "left")
        except OSError as error:
            self.tally.record("never-reads", "lost", f"{type(error).__name__}: {error}")
        finally:
            sock.close()

    async def hostile(self, client: httpx.AsyncClient, case: tuple[str, dict[str, str], bytes]) -> None:
        name, headers, content = case
        try:
            response = await client.post(f"{self.url}/v1/chat/completions", content=content, headers=headers)
            self.tally.statuses[response.status_code] += 1
            outcome = classify(response, tuple(range(400, 500)))
            self.tally.record(f"hostile: {name}", outcome, response.text)
        except httpx.HTTPError as error:
            self.tally.record(f"hostile: {name}", "lost", f"{type(error).__name__}: {error}")

    def hostile_cases(self) -> list[tuple[str, dict[str, str], bytes]]:
        key = self.keys[0]
        json_headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
        cases = [case for case in malformed_requests(key) if case[0] != "lossy verifier" or not self.lossy_allowed]
        oversized = b'{"messages": [{"role": "user", "content": "' + b"x" * (self.args.max_body_bytes + 1) + b'"}]}'
        chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
        wrong = {**json_headers, "authorization": f"Bearer {secrets.token_urlsafe(24)}"}
        almost = {**json_headers, "authorization": f"Bearer {key[:-1]}"}  # one character short of a real key
        return [*cases, ("oversized body", json_headers, oversized), ("random key", wrong, chat),
                ("truncated key", almost, chat)]  # fmt: skip


def process_sample(pid: int) -> dict[str, float]:
    """RSS (bytes), open fds and threads of ``pid``: psutil when installed, else /proc."""
    try:
        import psutil

        process = psutil.Process(pid)
        return {"rss": process.memory_info().rss, "fds": process.num_fds(), "threads": process.num_threads()}
    except ImportError:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        return {
            "rss": int(status["VmRSS"].split()[0]) * 1024,
            "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(status["Threads"]),
        }


async def sample(pid: int, tally: Tally, interval_s: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(OSError, ProcessLookupError, KeyError):
            tally.samples.append({"t": time.monotonic() - tally.started, **process_sample(pid)})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


async def load(args: argparse.Namespace, url: str, keys: list[str], pid: int) -> Tally:
    tally = Tally()
    traffic = Traffic(args, url, keys, tally)
    stop_at = time.monotonic() + args.duration
    sampling_done = asyncio.Event()
    sampler = asyncio.create_task(sample(pid, tally, args.sample_interval, sampling_done))
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    # clients wait longer than the server's deadline (--request-timeout): its answer comes first
    async with httpx.AsyncClient(limits=limits, timeout=args.request_timeout + 30) as client:
        side: set[asyncio.Task] = set()
        cases = traffic.hostile_cases()
        count = iter(range(1 << 40))

        async def client_loop(index: int) -> None:
            while time.monotonic() < stop_at:
                await traffic.good(client, slow=traffic.rng.random() < args.slow_fraction)

        launchers = [
            every(args.abandon_rate, stop_at, lambda: traffic.abandon(client, mid_stream=False), side),
            every(args.abandon_rate, stop_at, lambda: traffic.abandon(client, mid_stream=True), side),
            every(args.stall_rate, stop_at, traffic.never_reads, side),
            every(args.hostile_rate, stop_at, lambda: traffic.hostile(client, cases[next(count) % len(cases)]), side),
        ]
        loops = [asyncio.ensure_future(client_loop(index)) for index in range(args.clients)]
        await asyncio.gather(*launchers)
        _, not_done = await asyncio.wait([*loops, *side], timeout=args.request_timeout + 60)
        for task in not_done:
            task.cancel()
            tally.record("drain", "lost", "a request still running after the drain timeout")
    await asyncio.sleep(args.sample_interval)  # one sample after the load, when the server is idle
    sampling_done.set()
    await sampler
    return tally


def start_server(args: argparse.Namespace, port: int, key_file: Path, cache_file: Path) -> subprocess.Popen:
    command = [
        sys.executable, "-c", "from flyspec.cli.app import main; raise SystemExit(main())", "serve",
        "--port", str(port), "--api-key-file", str(key_file), "--log-level", "warning",
        "--ngram-cache-file", str(cache_file), "--ngram-cache-save-interval", str(args.save_interval),
        "--allow-request-speculative", args.allow_request_speculative,
        "--max-body-bytes", str(args.max_body_bytes), "--request-timeout", str(args.request_timeout),
        "--threads", str(args.threads), "--shutdown-timeout", "10",
        *(["--target", args.target] if args.target else []), *args.serve_args,
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(key_file.parent / "server.log", "ab"))


def server_metrics(url: str, key: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {key}"}, timeout=30).text
    return {
        name: float(value)
        for line in text.splitlines()
        if line.startswith("flyspec_") and " " in line
        for name, value in [line.rsplit(" ", 1)]
    }


async def sigterm_under_load(args: argparse.Namespace, url: str, keys: list[str], server: subprocess.Popen) -> dict:
    """SIGTERM while ``--clients`` streams run: each must end complete or with a clear error (event or 503)."""
    outcomes: Counter = Counter()

    async def one(client: httpx.AsyncClient, index: int) -> None:
        body = {"prompt": PROMPTS[index % len(PROMPTS)], "max_tokens": 4 * args.max_tokens, "stream": True,
                "temperature": 0, "speculative": {"verifier": "exact", "drafter": "ngram-cache"}}  # fmt: skip
        headers = {"authorization": f"Bearer {keys[index % len(keys)]}"}
        events: list[Any] = []
        try:
            async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
                if response.status_code != 200:
                    await response.aread()
                    ok = response.status_code == 503 and is_openai_error(response)
                    outcomes["503 shutting_down" if ok else f"unclear {response.status_code}"] += 1
                    return
                async for line in sse_lines(response):
                    if (event := sse_event(line)) is not None:
                        events.append(event)
        except (httpx.HTTPError, ValueError) as error:
            outcomes[f"lost ({type(error).__name__})"] += 1
            return
        if events and events[-1] == "[DONE]":
            outcomes["complete"] += 1
        elif events and "error" in events[-1] and events[-1]["error"].get("code") == "shutting_down":
            outcomes["stream error event shutting_down"] += 1
        else:
            outcomes["lost (torn stream)"] += 1

    async with httpx.AsyncClient(timeout=120) as client:
        tasks = [asyncio.ensure_future(one(client, index)) for index in range(args.clients + 4)]
        await asyncio.sleep(1.0)
        started = time.monotonic()
        server.send_signal(signal.SIGTERM)
        await asyncio.gather(*tasks)
    code = await asyncio.to_thread(server.wait, 120)
    lost = sum(count for outcome, count in outcomes.items() if outcome.startswith(("lost", "unclear")))
    return {"outcomes": dict(outcomes), "lost": lost, "exit_code": code,
            "exit_s": round(time.monotonic() - started, 2)}  # fmt: skip


def cache_file_check(cache_file: Path) -> dict[str, Any]:
    from flyspec.server.cache_file import parse_cache_file

    saved = parse_cache_file(cache_file).tenants
    return {
        "bytes": cache_file.stat().st_size,
        "mode": oct(cache_file.stat().st_mode & 0o777),
        "tenants": len(saved),
        "entries": sum(tenant.size() for tenant in saved.values()),
        "stale_temporaries": len(list(cache_file.parent.glob(f".{cache_file.name}.*.tmp"))),
    }


def windows(tally: Tally, width_s: float) -> list[dict[str, float]]:
    """Latency p50/p99 of the answered requests, per window of ``width_s`` seconds (by completion time)."""
    grouped: dict[int, list[float]] = {}
    for at, latency in tally.latencies:
        grouped.setdefault(int(at // width_s), []).append(latency)
    return [
        {
            "start_s": index * width_s,
            "answered": len(values),
            "p50_s": round(percentile(values, 0.5), 3),
            "p99_s": round(percentile(values, 0.99), 3),
        }
        for index, values in sorted(grouped.items())
    ]


def memory_growth(tally: Tally, warmup_s: float, width_s: float, load_end_s: float) -> dict[str, Any]:
    """RSS after warm-up (median of the first window) against the end of the load (median of the last)."""
    loaded = [row for row in tally.samples if warmup_s <= row["t"] <= load_end_s]
    if len(loaded) < 2:
        return {"growth_pct": None, "note": "too few samples after the warm-up"}
    first = [row["rss"] for row in loaded if row["t"] < warmup_s + width_s]
    last = [row["rss"] for row in loaded if row["t"] > load_end_s - width_s]
    baseline, final = statistics.median(first), statistics.median(last)
    times = [row["t"] for row in loaded]
    slope = statistics.linear_regression(times, [row["rss"] for row in loaded]).slope if len(set(times)) > 1 else 0.0
    return {
        "warmup_s": warmup_s,
        "rss_after_warmup_mib": round(baseline / 2**20, 1),
        "rss_at_end_mib": round(final / 2**20, 1),
        "rss_max_mib": round(max(row["rss"] for row in tally.samples) / 2**20, 1),
        "growth_pct": round(100 * (final - baseline) / baseline, 2),
        "slope_mib_per_hour": round(slope * 3600 / 2**20, 2),
        "fds_after_warmup_max_end": [int(loaded[0]["fds"]), int(max(r["fds"] for r in loaded)), int(loaded[-1]["fds"])],
        "threads_after_warmup_max_end": [
            int(loaded[0]["threads"]),
            int(max(r["threads"] for r in loaded)),
            int(loaded[-1]["threads"]),
        ],
    }


def plot(tally: Tally, rows: list[dict[str, float]], path: Path, warmup_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (memory, latency) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    minutes = [row["t"] / 60 for row in tally.samples]
    memory.plot(minutes, [row["rss"] / 2**20 for row in tally.samples], label="RSS (MiB)")
    memory.axvline(warmup_s / 60, color="grey", linestyle=":", label="end of warm-up")
    memory.set_ylabel("server RSS (MiB)")
    memory.legend(loc="lower right")
    middle = [(row["start_s"] + (rows[1]["start_s"] - rows[0]["start_s"] if len(rows) > 1 else 60) / 2) / 60
              for row in rows]  # fmt: skip
    latency.plot(middle, [row["p99_s"] for row in rows], marker="o", label="p99")
    latency.plot(middle, [row["p50_s"] for row in rows], marker=".", label="p50")
    latency.set_ylabel("latency per window (s)")
    latency.set_xlabel("minutes since the load started")
    latency.legend(loc="upper right")
    figure.suptitle("flyspec serve soak: server RSS and request latency (shared CPU)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())  # fmt: skip
    return f"{platform.node()}: {os.cpu_count()} CPUs, {model}, Linux {platform.release()}"


def git_state() -> str:
    """The commit the server ran from, and whether the work tree differed from it."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=root, capture_output=True, text=True)
    except OSError:
        return "unknown"
    return commit.stdout.strip() + (" + uncommitted changes in src/" if dirty.stdout.strip() else "")


def write_report(result: dict[str, Any], out: Path) -> None:
    counts = result["counts"]
    lines = [
        f"# flyspec serve soak, {result['date']}",
        "",
        f"Machine: {result['machine']} (shared with other jobs: latency figures are indicative only).",
        f"Code: {result['commit']}.",
        f"Command: `{result['command']}`",
        "",
        f"**{'PASSED' if result['passed'] else 'FAILED'}**: {result['duration_s']:.0f} s of load, "
        f"{sum(counts.values())} requests.",
        "",
        "| outcome | requests |",
        "| --- | ---: |",
        *(f"| {outcome} | {counts[outcome]} |" for outcome in OUTCOMES),
        "",
        "| memory | value |",
        "| --- | ---: |",
        *(f"| {name} | {value} |" for name, value in result["memory"].items()),
        "",
        f"Server 5xx in its own metrics: {result['server_5xx']:.0f}; "
        f"healthy after the load: {result['healthy_after']}.",
        f"SIGTERM under load: {result['sigterm']}.",
        f"Cache file after shutdown: {result['cache_file']}; restored after restart: {result['restored']}.",
        "",
        "| window start (s) | answered | p50 (s) | p99 (s) |",
        "| ---: | ---: | ---: | ---: |",
        *(
            f"| {row['start_s']:.0f} | {row['answered']} | {row['p50_s']} | {row['p99_s']} |"
            for row in result["windows"]
        ),
        "",
        "Outcomes by kind:",
        "",
        *(f"- {kind}: {outcome} × {count}" for kind, outcome, count in result["by_kind"]),
        "",
        "![RSS and p99 latency over time](soak.png)",
    ]
    if result["problems"]:
        lines += ["", "Problems (first 20):", "", *(f"- `{problem}`" for problem in result["problems"][:20])]
    (out / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--duration", type=float, default=1800.0, help="seconds of load (default 1800)")
    add("--out", required=True, help="directory for results.json, report.md and soak.png")
    add("--target", help="model to serve (default: flyspec serve's default, the packaged model)")
    add("--threads", type=int, default=1, help="server torch threads (default 1: best on a shared CPU)")
    add("--tenants", type=int, default=3, help="API keys, one tenant each (default 3)")
    add("--clients", type=int, default=4, help="clients sending good requests back to back (default 4)")
    add("--max-tokens", type=int, default=24, help="max_tokens of each good request (default 24)")
    add("--slow-fraction", type=float, default=0.1, help="good streams read slowly (default 0.1)")
    add("--slow-read-s", type=float, default=0.05, help="a slow reader's pause per line (default 0.05 s)")
    add("--abandon-rate", type=float, default=0.2, help="streams abandoned per second, queued and mid-stream each")
    add("--stall-rate", type=float, default=0.05, help="streams per second whose client never reads")
    add("--stall-s", type=float, default=10.0, help="how long a client that never reads keeps its connection")
    add("--hostile-rate", type=float, default=1.0, help="malformed/oversized/wrong-key requests per second")
    add("--allow-request-speculative", default="all", choices=("none", "lossless", "all"))
    add("--max-body-bytes", type=int, default=65536, help="the server's body limit; oversized bodies exceed it")
    add("--request-timeout", type=float, default=120.0, help="the server's --request-timeout (default 120 s)")
    add("--save-interval", type=float, default=30.0, help="the server's --ngram-cache-save-interval (default 30 s)")
    add("--sample-interval", type=float, default=5.0, help="seconds between RSS/fd/thread samples (default 5)")
    add("--window", type=float, default=60.0, help="latency window in seconds (default 60: per minute)")
    add("--warmup", type=float, help="seconds of warm-up before the memory baseline (default duration / 6)")
    add("--seed", type=int, default=0, help="the traffic's random seed")
    add("--serve-args", nargs=argparse.REMAINDER, default=[], help="more flyspec serve options (last)")
    args = parser.parse_args(argv)
    if args.warmup is None:
        args.warmup = min(args.duration / 6, 300.0)
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="flyspec-soak-"))  # keys and the cache file: never in --out
    keys = [secrets.token_urlsafe(24) for _ in range(args.tenants)]
    key_file, cache_file = work / "keys.txt", work / "caches.json"
    key_file.write_text("\n".join(keys) + "\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(args, port, key_file, cache_file)
    try:
        asyncio.run(wait_healthy(url, server, timeout_s=600))
        tally = asyncio.run(load(args, url, keys, server.pid))
        load_end_s = args.duration
        metrics = server_metrics(url, keys[0])
        health = httpx.get(f"{url}/health", timeout=30).json()
        sigterm = asyncio.run(sigterm_under_load(args, url, keys, server))
    finally:
        if server.poll() is None:
            server.kill()
    cache = cache_file_check(cache_file)
    restarted = start_server(args, port, key_file, cache_file)
    try:
        asyncio.run(wait_healthy(url, restarted, timeout_s=600))
        restored = server_metrics(url, keys[0]).get('flyspec_ngram_cache{quantity="entries"}', 0.0)
    finally:
        restarted.send_signal(signal.SIGTERM)
        restarted.wait(60)
    rows = windows(tally, args.window)
    counts = {outcome: tally.total(outcome) for outcome in OUTCOMES}
    server_5xx = sum(value for name, value in metrics.items() if name.startswith("flyspec_requests_total{")
                     and 'status="5' in name)  # fmt: skip
    memory = memory_growth(tally, args.warmup, args.window, load_end_s)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": machine(),
        "commit": git_state(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "duration_s": args.duration,
        "settings": {name: value for name, value in vars(args).items() if name != "out"},
        "counts": counts,
        "by_kind": sorted((kind, outcome, count) for (kind, outcome), count in tally.outcomes.items()),
        "client_statuses": dict(sorted(tally.statuses.items())),
        "server_5xx": server_5xx,
        "server_failed_generations": metrics.get("flyspec_failed_generations_total", 0.0),
        "server_cancelled": metrics.get("flyspec_cancelled_requests_total", 0.0),
        "healthy_after": health.get("status") == "ok",
        "windows": rows,
        "memory": memory,
        "memory_goal_met": memory.get("growth_pct") is not None and memory["growth_pct"] <= 5.0,
        "sigterm": sigterm,
        "cache_file": cache,
        "restored": restored,
        "samples": tally.samples,
        "problems": tally.problems,
    }
    result["passed"] = (
        counts["5xx"] == counts["unexpected"] == counts["lost"] == 0
        and server_5xx == 0
        and result["healthy_after"]
        and sigterm["lost"] == 0
        and sigterm["exit_code"] in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
        and restored > 0
    )
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    write_report(result, out)
    plot(tally, rows, out / "soak.png", args.warmup)
    return result


def main() -> int:
    result = run(parse_args())
    summary = {name: result[name] for name in ("counts", "server_5xx", "memory", "sigterm", "restored", "passed")}
    print(json.dumps(summary, indent=2, default=str))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
