"""The server's n-gram caches (``ngram-cache`` drafter): one per tenant, never shared by default.

The cache remembers the n-grams of earlier generations, prompts included. Shared between
clients it leaks: a lossy verifier could emit another client's text, and even a lossless one
shows, through acceptance statistics and timing, what the cache drafted. So the server owns one
cache per tenant (one per API key; every client is one tenant when the server has no keys) and
per tokenizer (the model whose vocabulary the n-grams are in), and shares one cache between
tenants only when the operator opts in (``--share-ngram-cache``). The number of caches is bounded
by the number of API keys, each cache by ``NgramCacheConfig.max_entries``.
"""

from __future__ import annotations

import threading

from flyspec.config import NgramCacheConfig, NgramConfig
from flyspec.drafters.ngram_cache import NgramCache
from flyspec.server.settings import SpeculationDefaults

NGRAM_CACHE = "ngram-cache"
SHARED_TENANT = "shared"


class TenantCaches:
    """``cache_for(tenant, speculation)``: the tenant's cache for the drafter that will run, made on first use."""

    def __init__(self, target_name: str, config: NgramCacheConfig, ngram: NgramConfig, *, shared: bool) -> None:
        self.target_name = target_name
        self.config = config
        self.ngram = ngram
        self.shared = shared
        self._caches: dict[tuple[str, str], NgramCache] = {}
        self._lock = threading.Lock()

    def cache_for(self, tenant: str, speculation: SpeculationDefaults) -> NgramCache | None:
        """The cache an ``ngram-cache`` level of this speculation drafts from, or None when it has none."""
        vocabulary = self._vocabulary(speculation)
        if vocabulary is None:
            return None
        key = (SHARED_TENANT if self.shared else tenant, vocabulary)
        with self._lock:
            cache = self._caches.get(key)
            if cache is None:
                cache = self._caches[key] = NgramCache(self.config, self.ngram)
            return cache

    def _vocabulary(self, speculation: SpeculationDefaults) -> str | None:
        """The model whose token ids the cache holds: the level above the n-gram level (see drafters/registry.py)."""
        if speculation.drafter == NGRAM_CACHE:
            return self.target_name
        levels = speculation.stack
        if speculation.drafter == "stack" and levels and levels[0] == NGRAM_CACHE:
            return levels[1] if len(levels) > 1 and levels[1] != "layer-skip" else self.target_name
        return None

    def totals(self) -> dict[str, float]:
        """Sums over every cache, for ``/metrics`` (the operator's view; never sent in a response)."""
        with self._lock:
            caches = list(self._caches.values())
        totals: dict[str, float] = {"caches": float(len(caches))}
        for cache in caches:
            for quantity, value in cache.stats().items():
                if quantity != "hit_rate" and isinstance(value, int | float):
                    totals[quantity] = totals.get(quantity, 0.0) + value
        return totals
