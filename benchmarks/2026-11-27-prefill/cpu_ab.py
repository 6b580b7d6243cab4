"""CPU seconds per request of flyspec's plain engine and of vLLM-CPU's, on the same prompt ids, one thread each.

On a machine other jobs share, wall times say little; the CPU time a process spends on a request (one OpenMP
thread, so no time is spent spinning at barriers) is what stays comparable. For each prompt: the CPU time of a
request for 1 new token (prefill and first token: the CPU cost of the time to first token) and for N new tokens
(EOS ignored), and their difference per token (the decode step). Run it once per engine, in its own venv:

    cd benchmarks/2026-11-27-prefill
    OMP_NUM_THREADS=1 ../../.venv/bin/python cpu_ab.py --engine flyspec --dtype bfloat16 --compile
    VLLM_CPU_OMP_THREADS_BIND=0 ../../.venv-vllm/bin/python cpu_ab.py --engine vllm --dtype bfloat16

vLLM runs compiled (not enforce_eager) unless --eager, with prefix caching off (flyspec reuses no prefix across
unrelated prompts either).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

MODEL = "smollm2-135m-instruct"


def prompt_ids(limit: int) -> tuple[list[list[int]], str]:
    """The bench's --quick first turns (chat template applied), and the model directory vLLM loads."""
    from flyspec.bench.backends import conversation_ids
    from flyspec.bench.data import load_prompts
    from flyspec.runtime.loading import find_gguf, gguf_to_hf_dir, load_served

    served = load_served(MODEL, "float32")
    ids = [conversation_ids(served, prompt.turns[:1], [], None) for prompt in load_prompts(limit=limit)]
    gguf = find_gguf(MODEL)
    assert gguf is not None
    return ids, str(gguf_to_hf_dir(gguf))


def flyspec_engine(args: argparse.Namespace, model_dir: str) -> Callable[[list[int], int], int]:
    from flyspec.baseline import PlainDecoder

    from flyspec.config import DecodeConfig
    from flyspec.runtime.loading import load_model

    target = load_model(MODEL, args.dtype, compile=args.compile)

    def generate(ids: list[int], tokens: int) -> int:
        # a decoder per request, as flyspec serve builds: no prefix of an earlier request is reused
        config = DecodeConfig(max_new_tokens=tokens, ignore_eos=True)
        return len(PlainDecoder(target).generate(ids, config=config).token_ids)

    return generate


def vllm_engine(args: argparse.Namespace, model_dir: str) -> Callable[[list[int], int], int]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its CPU time counted
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=args.dtype, max_model_len=4096, kv_cache_memory_bytes=512 << 20,
              enable_prefix_caching=False, enforce_eager=args.eager, seed=0)  # fmt: skip

    def generate(ids: list[int], tokens: int) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        return len(llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids)

    return generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("flyspec", "vllm"), required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--compile", action="store_true", help="flyspec: --compile")
    parser.add_argument("--eager", action="store_true", help="vLLM: enforce_eager")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--limit", type=int, default=2, help="prompts per Spec-Bench category")
    parser.add_argument("--repeats", type=int, default=3, help="the least CPU time of this many runs counts")
    args = parser.parse_args()
    prompts, model_dir = prompt_ids(args.limit)
    generate = (flyspec_engine if args.engine == "flyspec" else vllm_engine)(args, model_dir)
    generate(prompts[0], 8)  # warm-up

    def cpu_ms(ids: list[int], tokens: int) -> float:
        times = []
        for _ in range(args.repeats):
            started = time.process_time()
            assert generate(ids, tokens) == tokens
            times.append(time.process_time() - started)
        return 1000 * min(times)

    rows: list[dict[str, Any]] = []
    for ids in prompts:
        first, whole = cpu_ms(ids, 1), cpu_ms(ids, args.tokens)
        rows.append({"prompt_tokens": len(ids), "first_token_cpu_ms": first, "request_cpu_ms": whole,
                     "step_cpu_ms": (whole - first) / (args.tokens - 1)})  # fmt: skip
        print(json.dumps({key: round(value, 2) for key, value in rows[-1].items()}), flush=True)
    label = f"{args.engine} {args.dtype} " + ("compiled" if args.compile or (args.engine == "vllm" and not args.eager)
                                             else "eager")  # fmt: skip
    medians = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    total = sum(row["request_cpu_ms"] for row in rows)
    print(
        f"{label}: medians over {len(rows)} prompts: first token {medians['first_token_cpu_ms']:.1f} ms CPU, "
        f"step {medians['step_cpu_ms']:.2f} ms CPU; {args.tokens}-token requests {total:.0f} ms CPU in all"
    )


if __name__ == "__main__":
    main()
