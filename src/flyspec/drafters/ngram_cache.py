"""Persistent n-gram cache drafting (``ngram-cache``): prompt lookup plus n-grams of earlier generations.

The Cacheback idea (training-free drafting from a least-recently-used table of n-grams): text a
model produced before — for another request, or in an earlier turn — tends to be produced again.
:class:`NgramCache` maps every recent n-gram to the token that most recently followed it; one
cache is shared only where its owner (``flyspec.resources.Resources``) shares it.

Draft rule of :class:`NgramCacheDrafter`: the longest match wins. For ``n`` from ``max_ngram``
down to ``min_ngram``: if the last ``n`` committed tokens occur earlier in the current context,
draft the prompt-lookup continuation (``longest_match``); otherwise, if the cache knows those ``n``
tokens, draft the cache's chained continuation. A 3-gram cache hit thus beats a 1-gram context
match; at equal length the context wins (its continuation is read off one occurrence and is
extended periodically, while the cache can only chain single-token predictions).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from flyspec.config import ConfigError, NgramCacheConfig, NgramConfig, SamplingConfig
from flyspec.drafters.ngram import copy_sources, longest_match
from flyspec.sampling.coupled import Draws
from flyspec.types import CACHE, Draft

logger = logging.getLogger(__name__)

FILE_FORMAT = "flyspec-ngram-cache"
FILE_VERSION = 1


class NgramCache:
    """A thread-safe LRU table: n-gram (``min_ngram`` ≤ n ≤ ``max_ngram`` ids) → the token that last followed it.

    At most ``max_entries`` n-grams (all orders together). A new n-gram in a full table evicts
    the least recently used one; a lookup hit and an insert both make an n-gram the most recent.
    One lock guards the table and its counters: the server drafts for requests on worker threads.
    """

    def __init__(self, config: NgramCacheConfig | None = None, ngram: NgramConfig | None = None) -> None:
        config = config or NgramCacheConfig()
        ngram = ngram or NgramConfig()
        self.max_entries = config.max_entries
        self.max_order = ngram.max_ngram
        self.min_order = ngram.min_ngram
        self._table: OrderedDict[tuple[int, ...], int] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._lookups = 0
        self._hits = 0
        self._insertions = 0  # new n-grams; an n-gram seen again is an update
        self._updates = 0
        self._evictions = 0

    def __len__(self) -> int:
        return len(self._table)

    def add(self, token_ids: Sequence[int], start: int = 0) -> None:
        """Record, for each position ``i >= start``, every n-gram ending just before ``i`` → ``token_ids[i]``.

        Pass the whole sequence and, as ``start``, how many of its tokens were recorded before: only
        the new tokens are recorded, each with its left context (which may lie before ``start``).
        """
        first = max(start, 1)
        offset = max(first - self.max_order, 0)
        tokens = [int(token) for token in token_ids[offset:]]  # only the new tokens and their left context
        with self._lock:
            for position in range(first - offset, len(tokens)):
                following = tokens[position]
                for order in range(self.min_order, min(self.max_order, position) + 1):
                    self._store(tuple(tokens[position - order : position]), following)

    def _store(self, key: tuple[int, ...], following: int) -> None:
        if key in self._table:
            self._table.move_to_end(key)
            self._updates += 1
        else:
            self._insertions += 1
        self._table[key] = following
        if len(self._table) > self.max_entries:
            self._table.popitem(last=False)
            self._evictions += 1

    def _orders(self, max_order: int | None, min_order: int | None) -> tuple[int, int]:
        """The requested orders, within those this cache stores."""
        highest = self.max_order if max_order is None else min(max_order, self.max_order)
        lowest = self.min_order if min_order is None else max(min_order, self.min_order)
        return highest, lowest

    def _match(self, tail: list[int], highest: int, lowest: int) -> tuple[int, int] | None:
        """One lookup (caller holds the lock): the longest suffix of ``tail`` in the table."""
        self._lookups += 1
        for order in range(min(highest, len(tail)), lowest - 1, -1):
            key = tuple(tail[-order:])
            following = self._table.get(key)
            if following is not None:
                self._table.move_to_end(key)
                self._hits += 1
                return order, following
        return None

    def longest_match(
        self, context: Sequence[int], max_order: int | None = None, min_order: int | None = None
    ) -> tuple[int, int] | None:
        """``(n, next token)`` for the longest suffix of ``context`` in the table, or None (one lookup)."""
        highest, lowest = self._orders(max_order, min_order)
        tail = [int(token) for token in context[-highest:]]
        with self._lock:
            return self._match(tail, highest, lowest)

    def continuation(
        self, context: Sequence[int], max_tokens: int, max_order: int | None = None, min_order: int | None = None
    ) -> list[int]:
        """Chained lookups: predict a token, append it, predict again; stops at a miss or at ``max_tokens``.

        Each prediction is one lookup in the statistics, so ``r`` tokens cost ``r`` lookups, plus one
        for the miss that ended the chain when ``r < max_tokens``.
        """
        highest, lowest = self._orders(max_order, min_order)
        tail = [int(token) for token in context[-highest:]]
        tokens: list[int] = []
        with self._lock:
            while len(tokens) < max_tokens:
                match = self._match(tail, highest, lowest)
                if match is None:
                    break
                tokens.append(match[1])
                tail = [*tail[1 - highest :], match[1]] if highest > 1 else [match[1]]
        return tokens

    def stats(self) -> dict[str, Any]:
        """Global counters since creation (or ``clear``): all requests sharing this cache together."""
        with self._lock:
            return {
                "entries": len(self._table),
                "max_entries": self.max_entries,
                "lookups": self._lookups,
                "hits": self._hits,
                "hit_rate": self._hits / self._lookups if self._lookups else 0.0,
                "insertions": self._insertions,
                "updates": self._updates,
                "evictions": self._evictions,
            }

    def clear(self) -> None:
        """Forget every n-gram and zero the counters."""
        with self._lock:
            self._table.clear()
            self._reset_counters()

    def entries(self) -> list[list[Any]]:
        """The table as JSON-ready ``[[n-gram ids], next id]`` pairs, least recently used first."""
        with self._lock:
            return [[list(key), following] for key, following in self._table.items()]

    def add_entries(self, entries: Sequence[tuple[tuple[int, ...], int]]) -> int:
        """Store checked ``(n-gram, next id)`` pairs, oldest first (see :func:`parse_entries`); return how many.

        N-grams of orders this cache does not store are skipped; more than ``max_entries`` keep the most recent.
        """
        kept = [(key, following) for key, following in entries if self.min_order <= len(key) <= self.max_order]
        with self._lock:
            for key, following in kept:
                self._store(key, following)
        return len(kept)

    def save(self, path: str | Path) -> None:
        """Write the table as JSON, least recently used first, so that ``load`` restores the recency order."""
        write_json_atomically({"format": FILE_FORMAT, "version": FILE_VERSION, "entries": self.entries()}, path)

    def load(self, path: str | Path) -> int:
        """Add the n-grams of a file written by ``save`` (oldest first); return how many were added.

        The file is parsed as JSON and checked, nothing in it is executed. N-grams of orders this
        cache does not store are skipped; a file larger than ``max_entries`` keeps its most recent ones.
        """
        document = read_json(path, "n-gram cache file")
        problem = (
            f"{str(path)!r} is not a flyspec n-gram cache file (version {FILE_VERSION}); delete it or save it again"
        )
        if not (
            isinstance(document, dict)
            and document.get("format") == FILE_FORMAT
            and document.get("version") == FILE_VERSION
        ):
            raise ConfigError(problem)
        return self.add_entries(parse_entries(document.get("entries"), problem))


def write_json_atomically(document: Any, path: str | Path) -> None:
    """Write ``document`` beside ``path`` (a 0600 file), fsync it, rename it over ``path``, fsync the directory.

    A crash (of the process or the machine) leaves the old file or the new one, never a torn or
    empty one: without the first fsync the rename may reach the disk before the data, without the
    second the rename itself may be lost. On an error (a full disk) the old file is left as it was.
    """
    path = Path(path)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            json.dump(document, file, separators=(",", ":"))
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
        fsync_directory(path.parent)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def fsync_directory(directory: str | Path) -> None:
    """Make a rename or a new file in ``directory`` durable (POSIX: the entry lives in the directory)."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def read_json(path: str | Path, what: str) -> Any:
    """A JSON file's content (parsed, never executed); ConfigError naming ``what`` if unreadable."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read the {what} {str(path)!r}: {error}") from error


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_entries(entries: object, problem: str) -> list[tuple[tuple[int, ...], int]]:
    """The ``[[n-gram ids], next id]`` pairs of a saved cache, checked; ConfigError(``problem``) if malformed."""
    if not isinstance(entries, list):
        raise ConfigError(problem)
    parsed = []
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list) and entry[0]):
            raise ConfigError(f"{problem} (bad entry {entry!r})")
        key, following = entry
        if not (all(_is_token(token) for token in key) and _is_token(following)):
            raise ConfigError(f"{problem} (bad entry {entry!r})")
        parsed.append((tuple(key), following))
    return parsed


@dataclass
class NgramCacheCounters:
    """Per-generation counters of :class:`NgramCacheDrafter` (the cache's own ``stats`` are global)."""

    cache_lookups: int = 0  # this generation's lookups in the shared cache
    cache_hits: int = 0
    context_drafts: int = 0  # steps drafted by prompt lookup in the current context
    cache_drafts: int = 0  # steps drafted from the cache
    context_draft_tokens: int = 0
    cache_draft_tokens: int = 0
    context_tokens_accepted: int = 0
    cache_tokens_accepted: int = 0


@dataclass
class NgramCacheDrafter:
    """Prompt lookup backed by a shared :class:`NgramCache`; the draft rule is in the module docstring.

    A generation's prompt and committed tokens enter the cache when it ends (``finish``, called
    by the decoding loop, also for a stream closed early), so later requests and turns can draft
    from them. Recording only then keeps unverified tokens out of the cache: below a draft model
    (a stack), ``propose`` sees that model's draft tokens too. Within a generation its own text is
    covered by the context lookup.
    Proposals are deterministic (``draft_probs=None``, one-hot), so rejection sampling stays lossless.
    """

    cache: NgramCache
    ngram: NgramConfig = field(default_factory=NgramConfig)
    name: str = "ngram-cache"
    device: torch.device | str = "cpu"  # where drafts are built: the device of the model that checks them

    def __post_init__(self) -> None:
        self.reset([])

    def reset(self, prompt_ids: list[int]) -> None:
        self.counters = NgramCacheCounters()
        self._num_committed = len(prompt_ids)
        self._prompt_length = len(prompt_ids)
        self._pending: tuple[str, int] = ("none", 0)  # source and size of the draft being verified

    def propose(
        self,
        token_ids: list[int],
        num_draft_tokens: int,
        sampling: SamplingConfig,
        draws: Draws | None,
    ) -> Draft:
        self._num_committed = len(token_ids)
        source, tokens, sources, matched = self._draft(token_ids, num_draft_tokens)
        self._pending = (source, len(tokens))
        if source == "context":
            self.counters.context_drafts += 1
            self.counters.context_draft_tokens += len(tokens)
        elif source == "cache":
            self.counters.cache_drafts += 1
            self.counters.cache_draft_tokens += len(tokens)
        tokens_on_device = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return Draft(tokens_on_device, sources=sources, match_length=matched)

    def _draft(self, token_ids: list[int], num_tokens: int) -> tuple[str, list[int], tuple[str, ...], int]:
        """(source, tokens, per-token provenance, matched n-gram length): the longest match of the context
        and the cache; the context wins ties. Cache tokens are marked ``CACHE``: the trust guards never
        loosely accept them."""
        if num_tokens <= 0:
            return "none", [], (), 0
        match = self.cache.longest_match(token_ids, self.ngram.max_ngram, self.ngram.min_ngram)
        self.counters.cache_lookups += 1
        self.counters.cache_hits += match is not None
        # the context needs a match at least as long as the cache's to win
        shortest = self.ngram.min_ngram if match is None else match[0]
        ngram = self.ngram
        indices, matched = longest_match(token_ids, num_tokens, ngram.max_ngram, shortest, ngram.match, ngram.extend)
        if indices:
            return "context", [token_ids[i] for i in indices], copy_sources(indices, self._prompt_length), matched
        if match is None:
            return "none", [], (), 0
        first = match[1]
        rest = self.cache.continuation(
            [*token_ids[-self.ngram.max_ngram :], first], num_tokens - 1, self.ngram.max_ngram, self.ngram.min_ngram
        )
        # counted as NgramCache.continuation does: one lookup per token, plus the miss that ended the chain
        self.counters.cache_lookups += len(rest) + (len(rest) < num_tokens - 1)
        self.counters.cache_hits += len(rest)
        return "cache", [first, *rest], (CACHE,) * (1 + len(rest)), match[0]

    def rollback(self, num_committed: int) -> None:
        """Credit the accepted draft tokens to their source: the step committed them plus one recovered/bonus."""
        source, size = self._pending
        accepted = min(max(num_committed - self._num_committed - 1, 0), size)
        if source == "context":
            self.counters.context_tokens_accepted += accepted
        elif source == "cache":
            self.counters.cache_tokens_accepted += accepted
        self._pending = ("none", 0)
        self._num_committed = num_committed

    def finish(self, token_ids: list[int]) -> None:
        """Remember the finished generation (prompt + committed tokens) for later ones."""
        self.cache.add(token_ids)

    def report(self) -> dict[str, Any]:
        return {**asdict(self.counters), "cache": self.cache.stats()}
