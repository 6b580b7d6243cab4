"""The n-gram cache file of ``flyspec serve --ngram-cache-file``: durable, private, bounded.

The file (:data:`FILE_FORMAT`, version :data:`FILE_VERSION`; JSON, parsed and checked, never executed)::

    {"format": ..., "version": 2, "key_id": "<16 hex>",
     "tenants": {"<tenant id>": {"last_used": <unix s>, "caches": {"<model>": [[[n-gram ids], next id], ...]}}}}

each cache's n-grams least recently used first.

Durable: it is written to a temporary file beside it (created 0600), fsynced, renamed over the old
one and the directory fsynced (:func:`~flyspec.drafters.ngram_cache.write_json_atomically`), so a
crash at any moment leaves the old file or the new one, never a torn one; a temporary file a
``kill -9`` left behind is removed at the next start.

Private: a tenant id is ``key-`` + HMAC-SHA256(secret, API key) (:func:`flyspec.server.security.tenant_of`),
not a bare hash of the key: whoever reads a bare hash can test guessed keys against it offline.
The secret is the operator's (``$FLYSPEC_NGRAM_CACHE_SECRET``, or a file named by
``--ngram-cache-secret-file``) or else made on first use in ``PATH.key`` beside the cache (0600).
``key_id`` names the secret (an HMAC of a constant) so a file written under another secret is
recognised. Tenants whose API keys are no longer configured are dropped when the file is read and
so never written again (``default``, the tenant of a server without keys, goes once keys are set).

Bounded: at most ``max_entries`` n-grams in all; beyond that the least recently used tenants'
least recently used n-grams are left out (each cache in memory is bounded by its own ``max_entries``).

Version 1 files (tenant ids were bare SHA-256 prefixes of the keys) are migrated: the tenants of
keys still configured get their new ids, the others are dropped, with a logged warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import stat
import tempfile
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flyspec.config import ConfigError
from flyspec.drafters.ngram_cache import fsync_directory, parse_entries, read_json, write_json_atomically

logger = logging.getLogger(__name__)

FILE_FORMAT = "flyspec-server-ngram-caches"
FILE_VERSION = 2
LEGACY_VERSION = 1  # tenant ids were "key-" + sha256(key)[:16]; no last_used, no key_id
SECRET_ENV = "FLYSPEC_NGRAM_CACHE_SECRET"
DEFAULT_MAX_ENTRIES = 1_000_000  # all tenants together: about 20-30 MB of JSON
_KEY_ID_MESSAGE = b"flyspec serve n-gram cache file"
Entries = list[tuple[tuple[int, ...], int]]


@dataclass
class SavedTenant:
    """One tenant's caches as saved: model (vocabulary) name → n-grams, least recently used first."""

    last_used: float
    caches: dict[str, Entries]

    def size(self) -> int:
        return sum(len(entries) for entries in self.caches.values())


Saved = dict[str, SavedTenant]  # tenant id → its caches


@dataclass(frozen=True)
class ParsedFile:
    """What a cache file holds, checked but not yet matched to this server's tenants."""

    version: int
    key_id: str | None
    tenants: Saved


def legacy_tenant_of(key: str) -> str:
    """The tenant id version 1 files used: a bare hash of the key (read for migration only)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def check_cache_path(path: str | Path) -> ParsedFile | None:
    """What ``path`` holds (None if it does not exist yet), after checking it can be written at shutdown."""
    path = Path(path)
    if not path.parent.is_dir():
        raise ConfigError(f"--ngram-cache-file {str(path)!r}: the directory {str(path.parent)!r} does not exist")
    if path.is_dir():
        raise ConfigError(f"--ngram-cache-file {str(path)!r} is a directory; give a file path")
    return parse_cache_file(path) if path.exists() else None


def parse_cache_file(path: str | Path) -> ParsedFile:
    """The file's content, checked; ConfigError saying what is wrong for a corrupt or foreign file."""
    document = read_json(path, "--ngram-cache-file")
    problem = (
        f"--ngram-cache-file {str(path)!r} is not a flyspec serve n-gram cache file (version {LEGACY_VERSION} or "
        f"{FILE_VERSION}); delete it or point at another path"
    )
    version = document.get("version") if isinstance(document, dict) else None
    tenants = document.get("tenants") if isinstance(document, dict) else None
    if not (
        isinstance(document, dict)
        and document.get("format") == FILE_FORMAT
        and version in (LEGACY_VERSION, FILE_VERSION)
        and isinstance(tenants, dict)
    ):
        raise ConfigError(problem)
    parsed: Saved = {}
    modified = Path(path).stat().st_mtime
    for tenant, saved in tenants.items():
        if version == LEGACY_VERSION:
            saved = {"last_used": modified, "caches": saved}
        last_used = saved.get("last_used") if isinstance(saved, dict) else None
        caches = saved.get("caches") if isinstance(saved, dict) else None
        if not (isinstance(last_used, int | float) and not isinstance(last_used, bool) and isinstance(caches, dict)):
            raise ConfigError(f"{problem} (bad tenant {str(tenant)[:40]!r})")
        entries = {str(model): parse_entries(kept, problem) for model, kept in caches.items()}
        parsed[str(tenant)] = SavedTenant(float(last_used), entries)
    key_id = document.get("key_id")
    return ParsedFile(int(version), key_id if isinstance(key_id, str) else None, parsed)


