"""A calibration baseline's drafts, cut to what its shadow rules read (``flyspec_reference``, trusted requests).

A lossless request that carries shadow rules (``rule.py``) verifies all ``k`` draft tokens of every step,
although only its first mismatch decides where a shadow rule leaves the path, and each rule reads only a few
tokens past it (``flyspec.verifiers.registry.verdict_reach``: FLy's window + 1, the guards' n-gram). When the
request names the output it will produce (``flyspec_reference``: its plain decoding, which a lossless greedy
request reproduces), the proposer knows where each draft's first mismatch will be and cuts the draft ``reach``
tokens past it: the same steps, accepts and shadow verdicts, fewer token rows through the target (measured on a
400-prompt calibration with k = 15: 13,533 draft tokens cut, the baseline about 12 % faster;
``evaluation/2026-11-26-calibrate-speed``).

Should the output leave its reference (a batch that rounds a near-tie the other way), the cut stops there and
the record says where (``departed``): the step that left may have been judged on a cut draft, so the caller
decodes that request again without a reference. The draft tokens withheld are recorded too (``cut``), so that
vLLM's counters can still be checked against the replayed steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from flyspec_vllm import records
from flyspec_vllm._flyspec import ConfigError, verdict_reach


@dataclass
class Reference:
    """One request's expected output and how far past a mismatch its shadow rules read."""

    record: str
    prompt_length: int
    tokens: np.ndarray  # [n] the output the request is expected to produce
    reach: int
    departed: bool = False

    def cap(self, row: np.ndarray, length: int, draft: list[int]) -> list[int]:
        """``draft`` (proposed at ``length`` committed tokens of ``row``) cut ``reach`` tokens past the position
        where it will first miss, while the output so far is the reference's; else ``draft`` unchanged."""
        if self.departed or not draft:
            return draft
        produced = length - self.prompt_length
        if produced > len(self.tokens):
            return draft  # past the reference's end: nothing to predict from
        if not np.array_equal(row[self.prompt_length : length], self.tokens[:produced]):
            self.departed = True
            records.add_departure(self.record, produced)
            return draft
        expected = self.tokens[produced : produced + len(draft)]
        matching = 0
        while matching < len(expected) and draft[matching] == int(expected[matching]):
            matching += 1
        if matching == len(expected) < len(draft):
            return draft  # the reference ends inside the draft: nothing to predict past it
        keep = matching + self.reach
        if keep >= len(draft):
            return draft
        records.add_cut(self.record, len(draft) - keep)
        return draft[:keep]


def reference_rows(
    runner: Any, memos: dict[str, dict[str, Any]], options_of: Callable[[str, Any], Any], trusted: bool
) -> dict[int, Reference]:
    """This step's batch rows whose request names a reference, for the proposer that runs right after ``_sample``
    (same batch order). Built once per request (kept in its memo) from its options as ``options_of(req_id,
    sampling_params)`` parses them (``patch._options``: once per request too); a request whose options are refused
    gets none (``patch.batch_rules`` says why)."""
    rows: dict[int, Reference] = {}
    if not trusted:
        return rows
    batch = runner.input_batch
    for index, req_id in enumerate(batch.req_ids):
        params = runner.requests[req_id].sampling_params
        if "flyspec_reference" not in (getattr(params, "extra_args", None) or {}):
            continue
        memo = memos.setdefault(req_id, {})
        if "reference" not in memo:
            try:
                memo["reference"] = _reference(options_of(req_id, params), int(batch.num_prompt_tokens[index]))
            except ConfigError:
                memo["reference"] = None
        if memo["reference"] is not None:
            rows[index] = memo["reference"]
    return rows


def _reference(options: Any, prompt_length: int) -> Reference | None:
    if options.reference is None or options.record is None:
        return None
    reach = max(verdict_reach(rule) for family in options.shadow for rule in family)
    return Reference(options.record, prompt_length, np.asarray(options.reference, dtype=np.int64), reach)
