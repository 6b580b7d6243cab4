"""GPU cost measurement on random-initialised targets with real shapes: no weights, no network.

    make gpu-bench                                   # every config, on CUDA, into $OUT or gpu-bench-out/
    make gpu-check                                   # Llama-3.1-8B's t(n) to n = 64 among the GPU check's stages
    PYTHONPATH=src python scripts/gpu_bench.py --device cuda --models llama-3.1-8b --out DIR
    PYTHONPATH=src python scripts/gpu_bench.py --smoke --device cpu --out DIR   # tiny config, seconds

Needs torch and transformers only (flyspec from ``src/``), so it runs on a machine that has the repo
tree and nothing else. For each target config in ``benchmarks/gpu-configs/*.json`` (the published
``config.json`` values of SmolLM2-1.7B, Llama-3.2-1B/3B, Llama-3.1-8B) it builds the model with
random weights on the device and measures:

1. ``t(n)``: one cached target forward of ``n`` tokens after ``--context`` cached tokens, n = 1..16
   (what a speculative step costs per draft length; flyspec's own ``CachedModel``, crop included).
2. flyspec's decoders on Spec-Bench prompts (the first turn, ``--per-category`` per category):
   plain decoding, n-gram + exact and n-gram + FLy, with tok/s and per step the target, draft and
   *engine* time (everything that is neither a target forward nor drafting: verification,
   commit, rollback, Python).
3. transformers' ``generate`` on the same prompts and device: plain greedy and prompt lookup
   (``prompt_lookup_num_tokens=k``), the peer of n-gram drafting.

Random weights make acceptance meaningless (the text is noise), so speedups measured here say
nothing; costs are real. The report combines the measured ``t(n)`` and engine time with the
acceptance length τ measured on the CPU with a real model (``--acceptance``, a ``flyspec bench``
results.json) into a **projected** speedup, labelled as such.

Token ids are the UTF-8 bytes of the prompts (a byte-level tokenizer built here, ids 3..258), so no
tokenizer needs downloading; every run generates exactly ``--max-new-tokens`` tokens (EOS ignored).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from flyspec.api import build_decoder
from flyspec.bench.data import load_prompts
from flyspec.bench.loop import forward_times
from flyspec.config import ConfigError, DecodeConfig, SpeculationConfig
from flyspec.decoding.plain import PlainDecoder
from flyspec.resources import Resources
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.loading import cpu_name, device_name, resolve_device, resolve_dtype

REPO = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO / "benchmarks" / "gpu-configs"
DEFAULT_ACCEPTANCE = REPO / "benchmarks" / "2026-11-21-spec-bench-fp32" / "results.json"
BYTE_OFFSET = 3  # ids 0-2: <pad>, <s>, </s>; byte b is id b + 3
SMOKE_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
METHODS = {"ngram+exact": "exact", "ngram+fly": "fly"}  # flyspec methods beside plain decoding
# On an H100 (2026-11-27) the first pass over the prompts cost 3-4x a warm one (78 against 22 ms per step for
# Llama-3.1-8B's shape), and the same method on the same prompts took 3-4 full passes to settle (78, 33, 34, 26, then
# 22 ms: benchmarks/2026-11-27-gpu-check-h100/rerun), after which every other method of the engine ran warm at once.
# A fixed single warm pass left the third method (ngram+fly) timed before the engine had settled (25.8 against 21.6
# ms per step for exact with the same ~0 drafts). So each engine's first method repeats full untimed passes until
# two in a row agree (WARM_TOLERANCE) or WARM_LIMIT_S is spent; the report gives the passes and their times.
WARM_TOLERANCE = 0.05
WARM_MAX_PASSES = 8
WARM_LIMIT_S = 45.0
WARM_UP = (
    f"each engine's first method (flyspec's, transformers') repeats every prompt in full, untimed, until two passes "
    f"in a row agree within {WARM_TOLERANCE:.0%} (at most {WARM_MAX_PASSES} passes or {WARM_LIMIT_S:.0f} s); 4 tokens "
    "by the others"
)


def warm_up(one_pass: Callable[[], tuple[int, float]], limit_s: float = WARM_LIMIT_S) -> list[float]:
    """Run ``one_pass`` (one untimed pass: new tokens, seconds) until two passes in a row agree per token.

    Agreement is within ``WARM_TOLERANCE`` of the later one; stops anyway after ``WARM_MAX_PASSES`` passes or once
    ``limit_s`` is spent (the cost stage has its own time limit). Returns every pass's milliseconds per token.
    """

    def per_token() -> float:
        tokens, seconds = one_pass()
        return 1000 * seconds / max(tokens, 1)

    started, times = time.monotonic(), [per_token()]
    while len(times) < WARM_MAX_PASSES and time.monotonic() - started < limit_s:
        times.append(per_token())
        if abs(times[-1] - times[-2]) <= WARM_TOLERANCE * times[-1]:
            break
    return times


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with no merges: one token per UTF-8 byte, nothing to download."""
    alphabet = _bytes_to_unicode()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {alphabet[b]: b + BYTE_OFFSET for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def read_config(name: str) -> tuple[dict[str, Any], str]:
    """The config values of ``name`` (a file in benchmarks/gpu-configs/, without .json) and its source."""
    path = CONFIG_DIR / f"{name}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.json")))
        raise SystemExit(f"gpu_bench: error: no config {path.name} in {CONFIG_DIR}; known: {known}")
    values = json.loads(path.read_text())
    return {key: value for key, value in values.items() if not key.startswith("_")}, values.get("_source", str(path))


