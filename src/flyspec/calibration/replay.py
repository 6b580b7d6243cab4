"""Replay: many verification rules run on one prompt for the price of the forwards they do not share.

A calibration runs the same prompt under many lossy settings (FLy thresholds, windows, guards,
competing rules). Greedy decoding is deterministic, and so is sampling for a given seed (every draw is keyed by
the seed and the position: ``sampling/coupled.py``), so two settings commit the same tokens until
one of them keeps a loose accept the other refuses; until then they ask the target the same
questions (the logits after the same tokens) and the drafter for the same drafts. Replay answers
every question once per prompt:

:class:`ScoreStore`
    The target's logits row after each token prefix it has scored (keyed by the output tokens;
    the prompt is fixed per item). A question whose rows are all known costs nothing; otherwise
    the one real KV cache is cropped to the longest prefix it shares with the question and the
    rest is forwarded, and every new row is kept.
:class:`DraftStore`
    The drafter's draft for each (output so far, draft length). On a miss the one real drafter is
    told how much of what it last saw still stands (``rollback``) and drafts for real.

:class:`ReplayTarget` and :class:`ReplayDrafter` are what each decoder sees: a ``Target`` and a
``Drafter`` answering from the stores. The decoder itself is the real one (``SpeculativeDecoder``
with the real verifier, guards, draft-length policy, stopping and statistics), so a replayed
generation takes the same decisions as a live one, and counts the same target forwards (τ) and
loose accepts. Its timings are not real (a remembered answer is free): speed comes from the cost
model (``projection.py``).

The rows are the target's float32 logits computed in other batch shapes than a live run would
use, so a replayed output equals a live one up to floating-point rounding, as speculative and plain
decoding agree in float32 (tested: ``tests/test_calibrate_replay.py`` runs every drafter both ways).
Sampled, the rows serve every seed of a prompt (the logits after a prefix do not depend on the sampling), and the
drafts are one seed's (a model drafter samples with the seed's noise): ``DraftStore.begin`` per seed. Block
verification draws fresh numbers at every step, so its path is not replayable: it is not a calibration point.

The rows stay on the target's device up to ``device_budget_bytes`` (default 1 GiB: a 128k vocabulary's
float32 rows are 0.5 MB each); past it the oldest forwards' rows move to host memory, and come back when
asked again. Moved, not dropped: an answer is still the row first computed for its prefix.
"""

from __future__ import annotations

import torch

from flyspec.config import SamplingConfig
from flyspec.drafters.base import Drafter
from flyspec.drafters.cross_tokenizer import CrossTokenizerDrafter, common_prefix_length
from flyspec.runtime.cached_model import CachedModel
from flyspec.runtime.clock import device_clock
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.sampling.coupled import Draws
from flyspec.types import Draft

Key = tuple[int, ...]  # output tokens after the prompt


DEVICE_BUDGET_BYTES = 1 << 30


