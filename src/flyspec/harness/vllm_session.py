"""Requests to a vLLM engine with the flyspec-vllm plugin, and their outputs as flyspec's engine would return them.

What ``flyspec calibrate --engine vllm`` and ``flyspec eval --engine vllm`` share: a submission of many requests
(each with its own rule, ``flyspec_vllm.options``) that vLLM batches; each output cut by flyspec's
:class:`Stopper` (EOS, length, stop strings) as flyspec's engine cuts it; its steps (target forwards, draft
tokens per forward: τ and a projection's inputs) counted by replaying vLLM's proposer on it (:func:`count_steps`:
the drafter is deterministic, and a draft token is accepted exactly when the output has it there), and checked
against vLLM's own counters for every submission (``counter_mismatches``); loose accepts from the plugin's records.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass
from typing import Any

import numpy as np

from flyspec.config import ConfigError, DecodeConfig, NgramConfig, SpeculationConfig
from flyspec.decoding.result import GenerationResult
from flyspec.decoding.stats import DecodeStats
from flyspec.decoding.stopping import Stopper
from flyspec.drafters.ngram import copy_sources, longest_match
from flyspec.drafters.prediction import Alignment, aligned_tokens, follow
from flyspec.harness.vllm_worker import VllmWorker
from flyspec.runtime.loaded_model import ServedModel
from flyspec.types import PREDICTION, LooseAccept, Verdict

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    """One target forward of a vLLM request, replayed: where it started, the draft it verified, what it kept."""

    position: int  # output index of the first token it commits
    draft: tuple[int, ...]
    sources: tuple[str, ...]
    accepted: int  # leading draft tokens the output has (loose accepts included)


@dataclass(frozen=True)
class StepCounts:
    """What replayed steps say vLLM's counters should read: target forwards (the prefill's included), steps with a
    draft, draft tokens, draft tokens kept; ``slack``: the last steps' drafted-but-not-kept tokens, which vLLM also
    counts as accepted where its target went on past a request's end (EOS, length) inside a step's draft."""

    forwards: int = 0
    drafts: int = 0
    drafted: int = 0
    accepted: int = 0
    slack: int = 0

    @classmethod
    def of(cls, steps: list[Step], cut: int = 0) -> StepCounts:
        """One request's (``cut``: draft tokens the plugin withheld from a baseline that named its output)."""
        drafted = sum(len(step.draft) for step in steps) - cut
        slack = len(steps[-1].draft) - steps[-1].accepted if steps else 0
        return cls(len(steps), sum(bool(step.draft) for step in steps), drafted, sum(s.accepted for s in steps), slack)

    def __add__(self, other: StepCounts) -> StepCounts:
        return StepCounts(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def agree(self, reply: dict[str, Any], what: str) -> bool:
        """Whether vLLM's counters in ``reply`` are these steps' (a warning naming ``what`` where not)."""
        agree = (self.drafts, self.drafted) == (reply["drafts"], reply["draft_tokens"]) and (
            self.accepted <= reply["accepted"] <= self.accepted + self.slack
        )
        if not agree:
            logger.warning(
                "%s: vLLM counted %d drafts, %d draft tokens, %d accepted; the replayed steps %d, %d, %d",
                what, reply["drafts"], reply["draft_tokens"], reply["accepted"], self.drafts, self.drafted,
                self.accepted,
            )  # fmt: skip
        return agree


def count_steps(
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    k: int,
    ngram: NgramConfig,
    max_model_len: int,
    vllms_own: bool = False,
) -> list[Step]:
    """vLLM's steps for ``output_ids``: the prefill commits the first token, then each step verifies the draft
    ``flyspec_vllm.NgramProposer`` proposes from the tokens so far (``vllms_own``: vLLM's own n-gram proposer,
    the earliest match, no periodic extension) and commits its accepted prefix plus one (a rejected draft token
    is never the committed one there: the target's choice is)."""
    match, extend = ("earliest", False) if vllms_own else ("recent", True)

    def propose(sequence: list[int], room: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
        indices = longest_match(sequence, room, ngram.max_ngram, ngram.min_ngram, match, extend)[0]
        return tuple(sequence[index] for index in indices), copy_sources(list(indices), len(prompt_ids))

    return replay_steps(prompt_ids, output_ids, k, max_model_len, propose)


def prediction_steps(
    prompt_ids: Sequence[int], output_ids: Sequence[int], prediction_ids: Sequence[int], k: int, max_model_len: int
) -> list[Step]:
    """vLLM's steps for a request with a prediction: the plugin's proposer drafts from the prediction alone
    (``flyspec_vllm.prediction``: flyspec's alignment, :func:`follow` and :func:`aligned_tokens`)."""
    prediction = np.asarray(prediction_ids, dtype=np.int64)
    alignment = Alignment.start(len(prediction))

    def propose(sequence: list[int], room: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
        nonlocal alignment
        alignment, _ = follow(prediction, sequence[len(prompt_ids) :], alignment)
        draft = tuple(int(token) for token in aligned_tokens(prediction, alignment, room))
        return draft, (PREDICTION,) * len(draft)

    return replay_steps(prompt_ids, output_ids, k, max_model_len, propose)


def replay_steps(
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    k: int,
    max_model_len: int,
    propose: Callable[[list[int], int], tuple[tuple[int, ...], tuple[str, ...]]],
) -> list[Step]:
    """The steps of ``output_ids`` under a deterministic proposer: ``propose(tokens so far, room)`` gives each
    step's draft (at most ``room`` tokens: k, or what vLLM's ``max_model_len`` leaves) and its sources."""
    if not output_ids:
        return []
    steps = [Step(0, (), (), 0)]
    sequence = [*prompt_ids, output_ids[0]]
    position = 1
    while position < len(output_ids):
        room = min(k, max_model_len - len(sequence) - 1)
        draft, sources = propose(sequence, room) if room > 0 else ((), ())
        accepted = 0
        while accepted < len(draft) and position + accepted < len(output_ids):
            if draft[accepted] != output_ids[position + accepted]:
                break
            accepted += 1
        committed = min(accepted + 1, len(output_ids) - position)
        steps.append(Step(position, draft, sources, accepted))
        sequence += output_ids[position : position + committed]
        position += committed
    return steps


def step_stats(steps: list[Step], length: int, loose: dict[int, dict[str, Any]]) -> DecodeStats:
    """The :class:`DecodeStats` of the first ``length`` output tokens (what the stopper kept) of these steps."""
    stats = DecodeStats()
    for step in steps:
        if step.position >= length:
            break
        committed = min(step.accepted + 1, length - step.position)
        if not step.draft:
            stats.observe(0, None, committed)
            continue
        positions = tuple(j for j in range(step.accepted) if step.position + j in loose)
        explained = tuple(
            LooseAccept(j, step.draft[j], int(loose[step.position + j]["target_token"]),
                        float(loose[step.position + j]["evidence"]), step.sources[j])
            for j in positions
        )  # fmt: skip
        tokens = [*step.draft[: step.accepted], -1]  # the recovered/bonus token's value is not counted
        verdict = Verdict(tokens, step.accepted, positions, step.accepted == len(step.draft), explained)
        stats.observe(len(step.draft), verdict, committed)
    return stats


def check_record(request: dict[str, Any], output: dict[str, Any], drafted_steps: int) -> None:
    """A recorded request judged by a rule or shadows (``flyspec_vllm.records``) must have been judged at every step
    that verified a draft: a record missing steps (a rule refused or disabled in the engine, records read where the
    rule does not run) would make a calibration or evaluation from it silently wrong, so it is refused."""
    extra = request["extra_args"]
    if "flyspec_record" not in extra or not (extra.get("flyspec_rule") or extra.get("flyspec_shadow")):
        return
    judged = (output.get("record") or {}).get("steps", 0)
    if judged != drafted_steps:
        raise ConfigError(
            f"vLLM: the flyspec-vllm plugin judged {judged} of the {drafted_steps} verification steps of request "
            f"{extra['flyspec_record']!r}, so its record is incomplete (see the vLLM log for a refused or disabled "
            "rule); nothing from it is used"
        )


class VllmSession:
    """A started engine for ``target``, drafting with ``base``'s n-gram settings and draft length."""

    def __init__(self, worker: VllmWorker, target: ServedModel, base: SpeculationConfig, max_model_len: int) -> None:
        self.worker, self.target, self.base, self.max_model_len = worker, target, base, max_model_len
        self.largest_submission = 0
        self.counter_mismatches = 0  # submissions whose replayed steps differ from vLLM's counters
        self.submissions = 0
        self.draft_tokens_cut = 0  # withheld from baselines that named their output (flyspec_vllm.reference)
        self.redecoded = 0  # baselines decoded again uncut: their output left the one they named

    @staticmethod
    def request(key: str, prompt: list[int], max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
        return {"key": key, "prompt": prompt, "max_tokens": max_tokens, "extra_args": extra}

    def submit(self, requests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """One submission (vLLM batches all of it), by request key; the replayed steps checked against its counters."""
        reply = self.worker.request({"requests": requests})
        self.submissions += 1
        self.largest_submission = max(self.largest_submission, len(requests))
        outputs = {output["key"]: output for output in reply["outputs"]}
        counts = StepCounts()
        for request in requests:
            if request["extra_args"].get("flyspec_draft") is False:
                continue  # plain decoding: no drafts
            output = outputs[request["key"]]
            steps = self.steps(request["prompt"], output["token_ids"])
            check_record(request, output, sum(bool(step.draft) for step in steps))
            cut = (output.get("record") or {}).get("cut", 0)
            self.draft_tokens_cut += cut
            counts += StepCounts.of(steps, cut)
        if not counts.agree(reply, "a submission"):
            self.counter_mismatches += 1
        return outputs

    def steps(self, prompt: Sequence[int], output: Sequence[int]) -> list[Step]:
        return count_steps(prompt, output, self.base.num_draft_tokens, self.base.ngram, self.max_model_len)

    def result(
        self,
        prompt_ids: list[int],
        decode: DecodeConfig,
        raw: list[int],
        loose: dict[int, dict[str, Any]],
        drafted: bool = True,
    ) -> GenerationResult:
        """An output as flyspec's engine would return it: cut by the stopper, its steps counted."""
        stopper = Stopper(self.target.tokenizer, self.target.eos_token_ids, decode.max_new_tokens, decode.stop_strings)
        token_ids = stopper.commit(raw)
        kept_loose = {index: entry for index, entry in loose.items() if index < len(token_ids)}
        steps = self.steps(prompt_ids, raw) if drafted else [Step(i, (), (), 0) for i in range(len(raw))]
        stats = step_stats(steps, len(token_ids), kept_loose)
        for record in stats.loose_accepts:
            record["draft_text"] = self.target.decode([record["draft_token"]])
            record["target_text"] = self.target.decode([record["target_token"]])
        return GenerationResult(
            stopper.text(),
            token_ids,
            list(prompt_ids),
            stats,
            stopper.finish_reason or "length",
            loose_token_indices=sorted(kept_loose),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "largest_batch": self.largest_submission,
            "submissions": self.submissions,
            "counter_mismatches": self.counter_mismatches,
            "draft_tokens_cut": self.draft_tokens_cut,
            "baselines_redecoded": self.redecoded,
        }
