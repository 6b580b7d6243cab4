"""The persistent n-gram cache (``ngram-cache``): LRU table, sharing, persistence, draft rule, losslessness."""

from __future__ import annotations

import json
import random
import sys
import threading
from pathlib import Path

import pytest
import torch

from flyspec import DecodeConfig, DraftModelDrafter, PlainDecoder, SpeculativeDecoder, make_verifier
from flyspec.config import ConfigError, NgramCacheConfig, NgramConfig, SamplingConfig, SpeculationConfig
from flyspec.drafters.base import Drafter
from flyspec.drafters.ngram_cache import NgramCache, NgramCacheDrafter
from flyspec.resources import Resources
from flyspec.runtime.loaded_model import LoadedModel

torch.set_num_threads(1)

GREEDY = SamplingConfig()
PROMPTS = ("The capital of", "def add(a, b):\n    return", "Once upon a time there was a small model that")


def make_cache(max_entries: int = 1000, max_order: int = 4, min_order: int = 1) -> NgramCache:
    return NgramCache(NgramCacheConfig(max_entries=max_entries), NgramConfig(max_ngram=max_order, min_ngram=min_order))


def lookup(cache: NgramCache, context: list[int]) -> int | None:
    """The token the cache predicts after ``context`` by its longest known suffix (one lookup), or None."""
    match = cache.longest_match(context)
    return None if match is None else match[1]


def propose(drafter: NgramCacheDrafter, token_ids: list[int], num_draft_tokens: int) -> list[int]:
    return drafter.propose(token_ids, num_draft_tokens, GREEDY, None).tokens.tolist()


# --- the LRU table ---------------------------------------------------------------------------------


def test_add_records_every_order_and_counts_exactly() -> None:
    cache = make_cache(max_order=2)
    cache.add([1, 2, 3, 2, 3])
    # (1)→2 (2)→3 (1,2)→3 (3)→2 (2,3)→2; then (2)→3 and (3,2)→3 are new, (2)→3 again is an update
    assert lookup(cache, [3]) == 2
    assert lookup(cache, [1, 2]) == 3
    assert lookup(cache, [3, 2]) == 3
    assert lookup(cache, [9]) is None
    stats = cache.stats()
    assert stats["entries"] == stats["insertions"] == 6
    assert stats["updates"] == 1  # (2) → 3 seen twice
    assert (stats["lookups"], stats["hits"], stats["hit_rate"], stats["evictions"]) == (4, 3, 0.75, 0)


def test_incremental_add_equals_adding_all_at_once() -> None:
    sequence = [5, 1, 2, 5, 1, 3, 7, 5, 1, 2, 9, 4]
    whole, pieces = make_cache(), make_cache()
    whole.add(sequence)
    recorded = 0
    for end in (3, 4, 8, 12):  # as a generation feeds its new tokens; their left context lies before `start`
        pieces.add(sequence[:end], start=recorded)
        recorded = end
    assert list(pieces._table.items()) == list(whole._table.items())
    assert pieces.stats() == whole.stats()


def test_longest_suffix_wins() -> None:
    cache = make_cache()
    cache.add([1, 2, 3, 40])
    cache.add([9, 3, 50])  # (3) → 50 is more recent than (3) → 40, but (2, 3) → 40 is longer
    assert cache.longest_match([7, 2, 3]) == (2, 40)
    assert cache.longest_match([7, 8, 3]) == (1, 50)
    assert cache.longest_match([1, 2, 3], max_order=1) == (1, 50)
    assert cache.longest_match([7, 8, 3], min_order=2) is None


def test_continuation_chains_predictions_and_stops_at_a_miss() -> None:
    cache = make_cache()
    cache.add([1, 2, 3, 4, 5, 6])
    assert cache.continuation([0, 1, 2], 10) == [3, 4, 5, 6]  # (6) has no follower: the chain ends
    assert cache.continuation([0, 1, 2], 2) == [3, 4]
    assert cache.continuation([0, 1, 2], 0) == []
    cache.add([7, 8, 7, 8])  # a cycle: the chain runs until max_tokens
    assert cache.continuation([8], 5) == [7, 8, 7, 8, 7]
    before = cache.stats()
    assert cache.continuation([0, 1, 2], 10) == [3, 4, 5, 6]
    after = cache.stats()
    assert after["lookups"] - before["lookups"] == 5 and after["hits"] - before["hits"] == 4