def random_target(name: str, values: dict[str, Any], device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """The architecture of ``values`` with random weights, built directly on ``device`` in ``dtype``."""
    values = dict(values)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    config.eos_token_id = None  # random text has no end: every run generates max_new_tokens
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:  # weights are created (and randomly initialised) on the device: no host copy of 16 GB
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return LoadedModel(model=model.eval(), tokenizer=byte_tokenizer(), name=name)


def prompt_ids(tokenizer: PreTrainedTokenizerFast, per_category: int, max_prompt_tokens: int) -> list[list[int]]:
    """The first turn of ``per_category`` Spec-Bench prompts per category, as byte ids (cut to a length)."""
    prompts = load_prompts(None, limit=per_category)
    return [tokenizer(prompt.turns[0])["input_ids"][:max_prompt_tokens] for prompt in prompts]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cost_curve(target: LoadedModel, context_tokens: int, sizes: list[int], repeats: int) -> dict[str, float]:
    """``t(n)`` in ms for each size, after ``context_tokens`` cached positions (median of ``repeats``)."""
    context = (byte_tokenizer()(_spec_bench_text())["input_ids"] * 8)[:context_tokens]
    times = forward_times(target, context, tuple(sizes), repeats=repeats)
    return {str(size): 1000 * seconds for size, seconds in times.items()}


def _spec_bench_text() -> str:
    return " ".join(prompt.turns[0] for prompt in load_prompts(None, limit=2))


def run_flyspec(
    target: LoadedModel, prompts: list[list[int]], max_new_tokens: int, k: int
) -> tuple[dict[str, Any], list[float]]:
    """Plain decoding and the n-gram methods on every prompt: tok/s and per-step time split; the warm-up passes."""
    decode = DecodeConfig(max_new_tokens=max_new_tokens, ignore_eos=True)
    decoders: dict[str, Any] = {"plain": PlainDecoder(target, decode)}
    for method, verifier in METHODS.items():
        spec = SpeculationConfig(drafter="ngram", verifier=verifier, num_draft_tokens=k)
        decoders[method] = build_decoder(target, spec, decode, resources=Resources(models=(target,)))
    results: dict[str, Any] = {}
    warm: list[float] = []

    def one_pass(decoder: Any) -> tuple[int, float]:
        stats = [decoder.generate(ids).stats for ids in prompts]
        return sum(s.num_new_tokens for s in stats), sum(s.wall_time_s for s in stats)

    for index, (method, decoder) in enumerate(decoders.items()):
        if index == 0:  # see WARM_UP
            warm = warm_up(lambda: one_pass(decoder))  # noqa: B023
        else:
            decoder.generate(prompts[0], config=DecodeConfig(max_new_tokens=4, ignore_eos=True))
        totals = {"tokens": 0, "steps": 0, "proposed": 0, "wall": 0.0, "prefill": 0.0, "target": 0.0, "draft": 0.0}
        for ids in prompts:
            stats = decoder.generate(ids).stats
            totals["tokens"] += stats.num_new_tokens
            totals["steps"] += stats.num_target_forwards
            totals["proposed"] += stats.num_proposed
            totals["wall"] += stats.wall_time_s
            totals["prefill"] += stats.prefill_time_s
            totals["target"] += stats.target_time_s
            totals["draft"] += stats.draft_time_s
        decode_s = totals["wall"] - totals["prefill"]
        steps = max(totals["steps"], 1)
        results[method] = {
            "tokens_per_s": totals["tokens"] / totals["wall"],
            "decode_tokens_per_s": totals["tokens"] / decode_s,
            "tau": totals["tokens"] / steps,
            "mean_draft_tokens": totals["proposed"] / steps,
            "target_ms_per_step": 1000 * totals["target"] / steps,
            "draft_ms_per_step": 1000 * totals["draft"] / steps,
            "engine_ms_per_step": 1000 * (decode_s - totals["target"] - totals["draft"]) / steps,
            "num_new_tokens": totals["tokens"],
        }
    return results, warm


def generate_pass(
    target: LoadedModel, prompts: list[list[int]], max_new_tokens: int, **options: Any
) -> tuple[int, float]:
    """transformers' ``generate`` on each prompt in turn: new tokens and seconds, together."""
    device, tokens, seconds = target.device, 0, 0.0
    for ids in prompts:
        inputs = torch.tensor([ids], dtype=torch.long, device=device)
        synchronize(device)
        started = time.perf_counter()
        output = target.model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=0,
            **options,
        )
        synchronize(device)
        seconds += time.perf_counter() - started
        tokens += output.shape[1] - len(ids)
    return tokens, seconds


