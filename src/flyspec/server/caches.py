"""The server's n-gram caches (``ngram-cache`` drafter): one per tenant, never shared by default.

The cache remembers the n-grams of earlier generations, prompts included. Shared between
clients it leaks: a lossy verifier could emit another client's text, and even a lossless one
shows, through acceptance statistics and timing, what the cache drafted. So the server owns one
cache per tenant (one per API key; every client is one tenant when the server has no keys) and
per tokenizer (the model whose vocabulary the n-grams are in), and shares one cache between
tenants only when the operator opts in (``--share-ngram-cache``). The number of caches is bounded
by the number of API keys, each cache by ``NgramCacheConfig.max_entries``.

``flyspec serve --ngram-cache-file PATH`` keeps the caches across restarts in one JSON file
(:data:`FILE_FORMAT`; parsed and checked, never executed): tenant id → model name → the cache's
n-grams, least recently used first. Tenant ids are ``default`` (no API keys), ``key-`` + a hash of
an API key (never the key), or ``shared`` (``--share-ngram-cache``). A tenant's n-grams are
restored into that tenant's cache only: a server that shares one cache restores only ``shared``,
one that keeps caches apart restores every tenant but ``shared``, so nothing one client produced is
ever drafted for another after a restart. Tenants a run does not restore are written back unchanged.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from flyspec.config import ConfigError, NgramCacheConfig, NgramConfig
from flyspec.drafters.ngram_cache import parse_entries, read_json, write_json_atomically
from flyspec.resources import Resources

logger = logging.getLogger(__name__)

SHARED_TENANT = "shared"
FILE_FORMAT = "flyspec-server-ngram-caches"
FILE_VERSION = 1
Saved = dict[str, dict[str, list[tuple[tuple[int, ...], int]]]]  # tenant → model name → (n-gram, next id)


def check_cache_file(path: str | Path) -> Saved:
    """What ``path`` holds (nothing yet if it does not exist), after checking it can be written at shutdown."""
    path = Path(path)
    if not path.parent.is_dir():
        raise ConfigError(f"--ngram-cache-file {str(path)!r}: the directory {str(path.parent)!r} does not exist")
    if path.is_dir():
        raise ConfigError(f"--ngram-cache-file {str(path)!r} is a directory; give a file path")
    return read_cache_file(path) if path.exists() else {}


def read_cache_file(path: str | Path) -> Saved:
    """The caches saved in ``path`` (checked); ConfigError saying what is wrong, for a corrupt or foreign file."""
    document = read_json(path, "--ngram-cache-file")
    problem = (
        f"--ngram-cache-file {str(path)!r} is not a flyspec serve n-gram cache file (version {FILE_VERSION}); "
        "delete it or point at another path"
    )
    tenants = document.get("tenants") if isinstance(document, dict) else None
    if not (
        isinstance(document, dict)
        and document.get("format") == FILE_FORMAT
        and document.get("version") == FILE_VERSION
        and isinstance(tenants, dict)
        and all(isinstance(caches, dict) for caches in tenants.values())
    ):
        raise ConfigError(problem)
    return {
        str(tenant): {str(model): parse_entries(entries, problem) for model, entries in caches.items()}
        for tenant, caches in tenants.items()
    }


class TenantCaches:
    """``resources_for(tenant)``: the server's models and calibrations with the tenant's own n-gram caches.

    Inside a tenant's view the caches are one per vocabulary (see ``Resources.ngram_cache``).
    """

    def __init__(self, resources: Resources, *, shared: bool) -> None:
        self.resources = resources
        self.shared = shared
        self._tenants: dict[str, Resources] = {}
        self._dormant: dict[str, dict[str, list[list[Any]]]] = {}  # saved tenants this run keeps out
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()  # one writer of the cache file at a time

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

    def restore(self, saved: Saved, config: NgramCacheConfig, ngram: NgramConfig) -> int:
        """Fill the tenants' caches from ``saved`` (which tenants: module docstring); return the n-grams added."""
        added = 0
        for tenant, caches in saved.items():
            if (tenant == SHARED_TENANT) != self.shared:
                self._dormant[tenant] = {
                    name: [[list(key), value] for key, value in kept] for name, kept in caches.items()
                }
                continue
            view = self.resources_for(tenant)
            for model_name, entries in caches.items():
                added += view.ngram_cache(model_name, config, ngram).add_entries(entries)
        if self._dormant:
            logger.info(
                "n-gram caches of %d tenant(s) kept in the file but not restored (%s the cache now)",
                len(self._dormant),
                "sharing" if self.shared else "not sharing",
            )
        return added

    def save(self, path: str | Path) -> None:
        """Write every tenant's caches (and the tenants not restored) to ``path``, atomically.

        The snapshot is taken under the writers' lock, so a save still running (the periodic one,
        in a thread) never writes older n-grams over a later save's.
        """
        with self._save_lock:
            with self._lock:
                views = dict(self._tenants)
            tenants: dict[str, dict[str, list[list[Any]]]] = dict(self._dormant)
            for tenant, view in views.items():
                caches = {name: cache.entries() for name, cache in view.ngram_caches_by_vocabulary().items()}
                if caches:
                    tenants[tenant] = caches
            write_json_atomically({"format": FILE_FORMAT, "version": FILE_VERSION, "tenants": tenants}, path)
