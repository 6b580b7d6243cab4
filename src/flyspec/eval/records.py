"""One output's record: its task's scores, and how it compares with plain decoding's output of the same item and seed.

``Evaluation`` (``evaluation.py``) decodes; this module says what each output's record holds (``Scorer``), which
outputs a resumed run has already (``record_key``), where plain decoding's outputs are cached (``BaselineCache``), and
how records pair with plain's for the reports (``iter_pairs``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flyspec.config import SamplingConfig
from flyspec.decoding.result import GenerationResult
from flyspec.eval import fidelity, trust
from flyspec.eval.data import EvalItem
from flyspec.eval.tasks import PROMPT_FORMAT, Task
from flyspec.harness.data import JsonlWriter, read_records
from flyspec.harness.methods import PLAIN, Method
from flyspec.runtime.loaded_model import LoadedModel, ServedModel
from flyspec.sampling.coupled import COUPLED_SAMPLING


def record_key(task: str, method: str, item_id: str, seed: int = 0) -> str:
    return f"{task}\t{method}\t{item_id}\t{seed}"


class BaselineCache:
    """Plain decoding outputs keyed by everything that determines them."""

    def __init__(self, directory: Path | None) -> None:
        self.path = directory / "baseline.jsonl" if directory else None
        self.entries = {entry["key"]: entry for entry in read_records(self.path)} if self.path else {}
        self.writer = JsonlWriter(self.path, append=True) if self.path else None

    @staticmethod
    def key(
        target: LoadedModel,
        task: Task,
        item_id: str,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        seed: int = 0,
    ) -> str:
        fields = [target.name, str(target.dtype), task.name, item_id, max_new_tokens, task.stop, PROMPT_FORMAT]
        if target.device.type != "cpu":  # a GPU rounds differently; CPU keys stay as they were
            fields.append(target.device.type)
        if sampling is not None and not sampling.greedy:  # greedy keys stay as they were
            fields += ["sampled", sampling.temperature, sampling.top_k, sampling.top_p, seed, COUPLED_SAMPLING]
        return hashlib.sha256(json.dumps([*fields, prompt_ids]).encode()).hexdigest()

    def get(self, key: str) -> dict[str, Any] | None:
        return self.entries.get(key)

    def put(self, key: str, entry: dict[str, Any]) -> None:
        self.entries[key] = {"key": key, **entry}
        if self.writer:
            self.writer.write(self.entries[key])

    def close(self) -> None:
        if self.writer:
            self.writer.close()


@dataclass
class Output:
    """One generation, as stored (a cached baseline has no live GenerationResult)."""

    text: str
    token_ids: list[int]
    loose_token_indices: list[int]
    stats: dict[str, Any]
    finish_reason: str
    cached: bool = False

    @staticmethod
    def of(result: GenerationResult) -> Output:
        return Output(
            result.text,
            result.token_ids,
            list(result.loose_token_indices),
            result.stats.to_dict(),
            result.finish_reason,
        )


@dataclass(frozen=True)
class ItemRun:
    """One item in progress: its task, its prompt (text and ids) and plain decoding's output (the reference)."""

    task: Task
    item: EvalItem
    prompt: str
    prompt_ids: list[int]
    plain: Output
    seed: int = 0  # the seed every output of this run samples with (T > 0)


class Scorer:
    """Makes each output's record: its task's scores, and its fidelity and trust against plain decoding's output."""

    def __init__(self, target: LoadedModel | ServedModel, similarity: bool = True) -> None:
        self.target = target
        self.similarity = similarity  # False: the similarity model only where the texts are identical (no load)
        self.similarity_model = fidelity.SimilarityModel()

    def record(self, run: ItemRun, method: Method | None, output: Output) -> dict[str, Any]:
        """The record of ``output`` (by ``method``, or plain decoding's own when None) for ``run``'s item and seed."""
        name = method.name if method else PLAIN
        score = run.task.score(run.item, output.text)
        record: dict[str, Any] = {
            "task": run.task.name,
            "task_kind": run.task.kind,
            "item_id": run.item.id,
            "seed": run.seed,
            "method": name,
            "verifier": method.verifier if method else PLAIN,
            "protect": list(method.protect(run.task.kind)) if method else [],
            "lossless": method.lossless if method else True,
            "scores": score.values,
            "score_detail": score.detail,
            "text": output.text,
            "token_ids": output.token_ids,
            "loose_token_indices": output.loose_token_indices,
            "finish_reason": output.finish_reason,
            "baseline_cached": output.cached,
            "stats": output.stats,
            "fidelity": {**self._fidelity(output, run.plain, run.prompt_ids), **self._trust(output, run)},
        }
        if "category" in run.item.extra:  # the adversarial set's
            record["category"] = run.item.extra["category"]
        if method is not None and output.token_ids != run.plain.token_ids:
            record["segments"] = fidelity.highlight_segments(self.target, output.token_ids, output.loose_token_indices)
        return record

    def _fidelity(self, output: Output, plain: Output, prompt_ids: list[int]) -> dict[str, Any]:
        identical = output.token_ids == plain.token_ids
        similarity = None
        if self.similarity or identical:
            similarity = self.similarity_model.similarity(output.text, plain.text)
        return {
            "identical": identical,
            "similarity": similarity,
            "token_agreement": fidelity.token_agreement(output.token_ids, plain.token_ids),
            "common_prefix": fidelity.common_prefix(output.token_ids, plain.token_ids),
            # the target's weights are only in vLLM's process with --engine vllm: no likelihood there
            "log_likelihood": fidelity.mean_log_likelihood(self.target, prompt_ids, output.token_ids)
            if isinstance(self.target, LoadedModel)
            else None,
        }

    def _trust(self, output: Output, run: ItemRun) -> dict[str, Any]:
        """Meaning change and new loop against plain decoding's output (see ``trust.py``)."""
        change = trust.meaning_change(
            output.text,
            run.plain.text,
            run.prompt,
            method_truncated=output.finish_reason == "length",
            plain_truncated=run.plain.finish_reason == "length",
        )
        loop = trust.new_loop(output.token_ids, run.plain.token_ids)
        return {
            "meaning_changed": change.changed,
            "meaning_diff": change.to_dict(),
            "loop": loop is not None,
            "loop_text": self.target.decode(list(loop)) if loop else None,
        }


def iter_pairs(records: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """``(plain record, method record)`` for every method output whose item (and seed) also has a plain record."""

    def key(record: dict[str, Any]) -> tuple[str, str, int]:
        return record["task"], record["item_id"], record.get("seed", 0)

    plain = {key(r): r for r in records if r["method"] == PLAIN}
    for record in records:
        if record["method"] != PLAIN and key(record) in plain:
            yield plain[key(record)], record
