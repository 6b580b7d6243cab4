"""flyspec's n-gram drafter as a vLLM proposer (``speculative_config={"method": "custom_class", ...}``).

Use ``"model": "flyspec_vllm.NgramProposer"``. The lookup is flyspec's own ``ngram_lookup``
(most recent match, LZ77-style periodic extension; ``drafters/ngram.py``), compiled for the whole batch
(``lookup.py``, numba), so vLLM and ``flyspec generate --drafter ngram`` propose the same tokens. n-gram sizes: vLLM's
``prompt_lookup_max`` / ``prompt_lookup_min`` where given, else flyspec's ``NgramConfig``. A request that
carries a prediction (OpenAI's Predicted Outputs, ``extra_args["flyspec_prediction"]``: ``prediction.py``) is drafted
from its prediction alone, aligned with its output. A request that asks for none
(``extra_args={"flyspec_draft": false}``) gets no drafts: plain decoding in the same engine; so does
a batch holding a sampled request on an engine that failed the sampling check (``sampling_guard.py``). A
calibration's baseline that names its output (``flyspec_reference``) gets its drafts cut to what its shadow
rules read (``reference.py``).

A batch-size schedule (``flyspec.config.schedule``) caps the drafts by the step's batch size: ``$FLYSPEC_VLLM_SCHEDULE``
(its entries inline, ``[[1, 8, 6], [9, 256, 0]]``, or a file: a schedule.json or a profile carrying one; what
profiles' deploy blocks and ``flyspec bench --online`` set), else vLLM's own
``speculative_config["num_speculative_tokens_per_batch_size"]`` where vLLM leaves it (0.32 does for this proposer;
0.33 drops it for ``custom_class`` on the V1 runner, ``VllmConfig._maybe_disable_dynamic_sd_for_v1``). ``k = 0`` in
a range: no drafts at those batch sizes, plain decoding.

A fault inside :meth:`NgramProposer.propose` (a plugin hook like the others: ``failsafe.py``) costs one step its
drafts (plain decoding, lossless), one error line and a count; the engine keeps serving.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from flyspec_vllm import failsafe
from flyspec_vllm._flyspec import BatchSchedule, ConfigError, NgramConfig
from flyspec_vllm.lookup import lookup_rows

logger = logging.getLogger(__name__)
SCHEDULE_VARIABLE = "FLYSPEC_VLLM_SCHEDULE"
VLLM_SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"
_override: list[BatchSchedule] = []  # flyspec's worker sweeps draft lengths on one engine (:func:`override`)


def operator_schedule(speculative: Any, environ: Any = os.environ) -> BatchSchedule | None:
    """The batch-size schedule: ``$FLYSPEC_VLLM_SCHEDULE``'s (inline entries or a file), else ``speculative_config``'s
    (where vLLM kept it), else None."""
    value = environ.get(SCHEDULE_VARIABLE, "").strip()
    if value.startswith("["):
        try:
            return BatchSchedule.from_entries(json.loads(value))
        except json.JSONDecodeError as error:
            raise ConfigError(f"{SCHEDULE_VARIABLE}: not a JSON list of [start, end, k] entries ({error})") from None
    if value:
        return BatchSchedule.load(value)
    entries = getattr(speculative, VLLM_SCHEDULE_KEY, None)
    return BatchSchedule.from_entries(entries) if entries else None


def override(schedule: BatchSchedule | None) -> None:
    """From now on every proposer in this process follows ``schedule`` (None: the configured one again); flyspec's
    worker sets it in every worker process through ``gather.Ranks.schedule``."""
    _override[:] = [] if schedule is None else [schedule]


@contextlib.contextmanager
def overriding(schedule: BatchSchedule | None) -> Iterator[None]:
    """Within the block, every proposer in this process follows ``schedule`` (None: the configured one)."""
    if schedule is None:
        yield
        return
    _override.append(schedule)
    try:
        yield
    finally:
        _override.pop()


class NgramProposer:
    """Proposes, per request, a continuation of an earlier occurrence of its last n tokens."""

    def __init__(self, vllm_config: Any) -> None:
        speculative = vllm_config.speculative_config
        defaults = NgramConfig()
        self.num_draft_tokens = int(speculative.num_speculative_tokens)
        self.max_ngram = int(getattr(speculative, "prompt_lookup_max", None) or defaults.max_ngram)
        self.min_ngram = int(getattr(speculative, "prompt_lookup_min", None) or defaults.min_ngram)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        try:
            self.schedule = operator_schedule(speculative)
        except ConfigError as error:
            raise ConfigError(f"flyspec_vllm.NgramProposer: {error}") from None
        lookup_rows(np.zeros((1, 2), dtype=np.int32), [2], [0], [1], 1, 1)  # numba compiles now, not in a step
        if self.schedule is not None:
            logger.info("flyspec-vllm: n-gram proposer follows the batch schedule (%s)", self.schedule.describe())

    def draft_limit(self, batch_size: int) -> int:
        """At most this many draft tokens per request at this batch size."""
        schedule = _override[-1] if _override else self.schedule
        return self.num_draft_tokens if schedule is None else min(self.num_draft_tokens, schedule.k_for(batch_size))

    def propose(
        self,
        sampled_token_ids: list[list[int]],  # [batch][tokens committed last step]; empty: nothing new
        num_tokens_no_spec: np.ndarray,  # [max_batch] committed tokens per request
        token_ids_cpu: np.ndarray,  # [max_batch, max_model_len]
        slot_mappings: Any = None,  # unused (no KV cache)
    ) -> list[list[int]]:
        batch = len(sampled_token_ids)
        try:
            return self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        except Exception as error:  # noqa: BLE001 - fail closed: this step gets no drafts (plain decoding)
            failsafe.fault("flyspec's n-gram proposer", error, ())
            return [[] for _ in range(batch)]

    def _propose(
        self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray
    ) -> list[list[int]]:
        from flyspec_vllm.patch import draftless as draftless_rows  # set by the _sample wrapper this step
        from flyspec_vllm.patch import references as reference_rows
        from flyspec_vllm.prediction import PREDICTIONS
        from flyspec_vllm.sampling_guard import GUARD

        predicted = PREDICTIONS.take()  # rows whose request has a prediction (prediction.py); None: unknown, none
        if GUARD.step_guarded or predicted is None:  # a sampled request on an engine that failed the sampling check
            return [[] for _ in sampled_token_ids]
        draftless = draftless_rows()  # rows whose request asked for plain decoding (flyspec_draft: false)
        references = reference_rows()  # rows whose drafts are cut to what their shadow rules read (reference.py)
        batch = len(sampled_token_ids)
        limit = self.draft_limit(batch)
        drafts: list[list[int]] = [[] for _ in range(batch)]
        if limit <= 0:
            return drafts
        lengths = np.asarray(num_tokens_no_spec[:batch], dtype=np.int64)
        rooms = np.minimum(limit, self.max_model_len - lengths - 1)
        rows = [
            index
            for index, sampled in enumerate(sampled_token_ids)
            if sampled and rooms[index] > 0 and index not in draftless
        ]
        for index in [index for index in rows if index in predicted]:  # drafted from the prediction alone
            drafts[index] = predicted[index].draft(token_ids_cpu[index], int(lengths[index]), int(rooms[index]))
        rows = [index for index in rows if index not in predicted]
        found = lookup_rows(token_ids_cpu, lengths[rows], rows, rooms[rows], self.max_ngram, self.min_ngram)
        for index, draft in zip(rows, found, strict=True):
            reference = references.get(index)
            drafts[index] = draft if reference is None else reference.cap(token_ids_cpu[index], lengths[index], draft)
        return drafts

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No model to load."""
