"""The first token's cost, old path against new, back to back in one process (A/B ratios on a shared machine).

Per prompt of `flyspec bench --quick` (first turns), on one model loaded once, each variant runs in turn, the
order rotated per repeat, the least time of the repeats kept:

* ``two-forwards`` (the engine before issue 53): an eager prefill of all but the last prompt token (its output
  head run for one unused row), then the last token as a step of its own (compiled with --compile);
* ``one-eager``: one eager prefill of the whole prompt, the last row kept (the first token's logits);
* ``one-compiled`` (--compile only; the engine now): the same through the compiled prefill graph.

CPU time of this thread (``time.thread_time``) and wall time, ms. Use one thread (OMP_NUM_THREADS=1) where other
jobs share the machine: CPU time then stays comparable.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/2026-11-27-prefill/ab_first_token.py --dtype bfloat16 --compile
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from flyspec.bench.backends import conversation_ids
from flyspec.bench.data import load_prompts
from flyspec.runtime.cached_model import CachedModel
from flyspec.runtime.loading import load_model


def variants(cached: CachedModel, ids: list[int], compiled: bool) -> dict[str, Callable[[], torch.Tensor]]:
    model, prefill = cached.model, cached.prefill_forward

    def run(forward: Callable, tokens: list[int], keep: int) -> torch.Tensor:
        inputs = torch.tensor([tokens])
        for layer in cached.cache.layers:
            layer.reserve(len(tokens))  # as CachedModel.forward does (a no-op before the first write)
        with torch.inference_mode():
            output = forward(
                input_ids=inputs, use_cache=True, logits_to_keep=keep, **{cached._cache_argument: cached.cache}
            )
        return output.logits[0, -1].float()

    def two_forwards() -> torch.Tensor:
        cached.reset()
        run(model, ids[:-1], 1)
        return cached.forward(ids[-1:])[-1]  # the step's compiled graph with --compile

    def one(forward: Callable) -> Callable[[], torch.Tensor]:
        return lambda: (cached.reset(), run(forward, ids, 1))[1]

    chosen = {"two-forwards": two_forwards, "one-eager": one(model)}
    if compiled:
        assert prefill is not None
        chosen["one-compiled"] = one(prefill)
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--limit", type=int, default=2)
    args = parser.parse_args()
    loaded = load_model("smollm2-135m-instruct", args.dtype, compile=args.compile)
    cached = CachedModel(loaded)
    prompts = [conversation_ids(loaded, prompt.turns[:1], [], None) for prompt in load_prompts(limit=args.limit)]
    cpu: dict[str, list[float]] = {}
    wall: dict[str, list[float]] = {}
    for ids in prompts:
        chosen = variants(cached, ids, args.compile)
        best_cpu = {name: float("inf") for name in chosen}
        best_wall = dict(best_cpu)
        names = list(chosen)
        for repeat in range(args.repeats + 1):  # the first round warms up
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                started_cpu, started_wall = time.thread_time(), time.perf_counter()
                chosen[name]().argmax()
                if repeat:
                    best_cpu[name] = min(best_cpu[name], 1000 * (time.thread_time() - started_cpu))
                    best_wall[name] = min(best_wall[name], 1000 * (time.perf_counter() - started_wall))
        for name in names:
            cpu.setdefault(name, []).append(best_cpu[name])
            wall.setdefault(name, []).append(best_wall[name])
        print(len(ids), " ".join(f"{name} {best_cpu[name]:.1f}/{best_wall[name]:.1f}" for name in names), flush=True)
    reference = statistics.median(cpu["two-forwards"])
    print(f"\n{args.dtype}, {'compiled' if args.compile else 'eager'}, {torch.get_num_threads()} thread(s), "
          f"{len(prompts)} prompts; median CPU / wall ms, and CPU ÷ two-forwards'")  # fmt: skip
    for name in cpu:
        median = statistics.median(cpu[name])
        print(f"  {name}: {median:.1f} / {statistics.median(wall[name]):.1f} ms ({median / reference:.2f})")


if __name__ == "__main__":
    main()