@torch.inference_mode()
def run_transformers(
    target: LoadedModel, prompts: list[list[int]], max_new_tokens: int, k: int
) -> tuple[dict[str, Any], list[float]]:
    """transformers' ``generate``: plain greedy and prompt lookup with ``k`` tokens, on the same prompts."""
    results, warm = {}, []
    for number, (method, options) in enumerate({"hf-plain": {}, "hf-lookup": {"prompt_lookup_num_tokens": k}}.items()):
        if number == 0:  # see WARM_UP
            warm = warm_up(lambda: generate_pass(target, prompts, max_new_tokens))
        else:
            generate_pass(target, prompts[:1], 4, **options)
        total_tokens, total_s = generate_pass(target, prompts, max_new_tokens, **options)
        results[method] = {"tokens_per_s": total_tokens / total_s, "num_new_tokens": total_tokens}
    return results, warm


def read_acceptance(path: Path | None) -> dict[str, Any]:
    """τ and k per method from a ``flyspec bench`` results.json (measured on the CPU with a real model)."""
    if path is None or not path.is_file():
        return {}
    results = json.loads(path.read_text())
    overall = results["summary"]["overall"]
    meta = results["meta"]
    methods = {method: {"tau": overall[method]["tau"]} for method in METHODS if method in overall}
    return {
        "source": str(path.relative_to(REPO) if path.is_relative_to(REPO) else path),
        "target": meta.get("target"),
        "dtype": meta.get("dtype"),
        "machine": meta.get("machine"),
        "date": meta.get("date"),
        "num_draft_tokens": meta.get("num_draft_tokens"),
        "methods": methods,
    }


