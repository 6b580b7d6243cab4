"""The server's n-gram caches (``ngram-cache`` drafter): one per tenant, never shared by default.

The cache remembers the n-grams of earlier generations, prompts included. Shared between
clients it leaks: a lossy verifier could emit another client's text, and even a lossless one
shows, through acceptance statistics and timing, what the cache drafted. So the server owns one
cache per tenant (one per API key; every client is one tenant when the server has no keys) and
per tokenizer (the model whose vocabulary the n-grams are in), and shares one cache between
tenants only when the operator opts in (``--share-ngram-cache``). The number of caches is bounded
by the number of API keys, each cache by ``NgramCacheConfig.max_entries``.

``flyspec serve --ngram-cache-file PATH`` keeps the caches across restarts in one file
(:mod:`flyspec.server.cache_file`: durable, private, bounded). Tenant ids are ``default`` (no API
keys), ``key-`` + an HMAC of an API key under the server's secret (never the key, never its bare
hash), or ``shared`` (``--share-ngram-cache``). A tenant's n-grams are restored into that tenant's
cache only: a server that shares one cache restores only ``shared``, one that keeps caches apart
restores every tenant but ``shared``, so nothing one client produced is ever drafted for another
after a restart. Tenants a run does not restore are written back unchanged; tenants whose keys
are no longer configured are dropped when the file is read.
"""

from __future__ import annotations

import logging
import threading
import time

from flyspec.config import NgramCacheConfig, NgramConfig
from flyspec.resources import Resources
from flyspec.server.cache_file import CacheFile, Saved, SavedTenant, legacy_tenant_of
from flyspec.server.security import DEFAULT_TENANT, tenant_of

logger = logging.getLogger(__name__)

SHARED_TENANT = "shared"


def tenant_ids(api_keys: tuple[str, ...], secret: bytes) -> tuple[list[str], dict[str, str]]:
    """This server's tenant ids (``shared`` included), and the version 1 file's id of each → its id now."""
    if not api_keys:
        return [DEFAULT_TENANT, SHARED_TENANT], {DEFAULT_TENANT: DEFAULT_TENANT, SHARED_TENANT: SHARED_TENANT}
    ids = {key: tenant_of(key, secret) for key in api_keys}
    legacy = {legacy_tenant_of(key): tenant for key, tenant in ids.items()}
    return [*ids.values(), SHARED_TENANT], {**legacy, SHARED_TENANT: SHARED_TENANT}


class TenantCaches:
    """``resources_for(tenant)``: the server's models and calibrations with the tenant's own n-gram caches.

    Inside a tenant's view the caches are one per vocabulary (see ``Resources.ngram_cache``).
    """

    def __init__(self, resources: Resources, *, shared: bool) -> None:
        self.resources = resources
        self.shared = shared
        self._tenants: dict[str, Resources] = {}
        self._last_used: dict[str, float] = {}  # tenant → when it last asked for its caches (for the file's bound)
        self._dormant: Saved = {}  # saved tenants this run keeps out
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()  # one writer of the cache file at a time

    def resources_for(self, tenant: str) -> Resources:
        """The tenant's view of the server's resources (one view for all tenants when shared), made on first use."""
        key = SHARED_TENANT if self.shared else tenant
        with self._lock:
            self._last_used[key] = time.time()
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

    def restore(self, saved: Saved, config: NgramCacheConfig, ngram: NgramConfig) -> int:
        """Fill the tenants' caches from ``saved`` (which tenants: module docstring); return the n-grams added."""
        added = 0
        for tenant, kept in saved.items():
            if (tenant == SHARED_TENANT) != self.shared:
                self._dormant[tenant] = kept
                continue
            view = self.resources_for(tenant)
            with self._lock:
                self._last_used[tenant] = kept.last_used
            for model_name, entries in kept.caches.items():
                added += view.ngram_cache(model_name, config, ngram).add_entries(entries)
        if self._dormant:
            logger.info(
                "n-gram caches of %d tenant(s) kept in the file but not restored (%s the cache now)",
                len(self._dormant),
                "sharing" if self.shared else "not sharing",
            )
        return added

    def snapshot(self) -> Saved:
        """Every tenant's caches as they are now, and the tenants not restored, for the cache file."""
        with self._lock:
            views, last_used = dict(self._tenants), dict(self._last_used)
        tenants: Saved = dict(self._dormant)
        for tenant, view in views.items():
            caches = {
                name: [(tuple(key), following) for key, following in cache.entries()]
                for name, cache in view.ngram_caches_by_vocabulary().items()
            }
            if any(caches.values()):
                tenants[tenant] = SavedTenant(last_used.get(tenant, 0.0), caches)
        return tenants

    def save(self, file: CacheFile) -> None:
        """Write every tenant's caches (and the tenants not restored) to ``file``, durably and atomically.

        The snapshot is taken under the writers' lock, so a save still running (the periodic one,
        in a thread) never writes older n-grams over a later save's.
        """
        with self._save_lock:
            evicted = file.save(self.snapshot())
        if evicted:
            logger.info("n-gram cache file: %d least recently used n-grams over its bound left out", evicted)