def test_bound_is_kept_and_least_recently_used_is_evicted() -> None:
    cache = make_cache(max_entries=3, max_order=1)
    cache.add([1, 2, 3, 4])  # (1)→2 (2)→3 (3)→4
    assert lookup(cache, [1]) == 2  # a hit: (1) becomes the most recent, (2) the least
    cache.add([4, 5])  # new (4) evicts (2)
    assert len(cache) == 3
    assert lookup(cache, [2]) is None
    assert lookup(cache, [1]) == 2 and lookup(cache, [3]) == 4 and lookup(cache, [4]) == 5
    cache.add([3, 9])  # an update refreshes too: (3) is now most recent, (1) the least
    cache.add([6, 7])
    assert lookup(cache, [1]) is None and lookup(cache, [3]) == 9
    stats = cache.stats()
    assert stats["entries"] == 3 == stats["insertions"] - stats["evictions"]
    assert stats["evictions"] == 2
    for seed in range(5):
        rng = random.Random(seed)
        cache.add([rng.randrange(50) for _ in range(200)])
        assert len(cache) == 3


def test_clear_forgets_entries_and_counters() -> None:
    cache = make_cache()
    cache.add([1, 2, 3])
    lookup(cache, [1])
    cache.clear()
    assert cache.stats() == {
        "entries": 0,
        "max_entries": 1000,
        "lookups": 0,
        "hits": 0,
        "hit_rate": 0.0,
        "insertions": 0,
        "updates": 0,
        "evictions": 0,
    }


def test_concurrent_adds_and_lookups_keep_the_bound_and_the_counts() -> None:
    cache = make_cache(max_entries=500, max_order=3)
    num_threads, rounds = 8, 40
    errors: list[BaseException] = []
    barrier = threading.Barrier(num_threads)

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            barrier.wait()
            for _ in range(rounds):
                sequence = [rng.randrange(60) for _ in range(50)]
                cache.add(sequence)
                lookup(cache, sequence[:10])
                cache.continuation(sequence[:5], 8)
                assert len(cache) <= 500
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(num_threads)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, so that races show
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    stats = cache.stats()
    assert stats["entries"] == len(cache) == 500
    assert stats["entries"] == stats["insertions"] - stats["evictions"]
    # every add of 50 tokens records 49 + 48 + 47 n-grams, as insertions or updates: none lost
    assert stats["insertions"] + stats["updates"] == num_threads * rounds * (49 + 48 + 47)
    assert stats["lookups"] >= num_threads * rounds * 2


# --- sharing and persistence -----------------------------------------------------------------------


def test_resources_keep_one_cache_per_vocabulary_with_its_first_config() -> None:
    resources, ngram = Resources(), NgramConfig()
    first = resources.ngram_cache("model", NgramCacheConfig(max_entries=100), ngram)
    assert resources.ngram_cache("model", NgramCacheConfig(max_entries=100), ngram) is first
    assert resources.ngram_cache("other", NgramCacheConfig(), ngram) is not first
    again = resources.ngram_cache("model", NgramCacheConfig(max_entries=5), ngram)
    assert again is first and again.max_entries == 100
    assert Resources().ngram_cache("model", NgramCacheConfig(), ngram) is not first  # nothing process-wide
    assert resources.isolated().ngram_cache("model", NgramCacheConfig(), ngram) is not first


def test_resources_cache_creation_is_race_free() -> None:
    resources = Resources()
    found: list[NgramCache] = []

    def make() -> None:
        found.append(resources.ngram_cache("model", NgramCacheConfig(), NgramConfig()))

    threads = [threading.Thread(target=make) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(found) == 8 and all(cache is found[0] for cache in found)


def test_save_and_load_round_trip_keeps_entries_and_recency(tmp_path: Path) -> None:
    cache = make_cache(max_entries=50, max_order=2)
    cache.add([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5])
    lookup(cache, [3])  # (3) → 5 becomes the most recent
    path = tmp_path / "cache.json"
    cache.save(path)
    loaded = make_cache(max_entries=50, max_order=2)
    assert loaded.load(path) == len(cache)
    assert list(loaded._table.items()) == list(cache._table.items())
    smaller = make_cache(max_entries=3, max_order=1)  # other orders skipped, the most recent kept
    assert smaller.load(path) == 7  # the 1-grams
    assert list(smaller._table) == list(key for key in cache._table if len(key) == 1)[-3:]


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        json.dumps({"format": "something-else", "version": 1, "entries": []}),
        json.dumps({"format": "flyspec-ngram-cache", "version": 1, "entries": [[[1, 2], -3]]}),
        json.dumps({"format": "flyspec-ngram-cache", "version": 1, "entries": [[[], 3]]}),
        json.dumps({"format": "flyspec-ngram-cache", "version": 1, "entries": [[["a"], 3]]}),
    ],
)
def test_load_refuses_other_files(tmp_path: Path, content: str) -> None:
    path = tmp_path / "cache.json"
    path.write_text(content)
    cache = make_cache()
    with pytest.raises(ConfigError, match="n-gram cache file"):
        cache.load(path)
    assert len(cache) == 0


