"""A first small measured table for BENCHMARKS.md: plain decoding vs n-gram+exact vs n-gram+FLy.

Runs every method on the same prompts in one process, interleaved per prompt (so machine drift
hits all methods alike), after a warm-up. Speedup = method tokens/s ÷ plain tokens/s summed over
the same prompts. Prints a Markdown table. The full harness with Spec-Bench is `flyspec bench`
(a later issue); this script only exercises the public API.

    python benchmarks/first_table.py [--max-new-tokens 128] [--dtype auto] [--repeats 1]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch

import flyspec
from flyspec import DecodeConfig, NgramDrafter, PlainDecoder, SpeculativeDecoder, load_model, make_verifier

PROMPTS = {
    "code": "Write a Python function that checks whether a number is prime, then explain how it works.",
    "rewrite": (
        "Rewrite this paragraph in simpler words: Speculative decoding accelerates autoregressive generation "
        "by drafting several tokens cheaply and verifying them with the large model in a single forward pass. "
        "Verification keeps the drafted tokens that match the target model's own predictions."
    ),
    "qa": "What is the capital of France, and what is it famous for?",
    "math": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Explain step by step.",
    "summary": (
        "Summarize in two sentences: The city council met on Tuesday to discuss the new bike lanes. Residents "
        "said the lanes made streets safer, while some shop owners worried about losing parking. The council "
        "voted to extend the lanes to two more streets and to review parking in six months."
    ),
    "list": "List ten fruits, one per line, each with its typical color.",
}
METHODS = ("plain", "ngram+exact", "ngram+fly")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def forward_time(target, num_tokens: int, context: int = 200, repeats: int = 15) -> float:
    """Median seconds for one target forward of ``num_tokens`` tokens after ``context`` cached tokens."""
    from flyspec.target import CachedModel

    runner = CachedModel(target)
    runner.forward(list(range(1000, 1000 + context)), logits_to_keep=1)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        runner.forward(list(range(2000, 2000 + num_tokens)))
        times.append(time.perf_counter() - started)
        runner.crop_to(context)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--target", default=flyspec.DEFAULT_MODEL)
    args = parser.parse_args()

    target = load_model(args.target, dtype=args.dtype)
    config = DecodeConfig(max_new_tokens=args.max_new_tokens)
    decoders = {
        "plain": PlainDecoder(target, config),
        "ngram+exact": SpeculativeDecoder(target, NgramDrafter(), make_verifier("exact"), config),
        "ngram+fly": SpeculativeDecoder(target, NgramDrafter(), make_verifier("fly"), config),
    }
    for decoder in decoders.values():  # warm-up
        decoder.generate("Hello!", config=DecodeConfig(max_new_tokens=8))

    rows: dict[str, dict[str, list]] = {m: {"tokens": [], "time": [], "forwards": [], "identical": []} for m in METHODS}
    per_prompt: list[str] = []
    for name, prompt in PROMPTS.items():
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        outputs = {}
        for _ in range(args.repeats):
            for method in METHODS:  # interleaved per prompt
                result = decoders[method].generate(prompt)
                times[method].append(result.stats.wall_time_s)
                outputs[method] = result
        for method in METHODS:
            result = outputs[method]
            rows[method]["tokens"].append(result.num_new_tokens)
            rows[method]["time"].append(statistics.median(times[method]))
            rows[method]["forwards"].append(result.stats.num_target_forwards)
            rows[method]["identical"].append(result.token_ids == outputs["plain"].token_ids)
        fly = outputs["ngram+fly"]
        per_prompt.append(
            f"| {name} | {outputs['plain'].num_new_tokens} | {outputs['ngram+exact'].stats.mean_acceptance_length:.2f} "
            f"| {fly.stats.mean_acceptance_length:.2f} | {fly.stats.num_loose_accepts} "
            f"| {'yes' if fly.token_ids == outputs['plain'].token_ids else 'no'} |"
        )

    plain_rate = sum(rows["plain"]["tokens"]) / sum(rows["plain"]["time"])
    t1, tk = forward_time(target, 1), forward_time(target, config.num_draft_tokens + 1)
    print(f"Date: {datetime.date.today().isoformat()}  ")
    print(f"Machine: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}  ")
    print(
        f"Target: {args.target}, dtype {str(target.dtype).removeprefix('torch.')}, greedy (T=0), "
        f"k={config.num_draft_tokens}, max_new_tokens={args.max_new_tokens}, {len(PROMPTS)} prompts, "
        f"repeats={args.repeats} (median time per prompt)\n"
    )
    print("| method | lossless | tokens | tokens/s | τ (tokens/forward) | speedup vs plain | identical to plain |")
    print("|---|---|---|---|---|---|---|")
    for method in METHODS:
        row = rows[method]
        rate = sum(row["tokens"]) / sum(row["time"])
        tau = sum(row["tokens"]) / sum(row["forwards"])
        lossless = "no (lossy)" if method == "ngram+fly" else "yes"
        print(
            f"| {method} | {lossless} | {sum(row['tokens'])} | {rate:.1f} | {tau:.2f} | {rate / plain_rate:.2f}x "
            f"| {sum(row['identical'])}/{len(row['identical'])} prompts |"
        )
    print(
        f"\nTarget forward after 200 cached tokens: t(1) = {t1 * 1000:.1f} ms, "
        f"t(k+1={config.num_draft_tokens + 1}) = {tk * 1000:.1f} ms, ratio {tk / t1:.2f}. "
        f"The τ-limit of a method is τ × t(1)/t(k+1) (every forward at full k+1 tokens)."
    )
    print("\nPer prompt: τ of n-gram+exact and n-gram+FLy, FLy's loose accepts, FLy identical to plain\n")
    print("| prompt | tokens | τ exact | τ FLy | loose accepts | FLy identical |")
    print("|---|---|---|---|---|---|")
    print("\n".join(per_prompt))


if __name__ == "__main__":
    main()