def bounded(tenants: Saved, max_entries: int) -> tuple[Saved, int]:
    """``tenants`` with at most ``max_entries`` n-grams, and how many were left out (least recently used first)."""
    excess = sum(tenant.size() for tenant in tenants.values()) - max_entries
    if excess <= 0:
        return tenants, 0
    evicted = 0
    kept: Saved = {}
    for name in sorted(tenants, key=lambda name: tenants[name].last_used):  # least recently used tenant first
        caches: dict[str, Entries] = {}
        for model, entries in tenants[name].caches.items():
            dropped = min(excess - evicted, len(entries))
            evicted += dropped
            if entries[dropped:]:
                caches[model] = entries[dropped:]  # the front of each cache is its least recently used end
        if caches:
            kept[name] = SavedTenant(tenants[name].last_used, caches)
    return kept, evicted


def read_secret(path: Path) -> bytes:
    try:
        mode = path.stat().st_mode
        secret = path.read_text(encoding="utf-8").strip().encode()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read the n-gram cache secret {str(path)!r}: {error}") from error
    if not secret:
        raise ConfigError(f"the n-gram cache secret file {str(path)!r} is empty; delete it to make a new one")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("the n-gram cache secret %s is readable by others (mode %o); chmod 600 it", path, mode & 0o777)
    return secret


def create_secret(path: Path) -> bytes:
    """A new random secret in ``path`` (0600), written whole before it appears; an existing one wins a race."""
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(secrets.token_hex(32) + "\n")
            file.flush()
            os.fsync(file.fileno())
        with contextlib.suppress(FileExistsError):  # a secret another process just made is kept
            os.link(temporary, path)  # never replaces, unlike os.replace
        fsync_directory(path.parent)
    finally:
        os.unlink(temporary)
    logger.info("n-gram cache secret created in %s (keep it with the cache file)", path)
    return read_secret(path)


def load_secret(cache_path: str | Path, secret_file: str | Path | None = None) -> bytes:
    """The operator's secret ($FLYSPEC_NGRAM_CACHE_SECRET, else ``secret_file``), or the one beside the cache."""
    from_env = os.environ.get(SECRET_ENV, "").strip()
    if from_env:
        return from_env.encode()
    path = Path(secret_file) if secret_file is not None else Path(f"{cache_path}.key")
    if path.exists():
        return read_secret(path)
    if not path.parent.is_dir():
        raise ConfigError(f"the n-gram cache secret's directory {str(path.parent)!r} does not exist")
    try:
        return create_secret(path)
    except OSError as error:
        raise ConfigError(f"cannot create the n-gram cache secret {str(path)!r}: {error}") from error


def key_id(secret: bytes) -> str:
    return hmac.new(secret, _KEY_ID_MESSAGE, hashlib.sha256).hexdigest()[:16]


class CacheFile:
    """The file at ``path``, its tenants' ids under ``secret``, and its bound (module docstring)."""

    def __init__(self, path: str | Path, secret: bytes, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ConfigError(f"--ngram-cache-file-max-entries must be >= 1 (got {max_entries})")
        self.path = Path(path)
        self.secret = secret
        self.max_entries = max_entries
        self.key_id = key_id(secret)

    def load(self, tenants: Collection[str], legacy: dict[str, str]) -> Saved:
        """The saved caches of ``tenants`` (this server's), migrated from ``legacy`` ids (v1 id → id); bounded."""
        self.remove_stale_temporaries()
        parsed = check_cache_path(self.path)
        if parsed is None:
            return {}
        if parsed.version == LEGACY_VERSION:
            known = {legacy[name]: tenant for name, tenant in parsed.tenants.items() if name in legacy}
            logger.warning(
                "n-gram cache file %s is version %d (tenant ids were bare key hashes): %d tenant(s) migrated, "
                "%d of keys no longer configured dropped; it is written as version %d from now on",
                self.path, LEGACY_VERSION, len(known), len(parsed.tenants) - len(known), FILE_VERSION,
            )  # fmt: skip
        else:
            if parsed.key_id != self.key_id:
                logger.warning(
                    "n-gram cache file %s was written under another secret: its API-key tenants cannot be "
                    "matched and are dropped",
                    self.path,
                )
            known = {name: tenant for name, tenant in parsed.tenants.items() if name in tenants}
            dropped = len(parsed.tenants) - len(known)
            if dropped:
                logger.warning("n-gram caches of %d tenant(s) whose API keys are no longer configured dropped", dropped)
        kept, evicted = bounded(known, self.max_entries)
        if evicted:
            logger.info("n-gram cache file: %d least recently used n-grams over the bound left out", evicted)
        return kept

    def save(self, tenants: Saved) -> int:
        """Write ``tenants`` (bounded), durably and atomically; return the n-grams left out by the bound."""
        kept, evicted = bounded(tenants, self.max_entries)
        document: dict[str, Any] = {
            "format": FILE_FORMAT,
            "version": FILE_VERSION,
            "key_id": self.key_id,
            "tenants": {
                name: {
                    "last_used": round(tenant.last_used, 3),
                    "caches": {
                        model: [[list(key), following] for key, following in entries]
                        for model, entries in tenant.caches.items()
                    },  # fmt: skip
                }
                for name, tenant in kept.items()
            },
        }
        write_json_atomically(document, self.path)
        return evicted

    def remove_stale_temporaries(self) -> None:
        """Temporary files of saves a ``kill -9`` interrupted (the file itself is whole: old or new)."""
        for stale in self.path.parent.glob(f".{self.path.name}.*.tmp"):
            try:
                stale.unlink()
                logger.info("removed %s, left by an interrupted save", stale)
            except OSError as error:
                logger.warning("could not remove %s, left by an interrupted save: %s", stale, error)