class ScoreStore:
    """The target's logits after every prefix scored for one prompt; one real KV cache behind them."""

    def __init__(self, target: LoadedModel, device_budget_bytes: int = DEVICE_BUDGET_BYTES) -> None:
        self.cached_model = CachedModel(target)
        self.device = self.cached_model.device
        self.device_budget_bytes = device_budget_bytes
        self.prompt_ids: list[int] = []
        # output tokens → (which forward's logits [n, vocab] in ``blocks``, the row predicting the next position)
        self.rows: dict[Key, tuple[int, int]] = {}
        self.blocks: list[torch.Tensor] = []  # each forward's kept rows, in order; the oldest may be on the host
        self.device_bytes = 0  # bytes of ``blocks`` on the device
        self._oldest_on_device = 0  # blocks before it are on the host
        self.cached: list[int] = []  # the tokens whose keys and values the real cache holds
        self.num_forwards = 0  # real forwards, this prompt
        self.num_scored_tokens = 0  # real tokens forwarded, prefills included

    def begin(self, prompt_ids: list[int]) -> None:
        """Forget the previous prompt's rows (the next question prefills this one); for the same prompt again (another
        seed or sampling), keep them: they are the target's logits, which no sampling changes."""
        if list(prompt_ids) == self.prompt_ids and self.rows:
            return
        self.prompt_ids = list(prompt_ids)
        self.rows.clear()
        self.blocks.clear()
        self.device_bytes = self._oldest_on_device = 0
        self.cached_model.reset()
        self.cached = []
        self.num_forwards = self.num_scored_tokens = 0

    def score(self, committed: list[int], draft: list[int]) -> torch.Tensor:
        """Logits ``[k + 1, vocab]`` after ``committed`` and after each draft prefix (as ``Target.score``)."""
        start = len(self.prompt_ids)
        if committed[:start] != self.prompt_ids:
            raise RuntimeError("replay: a generation scored another prompt than the store's; call begin() first")
        output = tuple(committed[start:])
        keys = [output + tuple(draft[:index]) for index in range(len(draft) + 1)]
        if all(key in self.rows for key in keys):
            return self._rows(keys)
        sequence = committed + draft
        last = len(committed) - 1  # the cache must hold everything before the last committed token
        shared = min(common_prefix_length(self.cached, sequence), last)
        self.cached_model.crop_to(shared)
        if shared < last:  # catch up on committed tokens the cache does not hold (prefill, or another path)
            self._forward(sequence, shared, last)
        self._forward(sequence, last, len(sequence))
        self.cached = sequence
        return self._rows(keys)

    def _rows(self, keys: list[Key]) -> torch.Tensor:
        """The rows of ``keys`` ``[len(keys), vocab]``: a view when one forward computed them in order (the
        usual case, and no copy of a large vocabulary's rows), else a copy. The first row computed for a
        prefix is its row for good, so an answer never depends on the order of the questions."""
        found = [self.rows[key] for key in keys]
        block, first = found[0]
        if all(number == block and index == first + offset for offset, (number, index) in enumerate(found)):
            return self.blocks[block][first : first + len(keys)].to(self.device)  # a view, unless moved to the host
        return torch.stack([self.blocks[number][index].to(self.device) for number, index in found])

    def _forward(self, sequence: list[int], begin: int, end: int) -> None:
        """Forward ``sequence[begin:end]`` onto the cache; keep the rows after every output prefix.

        Row ``j`` of the result predicts the token after ``sequence[: begin + j + 1]``; rows of
        prefixes inside the prompt are never asked for and not computed (``logits_to_keep``).
        """
        start = len(self.prompt_ids)
        wanted = end - max(begin, start - 1)  # positions whose prefix ends at or after the prompt
        logits = self.cached_model.forward(sequence[begin:end], logits_to_keep=max(wanted, 1) if begin < start else 0)
        self.num_forwards += 1
        self.num_scored_tokens += end - begin
        if wanted <= 0:
            return
        rows = logits[-wanted:]  # [wanted, vocab]
        first = end - wanted  # the absolute position of the first kept row's last token
        block = len(self.blocks)
        self.blocks.append(rows)
        self.device_bytes += rows.numel() * rows.element_size()
        for offset in range(wanted):
            self.rows.setdefault(tuple(sequence[start : first + offset + 1]), (block, offset))
        self._bound()

    def _bound(self) -> None:
        """Move the oldest blocks to the host while the device holds more than the budget (the newest stays)."""
        while self.device_bytes > self.device_budget_bytes and self._oldest_on_device < len(self.blocks) - 1:
            oldest = self.blocks[self._oldest_on_device]
            self.device_bytes -= oldest.numel() * oldest.element_size()
            self.blocks[self._oldest_on_device] = oldest.to("cpu")  # a host copy; nothing is recomputed
            self._oldest_on_device += 1


class ReplayTarget:
    """A decoder's ``Target`` (``runtime/target.py``) answering from a shared :class:`ScoreStore`."""

    def __init__(self, store: ScoreStore) -> None:
        self.store = store
        self.committed: list[int] = []

    @property
    def device(self) -> torch.device:
        return self.store.device

    @property
    def num_committed(self) -> int:
        return len(self.committed)

    def start(self, prompt_ids: list[int]) -> int:
        if prompt_ids != self.store.prompt_ids:
            raise RuntimeError("replay: call ScoreStore.begin(prompt_ids) before generating for a new prompt")
        self.committed = list(prompt_ids)
        return 0

    def score(self, last_token: int, draft_tokens: torch.Tensor) -> torch.Tensor:
        if self.committed[-1] != last_token:
            raise RuntimeError("replay: the scored token is not the last committed one")
        return self.store.score(self.committed, draft_tokens.tolist())

    def rollback(self, committed: list[int]) -> None:
        self.committed = committed

    def check_invariant(self) -> None:
        """Nothing to check: the real cache is positioned on demand, per question."""


