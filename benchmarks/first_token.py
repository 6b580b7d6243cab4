"""Where the time to the first token goes, per prompt, in flyspec's engine (default: plain and ngram+exact).

For each benchmark turn of `flyspec bench --quick` (Spec-Bench, 2 prompts per category, mt_bench's second
turns included), the phases from the prompt to the first committed token, timed by wrapping the engine's
own methods (nothing is re-implemented here):

* encode: the chat template and the tokenizer (``LoadedModel.encode_prompt``; the bench does it once per turn);
* setup: the generation's state (stopper, draft length, drafter reset), up to the prefill;
* cache: the KV cache's reset or crop;
* prefill: the prefill forward(s) (``CachedModel.forward`` with ``logits_to_keep``);
* first step: the rest of the time to the first token (the drafter's reset, the first scoring forward where one
  runs, choosing and committing the token);
* compiles: graphs torch.compile built during the turn (``torch._dynamo`` counters: frames compiled,
  unique graphs), which must stay 0 after the load-time warm-up: the run fails (exit 1) where one was built.

Times are CPU seconds of this thread (``time.thread_time``) and wall seconds: run with one thread
(OMP_NUM_THREADS=1) on a shared machine, where CPU time is what stays comparable. Proportions and counts are
the result; absolute figures depend on the machine and its load.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/first_token.py --dtype bfloat16 --compile --out rows.jsonl

Each turn's row is printed as one JSON line (and written to --out), then the medians per method.
``tests/test_benchmark_tools.py`` runs it small on a tiny model. Records of its runs: benchmarks/2026-11-27-prefill.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._dynamo.utils import counters

from flyspec.api import build_decoder
from flyspec.bench.backends import conversation_ids
from flyspec.bench.data import load_prompts
from flyspec.config import DecodeConfig, SpeculationConfig
from flyspec.decoding.generation import Decoder
from flyspec.decoding.plain import PlainDecoder
from flyspec.resources import Resources
from flyspec.runtime.cached_model import CachedModel
from flyspec.runtime.loaded_model import LoadedModel

PHASES = ("encode", "setup", "cache", "prefill", "first_step")


class Clock:
    """CPU and wall seconds per phase; the phase running now (nested calls count in the outer one)."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = defaultdict(float)
        self.wall: dict[str, float] = defaultdict(float)
        self.current: str | None = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.current is not None:
            yield
            return
        self.current = name
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            yield
        finally:
            self.cpu[name] += time.thread_time() - cpu
            self.wall[name] += time.perf_counter() - wall
            self.current = None


def wrap(owner: Any, name: str, phase: Callable[..., str | None], clock: Clock) -> None:
    """Time every call of ``owner.name`` in the phase ``phase(*args)`` names (None: not timed)."""
    original = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        label = phase(*args, **kwargs)
        if label is None:
            return original(*args, **kwargs)
        with clock.phase(label):
            return original(*args, **kwargs)

    setattr(owner, name, timed)


def instrument(clock: Clock) -> None:
    wrap(LoadedModel, "encode_prompt", lambda *a, **k: "encode", clock)
    wrap(CachedModel, "reset", lambda *a, **k: "cache", clock)
    wrap(CachedModel, "crop_to", lambda *a, **k: "cache" if clock.current is None else None, clock)
    wrap(CachedModel, "forward", lambda self, ids, logits_to_keep=0: "prefill" if logits_to_keep else None, clock)


