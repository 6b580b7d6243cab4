"""Server-wide settings: request limits and the security model; speculation helpers over :class:`SpeculationConfig`.

The server's speculation defaults are a :class:`flyspec.config.SpeculationConfig` (from the CLI);
a request may override them (:func:`for_request`, within :attr:`ServerSecurity.allow_request_speculative`)
but never the limits or the security settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from flyspec.config import DEFAULT_MAX_NEW_TOKENS, ConfigError, SpeculationConfig
from flyspec.config.mapping import FLAT_OPTIONS
from flyspec.config.names import LOSSLESS_VERIFIERS, LOSSY_VERIFIERS

# Which verifier each per-request speculative parameter belongs to: setting one while another
# verifier runs is a 400, so nobody believes they ran FLy when they did not.
VERIFIER_PARAMETERS: dict[str, tuple[str, ...]] = {
    "window_size": ("fly",),
    "entropy_threshold": ("fly",),
    "fly_temperature_rule": ("fly",),
    "margin_ratio": ("margin",),
    "typical_epsilon": ("typical",),
    "typical_delta": ("typical",),
    "bild_rollback": ("bild",),
    "lenience": ("lenience",),
    "fsd_divergence": ("fsd",),
    "fsd_threshold": ("fsd",),
    "cascade_rule": ("cascade",),
    "cascade_lenience": ("cascade",),
    "adasd_min_samples": ("adasd",),
    "adasd_scale": ("adasd",),
    "protect": LOSSY_VERIFIERS,
    "bare_rule": LOSSY_VERIFIERS,
    "exact_first": LOSSY_VERIFIERS,
}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def is_lossless(spec: SpeculationConfig) -> bool:
    return spec.verifier in LOSSLESS_VERIFIERS


def for_request(defaults: SpeculationConfig, overrides: dict[str, Any]) -> SpeculationConfig:
    """The defaults with one request's ``speculative`` fields applied (``None`` = keep the default).

    Raises :class:`ConfigError` when a value is invalid or belongs to a verifier that is not running.
    """
    overrides = {name: value for name, value in overrides.items() if value is not None}
    if "adaptive_draft" in overrides:  # the older spelling of draft_length
        adaptive = "heuristic" if overrides.pop("adaptive_draft") else "fixed"
        _require(
            overrides.setdefault("draft_length", adaptive) == adaptive,
            f'speculative.adaptive_draft says draft_length "{adaptive}" but speculative.draft_length says '
            f'"{overrides["draft_length"]}"; send only draft_length',
        )
    verifier = overrides.get("verifier", defaults.verifier)
    for name, owners in VERIFIER_PARAMETERS.items():
        _require(
            name not in overrides or verifier in owners,
            f"speculative.{name} applies to verifier {' / '.join(owners)} only, but verifier {verifier!r} "
            f'would run; add "verifier": "{owners[0]}" or drop {name}',
        )
    return defaults.with_options(overrides, where="speculative.")


def changed_fields(spec: SpeculationConfig, other: SpeculationConfig) -> list[str]:
    """Names of the top-level settings in which ``other`` differs from ``spec``."""
    return [item.name for item in dataclasses.fields(spec) if getattr(spec, item.name) != getattr(other, item.name)]


def describe(spec: SpeculationConfig) -> dict[str, Any]:
    """What ran, for the ``flyspec`` object in responses: the verifier's own parameters only."""
    from flyspec.decoding.draft_length import resolve_policy  # imports torch: not at the CLI's start-up (--help)

    policy = resolve_policy(spec.draft_length, is_lossless(spec), spec.drafter)
    described: dict[str, Any] = {
        "verifier": spec.verifier,
        "lossless": is_lossless(spec),
        "drafter": spec.drafter,
        "num_draft_tokens": spec.num_draft_tokens,
        "draft_length": policy,  # what ran (auto decided)
        "adaptive_draft": policy != "fixed",
    }
    if spec.drafter == "stack":
        described["stack"] = list(spec.stack)
    for name, verifiers in VERIFIER_PARAMETERS.items():  # the running rule's own settings
        if spec.verifier in verifiers and name in FLAT_OPTIONS and FLAT_OPTIONS[name].count(".") == 1:
            component, field_name = FLAT_OPTIONS[name].split(".")
            described[name] = getattr(getattr(spec, component), field_name)
    if not is_lossless(spec):
        described["protect"] = list(spec.guard.protect)
        described["bare_rule"] = spec.guard.is_bare
    return described


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for and cost, and how much the server takes on at once."""

    default_max_tokens: int = DEFAULT_MAX_NEW_TOKENS  # when a request gives no max_tokens
    max_tokens_cap: int = 2048  # a larger max_tokens is a 400 (not silently clamped)
    max_prompt_tokens: int = 2048  # a longer prompt is a 400: its prefill is one uninterruptible forward
    max_queue: int = 32  # requests waiting for the model (or being prepared) besides the one generating; more → 429
    max_body_bytes: int = 1 << 20  # larger request bodies → 413
    retry_after_s: int = 1  # smallest Retry-After sent with a 429
    request_timeout_s: float = 300.0  # arrival to last token, queueing included; then 504 or a stream error event
    body_timeout_s: float = 30.0  # from the request's headers to the end of its body; then 408
    # an idle keep-alive connection is closed after this (uvicorn). Longer than the pools of common clients keep an
    # idle connection (httpx and the OpenAI SDK: 5 s): at equal times a client may send a request on a connection
    # just as the server closes it, and that request is lost (the soak saw it: a ReadError, no answer)
    keep_alive_timeout_s: float = 20.0
    send_timeout_s: float = 30.0  # a client that takes none of its response for this long is dropped
    shutdown_timeout_s: float = 30.0  # after SIGTERM, running generations get this long before they are ended

    def __post_init__(self) -> None:
        _require(self.max_tokens_cap >= 1, f"max_tokens_cap must be >= 1 (got {self.max_tokens_cap})")
        _require(
            1 <= self.default_max_tokens <= self.max_tokens_cap,
            f"default_max_tokens must be in [1, max_tokens_cap={self.max_tokens_cap}] (got {self.default_max_tokens})",
        )
        _require(self.max_prompt_tokens >= 1, f"max_prompt_tokens must be >= 1 (got {self.max_prompt_tokens})")
        _require(self.max_queue >= 0, f"max_queue must be >= 0 (got {self.max_queue}); 0 = no waiting requests")
        _require(self.max_body_bytes >= 1024, f"max_body_bytes must be >= 1024 (got {self.max_body_bytes})")
        _require(self.retry_after_s >= 1, f"retry_after_s must be >= 1 (got {self.retry_after_s})")
        for name in ("request_timeout_s", "body_timeout_s", "keep_alive_timeout_s", "send_timeout_s",
                     "shutdown_timeout_s"):  # fmt: skip
            value = getattr(self, name)
            _require(0 < value < math.inf, f"{name} must be a positive number of seconds (got {value})")


AllowRequestSpeculative = Literal["none", "lossless", "all"]
ALLOW_REQUEST_SPECULATIVE = ("none", "lossless", "all")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class ServerSecurity:
    """Who may call the server, from where, and what a request may change. See docs/guides/security.md.

    ``api_keys``: bearer keys; empty = no authentication (every client is one tenant). Each key is
    its own tenant: n-gram caches are never shared between keys unless ``share_ngram_cache``.
    ``allowed_hosts``: ``Host`` header names accepted (DNS rebinding); ``None`` = any.
    ``cors_origins``: browser origins allowed to call the API; empty = none (no CORS headers).
    ``allow_request_speculative``: ``none`` (requests cannot change the speculative settings),
    ``lossless`` (only to settings whose output is the target's own: a lossless verifier, with any
    drafter), ``all``. ``allow_special_tokens_in_messages``: keep chat-template control tokens typed
    in message text (default: removed, so a message cannot forge turns).
    """

    api_keys: tuple[str, ...] = field(default=(), repr=False)
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS
    cors_origins: tuple[str, ...] = ()
    allow_request_speculative: AllowRequestSpeculative = "lossless"
    share_ngram_cache: bool = False
    allow_special_tokens_in_messages: bool = False

    def __post_init__(self) -> None:
        for key in self.api_keys:
            _require(
                bool(key) and key.isascii() and key.isprintable() and " " not in key,
                "API keys must be non-empty printable ASCII without spaces (they travel in an HTTP header)",
            )
        _require(
            self.allow_request_speculative in ALLOW_REQUEST_SPECULATIVE,
            f"allow_request_speculative must be one of {', '.join(ALLOW_REQUEST_SPECULATIVE)} "
            f"(got {self.allow_request_speculative!r})",
        )


API_KEY_ENV = "FLYSPEC_API_KEY"
# the flags that set a ServerLimits field (its default is the field's), and what each means
LIMIT_FLAGS = (
    ("--default-max-tokens", "default_max_tokens", "max_tokens when a request gives none"),
    ("--max-tokens-cap", "max_tokens_cap", "largest max_tokens a request may ask for; above is a 400"),
    ("--max-queue", "max_queue", "requests that may wait besides the one generating; more get 429"),
    ("--max-body-bytes", "max_body_bytes", "largest request body; larger get 413"),
    ("--max-prompt-tokens", "max_prompt_tokens", "longest prompt, in tokens; longer get 400"),
    ("--request-timeout", "request_timeout_s", "a request's deadline, queueing included"),
    ("--body-timeout", "body_timeout_s", "time to send a request body; then 408"),
    ("--keep-alive-timeout", "keep_alive_timeout_s", "idle keep-alive connections close"),
    ("--send-timeout", "send_timeout_s", "a client that takes none of its response for this long is dropped"),
    ("--shutdown-timeout", "shutdown_timeout_s", "after SIGTERM, time the running generation gets"),
)


def api_keys_from(args: argparse.Namespace) -> tuple[str, ...]:
    """Keys from --api-key, --api-key-file and the environment, in that order, without repeats."""
    keys = list(args.api_key)
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text(encoding="utf-8").splitlines()
        except OSError as error:
            raise ConfigError(f"cannot read --api-key-file {args.api_key_file!r}: {error.strerror}") from error
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    keys += [key.strip() for key in os.environ.get(API_KEY_ENV, "").split(",") if key.strip()]
    return tuple(dict.fromkeys(keys))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
