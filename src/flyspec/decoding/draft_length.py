"""How many tokens to draft and verify at each step: fixed, heuristic, or cost-aware.

``fixed`` drafts ``num_draft_tokens`` (``-k``) every step.

``heuristic`` is transformers' ``num_assistant_tokens_schedule="heuristic"`` (used by its
assisted generation): after a step whose every draft token was kept the next draft is 2 tokens
longer, after any rejection 1 token shorter, always within ``[floor, num_draft_tokens]``.

``cost`` verifies, each step, the draft length ``k`` that maximises expected committed tokens per
second, ``E[committed | k] / (t(k + 1) + d·k)``: t(n) is the target's forward cost for n tokens,
measured once per model, dtype and machine (``runtime/step_cost.py``), d the drafter's measured time per
draft token, and ``E[committed | k] = 1 + Σ_{i≤k} Π_{j≤i} p_j`` with ``p_j`` the estimated chance
that draft token j is kept when every token before it was (:class:`AcceptanceModel`). The
estimate is per *evidence bucket* — the first draft token's source (prompt copy, output copy,
cache, model) and the length of the n-gram a copy matched — because a 4-gram match continues far
more often than a 1-gram one. A copy drafter proposes ``-k`` tokens (copying is free) and the
draft is cut to the chosen length once its bucket is known; a model drafter is asked for the
chosen length, since each of its tokens costs a forward. ``-k`` is the maximum; 0 (a plain step)
is a choice too; a verifier's floor (FLy: window + 1) is never cut below. The estimates start
from an even prior and decay (recent steps count most), and they live in the generation, never
shared between requests.

The table t(n) is measured once, at a short context, on a forward alone; a step of this request also
drafts, verifies and commits, at this request's context, on a machine that may be busier now, and a compiled
or packed path may scale differently with n than the table says. So each request also times its own steps
(:class:`StepTimes`: whole steps, wall clock, from one step's end to the next's) and corrects the table by
what it sees — one factor for plain steps (k = 0), one for speculative ones (k > 0), each the decayed ratio of
observed to tabled seconds, starting at 1 — so that where speculative steps cost more than their tokens repay,
the request drafts less or not at all: never slower than plain by the policy's own measure. Its evidence
decays like the acceptance's, so a request that stopped drafting tries again once the old steps have faded.
Only greedy requests time their steps: where a sample depends on the length (block verification), a seeded
sample must not depend on how busy the machine was, so a sampled request follows the table alone.

Lossless verifiers give the same output whatever the length. Lossy ones may not: a FLy loose
accept needs its window inside the draft, so a shorter draft can make a different choice. Pin
``fixed`` to reproduce a lossy output exactly across machines.
"""

from __future__ import annotations

import time

import numpy as np

from flyspec.config import ConfigError, DraftLengthConfig
from flyspec.config.names import COPY_DRAFTERS
from flyspec.runtime.step_cost import StepCost
from flyspec.types import UNKNOWN_SOURCE, Draft

MAX_MATCH_BUCKET = 8  # longer matches share a bucket


def resolve_policy(config: DraftLengthConfig, lossless: bool, drafter: str, greedy: bool = True) -> str:
    """The policy that runs with this verifier (lossless or not), drafter and decoding: ``auto`` decided.

    ``auto`` is ``cost`` under a lossless verifier, where the length changes only the speed: for every
    drafter in greedy decoding (a model drafter's tokens each cost a forward: on a GPU a fixed k = 15 is 15
    sequential draft forwards per step, whatever the acceptance) and for the copy drafters when sampling.
    It is ``fixed`` otherwise: a lossy output depends on the length (FLy's window must fit in the draft),
    and at T > 0 a model drafter's cost is timed as it runs, so a seeded sample would depend on the timings.
    """
    if config.policy != "auto":
        return config.policy
    if not lossless:
        return "fixed"
    return "cost" if greedy or drafter in COPY_DRAFTERS else "fixed"


def decoder_policy(
    config: DraftLengthConfig, lossless: bool, drafter: str, step_cost: StepCost | None, greedy: bool = True
) -> str:
    """The policy a decoder runs: :func:`resolve_policy`, where ``cost`` needs the target's ``step_cost``
    (``build_decoder`` measures it). Without one, ``auto`` drafts a fixed k and an explicit ``cost`` is refused."""
    policy = resolve_policy(config, lossless, drafter, greedy)
    if policy != "cost" or step_cost is not None:
        return policy
    if config.policy == "auto":
        return "fixed"
    raise ConfigError(
        "the cost-aware draft length needs the target's forward cost: build the decoder with "
        "flyspec.build_decoder, or pass step_cost=flyspec.runtime.step_cost.step_cost(target, k + 1)"
    )