def projections(curve: dict[str, float], measured: dict[str, Any], acceptance: dict[str, Any]) -> dict[str, Any]:
    """PROJECTED speedups: τ (CPU, real model) × the cost measured here. Not measurements.

    ``cost_only``: τ · t(1) / t(k + 1), every step one (k+1)-token forward and nothing else.
    ``with_engine``: τ · (t(1) + plain engine time) / (t(k + 1) + the method's draft and engine time).
    """
    k = acceptance.get("num_draft_tokens")
    if not acceptance.get("methods") or k is None or str(k + 1) not in curve:
        return {}
    plain = measured["plain"]["engine_ms_per_step"]
    found = {}
    for method, values in acceptance["methods"].items():
        tau = values["tau"]
        overhead = measured[method]["engine_ms_per_step"] + measured[method]["draft_ms_per_step"]
        found[method] = {
            "tau_cpu": tau,
            "k": k,
            "cost_only": tau * curve["1"] / curve[str(k + 1)],
            "with_engine": tau * (curve["1"] + plain) / (curve[str(k + 1)] + overhead),
        }
    return found


def machine(device: torch.device) -> str:
    hardware = device_name(device) if device.type == "cuda" else cpu_name()
    return (
        f"{hardware}; {os.cpu_count()} CPU cores, {platform.system()}; torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}), transformers {transformers.__version__}"
    )


