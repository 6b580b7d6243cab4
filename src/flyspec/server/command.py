"""``flyspec serve``: load the model once and serve the OpenAI-compatible API with uvicorn.

Heavy imports (torch models, FastAPI, uvicorn) happen inside :func:`run`, so other subcommands
start fast. Invalid options raise :class:`ConfigError` before any model is loaded (exit code 2).
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from flyspec.cli.extras import require_extra
from flyspec.cli.options import add_engine_options, add_model_options, engine_options
from flyspec.cli.speculation import add_speculation_options, speculation_config
from flyspec.config import ConfigError, SpeculationConfig
from flyspec.config.names import LOSSY_VERIFIERS
from flyspec.server.settings import (
    ALLOW_REQUEST_SPECULATIVE,
    API_KEY_ENV,
    LIMIT_FLAGS,
    LOOPBACK_HOSTS,
    ServerLimits,
    ServerSecurity,
    api_keys_from,
    describe,
    is_loopback,
    is_lossless,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

    from flyspec.runtime.loaded_model import LoadedModel

T = TypeVar("T")

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API (completions, chat, streaming, metrics)",
        description="Serve the target model over an OpenAI-compatible HTTP API. The options below are "
        "server-wide defaults; a request may choose its own drafter, verifier and parameters in the "
        f"`speculative` body field. {', '.join(LOSSY_VERIFIERS)} are lossy and run only when asked for.",
    )
    add_model_options(parser, chat=False)
    add_speculation_options(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST}: this machine)")
    server.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})")
    server.add_argument("--served-model-name", help="the `model` name clients use (default: the --target value)")
    for flag, field, meaning in LIMIT_FLAGS:
        default = getattr(ServerLimits(), field)
        seconds = isinstance(default, float)
        server.add_argument(
            flag,
            dest=field,
            type=type(default),
            default=default,
            metavar="SECONDS" if seconds else None,
            help=f"{meaning} (default {default:g})" if seconds else f"{meaning} (default {default})",
        )
    server.add_argument(
        "--ngram-cache-file",
        metavar="PATH",
        help="keep the n-gram caches (ngram-cache drafter) across restarts in this JSON file: read at start-up "
        "if it exists, written at shutdown and every --ngram-cache-save-interval; each tenant's n-grams go "
        "back to that tenant only",
    )
    server.add_argument(
        "--ngram-cache-save-interval",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="with --ngram-cache-file: save this often too; 0 only at shutdown (default 300)",
    )
    server.add_argument(
        "--ngram-cache-file-max-entries",
        type=int,
        default=1_000_000,
        metavar="N",
        help="with --ngram-cache-file: at most N n-grams in the file, all tenants together; the least recently "
        "used are left out (default 1000000, about 25 MB)",
    )
    server.add_argument(
        "--ngram-cache-secret-file",
        metavar="PATH",
        help="with --ngram-cache-file: the secret that keys the tenant ids in the file (HMAC of each API key); "
        "made on first use (0600) if missing (default PATH.key beside the cache file; "
        "$FLYSPEC_NGRAM_CACHE_SECRET overrides both)",
    )
    add_security_options(parser)
    add_engine_options(
        parser,
        "serve",
        engine_help="flyspec (default): flyspec's own engine and server, one request at a time, every drafter and "
        "verifier; vllm: vLLM's own OpenAI server (its venv: --vllm-venv) with the flyspec-vllm plugin, batching "
        "requests: the model converted for it, flyspec's n-gram proposer, the profile's rule, guards and batch "
        "schedule, the KV cache in bytes, threads bound, the plugin's counters on its /metrics; options vLLM has no "
        "spelling for are refused (docs/guides/vllm.md)",
    )
    server.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="server log level (default info)")
    server.add_argument("-v", "--verbose", action="store_true", help="also log model loading (transformers)")
    parser.set_defaults(handler=run)


def add_security_options(parser: argparse.ArgumentParser) -> None:
    """API keys, host names, CORS, and what a request may change (docs/guides/security.md)."""
    security = parser.add_argument_group("security")
    security.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help=f"require Authorization: Bearer KEY on every route but /health; repeatable, each key its own "
        f"tenant; also --api-key-file and ${API_KEY_ENV} (comma-separated)",
    )
    security.add_argument("--api-key-file", metavar="PATH", help="API keys, one per line (# comments)")
    security.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host header name to accept besides the bound address (on loopback, also localhost); "
        "repeatable; other names get 400 (DNS rebinding)",
    )
    security.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a browser origin allowed to call the API (e.g. https://app.example); repeatable; default none",
    )
    security.add_argument(
        "--allow-request-speculative",
        default="lossless",
        choices=ALLOW_REQUEST_SPECULATIVE,
        help="what a request's `speculative` field may change: none, lossless settings only, or all (default lossless)",
    )
    security.add_argument(
        "--share-ngram-cache",
        action="store_true",
        help="one n-gram cache for all API keys (default: one per key); clients can then infer each other's "
        "text from acceptance statistics and timing",
    )
    security.add_argument(
        "--allow-special-tokens-in-messages",
        action="store_true",
        help="keep chat-template control tokens typed in chat messages (default: removed, so no message can "
        "forge a turn)",
    )


def security_from_args(args: argparse.Namespace) -> ServerSecurity:
    """On loopback only the bound address and local names are accepted as Host; elsewhere any, unless named."""
    named = tuple(args.allowed_host)
    if is_loopback(args.host):
        allowed_hosts: tuple[str, ...] | None = (*LOOPBACK_HOSTS, args.host, *named)
    else:
        allowed_hosts = (args.host, *named) if named else None
    return ServerSecurity(
        api_keys=api_keys_from(args),
        allowed_hosts=allowed_hosts,
        cors_origins=tuple(args.cors_origin),
        allow_request_speculative=args.allow_request_speculative,
        share_ngram_cache=args.share_ngram_cache,
        allow_special_tokens_in_messages=args.allow_special_tokens_in_messages,
    )


def settings_from_args(args: argparse.Namespace) -> tuple[SpeculationConfig, ServerLimits]:
    """Validated server settings; raises :class:`ConfigError` with a message naming the option."""
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535] (got {args.port})")
    limits = ServerLimits(**{field: getattr(args, field) for _, field, _ in LIMIT_FLAGS})
    return speculation_config(args), limits


def run(args: argparse.Namespace) -> int:
    """Load the model(s), check the defaults once, and serve until interrupted (``--engine vllm``: vLLM's server)."""
    if args.engine == "vllm":
        from flyspec.server.on_vllm import serve_on_vllm

        return serve_on_vllm(args)
    from flyspec.server.on_vllm import check_flyspec_options

    check_flyspec_options(args)
    require_extra("serve", "flyspec serve")
    defaults, limits = settings_from_args(args)
    security = security_from_args(args)
    if args.ngram_cache_save_interval < 0:
        raise ConfigError(f"--ngram-cache-save-interval must be >= 0 (got {args.ngram_cache_save_interval:g})")
    if args.ngram_cache_file_max_entries < 1:
        raise ConfigError(f"--ngram-cache-file-max-entries must be >= 1 (got {args.ngram_cache_file_max_entries})")
    if args.ngram_cache_file:
        from flyspec.server.cache_file import check_cache_path

        check_cache_path(args.ngram_cache_file)  # a corrupt file fails now, before the model loads
    from flyspec.api import build_decoder  # heavy imports only when serving
    from flyspec.runtime.loading import load_model
    from flyspec.server.app import create_app
    from flyspec.server.lifecycle import GracefulServer, server_config
    from flyspec.verifiers.registry import checked_verifier

    checked_verifier(defaults)  # option errors that need no model come before loading one
    logging.getLogger("flyspec").setLevel(getattr(logging, args.log_level.upper()))
    engine = engine_options(args, [defaults])

    def load() -> tuple[LoadedModel, FastAPI]:
        target = load_model(args.target, threads=args.threads, **engine)
        draft = None
        if args.draft_model:
            draft = load_model(args.draft_model, **{**engine, "device": target.device})
        app = create_app(
            target,
            defaults,
            limits,
            security,
            draft_model=draft,
            served_model_name=args.served_model_name,
            ngram_cache_file=args.ngram_cache_file,
            ngram_cache_save_interval_s=args.ngram_cache_save_interval,
            ngram_cache_file_max_entries=args.ngram_cache_file_max_entries,
            ngram_cache_secret_file=args.ngram_cache_secret_file,
        )
        # bad defaults fail now, not per request (and stack models and layer-skip calibration load once)
        build_decoder(target, app.state.planner.defaults, resources=app.state.planner.caches.resources)
        return target, app

    target, app = in_a_passing_thread(load)
    planner = app.state.planner
    described = ", ".join(f"{name}={value}" for name, value in describe(planner.defaults).items())
    if planner.profile is not None:
        logger.info("calibration profile: %s", planner.profile.describe())
    logger.info(
        "serving %s (%s, %s on %s) at http://%s:%d/v1",
        args.served_model_name or target.name,
        described,
        str(target.dtype).removeprefix("torch."),
        target.device,
        args.host,
        args.port,
    )
    log_exposure(args.host, planner.defaults, security)
    config = server_config(app, host=args.host, port=args.port, log_level=args.log_level)
    GracefulServer(config, app.state.lifecycle).run()
    return 0


def in_a_passing_thread(work: Callable[[], T]) -> T:
    """``work()`` run in a thread that ends before this returns (its exception raised here).

    The server generates on its engine thread. Had the main thread run torch's parallel code too (loading, the
    compile's warm-up), two threads would each own an OpenMP team; GNU OpenMP then counts more threads than cores
    and all but stops spinning between parallel regions, and every step of the engine thread took twice as long
    (a compiled SmolLM2 bf16 step 20 → 40 ms on 2 cores: benchmarks/2026-11-28-one-query-attention). A thread that
    has ended leaves no team."""
    results: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(work())
        except BaseException as error:  # noqa: BLE001 - raised again in the calling thread
            errors.append(error)

    thread = threading.Thread(target=run, name="flyspec-load", daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return results[0]


def log_exposure(host: str, defaults: SpeculationConfig, security: ServerSecurity) -> None:
    """Start-up warnings: a lossy default, a non-loopback address without API keys, a cache shared by keys."""
    if not is_lossless(defaults):
        logger.warning("the default verifier %r is LOSSY: output may differ from plain decoding", defaults.verifier)
    if security.api_keys:
        logger.info("API keys: %d (each key is its own tenant)", len(security.api_keys))
    elif not is_loopback(host):
        logger.warning(
            "!!! NO API KEY: %s is not a loopback address, so anyone who can reach this port can use the "
            "model and share one n-gram cache with every other client. Pass --api-key (or $%s) unless a "
            "proxy in front authenticates clients. !!!",
            host,
            API_KEY_ENV,
        )
    if security.share_ngram_cache and len(security.api_keys) > 1:
        logger.warning("--share-ngram-cache: the n-gram cache is shared by all API keys (see the security model)")
