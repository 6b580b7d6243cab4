"""Verification rules, one file each. Definitions of every term: ``flyspec.verifiers.base``."""

from flyspec.verifiers.adasd import AdasdVerifier
from flyspec.verifiers.base import Verifier
from flyspec.verifiers.bild import BildVerifier
from flyspec.verifiers.block import BlockVerifier
from flyspec.verifiers.cascade import CascadeVerifier
from flyspec.verifiers.exact import ExactVerifier
from flyspec.verifiers.fly import FlyVerifier
from flyspec.verifiers.fsd import FsdVerifier
from flyspec.verifiers.lenience import LenienceVerifier
from flyspec.verifiers.margin import MarginVerifier
from flyspec.verifiers.registry import LOSSLESS_VERIFIERS, VERIFIERS, make_verifier
from flyspec.verifiers.rejection import RejectionVerifier
from flyspec.verifiers.typical import TypicalVerifier

__all__ = [
    "LOSSLESS_VERIFIERS",
    "VERIFIERS",
    "AdasdVerifier",
    "BildVerifier",
    "BlockVerifier",
    "CascadeVerifier",
    "ExactVerifier",
    "FlyVerifier",
    "FsdVerifier",
    "LenienceVerifier",
    "MarginVerifier",
    "RejectionVerifier",
    "TypicalVerifier",
    "Verifier",
    "make_verifier",
]