# --- the drafter -----------------------------------------------------------------------------------


def test_drafter_follows_the_protocol_and_records_only_finished_generations() -> None:
    cache = make_cache()
    drafter = NgramCacheDrafter(cache)
    assert isinstance(drafter, Drafter) and drafter.name == "ngram-cache"
    drafter.reset([1, 2, 3])
    draft = drafter.propose([1, 2, 3], 4, GREEDY, None)
    assert draft.num_tokens == 0 and draft.draft_probs is None
    drafter.rollback(5)
    assert propose(drafter, [1, 2, 3, 7, 8], 4) == []
    assert len(cache) == 0  # nothing is recorded while generating: proposals may hold unverified tokens
    drafter.finish([1, 2, 3, 7, 8])
    assert lookup(cache, [1, 2]) == 3 and lookup(cache, [3, 7]) == 8  # prompt and committed tokens, at the end


def test_a_longer_cache_match_beats_a_shorter_context_match() -> None:
    cache = make_cache()
    cache.add([8, 5, 2, 3, 77, 78])  # another generation: (8, 5, 2, 3) → 77, then 78
    drafter = NgramCacheDrafter(cache)
    context = [5, 2, 3, 60, 9, 8, 5, 2, 3]  # (5, 2, 3) occurs earlier in the context, (8, 5, 2, 3) does not
    drafter.reset(context)
    assert propose(drafter, context, 5) == [77, 78]
    assert (drafter.counters.cache_drafts, drafter.counters.context_drafts) == (1, 0)
    # limited to 3-grams, the context's 3-gram ties the cache's and wins: the prompt-lookup continuation
    drafter = NgramCacheDrafter(cache, NgramConfig(max_ngram=3))
    drafter.reset(context)
    assert propose(drafter, context, 5) == [60, 9, 8, 5, 2]
    assert (drafter.counters.cache_drafts, drafter.counters.context_drafts) == (0, 1)


def test_the_cache_drafts_when_the_context_has_no_match() -> None:
    cache = make_cache()
    cache.add([10, 11, 12, 13, 14])
    drafter = NgramCacheDrafter(cache, NgramConfig(max_ngram=3, min_ngram=2))
    drafter.reset([20, 11, 12])
    assert propose(drafter, [20, 11, 12], 8) == [13, 14]
    counters = drafter.counters
    # one lookup found (11, 12); the chain hit (12, 13) and missed (13, 14)
    assert (counters.cache_lookups, counters.cache_hits, counters.cache_draft_tokens) == (3, 2, 2)
    drafter.rollback(3 + 2)  # the target kept 13 and committed its own token instead of 14
    assert counters.cache_tokens_accepted == 1
    assert propose(drafter, [20, 11, 12, 13, 99], 8) == []  # min_ngram=2: (13, 99) is unknown
    drafter.rollback(6)
    assert counters.cache_tokens_accepted == 1
    report = drafter.report()
    assert report["cache_drafts"] == 1 and report["cache"]["entries"] == len(cache)


def test_accepted_tokens_are_bounded_by_the_draft() -> None:
    cache = make_cache()
    cache.add([1, 2, 3, 4])
    drafter = NgramCacheDrafter(cache)
    drafter.reset([7, 2])
    assert propose(drafter, [7, 2], 2) == [3, 4]
    drafter.rollback(2 + 3)  # both accepted, plus the bonus token
    assert drafter.counters.cache_tokens_accepted == 2
    assert propose(drafter, [7, 2, 3, 4, 1], 1) == [2]
    drafter.rollback(5 + 4)  # more than the draft was committed (say, by a caller that extends it): credit 1
    assert drafter.counters.cache_tokens_accepted == 3
    drafter.rollback(12)  # no proposal this step (budget 0): nothing to credit
    assert drafter.counters.cache_tokens_accepted == 3


def decode(target: LoadedModel, cache: NgramCache, prompt: str, verifier: str, k: int, max_new: int = 40):
    config = DecodeConfig(max_new_tokens=max_new, ignore_eos=True)
    decoder = SpeculativeDecoder(
        target, NgramCacheDrafter(cache), make_verifier(verifier), config, SpeculationConfig(num_draft_tokens=k)
    )
    return decoder.generate(prompt, use_chat=False)


