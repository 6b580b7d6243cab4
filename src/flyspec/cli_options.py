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
    FlyConfig,
    GuardConfig,
    MarginConfig,
    NgramConfig,
    TypicalConfig,
)
from flyspec.drafters.registry import DRAFTERS
from flyspec.models import DEFAULT_MODEL, DTYPES
from flyspec.verifiers.registry import VERIFIERS

_FLY, _MARGIN, _TYPICAL, _NGRAM = FlyConfig(), MarginConfig(), TypicalConfig(), NgramConfig()
DEFAULT_NUM_NGRAM_TOKENS = 6


def add_model_options(parser: argparse.ArgumentParser, *, chat: bool = True) -> None:
    """--target, --draft-model, --dtype, --threads and (optionally) --chat/--no-chat."""
    models = parser.add_argument_group("models")
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
        default=[],
        choices=PROTECT_CLASSES,
        help="lossy verifiers: never loosely accept a mismatch whose draft or target token has a digit "
        "(digits) or an identifier character (identifiers, for code); repeatable; off by default",
    )
    spec.add_argument("--typical-epsilon", type=float, default=_TYPICAL.epsilon, help="typical acceptance epsilon")
    spec.add_argument("--typical-delta", type=float, default=_TYPICAL.delta, help="typical acceptance delta")
    spec.add_argument("--max-ngram", type=int, default=_NGRAM.max_ngram, help="longest n-gram to look up")
    spec.add_argument("--min-ngram", type=int, default=_NGRAM.min_ngram, help="shortest n-gram to look up")
    spec.add_argument(
        "--num-ngram-tokens",
        type=int,
        default=DEFAULT_NUM_NGRAM_TOKENS,
        help=f"multilevel: n-gram tokens the draft model checks per forward (default {DEFAULT_NUM_NGRAM_TOKENS})",
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
        "guard": GuardConfig(tuple(dict.fromkeys(args.protect))),
    }


def quiet_transformers() -> None:
    """Silence transformers' info logs and progress bars (``-v`` keeps them)."""
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