class DraftLength:
    """The draft length for the next step, updated from each step's outcome (``fixed``, ``heuristic``)."""

    def __init__(self, config: DraftLengthConfig, num_draft_tokens: int, floor: int = 1) -> None:
        self.policy = config.policy
        self.maximum = num_draft_tokens
        # never below the floor (the verifier's min_draft_tokens: FLy's window + 1), never above the maximum
        self.minimum = min(max(config.min_tokens, floor), num_draft_tokens)
        self.current = num_draft_tokens

    def next(self) -> int:
        """How many tokens to ask the drafter for."""
        return self.current

    def choose(self, draft: Draft, draft_seconds: float) -> int:
        """How many of the proposed tokens to verify (``draft_seconds``: what proposing them took)."""
        return draft.num_tokens

    def recorded(self, requested: int, chosen: int) -> int:
        """The draft length a step reports as asked for: the request (the choice only cuts a short draft)."""
        return requested

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        """Record a step that verified ``num_proposed`` draft tokens and kept ``num_accepted`` of them."""
        if self.policy != "heuristic" or num_proposed == 0:
            return
        step = 2 if num_accepted == num_proposed else -1
        self.current = max(self.minimum, min(self.maximum, self.current + step))


Bucket = tuple[str, int]


class AcceptanceModel:
    """Estimates of ``p_i``: the chance draft token i is kept when tokens 1 .. i-1 were, per bucket.

    Counts decay by ``decay`` each step. Each estimate is shrunk with weight ``strength`` toward the one it
    extends: position 1 toward its bucket's pooled rate (→ every bucket's pooled rate → ``prior``), position
    i toward position i - 1's estimate. A bucket seen rarely borrows from the rest; a position seen rarely, or
    never verified (the policy chose shorter drafts), continues the rate of the deepest one verified, so a
    copy that has kept running is expected to run on and a longer draft is tried where t(k + 1) allows.
    (Shrinking every position toward the bucket's pooled rate instead, which the first position dominates since
    it is reached most, undervalued long copies: once a copy is kept its next token is kept far more often
    than a copy's first token.)
    """

    def __init__(self, max_tokens: int, prior: float = 0.5, strength: float = 4.0, decay: float = 0.9) -> None:
        self.max_tokens = max_tokens
        self.prior, self.strength, self.decay = prior, strength, decay
        self.counts: dict[Bucket, np.ndarray] = {}  # bucket → [2, max_tokens]: tokens reached, tokens kept

    def rates(self, bucket: Bucket) -> np.ndarray:
        """``p_1 .. p_max`` for ``bucket`` ([max_tokens])."""
        s = self.strength
        reached, kept = sum(self.counts.values(), np.zeros((2, self.max_tokens))).sum(axis=1)
        overall = (kept + s * self.prior) / (reached + s)
        counts = self.counts.get(bucket)
        if counts is None:
            return np.full(self.max_tokens, overall)
        previous = (counts[1].sum() + s * overall) / (counts[0].sum() + s)  # the bucket's pooled rate
        rates = np.empty(self.max_tokens)
        for position in range(self.max_tokens):  # each position shrunk toward the one it extends
            previous = rates[position] = (counts[1, position] + s * previous) / (counts[0, position] + s)
        return rates

    def expected_committed(self, bucket: Bucket) -> np.ndarray:
        """``E[committed | k]`` for k = 0 .. max_tokens ([max_tokens + 1]): 1 + Σ_{i≤k} Π_{j≤i} p_j."""
        return np.concatenate(([1.0], 1.0 + np.cumsum(np.cumprod(self.rates(bucket)))))

    def observe(self, bucket: Bucket | None, num_verified: int, num_accepted: int) -> None:
        for counts in self.counts.values():
            counts *= self.decay
        if bucket is None or num_verified == 0:
            return
        counts = self.counts.setdefault(bucket, np.zeros((2, self.max_tokens)))
        counts[0, : min(num_accepted + 1, num_verified)] += 1  # reached: every kept token and the first refused
        counts[1, :num_accepted] += 1

    @property
    def buckets(self) -> list[Bucket]:
        return list(self.counts)


def bucket_of(draft: Draft) -> Bucket:
    """The evidence a draft carries: its first token's source and the length of the n-gram it matched."""
    return draft.source(0) if draft.num_tokens else UNKNOWN_SOURCE, min(draft.match_length, MAX_MATCH_BUCKET)