def first_token(decoder: Decoder, prompt_ids: list[int], max_new_tokens: int, clock: Clock) -> dict[str, float]:
    """Run one generation; the phases up to its first committed token (CPU ms), the wall TTFT, and the rest."""
    config = DecodeConfig(max_new_tokens=max_new_tokens)
    compiled_before = counters["stats"]["unique_graphs"], counters["frames"]["total"]
    started_cpu, started_wall = time.thread_time(), time.perf_counter()
    with clock.phase("setup"):
        stream = decoder.stream(prompt_ids, config=config)
        steps = stream._steps  # the loop's generator: the first item is the first committed token
    next(steps)  # the cache and prefill phases inside it are timed by their own wrappers
    ttft_cpu, ttft_wall = time.thread_time() - started_cpu, time.perf_counter() - started_wall
    phases = {f"{phase}_cpu_ms": 1000 * clock.cpu[phase] for phase in PHASES[:-1]}  # before the later steps add
    for _ in steps:
        pass
    total_wall = time.perf_counter() - started_wall
    return {
        "ttft_cpu_ms": 1000 * ttft_cpu,
        "ttft_wall_ms": 1000 * ttft_wall,
        "total_wall_ms": 1000 * total_wall,
        "graphs_compiled": counters["stats"]["unique_graphs"] - compiled_before[0],
        "frames_compiled": counters["frames"]["total"] - compiled_before[1],
        **phases,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="as flyspec's --model (default: packaged)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--methods", default="plain,ngram+exact")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--limit", type=int, default=2, help="prompts per Spec-Bench category (the bench's --quick)")
    parser.add_argument("--categories", default="", help="comma-separated Spec-Bench categories (default: all)")
    parser.add_argument("--out", help="also write every turn's row to this JSONL file")
    args = parser.parse_args()
    resources = Resources(args.dtype, compile=args.compile, kernels=args.kernels)
    target = resources.model(args.model)
    decoders: dict[str, Decoder] = {}
    for method in args.methods.split(","):
        if method == "plain":
            decoders[method] = PlainDecoder(target)
        else:
            drafter, verifier = method.split("+")
            spec = SpeculationConfig(drafter=drafter, verifier=verifier)
            decoders[method] = build_decoder(target, spec, resources=resources.isolated())
    clock = Clock()
    instrument(clock)
    categories = tuple(name for name in args.categories.split(",") if name)
    prompts = load_prompts(categories=categories, limit=args.limit)
    for decoder in decoders.values():  # the bench's warm-up
        first_token(decoder, target.encode_prompt("Hello! Say something short.", None), 8, clock)
    rows = []
    for prompt in prompts:
        answers: dict[str, list[str]] = defaultdict(list)
        for turn in range(len(prompt.turns)):
            for method, decoder in decoders.items():
                clock.cpu.clear(), clock.wall.clear()
                ids = conversation_ids(target, prompt.turns[: turn + 1], answers[method], None)
                row = first_token(decoder, ids, args.max_new_tokens, clock)
                answers[method].append(target.decode(decoder.scorer.committed[len(ids) :]))
                # the rest of the time to the first token: drafter reset, the first step's forward (if it runs
                # one), choosing and committing the token
                inside = sum(row[f"{phase}_cpu_ms"] for phase in ("setup", "cache", "prefill"))
                row["first_step_cpu_ms"] = row["ttft_cpu_ms"] - inside
                row.update({"method": method, "prompt": prompt.id, "turn": turn, "num_prompt_tokens": len(ids)})
                rows.append(row)
                print(
                    json.dumps(
                        {key: round(value, 2) if isinstance(value, float) else value for key, value in row.items()}
                    ),
                    flush=True,
                )
    if args.out:
        with open(args.out, "w") as out:
            out.writelines(json.dumps(row) + "\n" for row in rows)
    summary(rows, args)
    compiled = [row for row in rows if row["graphs_compiled"] or row["frames_compiled"]]
    if compiled:
        raise SystemExit(f"FAILED: torch.compile built graphs during {len(compiled)} turn(s) after the warm-up")


def summary(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\n{args.dtype}, {'compiled' if args.compile else 'eager'}, kernels {args.kernels}, "
        f"{torch.get_num_threads()} thread(s); CPU ms per turn, medians (share of the CPU TTFT, summed)"
    )
    for method in dict.fromkeys(row["method"] for row in rows):
        mine = [row for row in rows if row["method"] == method]
        total = sum(row["ttft_cpu_ms"] for row in mine)
        cells = [
            f"{phase} {statistics.median(r[f'{phase}_cpu_ms'] for r in mine):.1f} "
            f"({sum(r[f'{phase}_cpu_ms'] for r in mine) / total:.0%})"
            for phase in PHASES
        ]
        compiled = sum(row["graphs_compiled"] for row in mine), sum(row["frames_compiled"] for row in mine)
        print(
            f"{method}: TTFT cpu {statistics.median(r['ttft_cpu_ms'] for r in mine):.1f} ms, "
            f"wall {statistics.median(r['ttft_wall_ms'] for r in mine):.1f} ms; "
            + ", ".join(cells)
            + f"; graphs/frames compiled {compiled[0]}/{compiled[1]} over {len(mine)} turns"
        )


if __name__ == "__main__":
    main()
