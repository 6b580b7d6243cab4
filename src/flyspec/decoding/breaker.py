"""The online circuit breaker: a calibrated lossy rule falls back to its strict base rule when a
generation's loose accepts run far above what calibration saw.

A profile (``profiles/profile.py``) records how many loose accepts per 100 tokens its chosen point made on
the calibration prompts. A prompt that makes the rule loosen far more often is unlike those
prompts, and the quality bounds measured on them say nothing about it. Once a generation has made
at least ``min_loose_accepts`` loose accepts and more than ``max_loose_per_100`` per 100 committed
tokens (``BreakerConfig``), the breaker trips: every later loose candidate is vetoed (guard
``breaker``), so the rest of the generation is verified strictly, and ``DecodeStats`` records
the output index where it tripped (``breaker_tripped_at``). Per generation: nothing carries over.
"""

from __future__ import annotations

from dataclasses import dataclass

from flyspec.config import BreakerConfig
from flyspec.decoding.stats import DecodeStats


@dataclass
class CircuitBreaker:
    """One generation's breaker, reading that generation's statistics."""

    config: BreakerConfig
    stats: DecodeStats

    @staticmethod
    def of(config: BreakerConfig, stats: DecodeStats) -> CircuitBreaker | None:
        """A breaker for this generation, or None when the config leaves it off."""
        return CircuitBreaker(config, stats) if config.enabled else None

    @property
    def tripped(self) -> bool:
        """Whether loose acceptance is off for the rest of the generation (decided once, then kept)."""
        stats = self.stats
        if stats.breaker_tripped_at is not None:
            return True
        loose, tokens = stats.num_loose_accepts, stats.num_new_tokens
        if loose >= self.config.min_loose_accepts and 100 * loose > self.config.max_loose_per_100 * tokens:
            stats.breaker_tripped_at = tokens
            return True
        return False
