"""``flyspec serve``: load the model once and serve the OpenAI-compatible API with uvicorn.

Heavy imports (torch models, FastAPI, uvicorn) happen inside :func:`run`, so other subcommands
start fast. Invalid options raise :class:`ConfigError` before any model is loaded (exit code 2).
"""

from __future__ import annotations

import argparse
import logging

from flyspec.cli_options import add_model_options, add_speculation_options, speculation_options
from flyspec.config import ConfigError
from flyspec.server.settings import ServerLimits, SpeculationDefaults

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
_LIMITS = ServerLimits()
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API (completions, chat, streaming, metrics)",
        description="Serve the target model over an OpenAI-compatible HTTP API. The options below are "
        "server-wide defaults; a request may choose its own drafter, verifier and parameters in the "
        "`speculative` body field. fly, margin and typical are lossy and run only when asked for.",
    )
    add_model_options(parser, chat=False)
    add_speculation_options(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST}: this machine)")
    server.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})")
    server.add_argument("--served-model-name", help="the `model` name clients use (default: the --target value)")
    server.add_argument(
        "--default-max-tokens",
        type=int,
        default=_LIMITS.default_max_tokens,
        help=f"max_tokens when a request gives none (default {_LIMITS.default_max_tokens})",
    )
    server.add_argument(
        "--max-tokens-cap",
        type=int,
        default=_LIMITS.max_tokens_cap,
        help=f"largest max_tokens a request may ask for; above is a 400 (default {_LIMITS.max_tokens_cap})",
    )
    server.add_argument(
        "--max-queue",
        type=int,
        default=_LIMITS.max_queue,
        help=f"requests that may wait besides the one generating; more get 429 (default {_LIMITS.max_queue})",
    )
    server.add_argument(
        "--max-body-bytes",
        type=int,
        default=_LIMITS.max_body_bytes,
        help=f"largest request body; larger get 413 (default {_LIMITS.max_body_bytes})",
    )
    server.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="server log level (default info)")
    server.add_argument("-v", "--verbose", action="store_true", help="also log model loading (transformers)")
    parser.set_defaults(handler=run)


def settings_from_args(args: argparse.Namespace) -> tuple[SpeculationDefaults, ServerLimits]:
    """Validated server settings; raises :class:`ConfigError` with a message naming the option."""
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535] (got {args.port})")
    limits = ServerLimits(
        default_max_tokens=args.default_max_tokens,
        max_tokens_cap=args.max_tokens_cap,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
    )
    defaults = SpeculationDefaults(drafter=args.drafter, verifier=args.verifier, **speculation_options(args))
    if defaults.drafter in ("draft-model", "multilevel") and not args.draft_model:
        raise ConfigError(f"--drafter {defaults.drafter} needs --draft-model NAME_OR_PATH")
    if defaults.drafter == "stack" and not defaults.stack:
        raise ConfigError("--drafter stack needs --stack LEVELS (bottom first, e.g. ngram,DRAFT_MODEL)")
    return defaults, limits


def run(args: argparse.Namespace) -> int:
    """Load the model(s), check the defaults once, and serve until interrupted."""
    defaults, limits = settings_from_args(args)
    import uvicorn  # noqa: PLC0415 - heavy imports only when serving

    from flyspec.api import build_decoder  # noqa: PLC0415
    from flyspec.models import load_model  # noqa: PLC0415
    from flyspec.server.app import create_app  # noqa: PLC0415

    logging.getLogger("flyspec").setLevel(getattr(logging, args.log_level.upper()))
    target = load_model(args.target, dtype=args.dtype, threads=args.threads)
    draft = load_model(args.draft_model, dtype=args.dtype) if args.draft_model else None
    # bad defaults fail now, not per request (and stack models and layer-skip calibration load once)
    build_decoder(target, draft_model=draft, dtype=target.dtype, **defaults.build_kwargs())
    app = create_app(target, defaults, limits, draft_model=draft, served_model_name=args.served_model_name)
    described = ", ".join(f"{name}={value}" for name, value in defaults.describe().items())
    logger.info(
        "serving %s (%s, %s) at http://%s:%d/v1",
        args.served_model_name or target.name,
        described,
        str(target.dtype).removeprefix("torch."),
        args.host,
        args.port,
    )
    if not defaults.lossless:
        logger.warning("the default verifier %r is LOSSY: output may differ from plain decoding", defaults.verifier)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
