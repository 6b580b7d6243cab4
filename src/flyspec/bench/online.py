"""``flyspec bench --concurrency 1,2,4,8 --online``: OpenAI-compatible servers under concurrent streaming clients.

One server at a time is started, measured at every concurrency and stopped:

* ``vllm-plain``, ``vllm-ngram``, ``vllm-flyspec-ngram``, ``vllm-ngram+fly``: vLLM's OpenAI server from the vLLM
  venv (``python -m vllm.entrypoints.openai.api_server``) with the offline methods' ``speculative_config``
  (``flyspec_vllm.worker.speculative_config``; ``--schedule``: with the batch schedule) and plugin switches;
* ``flyspec-serve``: ``flyspec serve`` with its defaults (n-gram drafts, exact verification) and the bench's
  ``--compile`` and ``--kernels``, which decodes one request at a time and queues the rest;
* ``llama-server``, ``llama-server-ngram``: llama.cpp's own server on the packaged GGUF file (``llama_server.py``).

A target with a chat template gets chat completions of each prompt's first turn; one without (a base model) gets
completions of the turn's text. The report says how many bytes of weights each engine reads per token: flyspec's
and vLLM's the parameters in the bench's dtype, llama.cpp's the GGUF file's (quantized) tensors.

At concurrency ``c``, ``c`` clients each stream chat completions back to back (greedy, ``max_tokens``,
usage included) until ``c·⌈min_prompts / c⌉`` requests are answered. Figures: total tokens/s (every
completion token ÷ the time from the first request to the last answer), per-request tokens/s (median),
time to first token (TTFT) and time per output token after the first (TPOT, per request), p50 and p99.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from flyspec.bench import llama_server
from flyspec.bench.summary import percentile
from flyspec.config import ConfigError
from flyspec.config.schedule import BatchSchedule

FLYSPEC_SERVE = "flyspec-serve"
SERVED_NAME = "bench"
START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 900.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def server_command(
    method: str, python: Path, model_path: str, target: str, dtype: str, port: int, k: int,
    schedule: BatchSchedule | None, eager: bool, serve_options: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:  # fmt: skip
    """The command line and extra environment that start ``method``'s server on ``port``; ``serve_options``: more
    options for ``flyspec serve`` (the bench's ``--compile``, ``--kernels``)."""
    if method == FLYSPEC_SERVE:
        command = [sys.executable, "-m", "flyspec", "serve", "--model", target, "--dtype", dtype, "--port", str(port),
                   "--served-model-name", SERVED_NAME, "--log-level", "warning", *serve_options]  # fmt: skip
        return command, {}
    from flyspec.bench.load import FLYSPEC_PROPOSER, LOAD_METHODS, engine_method

    if method not in LOAD_METHODS:
        raise ConfigError(f"--online measures {', '.join([*LOAD_METHODS, FLYSPEC_SERVE])}, not {method}")
    method = engine_method(method)
    from flyspec.harness.vllm_worker import schedule_environment, speculative_config

    entries = schedule.to_vllm() if schedule is not None and method in FLYSPEC_PROPOSER else None
    speculative = speculative_config(method, k, entries)
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--port", str(port),
               "--served-model-name", SERVED_NAME, "--dtype", dtype, "--max-model-len", "4096",
               "--kv-cache-memory-bytes", str(512 << 20), "--seed", "0", "--disable-uvicorn-access-log",
               *(["--enforce-eager"] if eager else []),
               *(["--speculative-config", json.dumps(speculative)] if speculative else [])]  # fmt: skip
    environment = {"FLYSPEC_VLLM_FLY": "all" if method.startswith("vllm-ngram+fly") else "off",
                   **schedule_environment(method, entries)}  # fmt: skip
    if method.endswith("+bare"):
        environment["FLYSPEC_VLLM_GUARDS"] = "bare"
    return command, environment


