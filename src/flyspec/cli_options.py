"""Command-line options shared by ``generate``, ``bench``, ``eval`` and ``serve``.

Each subcommand lives in its own module and registers itself with ``add_parser(commands)``;
this module holds the option groups they share. Errors are printed by ``cli.py`` (one line,
exit code 2, no traceback).
"""

from __future__ import annotations

import argparse
from typing import Any

from flyspec.config import (
    DEFAULT_NUM_DRAFT_TOKENS,
    PROTECT_CLASSES,
    ConfigError,
    DraftLengthConfig,
    FlyConfig,
    GuardConfig,
    LayerSkipConfig,
    MarginConfig,
    NgramCacheConfig,
    NgramConfig,
    TypicalConfig,
)
from flyspec.drafters.registry import DRAFTERS
from flyspec.models import DEFAULT_MODEL, DTYPES
from flyspec.verifiers.registry import VERIFIERS

_FLY, _MARGIN, _TYPICAL, _NGRAM = FlyConfig(), MarginConfig(), TypicalConfig(), NgramConfig()
_LENGTH, _CACHE, _GUARD = DraftLengthConfig(), NgramCacheConfig(), GuardConfig()
DEFAULT_NUM_NGRAM_TOKENS = 6


def add_model_options(parser: argparse.ArgumentParser, *, chat: bool = True) -> None:
    """--target, --draft-model, --dtype, --threads and (optionally) --chat/--no-chat."""
    models = parser.add_argument_group("models")
    models.add_argument(
        "--target",
        default=DEFAULT_MODEL,
        help=f"target model: packaged name, .gguf file, HF directory or hub id (default {DEFAULT_MODEL})",
    )
    models.add_argument(
        "--draft-model",
        help="draft model for --drafter draft-model/multilevel; a different tokenizer than the target's is "
        "fine (its draft text is re-tokenized)",
    )
    models.add_argument(
        "--dtype",
        default="auto",
        choices=sorted(DTYPES),
        help="weights/compute dtype; auto = bfloat16 where the CPU/GPU has native bf16, else float32",
    )
    models.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    if chat:
        group = models.add_mutually_exclusive_group()
        group.add_argument(
            "--chat",
            dest="use_chat",
            action="store_true",
            default=None,
            help="apply the chat template (default when the model has one)",
        )
        group.add_argument("--no-chat", dest="use_chat", action="store_false", help="feed the prompt as raw text")


def add_speculation_options(parser: argparse.ArgumentParser, *, components: bool = True) -> None:
    """Drafter/verifier choice (when ``components``) and every verifier/drafter parameter."""
    spec = parser.add_argument_group("speculation")
    if components:
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
    spec.add_argument(
        "--protect",
        action="append",
        choices=(*PROTECT_CLASSES, "none"),
        help="lossy verifiers: token classes never loosely accepted (repeatable; replaces the default "
        f"{'+'.join(_GUARD.protect)}): digits; names = identifiers inside code and names/identifiers of the "
        "prompt; identifiers = every word; none",
    )
    spec.add_argument(
        "--bare-rule",
        action="store_true",
        help="lossy verifiers: the paper's bare rule without flyspec's trust guards (top-3, protected tokens, "
        "loop and copy checks), for ablations; EOS and n-gram-cache tokens stay protected",
    )
    spec.add_argument("--typical-epsilon", type=float, default=_TYPICAL.epsilon, help="typical acceptance epsilon")
    spec.add_argument("--typical-delta", type=float, default=_TYPICAL.delta, help="typical acceptance delta")
    spec.add_argument("--max-ngram", type=int, default=_NGRAM.max_ngram, help="longest n-gram to look up")
    spec.add_argument("--min-ngram", type=int, default=_NGRAM.min_ngram, help="shortest n-gram to look up")
    spec.add_argument(
        "--num-ngram-tokens",
        type=int,
        default=DEFAULT_NUM_NGRAM_TOKENS,
        help=f"multilevel/stack: tokens a level checks per forward (default {DEFAULT_NUM_NGRAM_TOKENS})",
    )
    add_drafter_options(parser)