def report(results: dict[str, Any]) -> str:
    """The markdown report of everything measured so far."""
    meta = results["meta"]
    lines = [
        "# flyspec GPU cost measurement (random-initialised targets)",
        "",
        f"- Machine: {meta['machine']}",
        f"- Device: {meta['device']}, dtype {meta['dtype']}; command: `{meta['command']}`",
        f"- Prompts: {meta['num_prompts']} Spec-Bench first turns (byte ids, ≤ {meta['max_prompt_tokens']} tokens), "
        f"{meta['max_new_tokens']} new tokens each, k = {meta['k']}; t(n) after {meta['context']} cached tokens",
        f"- Warm-up before each method's timed pass: {WARM_UP}",
        "- Random weights: acceptance and speedups measured here are meaningless; costs are real.",
        "",
    ]
    for name, model in results["models"].items():
        curve = model["t_ms"]
        lines += [f"## {name} ({model['parameters'] / 1e9:.2f} B parameters; {model['source']})", ""]
        lines += ["| n | " + " | ".join(curve) + " |", "|---|" + "---|" * len(curve)]
        lines += ["| t(n) ms | " + " | ".join(f"{t:.2f}" for t in curve.values()) + " |"]
        lines += ["| t(n)/t(1) | " + " | ".join(f"{t / curve['1']:.2f}" for t in curve.values()) + " |", ""]
        lines += [
            "| method | tok/s | target ms/step | draft ms/step | engine ms/step | mean draft tokens |",
            "|---|---|---|---|---|---|",
        ]
        for method, row in model["flyspec"].items():
            lines.append(
                f"| flyspec {method} | {row['tokens_per_s']:.1f} | {row['target_ms_per_step']:.2f} | "
                f"{row['draft_ms_per_step']:.2f} | {row['engine_ms_per_step']:.2f} | {row['mean_draft_tokens']:.1f} |"
            )
        for method, row in model["transformers"].items():
            lines.append(f"| transformers {method} | {row['tokens_per_s']:.1f} | | | | |")
        for engine, passes in model.get("warm_up_ms_per_token", {}).items():
            lines += [
                "",
                f"Warm-up, {engine}: {len(passes)} untimed passes, ms per token "
                + ", ".join(f"{t:.1f}" for t in passes),
            ]
        if model["projected"]:
            source = results["acceptance"]
            lines += [
                "",
                f"**Projected** speedup (not measured): τ from `{source['source']}` ({source['target']}, "
                f"{source['dtype']}, measured {source.get('date') or 'on an unrecorded date'} on "
                f"{source.get('machine') or 'an unrecorded CPU machine'}) with the costs above, measured on "
                f"{results['meta']['machine']} ({results['meta']['dtype']}).",
                "",
                "| method | τ (CPU) | k | cost only τ·t(1)/t(k+1) | with measured draft + engine time |",
                "|---|---|---|---|---|",
            ]
            for method, row in model["projected"].items():
                lines.append(
                    f"| {method} | {row['tau_cpu']:.2f} | {row['k']} | {row['cost_only']:.2f}x | "
                    f"{row['with_engine']:.2f}x |"
                )
        lines.append("")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="auto, cpu, cuda or cuda:N (default cuda)")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp16 without bf16), bfloat16, float32")
    parser.add_argument("--models", help="comma-separated config names (default: every file in benchmarks/gpu-configs)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-bench-out", help="output directory ($OUT)")
    parser.add_argument("--per-category", type=int, default=2, help="Spec-Bench prompts per category (default 2)")
    parser.add_argument("--max-prompts", type=int, help="at most this many of those prompts (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=SpeculationConfig().num_draft_tokens)
    parser.add_argument("--max-size", type=int, default=16, help="t(n) for n = 1 .. this (default 16)")
    parser.add_argument("--context", type=int, default=512, help="cached tokens before each t(n) forward")
    parser.add_argument("--repeats", type=int, default=20, help="t(n) samples per size (median)")
    parser.add_argument(
        "--acceptance", type=Path, default=DEFAULT_ACCEPTANCE, help="a flyspec bench results.json with τ (CPU)"
    )
    parser.add_argument("--smoke", action="store_true", help="a tiny random config and few tokens (CI, any device)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.per_category, args.max_new_tokens, args.context, args.repeats = 1, 8, 32, 2
        args.max_prompt_tokens, args.num_draft_tokens, args.max_prompts = 64, 8, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
    except ConfigError as error:
        print(f"gpu_bench: error: {error}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = byte_tokenizer()
    prompts = prompt_ids(tokenizer, args.per_category, args.max_prompt_tokens)[: args.max_prompts]
    if args.smoke:
        configs = {"smoke-tiny": (SMOKE_CONFIG, "a tiny Llama built in gpu_bench.py (--smoke)")}
    else:
        names = args.models.split(",") if args.models else sorted(p.stem for p in CONFIG_DIR.glob("*.json"))
        configs = {name: read_config(name.strip()) for name in names}
    results: dict[str, Any] = {
        "meta": {
            "date": time.strftime("%Y-%m-%d"),
            "command": "python scripts/gpu_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": machine(device),
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
            "num_prompts": len(prompts),
            "max_prompt_tokens": args.max_prompt_tokens,
            "max_new_tokens": args.max_new_tokens,
            "k": args.num_draft_tokens,
            "context": args.context,
            "random_weights": True,
        },
        "acceptance": read_acceptance(args.acceptance),
        "models": {},
    }
    sizes = list(range(1, args.max_size + 1))
    for name, (values, source) in configs.items():
        print(f"gpu_bench: {name} on {device} ({dtype})", file=sys.stderr, flush=True)
        target = random_target(name, values, device, dtype)
        curve = cost_curve(target, args.context, sizes, args.repeats)
        measured, flyspec_warm = run_flyspec(target, prompts, args.max_new_tokens, args.num_draft_tokens)
        hf_measured, hf_warm = run_transformers(target, prompts, args.max_new_tokens, args.num_draft_tokens)
        results["models"][name] = {
            "source": source,
            "parameters": sum(parameter.numel() for parameter in target.model.parameters()),
            "t_ms": curve,
            "flyspec": measured,
            "transformers": hf_measured,
            "warm_up_ms_per_token": {"flyspec": flyspec_warm, "transformers": hf_warm},
            "projected": projections(curve, measured, results["acceptance"]),
        }
        # written after every model, so a run cut short keeps what it measured
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        (out / "report.md").write_text(report(results))
        del target
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"gpu_bench: wrote {out / 'results.json'} and {out / 'report.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
