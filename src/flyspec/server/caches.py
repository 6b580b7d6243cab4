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

from flyspec.resources import Resources

SHARED_TENANT = "shared"


class TenantCaches:
    """``resources_for(tenant)``: the server's models and calibrations with the tenant's own n-gram caches.

    Inside a tenant's view the caches are one per vocabulary (see ``Resources.ngram_cache``).
    """

    def __init__(self, resources: Resources, *, shared: bool) -> None:
        self.resources = resources
        self.shared = shared
        self._tenants: dict[str, Resources] = {}
        self._lock = threading.Lock()

    def resources_for(self, tenant: str) -> Resources:
        """The tenant's view of the server's resources (one view for all tenants when shared), made on first use."""
        key = SHARED_TENANT if self.shared else tenant
        with self._lock:
            view = self._tenants.get(key)
            if view is None:
                view = self._tenants[key] = self.resources.isolated()
            return view

    def totals(self) -> dict[str, float]:
        """Sums over every cache, for ``/metrics`` (the operator's view; never sent in a response)."""
        with self._lock:
            caches = [cache for view in self._tenants.values() for cache in view.ngram_caches()]
        totals: dict[str, float] = {"caches": float(len(caches))}
        for cache in caches:
            for quantity, value in cache.stats().items():
                if quantity != "hit_rate" and isinstance(value, int | float):
                    totals[quantity] = totals.get(quantity, 0.0) + value
        return totals