def add_drafter_options(parser: argparse.ArgumentParser) -> None:
    """Options of the newer drafters: stacks, layer skipping, the n-gram cache, adaptive draft length."""
    drafting = parser.add_argument_group("drafters")
    drafting.add_argument(
        "--stack",
        default="",
        help="--drafter stack: comma-separated levels, bottom first; each is ngram, ngram-cache (bottom only), "
        "layer-skip or a draft model (e.g. ngram,smollm2-135m-instruct)",
    )
    drafting.add_argument(
        "--skip-layers",
        default="auto",
        help="layer-skip: comma-separated 0-based target layers to skip, or auto (calibrate on the first prompt)",
    )
    drafting.add_argument(
        "--ngram-cache-entries",
        type=int,
        default=_CACHE.max_entries,
        help=f"ngram-cache: n-grams kept across generations, the least recently used evicted "
        f"(default {_CACHE.max_entries})",
    )
    drafting.add_argument(
        "--adaptive-draft",
        action="store_true",
        help="adapt the draft length to recent acceptance (+2 after a fully kept draft, -1 after a rejection), "
        "between --min-draft-tokens and -k",
    )
    drafting.add_argument(
        "--min-draft-tokens",
        type=int,
        default=_LENGTH.min_tokens,
        help=f"--adaptive-draft: shortest draft (default {_LENGTH.min_tokens}; FLy never goes below its window)",
    )
    drafting.add_argument(
        "--draft-confidence",
        type=float,
        default=_LENGTH.confidence_threshold,
        help="model drafters: stop drafting once the draft model's top probability falls below this (default 0: off)",
    )


def speculation_options(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`flyspec.api.build_decoder` keyword arguments from the speculation options.

    Raises :class:`flyspec.config.ConfigError` for invalid values.
    """
    return {
        "num_draft_tokens": args.num_draft_tokens,
        "fly": FlyConfig(args.window_size, args.entropy_threshold, temperature_rule=args.fly_temperature_rule),
        "margin": MarginConfig(args.margin_ratio),
        "typical": TypicalConfig(args.typical_epsilon, args.typical_delta),
        "ngram": NgramConfig(args.max_ngram, args.min_ngram),
        "num_ngram_tokens": args.num_ngram_tokens,
        "guard": guard_options(args),
        "draft_length": DraftLengthConfig(args.adaptive_draft, args.min_draft_tokens, args.draft_confidence),
        "layer_skip": LayerSkipConfig(parse_skip_layers(args.skip_layers)),
        "ngram_cache": NgramCacheConfig(args.ngram_cache_entries),
        "stack": tuple(level.strip() for level in args.stack.split(",") if level.strip()),
    }


def guard_options(args: argparse.Namespace) -> GuardConfig:
    """The trust guards from ``--protect`` and ``--bare-rule``."""
    if args.bare_rule:
        if args.protect:
            raise ConfigError("--bare-rule turns every trust guard off; drop --protect (or --bare-rule)")
        return GuardConfig.bare()
    if not args.protect:
        return GuardConfig()
    classes = tuple(dict.fromkeys(name for name in args.protect if name != "none"))
    if classes and "none" in args.protect:
        raise ConfigError("--protect none cannot be combined with other classes")
    return GuardConfig(protect=classes)


def parse_skip_layers(text: str) -> tuple[int, ...] | None:
    """``auto`` → None (calibrate); ``"3,5,7"`` → (3, 5, 7)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise ConfigError(
            f"--skip-layers must be 'auto' or comma-separated layer indices like 4,6,8 (got {text!r})"
        ) from error


def quiet_transformers() -> None:
    """Silence transformers' info logs and progress bars (``-v`` keeps them)."""
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
