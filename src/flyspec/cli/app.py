"""``flyspec`` command line: a thin layer over the library API.

Bad input exits with code 2 and one line saying what to change (no traceback).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import secrets
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from flyspec.cli.options import add_model_options, engine_options, quiet_transformers
from flyspec.cli.speculation import add_speculation_options, speculation_config
from flyspec.config import DEFAULT_MAX_NEW_TOKENS, ConfigError, DecodeConfig, SamplingConfig, SpeculationConfig
from flyspec.config.names import LOSSLESS_VERIFIERS, LOSSY_VERIFIERS, VERSION

if TYPE_CHECKING:
    from flyspec.decoding.result import GenerationResult

# torch and transformers are imported by the command handlers, never here: `flyspec --help` stays instant


class ErrorParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see `{self.prog} --help`)")


def fail(message: str) -> NoReturn:
    """Print ``flyspec: error: <message>`` to stderr and exit with code 2."""
    print(f"flyspec: error: {message}", file=sys.stderr)
    raise SystemExit(2)


# Subcommands beside `generate`: each module has ``add_parser(commands)``, which sets ``handler``.
_COMMAND_MODULES = (
    "flyspec.bench.command",
    "flyspec.bench.demo",
    "flyspec.eval.command",
    "flyspec.calibration.command",
    "flyspec.server.command",
    "flyspec.cli.export",
)


def build_parser() -> argparse.ArgumentParser:
    parser = ErrorParser(
        prog="flyspec",
        description="Training-free speculative decoding over Hugging Face transformers. Verifiers: "
        f"{', '.join(LOSSLESS_VERIFIERS)} (lossless); "
        f"{', '.join(LOSSY_VERIFIERS)} (lossy, opt-in).",
    )
    parser.add_argument("--version", action="version", version=f"flyspec {VERSION}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=ErrorParser)
    _add_generate_parser(commands)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).add_parser(commands)
    return parser


def _add_generate_parser(commands: argparse._SubParsersAction) -> None:
    gen = commands.add_parser(
        "generate",
        help="generate text with speculative decoding",
        description="Generate text with speculative decoding. The default verifier (exact) is lossless; "
        f"{', '.join(LOSSY_VERIFIERS)} are lossy and must be asked for.",
    )
    gen.set_defaults(handler=_generate)
    gen.add_argument(
        "prompt",
        nargs="?",
        help="the prompt (chat models get their chat template unless --no-chat); - or left out with input piped "
        "in: read it from stdin (one trailing newline dropped)",
    )
    gen.add_argument(
        "--prompt-file", metavar="PATH", help="read the prompt from this UTF-8 text file (one trailing newline dropped)"
    )
    gen.add_argument(
        "--prediction",
        metavar="PATH",
        help="a UTF-8 text file with what the output is expected to be, mostly (OpenAI's Predicted Outputs: the file "
        "before an edit); its tokens are drafted where they line up with the output, the text stays the target's "
        "(lossless verifiers); - reads it from stdin (the prompt then comes as an argument or --prompt-file)",
    )
    add_model_options(gen)
    add_speculation_options(gen)
    sampling = gen.add_argument_group("sampling and stopping")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    sampling.add_argument("--top-k", type=int, default=0, help="0 = off")
    sampling.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    sampling.add_argument(
        "--seed",
        type=int,
        help="random seed for sampling (T>0): it names the text, drafts or not (exact verification); default: a "
        "fresh one, shared with --compare's plain run and printed with --json",
    )
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.command_line = "flyspec " + shlex.join(argv)
    verbose = getattr(args, "verbose", False)
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s")
    if not verbose:
        quiet_transformers()
    try:
        return args.handler(args)
    except ConfigError as error:
        fail(str(error))
    except KeyboardInterrupt:
        print("flyspec: interrupted", file=sys.stderr)
        return 130


def run() -> NoReturn:
    """The console script (``flyspec``, ``python -m flyspec``): :func:`main`, then the process exits with its code.

    The heap is frozen first: the interpreter's exit otherwise sweeps every object torch and transformers made, ~0.9 s
    of a ``flyspec generate`` on 2 cores (6.0 -> 5.0 s). ``atexit`` handlers still run; only the last garbage
    collections skip what is frozen. Not where Triton is loaded (a GPU's compiled steps): its bindings report what
    is left uncollected as leaks. In-process callers use :func:`main`, which leaves their heap alone.
    """
    code = main()
    if "triton" not in sys.modules:
        gc.freeze()
    sys.exit(code)


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt from exactly one source: the argument, ``--prompt-file``, or stdin (``-``, or piped in).

    One trailing newline of a file or stdin is dropped, so ``echo hi | flyspec generate -`` is ``flyspec generate hi``.
    """
    piped = sys.stdin is not None and not sys.stdin.isatty()
    if args.prompt is not None and args.prompt_file is not None:
        where = "on stdin (-)" if args.prompt == "-" else "as an argument"
        raise ConfigError(f"give the prompt once: {where} or with --prompt-file, not both")
    if args.prompt == "-" or (args.prompt is None and args.prompt_file is None and piped):
        source, prompt = "stdin", _read_text(sys.stdin.read if sys.stdin is not None else None, "stdin")
    elif args.prompt_file is not None:
        source = f"--prompt-file {args.prompt_file}"
        prompt = _read_text(lambda: Path(args.prompt_file).read_text(encoding="utf-8"), source)
    elif args.prompt is not None:
        return _non_empty(args.prompt, "the prompt argument")
    else:
        raise ConfigError(
            "no prompt: give it as an argument, with --prompt-file PATH, or on stdin (echo text | flyspec generate -)"
        )
    return _non_empty(prompt.removesuffix("\n").removesuffix("\r"), source)


def read_prediction(args: argparse.Namespace) -> str | None:
    """The ``--prediction`` file's text as it is (its last newline too: an edited file keeps one), or stdin's (``-``).

    Called before :func:`read_prompt`: stdin can hold the prediction or the prompt, not both."""
    if args.prediction is None:
        return None
    if args.prediction != "-":
        path = args.prediction
        return _read_text(lambda: Path(path).read_text(encoding="utf-8"), f"--prediction {path}", "the prediction")
    if args.prompt == "-" or (args.prompt is None and args.prompt_file is None):
        raise ConfigError("--prediction - reads stdin, so give the prompt as an argument or with --prompt-file")
    return _read_text(sys.stdin.read if sys.stdin is not None else None, "stdin", "the prediction")


def _read_text(read: Callable[[], str] | None, source: str, what: str = "the prompt") -> str:
    if read is None:
        raise ConfigError(f"cannot read {what} from {source}: there is none")
    try:
        return read()
    except OSError as error:
        raise ConfigError(f"cannot read {what} from {source}: {error.strerror or error}") from error
    except UnicodeDecodeError as error:
        reason = f"it is not UTF-8 text ({error.reason} at byte {error.start})"
        raise ConfigError(f"cannot read {what} from {source}: {reason}") from error


def _non_empty(prompt: str, source: str) -> str:
    if not prompt.strip():
        raise ConfigError(f"the prompt is empty ({source}); give some text to continue")
    return prompt


def _generate(args: argparse.Namespace) -> int:
    from flyspec.api import build_decoder
    from flyspec.decoding.plain import PlainDecoder
    from flyspec.resources import Resources
    from flyspec.runtime.loading import set_threads
    from flyspec.sampling.sampler import make_generator

    prediction = read_prediction(args)
    args.prompt = read_prompt(args)
    set_threads(args.threads)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    spec = speculation_config(args)
    decode = DecodeConfig(max_new_tokens=args.max_new_tokens, stop_strings=tuple(args.stop), sampling=sampling)
    resources = Resources(**engine_options(args, [spec]))
    decoder = build_decoder(args.target, spec, decode, resources=resources)
    spec = decoder.speculation  # as it runs: a calibration profile may have set the lossy settings
    if decoder.profile is not None and not args.json:
        print(f"[profile] {decoder.profile.describe()}", file=sys.stderr)
    baseline = None
    device = decoder.device
    if args.seed is None and not sampling.greedy:  # one seed for both runs: it decides the text (sampling/coupled.py)
        args.seed = secrets.randbits(63)
    if args.compare:
        plain = PlainDecoder(decoder.target, decode)
        plain.generate(args.prompt, use_chat=args.use_chat, config=DecodeConfig(max_new_tokens=4))  # warm-up
        baseline = plain.generate(args.prompt, generator=make_generator(args.seed, device), use_chat=args.use_chat)
    generator = make_generator(args.seed, device)
    stream = decoder.stream(args.prompt, generator=generator, use_chat=args.use_chat, prediction=prediction)
    for piece in stream:
        if args.stream and not args.json:
            print(piece, end="", flush=True)
    result = stream.result
    assert result is not None
    if result.stats.exact_outside_sampling_range and not args.json:
        measured = result.stats.exact_outside_sampling_range
        print(
            f"[profile] {spec.verifier}'s setting was measured at {measured}, and this generation samples at "
            f"{sampling.temperature:g} (top-p {sampling.top_p:g}, top-k {sampling.top_k}): verified exactly (lossless)",
            file=sys.stderr,
        )
    if result.stats.exact_with_prediction and not args.json:
        print(f"[profile] {spec.verifier}'s setting was measured without predictions: this generation, with one, was "
              "verified exactly (lossless; a profile from flyspec calibrate --data edit applies with predictions)",
              file=sys.stderr)  # fmt: skip
    record = _record(args, spec, decoder.target, result, baseline, decoder.draft_length_policy)
    record["profile"] = decoder.profile.path if decoder.profile is not None else None
    if args.json:
        print(json.dumps(record, ensure_ascii=False))
    else:
        if args.stream:
            print()
        else:
            print(result.text)
        if baseline is not None and not record["identical_to_baseline"]:
            print(f"\n--- plain decoding (differs from the {spec.verifier} output above) ---\n{baseline.text}")
        _print_summary(record)
    return 0


def _record(
    args: argparse.Namespace,
    spec: SpeculationConfig,
    loaded: Any,
    result: GenerationResult,
    baseline: GenerationResult | None,
    draft_length: str,
) -> dict[str, Any]:
    stats = result.stats
    lossless = spec.verifier in LOSSLESS_VERIFIERS
    record: dict[str, Any] = {
        "text": result.text,
        "target": args.target,
        "drafter": spec.drafter,
        "draft_model": spec.draft_model,
        "verifier": spec.verifier,
        "lossless": lossless,
        "trust_guards": None if lossless else "bare" if spec.guard.is_bare else "on",
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "device": str(loaded.device),
        "num_draft_tokens": spec.num_draft_tokens,
        "draft_length": draft_length,  # the policy that ran (auto decided)
        "speculative_config": spec.to_dict(),
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
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


def _loose_lines(record: dict[str, Any], shown: int = 5) -> list[str]:
    """One line explaining the first loose accepts, one for what the trust guards refused."""
    lines = []
    accepts = record["loose_accepts"]
    if accepts:
        explained = "; ".join(
            f"#{a['index']} {a['draft_text']!r} for {a['target_text']!r} ({a['source']}, evidence {a['evidence']:.2f})"
            for a in accepts[:shown]
        )
        more = f"; … {len(accepts) - shown} more (--json: loose_accepts)" if len(accepts) > shown else ""
        lines.append(f"[loose accepts: kept instead of the target's choice] {explained}{more}")
    if record["guard_vetoes"]:
        vetoes = ", ".join(f"{reason} {count}" for reason, count in record["guard_vetoes"].items())
        lines.append(f"[trust guards refused loose accepts] {vetoes}")
    return lines


def _identity(record: dict[str, Any]) -> str:
    """Whether the output equals plain decoding's, and why not."""
    if record["identical_to_baseline"]:
        return "yes"
    if record["num_loose_accepts"]:
        return f"no ({record['num_loose_accepts']} loose accepts: a lossy verifier's output may differ)"
    sampled_drafts = record["drafter"] in ("draft-model", "multilevel", "stack", "layer-skip")
    if record["temperature"] > 0 and (
        record["verifier"] == "block" or record["verifier"] == "rejection" and sampled_drafts
    ):
        return (
            f"no, with no loose accept: {record['verifier']} commits another sample of the target's distribution "
            "than plain sampling's (--verifier exact commits plain sampling's text for the seed)"
        )
    if record["dtype"] != "float32":
        return (
            f"no, with no loose accept: {record['dtype']} rounds the batched verification forward differently "
            "from one-token forwards (--dtype float32 compares exactly)"
        )
    return "no"


def _print_summary(record: dict[str, Any]) -> None:
    label = "lossless" if record["lossless"] else "LOSSY: output may differ from plain decoding"
    if record["trust_guards"] == "bare":
        label += "; bare rule, no trust guards"
    lines = [
        f"[{record['drafter']} + {record['verifier']} ({label}), {record['dtype']}] "
        f"{record['num_new_tokens']} tokens in {record['wall_time_s']:.2f} s = {record['tokens_per_s']:.1f} tok/s, "
        f"τ = {record['mean_acceptance_length']:.2f} tokens/forward, "
        f"{record['num_loose_accepts']} loose accepts",
    ]
    lines.extend(_loose_lines(record))
    if record["drafter_stats"]:
        lines.append(f"[drafter {record['drafter']}] {json.dumps(record['drafter_stats'], ensure_ascii=False)}")
    prediction = record["drafter_stats"].get("prediction")
    if prediction is not None:
        lines.append(
            f"[prediction] {prediction['prediction_tokens']} tokens: {record['num_accepted_prediction_tokens']} "
            f"accepted, {record['num_rejected_prediction_tokens']} rejected (scored, not kept)"
        )
    if len(record["requested_draft_lengths"]) > 1:
        lengths = ", ".join(f"{length}: {count}" for length, count in record["requested_draft_lengths"].items())
        mean = record["mean_requested_draft_length"]
        lines.append(f"[{record['draft_length']} draft length] mean {mean:.1f}; steps by length {lengths}")
    if "speedup" in record:
        lines.append(
            f"[plain decoding] {record['baseline_tokens_per_s']:.1f} tok/s → speedup {record['speedup']:.2f}x, "
            f"identical to plain decoding: {_identity(record)}"
        )
    print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
