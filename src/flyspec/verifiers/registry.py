"""Verifier names → instances."""

from __future__ import annotations

from flyspec.config import ConfigError, FlyConfig, GuardConfig, MarginConfig, TypicalConfig
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
    guard: GuardConfig | None = None,
) -> Verifier:
    """Build a verifier by name; component configs default to their dataclass defaults.

    ``guard`` configures the trust guards of the lossy verifiers (default: on; ``GuardConfig.bare()``
    for the papers' bare rules); the lossless ones never loosely accept, so it is a no-op for them.
    """
    if name == "exact":
        return ExactVerifier()
    if name == "rejection":
        return RejectionVerifier()
    if name == "fly":
        return FlyVerifier(fly or FlyConfig(), guard=guard or GuardConfig())
    if name == "margin":
        return MarginVerifier(margin or MarginConfig(), guard=guard or GuardConfig())
    if name == "typical":
        return TypicalVerifier(typical or TypicalConfig(), guard=guard or GuardConfig())
    raise ConfigError(f"unknown verifier {name!r}; choose one of: {', '.join(VERIFIERS)}")