class StepTimes:
    """This request's own step times against the table: ``factor(k)`` scales t(k + 1) for a plain (k = 0) or
    speculative (k > 0) step by the decayed ratio of observed to tabled seconds of that kind, shrunk toward the
    ratio of all steps (so a kind not seen lately is taken to run as the other does: the table's own judgement);
    1 before any step.

    Only plain steps seen beside speculative ones tell a speculative step's own excess (a graph that recompiles
    or falls back to eager as the context grows) from a machine that is just slower than when the table was
    measured. So while speculative steps run above :data:`EXCESS` times the table and no plain step is in recent
    evidence, :meth:`wants_plain` asks for one.
    """

    EXCESS = 1.5  # speculative steps this much slower than the table: time a plain step beside them

    def __init__(self, unit: float, prior_steps: float = 0.1, decay: float = 0.9) -> None:
        self.decay = decay
        self.unit = unit  # t(1) by the table
        self.prior = prior_steps * unit  # pseudo-seconds on both sides of each ratio
        self.observed = np.zeros(2)  # [plain, speculative]: decayed sums of observed seconds
        self.tabled = np.zeros(2)  # ... and of the table's seconds for the same steps
        self._last: float | None = None  # when the previous step ended

    def factor(self, k: int) -> float:
        pooled = self.observed.sum() / self.tabled.sum() if self.tabled.sum() > 0 else 1.0
        kind = int(k > 0)
        return float((self.observed[kind] + self.prior * pooled) / (self.tabled[kind] + self.prior))

    def wants_plain(self) -> bool:
        """Whether the next step should be plain, to time one beside speculative steps running slow."""
        return self.tabled[0] < 0.5 * self.unit and self.tabled[1] > self.prior and self.factor(1) > self.EXCESS

    def step_ended(self, k: int, tabled: float, now: float | None = None) -> None:
        """A step that verified ``k`` draft tokens (t(k + 1) = ``tabled`` by the table) ended ``now``."""
        now = time.perf_counter() if now is None else now
        self.observed *= self.decay
        self.tabled *= self.decay
        if self._last is not None:  # the first step's time holds the prefill: not a step's
            self.observed[int(k > 0)] += now - self._last
            self.tabled[int(k > 0)] += tabled
        self._last = now


class CostAwareLength(DraftLength):
    """``cost``: the draft length that maximises expected committed tokens per second (module docstring)."""

    def __init__(
        self,
        config: DraftLengthConfig,
        num_draft_tokens: int,
        floor: int,
        step_cost: StepCost,
        cheap_drafts: bool,
        timed: bool = True,
    ) -> None:
        super().__init__(config, num_draft_tokens, floor)
        self.step_cost = step_cost
        self.cheap_drafts = cheap_drafts  # copy drafters: propose -k, cut once the bucket is known
        self.timed = timed  # correct the table by this request's own step times (greedy only: module docstring)
        self.acceptance = AcceptanceModel(num_draft_tokens)
        self.seconds_per_draft_token = 0.0  # measured: moving average over the steps that drafted
        self._bucket: Bucket | None = None
        # t(n) for n = 1 .. maximum + 1, once
        self._costs = np.array([step_cost(n) for n in range(1, num_draft_tokens + 2)])
        self.times = StepTimes(float(self._costs[0]))  # this request's steps against the table

    def best(self, bucket: Bucket, longest: int, seconds_per_token: float) -> int:
        """The k in {0} ∪ [minimum, longest] (``longest`` itself when shorter) with the most tokens per second."""
        expected = self.acceptance.expected_committed(bucket)
        candidates = np.array(sorted({0, longest, *range(self.minimum, longest + 1)}))
        factors = np.where(candidates > 0, self.times.factor(1), self.times.factor(0))  # as this request's steps ran
        seconds = self._costs[candidates] * factors + seconds_per_token * candidates
        rates = expected[candidates] / seconds
        return int(candidates[int(np.argmax(rates))])

    def next(self) -> int:
        if self.cheap_drafts:
            return self.maximum
        # a model drafter pays per token: ask for what its usual bucket (one source, no match) warrants
        buckets = self.acceptance.buckets or [(UNKNOWN_SOURCE, 0)]
        return max(self.best(bucket, self.maximum, self.seconds_per_draft_token) for bucket in buckets)

    def choose(self, draft: Draft, draft_seconds: float) -> int:
        if draft.num_tokens == 0:
            self._bucket = None
            return 0
        per_token = draft_seconds / draft.num_tokens
        self.seconds_per_draft_token = 0.8 * self.seconds_per_draft_token + 0.2 * per_token
        self._bucket = bucket_of(draft)
        if self.times.wants_plain():  # speculative steps run slow: time a plain one beside them
            return 0
        return self.best(self._bucket, draft.num_tokens, 0.0)  # drafting is paid for already

    def recorded(self, requested: int, chosen: int) -> int:
        return chosen  # the policy's own choice, not the -k every copy draft is asked for

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        self.acceptance.observe(self._bucket, num_proposed, num_accepted)
        if self.timed:
            self.times.step_ended(num_proposed, float(self._costs[min(num_proposed, len(self._costs) - 1)]))
        self._bucket = None


def new_draft_length(
    config: DraftLengthConfig,
    num_draft_tokens: int,
    floor: int,
    step_cost: StepCost | None = None,
    cheap_drafts: bool = True,
    timed: bool = True,
) -> DraftLength:
    """The policy ``config.policy`` names; ``cost`` needs the target's ``step_cost`` (``timed``: and corrects it by
    the request's own step times, which a sampled request must not: module docstring)."""
    if config.policy == "cost":
        if step_cost is None:
            raise ValueError("the cost-aware draft length needs the target's step cost (flyspec.runtime.step_cost)")
        return CostAwareLength(config, num_draft_tokens, floor, step_cost, cheap_drafts, timed)
    return DraftLength(config, num_draft_tokens, floor)
