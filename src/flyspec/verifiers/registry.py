"""Verifier names → instances."""

from __future__ import annotations

from flyspec.config import ConfigError, SpeculationConfig
from flyspec.names import LOSSLESS_VERIFIERS as LOSSLESS_VERIFIERS  # re-exported: the names live in names.py
from flyspec.names import VERIFIERS
from flyspec.verifiers.base import Verifier
from flyspec.verifiers.exact import ExactVerifier
from flyspec.verifiers.fly import FlyVerifier
from flyspec.verifiers.margin import MarginVerifier
from flyspec.verifiers.rejection import RejectionVerifier
from flyspec.verifiers.typical import TypicalVerifier


def make_verifier(name: str, spec: SpeculationConfig | None = None) -> Verifier:
    """Build a verifier by name with ``spec``'s component settings (default: the defaults).

    ``spec.guard`` configures the trust guards of the lossy verifiers; the lossless ones never
    loosely accept, so it is a no-op for them.
    """
    spec = spec or SpeculationConfig()
    if name == "exact":
        return ExactVerifier()
    if name == "rejection":
        return RejectionVerifier()
    if name == "fly":
        return FlyVerifier(spec.fly, guard=spec.guard)
    if name == "margin":
        return MarginVerifier(spec.margin, guard=spec.guard)
    if name == "typical":
        return TypicalVerifier(spec.typical, guard=spec.guard)
    raise ConfigError(f"unknown verifier {name!r}; choose one of: {', '.join(VERIFIERS)}")