DraftKey = tuple[Key, int]  # (output so far, draft length asked for)


def _path_levels(drafter: object) -> list[CrossTokenizerDrafter]:
    """The levels of a drafter stack that carry state along a path (``CrossTokenizerDrafter.path_state``)."""
    found = [drafter] if isinstance(drafter, CrossTokenizerDrafter) else []
    for name in ("inner", "proposer", "drafter"):  # a translator's, a draft model's, a layer-skip view's level
        below = getattr(drafter, name, None)
        if below is not None:
            found += _path_levels(below)
    return found


class DraftStore:
    """The drafter's drafts for one prompt, by (output so far, length asked for); one real drafter behind them.

    Drafts are a function of the path (greedy, or sampled with the one seed's noise): two generations that
    committed the same tokens took the same steps, so their drafters asked the same things. Caches re-sync from the
    tokens; the little state a drafter carries besides them (a cross-tokenizer drafter's token ratio) is kept after
    every real draft and restored before the next real draft of the same path.
    """

    def __init__(self, drafter: Drafter) -> None:
        self.device = getattr(drafter, "device", None)  # a model drafter's: its forwards are waited for
        self.drafter = drafter
        self.levels = _path_levels(drafter)
        self.prompt_ids: list[int] = []
        self.drafts: dict[DraftKey, Draft] = {}
        self.states: dict[DraftKey | None, list[tuple[int, int]]] = {}  # after each draft (None: after reset)
        self.seen: list[int] = []  # what the real drafter last saw: its sequence and its draft
        self.seconds = 0.0
        self.num_drafted = 0

    def begin(self, prompt_ids: list[int]) -> None:
        self.prompt_ids = list(prompt_ids)
        self.drafts.clear()
        self.drafter.reset(self.prompt_ids)
        self.states = {None: [level.path_state() for level in self.levels]}
        self.seen = list(prompt_ids)

    def propose(
        self,
        token_ids: list[int],
        num_draft_tokens: int,
        sampling: SamplingConfig,
        draws: Draws | None,
        previous: DraftKey | None = None,
    ) -> tuple[Draft, DraftKey]:
        """The draft after ``token_ids`` (and its key), ``previous`` being the path's last draft's key; sampled, a
        draft depends on the seed's noise too, which is one per store (``begin`` per seed)."""
        key = (tuple(token_ids[len(self.prompt_ids) :]), num_draft_tokens)
        draft = self.drafts.get(key)
        if draft is not None:
            return draft, key
        shared = common_prefix_length(self.seen, token_ids)
        if shared < len(self.seen):
            # Drafter protocol: the first n - 1 tokens of what it last saw stand; at least one is left to feed
            self.drafter.rollback(min(shared + 1, len(token_ids)))
        for level, state in zip(self.levels, self.states[previous], strict=True):
            level.restore_path_state(state)
        started = device_clock(self.device)
        draft = self.drafter.propose(token_ids, num_draft_tokens, sampling, draws)
        self.seconds += device_clock(self.device) - started
        self.num_drafted += draft.num_tokens
        self.seen = list(token_ids) + draft.tokens.tolist()
        self.drafts[key] = draft
        self.states[key] = [level.path_state() for level in self.levels]
        return draft, key


class ReplayDrafter:
    """A decoder's ``Drafter`` answering from a shared :class:`DraftStore` (keeps the real drafter's name)."""

    def __init__(self, store: DraftStore, name: str) -> None:
        self.store = store
        self.name = name
        self.previous: DraftKey | None = None  # this generation's last draft

    def reset(self, prompt_ids: list[int]) -> None:
        if prompt_ids != self.store.prompt_ids:
            raise RuntimeError("replay: call DraftStore.begin(prompt_ids) before generating for a new prompt")
        self.previous = None

    def propose(
        self, token_ids: list[int], num_draft_tokens: int, sampling: SamplingConfig, draws: Draws | None
    ) -> Draft:
        draft, self.previous = self.store.propose(token_ids, num_draft_tokens, sampling, draws, self.previous)
        return draft

    def rollback(self, num_committed: int) -> None:
        """Nothing now: the store tells the real drafter what stands on its next real draft."""

    def finish(self, token_ids: list[int]) -> None:
        """Nothing to learn: calibration drafters keep no memory across prompts."""

    def report(self) -> dict[str, object]:
        return {}