def test_a_repeated_request_drafts_from_the_cache(tiny_target: LoadedModel) -> None:
    cache = make_cache(max_entries=10_000)
    first = decode(tiny_target, cache, PROMPTS[1], "exact", 8)
    second = decode(tiny_target, cache, PROMPTS[1], "exact", 8)
    assert second.token_ids == first.token_ids
    report = second.stats.drafter
    assert report["cache_hits"] > 0 and report["cache_drafts"] > 0
    # the prompt's continuation is not in the context but it is in the cache: every draft is right
    assert report["cache_tokens_accepted"] == report["cache_draft_tokens"] > 8
    # 40 tokens = 1 from the prefill, 4 × (8 + 1), then 2 + 1 at the length limit
    assert second.stats.num_target_forwards == 6 < first.stats.num_target_forwards
    # a different prompt ending in a phrase of the first output is continued from the cache
    phrase = first.token_ids[10:16]
    context = tiny_target.encode_prompt(PROMPTS[0], use_chat=False) + phrase
    drafter = NgramCacheDrafter(cache)
    drafter.reset(context)
    assert propose(drafter, context, 4) == first.token_ids[16:20]
    assert drafter.counters.cache_drafts == 1


@pytest.mark.parametrize("verifier", ["exact", "rejection"])
@pytest.mark.parametrize("num_draft_tokens", [1, 3, 8])
def test_lossless_matches_plain_greedy_with_a_cold_and_a_warm_cache(
    tiny_target: LoadedModel, verifier: str, num_draft_tokens: int
) -> None:
    plain_config = DecodeConfig(max_new_tokens=40, ignore_eos=True)
    expected = {prompt: PlainDecoder(tiny_target, plain_config).generate(prompt, use_chat=False) for prompt in PROMPTS}
    noisy = make_cache(max_entries=2000)  # warm with wrong n-grams, so drafts get rejected
    rng = random.Random(num_draft_tokens)
    noisy.add([rng.randrange(len(tiny_target.tokenizer)) for _ in range(3000)])
    for cache in (make_cache(), noisy):
        drafted = accepted = 0
        for round_ in range(2):  # round 1: every prompt's own output is in the cache too
            for prompt in PROMPTS:
                result = decode(tiny_target, cache, prompt, verifier, num_draft_tokens)
                assert result.token_ids == expected[prompt].token_ids, (prompt, round_)
                assert result.stats.num_new_tokens == 40
                drafted += result.stats.drafter["cache_draft_tokens"]
                accepted += result.stats.drafter["cache_tokens_accepted"]
        assert 0 < accepted < drafted  # the cache drafted, sometimes right and sometimes wrong


def test_lossless_as_the_proposer_below_a_draft_model(tiny_target: LoadedModel, tiny_draft: LoadedModel) -> None:
    """Below a draft model the sequence it sees is cut back after each verification; drafts stay lossless."""
    config = DecodeConfig(max_new_tokens=40, ignore_eos=True)
    cache = make_cache()
    for prompt in PROMPTS[:2] * 2:
        expected = PlainDecoder(tiny_target, config).generate(prompt, use_chat=False).token_ids
        drafter = DraftModelDrafter(tiny_draft, proposer=NgramCacheDrafter(cache), num_proposal_tokens=3)
        result = SpeculativeDecoder(
            tiny_target, drafter, make_verifier("exact"), config, SpeculationConfig(num_draft_tokens=6)
        ).generate(prompt, use_chat=False)
        assert result.token_ids == expected
        assert result.stats.drafter["proposer"]["name"] == "ngram-cache"
    assert result.stats.drafter["proposal_tokens_kept"] > 0


def test_a_proposers_unverified_tokens_are_never_recorded() -> None:
    cache = make_cache(max_order=2)
    drafter = NgramCacheDrafter(cache, NgramConfig(max_ngram=2))
    drafter.reset([1, 2])
    propose(drafter, [1, 2, 3, 4, 5], 2)  # as a proposer: the draft model's own sequence
    drafter.rollback(3)  # the target kept only [1, 2, 3]
    propose(drafter, [1, 2, 3, 9, 8], 2)
    drafter.finish([1, 2, 3, 9])
    assert lookup(cache, [3]) == 9 and lookup(cache, [2, 3]) == 9
    assert lookup(cache, [3, 4]) is None and lookup(cache, [4]) is None and lookup(cache, [9]) is None
