"""Verifier names → instances."""

from __future__ import annotations

from flyspec.config import ConfigError, FlyConfig, MarginConfig, TypicalConfig
from flyspec.verifiers.base import Verifier
from flyspec.verifiers.exact import ExactVerifier
from flyspec.verifiers.fly import FlyVerifier
from flyspec.verifiers.margin import MarginVerifier
from flyspec.verifiers.rejection import RejectionVerifier
from flyspec.verifiers.typical import TypicalVerifier

VERIFIERS = ("exact", "rejection", "fly", "margin", "typical")
LOSSLESS_VERIFIERS = ("exact", "rejection")


def make_verifier(
    name: str,
    *,
    fly: FlyConfig | None = None,
    margin: MarginConfig | None = None,
    typical: TypicalConfig | None = None,
) -> Verifier:
    """Build a verifier by name; component configs default to their dataclass defaults."""
    if name == "exact":
        return ExactVerifier()
    if name == "rejection":
        return RejectionVerifier()
    if name == "fly":
        return FlyVerifier(fly or FlyConfig())
    if name == "margin":
        return MarginVerifier(margin or MarginConfig())
    if name == "typical":
        return TypicalVerifier(typical or TypicalConfig())
    raise ConfigError(f"unknown verifier {name!r}; choose one of: {', '.join(VERIFIERS)}")
