"""``flyspec`` command line: a thin layer over the library API.

Bad input exits with code 2 and one line saying what to change (no traceback).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, NoReturn

from flyspec import __version__
from flyspec.api import build_decoder, make_generator
from flyspec.baseline import PlainDecoder
from flyspec.config import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_NUM_DRAFT_TOKENS,
    ConfigError,
    DecodeConfig,
    FlyConfig,
    MarginConfig,
    NgramConfig,
    SamplingConfig,
    TypicalConfig,
)
from flyspec.drafters.registry import DRAFTERS
from flyspec.models import DEFAULT_MODEL, DTYPES, set_threads
from flyspec.types import GenerationResult
from flyspec.verifiers.registry import LOSSLESS_VERIFIERS, VERIFIERS

_FLY, _MARGIN, _TYPICAL = FlyConfig(), MarginConfig(), TypicalConfig()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        _fail(f"{message} (see `{self.prog} --help`)")


def _fail(message: str) -> NoReturn:
    print(f"flyspec: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="flyspec",
        description="Training-free speculative decoding over Hugging Face transformers. Verifiers: "
        f"{', '.join(LOSSLESS_VERIFIERS)} (lossless); "
        f"{', '.join(v for v in VERIFIERS if v not in LOSSLESS_VERIFIERS)} (lossy, opt-in).",
    )
    parser.add_argument("--version", action="version", version=f"flyspec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = commands.add_parser(
        "generate",
        help="generate text with speculative decoding",
        description="Generate text with speculative decoding. The default verifier (exact) is lossless; "
        "fly, margin and typical are lossy and must be asked for.",
    )
    gen.add_argument("prompt", help="the prompt (chat models get their chat template unless --no-chat)")
    models = gen.add_argument_group("models")
    models.add_argument(
        "--target",
        default=DEFAULT_MODEL,
        help=f"target model: packaged name, .gguf file, HF directory or hub id (default {DEFAULT_MODEL})",
    )
    models.add_argument("--draft-model", help="draft model for --drafter draft-model/multilevel (same tokenizer)")
    models.add_argument(
        "--dtype",
        default="auto",
        choices=sorted(DTYPES),
        help="weights/compute dtype; auto = bfloat16 where the CPU/GPU has native bf16, else float32",
    )
    models.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    chat = models.add_mutually_exclusive_group()
    chat.add_argument(
        "--chat",
        dest="use_chat",
        action="store_true",
        default=None,
        help="apply the chat template (default when the model has one)",
    )
    chat.add_argument("--no-chat", dest="use_chat", action="store_false", help="feed the prompt as raw text")

    spec = gen.add_argument_group("speculation")
    spec.add_argument("--drafter", default="ngram", choices=DRAFTERS, help="draft source (default ngram)")
    spec.add_argument(
        "--verifier",
        default="exact",
        choices=VERIFIERS,
        help="acceptance rule; exact/rejection are lossless, fly/margin/typical lossy (default exact)",
    )
    spec.add_argument(
        "-k",
        "--num-draft-tokens",
        type=int,
        default=DEFAULT_NUM_DRAFT_TOKENS,
        help=f"draft tokens per target forward (default {DEFAULT_NUM_DRAFT_TOKENS})",
    )
    spec.add_argument(
        "--window-size",
        type=int,
        default=_FLY.window_size,
        help=f"FLy deferred window; 0 disables it (default {_FLY.window_size})",
    )
    spec.add_argument(
        "--entropy-threshold",
        type=float,
        default=_FLY.entropy_threshold,
        help=f"FLy entropy gate on the target's top-3 entropy; 0 disables it (default {_FLY.entropy_threshold})",
    )
    spec.add_argument(
        "--fly-temperature-rule",
        default=_FLY.temperature_rule,
        choices=("rejection", "two-sample"),
        help="FLy base rule at T>0 (default rejection)",
    )
    spec.add_argument(
        "--margin-ratio",
        type=float,
        default=_MARGIN.logit_ratio,
        help=f"MARS: accept the runner-up when z2/z1 > this (default {_MARGIN.logit_ratio})",
    )
    spec.add_argument("--typical-epsilon", type=float, default=_TYPICAL.epsilon, help="typical acceptance epsilon")
    spec.add_argument("--typical-delta", type=float, default=_TYPICAL.delta, help="typical acceptance delta")
    spec.add_argument("--max-ngram", type=int, default=NgramConfig().max_ngram, help="longest n-gram to look up")
    spec.add_argument("--min-ngram", type=int, default=NgramConfig().min_ngram, help="shortest n-gram to look up")
    spec.add_argument(
        "--num-ngram-tokens",
        type=int,
        default=6,
        help="multilevel: n-gram tokens the draft model checks per forward (default 6)",
    )

    sampling = gen.add_argument_group("sampling and stopping")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    sampling.add_argument("--top-k", type=int, default=0, help="0 = off")
    sampling.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    sampling.add_argument("--seed", type=int, help="random seed for sampling (T>0)")
    sampling.add_argument(
        "--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help=f"default {DEFAULT_MAX_NEW_TOKENS}"
    )
    sampling.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")

    out = gen.add_argument_group("output")
    out.add_argument("--stream", action="store_true", help="print text as tokens are committed")
    out.add_argument(
        "--compare", action="store_true", help="also run plain decoding on the same prompt; report speedup and identity"
    )
    out.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    out.add_argument("-v", "--verbose", action="store_true", help="log model loading")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if not args.verbose:
        _quiet_transformers()
    try:
        return _generate(args)
    except ConfigError as error:
        _fail(str(error))


def _generate(args: argparse.Namespace) -> int:
    if not args.prompt.strip():
        raise ConfigError("the prompt is empty; give some text to continue")
    set_threads(args.threads)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    fly = FlyConfig(args.window_size, args.entropy_threshold, temperature_rule=args.fly_temperature_rule)
    decoder = build_decoder(
        args.target,
        args.drafter,
        args.verifier,
        args.draft_model,
        num_draft_tokens=args.num_draft_tokens,
        max_new_tokens=args.max_new_tokens,
        stop=tuple(args.stop),
        sampling=sampling,
        fly=fly,
        margin=MarginConfig(args.margin_ratio),
        typical=TypicalConfig(args.typical_epsilon, args.typical_delta),
        ngram=NgramConfig(args.max_ngram, args.min_ngram),
        num_ngram_tokens=args.num_ngram_tokens,
        dtype=args.dtype,
    )
    baseline = None
    if args.compare:
        plain = PlainDecoder(
            decoder.loaded,
            DecodeConfig(max_new_tokens=args.max_new_tokens, stop_strings=tuple(args.stop), sampling=sampling),
        )
        plain.generate(args.prompt, use_chat=args.use_chat, config=DecodeConfig(max_new_tokens=4))  # warm-up
        baseline = plain.generate(args.prompt, generator=make_generator(args.seed), use_chat=args.use_chat)
    stream = decoder.stream(args.prompt, generator=make_generator(args.seed), use_chat=args.use_chat)
    for piece in stream:
        if args.stream and not args.json:
            print(piece, end="", flush=True)
    result = stream.result
    assert result is not None
    record = _record(args, decoder.loaded.dtype, result, baseline)
    if args.json:
        print(json.dumps(record, ensure_ascii=False))
    else:
        if args.stream:
            print()
        else:
            print(result.text)
        if baseline is not None and not record["identical_to_baseline"]:
            print(f"\n--- plain decoding (differs from the {args.verifier} output above) ---\n{baseline.text}")
        _print_summary(record)
    return 0


def _record(
    args: argparse.Namespace, dtype: Any, result: GenerationResult, baseline: GenerationResult | None
) -> dict[str, Any]:
    stats = result.stats
    record: dict[str, Any] = {
        "text": result.text,
        "target": args.target,
        "drafter": args.drafter,
        "draft_model": args.draft_model,
        "verifier": args.verifier,
        "lossless": args.verifier in LOSSLESS_VERIFIERS,
        "dtype": str(dtype).removeprefix("torch."),
        "num_draft_tokens": args.num_draft_tokens,
        "temperature": args.temperature,
        "num_prompt_tokens": len(result.prompt_token_ids),
        "finish_reason": result.finish_reason,
        **stats.to_dict(),
    }
    if baseline is not None:
        record.update(
            baseline_text=baseline.text,
            baseline_num_new_tokens=baseline.num_new_tokens,
            baseline_wall_time_s=baseline.stats.wall_time_s,
            baseline_tokens_per_s=baseline.stats.tokens_per_s,
            speedup=stats.tokens_per_s / baseline.stats.tokens_per_s if baseline.stats.tokens_per_s else 0.0,
            identical_to_baseline=baseline.token_ids == result.token_ids,
        )
    return record


def _print_summary(record: dict[str, Any]) -> None:
    label = "lossless" if record["lossless"] else "LOSSY: output may differ from plain decoding"
    lines = [
        f"[{record['drafter']} + {record['verifier']} ({label}), {record['dtype']}] "
        f"{record['num_new_tokens']} tokens in {record['wall_time_s']:.2f} s = {record['tokens_per_s']:.1f} tok/s, "
        f"τ = {record['mean_acceptance_length']:.2f} tokens/forward, "
        f"{record['num_loose_accepts']} loose accepts",
    ]
    if "speedup" in record:
        lines.append(
            f"[plain decoding] {record['baseline_tokens_per_s']:.1f} tok/s → speedup {record['speedup']:.2f}x, "
            f"identical to plain decoding: {'yes' if record['identical_to_baseline'] else 'no'}"
        )
    print("\n".join(lines), file=sys.stderr)


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
