"""Verification rules. Definitions of every term: ``flyspec.verifiers.base``."""

from flyspec.verifiers.base import Verifier
from flyspec.verifiers.exact import ExactVerifier
from flyspec.verifiers.fly import FlyVerifier
from flyspec.verifiers.margin import MarginVerifier
from flyspec.verifiers.registry import LOSSLESS_VERIFIERS, VERIFIERS, make_verifier
from flyspec.verifiers.rejection import RejectionVerifier
from flyspec.verifiers.typical import TypicalVerifier

__all__ = [
    "LOSSLESS_VERIFIERS",
    "VERIFIERS",
    "ExactVerifier",
    "FlyVerifier",
    "MarginVerifier",
    "RejectionVerifier",
    "TypicalVerifier",
    "Verifier",
    "make_verifier",
]