class Server:
    """A started server process; its log kept in a temporary file for the error when it dies."""

    def __init__(self, command: list[str], environment: dict[str, str], port: int, log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        with log.open("w", encoding="utf-8") as sink:
            self.process = subprocess.Popen(command, env={**os.environ, **environment}, stdout=sink, stderr=sink)
        self.started = time.perf_counter()
        self.startup_s = 0.0

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}): {self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.startup_s = time.perf_counter() - self.started
                    return
            except httpx.TransportError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s: {self.tail()}")

    def tail(self) -> str:
        lines = [line.strip() for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        return " | ".join(lines[-3:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


async def sse_lines(response: Any) -> AsyncIterator[str]:
    """A server-sent event stream's lines, ended where the SSE format ends them (LF, CR LF) and nowhere else: httpx's
    ``aiter_lines`` also splits at characters JSON leaves raw in a string (U+2028, U+0085, ...), which a generated
    text may hold and another server (vLLM's) may send unescaped."""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending.removesuffix("\r")


def sse_event(line: str) -> Any:
    """One line of :func:`sse_lines` as its event: a ``data:`` line's JSON, ``"[DONE]"`` as the string, None for
    any other line (the blank line between events, a comment)."""
    if not line.startswith("data: "):
        return None
    data = line.removeprefix("data: ")
    return data if data == "[DONE]" else json.loads(data)


Request = list[dict[str, str]] | str  # chat messages, or a completion's prompt text (a target without a chat template)


async def stream_one(client: Any, url: str, request: Request, max_tokens: int) -> dict[str, Any]:
    """One streamed chat completion (or completion, for a prompt text): its start, first-token and end times and its
    completion tokens."""
    chat = not isinstance(request, str)
    body = {
        "model": SERVED_NAME,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **({"messages": request} if chat else {"prompt": request}),
    }
    started = time.perf_counter()
    first: float | None = None
    tokens = 0
    endpoint = f"{url}/v1/{'chat/completions' if chat else 'completions'}"
    async with client.stream("POST", endpoint, json=body) as response:
        if response.status_code != 200:
            return {"error": f"status {response.status_code}: {(await response.aread())[:200]!r}"}
        async for line in sse_lines(response):
            if (event := sse_event(line)) is None or event == "[DONE]":
                continue
            choices = event.get("choices") or []
            texts = [(choice.get("delta") or {}).get("content") if chat else choice.get("text") for choice in choices]
            if first is None and any(texts):
                first = time.perf_counter()
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
    ended = time.perf_counter()
    return {"started": started, "first": first or ended, "ended": ended, "tokens": tokens}


async def run_clients(url: str, prompts: Sequence[Request], concurrency: int, max_tokens: int) -> list:
    """``concurrency`` clients streaming ``prompts`` back to back; every request's timings."""
    import httpx

    queue: asyncio.Queue[Request] = asyncio.Queue()
    for messages in prompts:
        queue.put_nowait(messages)
    results: list[dict[str, Any]] = []
    # a fresh connection per request: llama.cpp's server closes a kept-alive one after a stream, and a request sent
    # on it failed ("Server disconnected without sending a response"); the same for every server, ~1 ms on loopback
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                messages = queue.get_nowait()
                try:
                    results.append(await stream_one(client, url, messages, max_tokens))
                except (httpx.HTTPError, json.JSONDecodeError) as error:  # counted as failed, never dropped
                    results.append({"error": f"{type(error).__name__}: {error}"})

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def summarize(method: str, concurrency: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    """One row: totals and latency percentiles over the requests answered (failures counted, never dropped)."""
    answered = [result for result in results if "error" not in result]
    failed = [result["error"] for result in results if "error" in result]
    if not answered:
        return {"method": method, "concurrency": concurrency, "failed": failed, "tokens_per_s": 0.0}
    span = max(r["ended"] for r in answered) - min(r["started"] for r in answered)
    tokens = sum(r["tokens"] for r in answered)
    ttft = [r["first"] - r["started"] for r in answered]
    tpot = [(r["ended"] - r["first"]) / (r["tokens"] - 1) for r in answered if r["tokens"] > 1]
    return {
        "method": method,
        "concurrency": concurrency,
        "num_requests": len(answered),
        "num_new_tokens": tokens,
        "seconds": span,
        "tokens_per_s": tokens / span if span > 0 else 0.0,
        "per_request_tokens_per_s": statistics.median(r["tokens"] / (r["ended"] - r["started"]) for r in answered),
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5),
        "tpot_p99_s": percentile(tpot, 0.99),
        "failed": failed,
    }


def run_online(
    starts: dict[str, Callable[[], Server]],
    prompts: Sequence[Request],
    concurrencies: Sequence[int],
    prompts_at: Callable[[int], int],
    max_tokens: int,
    on_row: Callable[[str], None] = lambda line: None,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Every server in turn at every concurrency (a warm-up request first); rows and start-up times."""
    rows: list[dict[str, Any]] = []
    startup: dict[str, float] = {}
    for method, start in starts.items():
        server = start()
        try:
            server.wait_ready()
            startup[method] = server.startup_s
            asyncio.run(run_clients(server.url, prompts[:1], 1, 8))  # warm-up
            for concurrency in concurrencies:
                batch = prompts[: prompts_at(concurrency)]
                rows.append(summarize(method, concurrency, asyncio.run(run_clients(server.url, batch, concurrency,
                                                                                   max_tokens))))  # fmt: skip
                row = rows[-1]
                on_row(f"online {method} at {concurrency}: {row['tokens_per_s']:.1f} tok/s, TTFT p50 "
                       f"{row.get('ttft_p50_s', float('nan')):.2f} s, failed {len(row['failed'])}")  # fmt: skip
        finally:
            server.stop()
    return rows, startup


def move_to_vllm_at(rows: list[dict[str, Any]]) -> int | None:
    """The smallest concurrency from which a vLLM server's total tokens/s beats ``flyspec serve``'s at every
    concurrency measured (None: it never does in this run)."""
    by_c: dict[int, dict[str, float]] = {}
    for row in rows:
        by_c.setdefault(row["concurrency"], {})[row["method"]] = row["tokens_per_s"]
    answer = None
    for concurrency in sorted(by_c, reverse=True):
        rates = by_c[concurrency]
        vllm = max((rate for name, rate in rates.items() if name.startswith("vllm-")), default=0.0)
        if FLYSPEC_SERVE not in rates or vllm <= rates[FLYSPEC_SERVE]:
            break
        answer = concurrency
    return answer


def online_report(rows: list[dict[str, Any]], startup: dict[str, float], weights: dict[str, int] | None = None
                  ) -> list[str]:  # fmt: skip
    """The report's online section (``weights``: bytes of weights each server reads per token)."""
    read = ", ".join(f"{name} {size / 1e6:.0f} MB" for name, size in (weights or {}).items())
    lines = [
        "",
        "## Online: OpenAI-compatible servers, streaming clients",
        "",
        "Server start-up (not in the figures): " + ", ".join(f"{name} {s:.0f} s" for name, s in startup.items()),
        *(["", f"Weights read per token (each engine's own format): {read}"] if read else []),
        "",
        "| server | c | total tok/s | per-request tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | failed |",
        "|---|---:|---:|---:|---|---|---:|",
    ]
    for row in rows:
        if not row.get("num_requests"):
            lines.append(f"| {row['method']} | {row['concurrency']} | – | – | – | – | {len(row['failed'])} |")
            continue
        lines.append(
            f"| {row['method']} | {row['concurrency']} | {row['tokens_per_s']:.1f} "
            f"| {row['per_request_tokens_per_s']:.1f} | {row['ttft_p50_s']:.2f} / {row['ttft_p99_s']:.2f} "
            f"| {1000 * row['tpot_p50_s']:.0f} / {1000 * row['tpot_p99_s']:.0f} | {len(row['failed'])} |"
        )
    if any(row["method"] == FLYSPEC_SERVE for row in rows):
        at = move_to_vllm_at(rows)
        lines += ["", "Move from `flyspec serve` to vLLM: " + (
            f"from {at} concurrent clients on (vLLM's total tokens/s is higher there and at every larger "
            "concurrency measured)" if at is not None else "not within the concurrencies measured")]  # fmt: skip
    return lines


def write_outputs(
    out_dir: Path, meta: dict[str, Any], rows: list[dict[str, Any]], startup: dict[str, float],
    schedule: BatchSchedule | None, plots: bool,
) -> list[Path]:  # fmt: skip
    """online.json, online.md and (``plots``) online.png."""
    from flyspec.bench.load import plot

    (out_dir / "online.json").write_text(json.dumps({"meta": meta, "rows": rows, "startup_s": startup}, indent=1))
    header = ["# flyspec bench --concurrency --online", "",
              f"- {meta['date']}; {meta['machine']} (CPU flags: {meta['cpu_isa']}); {meta['versions']}",
              f"- target {meta['target']}, {meta['dtype']}, {'enforce_eager' if meta['eager'] else 'compiled'}; "
              f"k = {meta['num_draft_tokens']}, {meta['max_new_tokens']} new tokens; schedule: "
              f"{schedule.describe() if schedule else 'none'}"]  # fmt: skip
    report = online_report(rows, startup, meta.get("weight_bytes_per_token"))
    (out_dir / "online.md").write_text("\n".join(header + report) + "\n")
    written = [out_dir / "online.json", out_dir / "online.md"]
    if plots:
        answered = [row for row in rows if row.get("num_requests")]
        written.append(plot(out_dir / "online.png", {**meta, "vllm_version": "server"}, answered))
    return written


def run_servers(
    args: Any, names: list[str], target: Any, prompts: list, settings: Any, schedule: Any, python: Path,
    out_dir: Path, console: Any,
) -> int:  # fmt: skip
    """``flyspec bench --concurrency ... --online``: each server under concurrent streaming clients, on ``prompts``
    (their categories taking turns: ``bench/data.interleaved``)."""
    import tempfile

    from flyspec.bench import load
    from flyspec.harness.meta import run_metadata
    from flyspec.runtime.loading import cpu_isa

    chat = target.has_chat_template if args.use_chat is None else args.use_chat
    turns = [prompt.turns[0] for prompt in prompts[: settings.prompts_at(settings.concurrencies[-1])]]
    requests: list[Request] = [[{"role": "user", "content": turn}] if chat else turn for turn in turns]
    logs = Path(tempfile.mkdtemp(prefix="flyspec-online-"))
    serve_options = [*(["--compile"] if args.compile else []), "--kernels", args.kernels]  # as the offline engine's
    llama = llama_server.LlamaPeer.of(args, names, settings.concurrencies[-1])

    def starter(method: str) -> Callable[[], Server]:
        def start() -> Server:
            port = free_port()
            if method in llama_server.METHODS:
                assert llama is not None
                return Server(llama.command(method, port), {}, port, logs / f"{method}.log")
            command, environment = server_command(method, python, target.path, args.target, target.dtype_name, port,
                                                  settings.num_draft_tokens, schedule, args.vllm_eager,
                                                  serve_options)  # fmt: skip
            return Server(command, environment, port, logs / f"{method}.log")

        return start

    def label(name: str) -> str:  # a server that follows the schedule is named as offline: "<method> scheduled"
        return name + load.SCHEDULED if schedule is not None and name in load.FLYSPEC_PROPOSER else name

    starts = {label(name): starter(name) for name in names}
    rows, startup = run_online(starts, requests, settings.concurrencies, settings.prompts_at,
                               settings.max_new_tokens, console.print)  # fmt: skip
    meta = {**run_metadata(target, getattr(args, "command_line", None)), "cpu_isa": cpu_isa(),
            # each server runs the model in its own process: vLLM's on its engine, flyspec serve on its own kernels
            "device": "each server's own (a process per server)", "kernels": "each server's",
            "eager": args.vllm_eager, "num_draft_tokens": settings.num_draft_tokens,
            "max_new_tokens": settings.max_new_tokens, "min_prompts": settings.min_prompts,
            "schedule": schedule.to_vllm() if schedule else None, "server_logs": str(logs),
            "flyspec_serve_options": serve_options, "requests": "chat completions" if chat else "completions",
            "weight_bytes_per_token": llama_server.weights_read(names, target, args.target, llama)}  # fmt: skip
    written = write_outputs(out_dir, meta, rows, startup, schedule, args.plots)
    console.print("wrote " + ", ".join(str(path) for path in written))
    return 0
