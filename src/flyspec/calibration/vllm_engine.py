"""``flyspec calibrate --engine vllm``: the points of a calibration decoded by vLLM, a wave of prompts at a time.

One engine (``flyspec_vllm.worker --method vllm-flyspec-rules``: flyspec's n-gram drafter, every request with
its own rule through the plugin) receives each wave in two submissions, so vLLM batches across prompts and points:

1. **The shared path.** Per prompt, plain decoding (``flyspec_draft: false``: no drafts, vLLM's own greedy
   decoding) and the lossless baseline (``exact``), the baseline carrying every pending lossy point as a
   *shadow* (``flyspec_vllm.rule``): for each, the step where it would first have kept a draft token the
   baseline rejected. A point that never leaves the path on a prompt has the baseline's output there, token
   for token, and is not decoded at all.
2. **The divergent paths.** A point that leaves at the step starting at output index ``s`` is decoded again
   from ``prompt + baseline[:s - 1]``: vLLM's prefill then samples ``baseline[s - 1]`` (the target's argmax,
   as the baseline's step did) and the point's first verification is the very step it left at, with the same
   drafts; from there it runs as it would have from the start. Its output is ``baseline[:s - 1]`` + that.

flyspec's :class:`Stopper` cuts each output at EOS, the length limit or a stop string, as flyspec's own engine
would. The steps of an output (target forwards, draft tokens per forward: τ and the projection's inputs) are
counted by replaying vLLM's proposer on it (:func:`count_steps`: the drafter is deterministic, and a draft
token is accepted exactly when the output has it there), and checked against vLLM's own counters for every
submission (``counter_mismatches``). Loose accepts are the plugin's records.

Where vLLM and flyspec's engine differ by construction: vLLM's first output token comes from the prefill, so
no draft (and no loose accept) is verified at output index 0; the draft length is fixed (vLLM's
``num_speculative_tokens``); a batch rounds a float32 forward differently from one request alone, so a
near-tie may fall the other way (the live check counts it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flyspec.calibration.frontier import BASELINE, PLAIN
from flyspec.calibration.projection import CostModel
from flyspec.calibration.runner import Outputs, Work
from flyspec.calibration.space import Point
from flyspec.config import NgramConfig, SpeculationConfig
from flyspec.drafters.ngram import copy_sources, longest_match
from flyspec.harness.vllm_worker import VllmWorker
from flyspec.result import GenerationResult
from flyspec.runtime.loaded_model import ServedModel
from flyspec.runtime.step_cost import StepCost
from flyspec.stats import DecodeStats
from flyspec.stopping import Stopper
from flyspec.types import LooseAccept, Verdict
from flyspec.verifiers.registry import rule_mapping as rule_request

logger = logging.getLogger(__name__)

DEFAULT_WAVE = 64  # prompts per wave: vLLM's batch, and how far past a point's stop the work can run


@dataclass(frozen=True)
class Step:
    """One target forward of a vLLM request, replayed: where it started, the draft it verified, what it kept."""

    position: int  # output index of the first token it commits
    draft: tuple[int, ...]
    sources: tuple[str, ...]
    accepted: int  # leading draft tokens the output has (loose accepts included)


def count_steps(
    prompt_ids: Sequence[int], output_ids: Sequence[int], k: int, ngram: NgramConfig, max_model_len: int
) -> list[Step]:
    """vLLM's steps for ``output_ids``: the prefill commits the first token, then each step verifies the draft
    ``flyspec_vllm.NgramProposer`` proposes from the tokens so far and commits its accepted prefix plus one
    (a rejected draft token is never the committed one there: the target's choice is)."""
    if not output_ids:
        return []
    steps = [Step(0, (), (), 0)]
    sequence = [*prompt_ids, output_ids[0]]
    position = 1
    while position < len(output_ids):
        room = min(k, max_model_len - len(sequence) - 1)
        indices = longest_match(sequence, room, ngram.max_ngram, ngram.min_ngram)[0] if room > 0 else []
        draft = tuple(sequence[index] for index in indices)
        accepted = 0
        while accepted < len(draft) and position + accepted < len(output_ids):
            if draft[accepted] != output_ids[position + accepted]:
                break
            accepted += 1
        committed = min(accepted + 1, len(output_ids) - position)
        steps.append(Step(position, draft, copy_sources(list(indices), len(prompt_ids)), accepted))
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


class VllmEngine:
    """The calibration's engine on vLLM (see the module docstring); ``wave_size`` prompts per wave."""

    def __init__(
        self,
        worker: VllmWorker,
        target: ServedModel,
        base: SpeculationConfig,
        points: list[Point],
        wave_size: int = DEFAULT_WAVE,
        max_model_len: int = 4096,
    ) -> None:
        self.worker, self.target, self.base = worker, target, base
        self.wave_size = wave_size
        self.max_model_len = max_model_len
        self.points = {point.name: point for point in points}
        self.largest_submission = 0
        self.counter_mismatches = 0  # submissions whose replayed steps differ from vLLM's counters
        self.submissions = 0

    def run(self, wave: list[Work]) -> dict[str, Outputs]:
        first: list[dict[str, Any]] = []
        for work in wave:
            if work.need_plain:
                first.append(self._request(f"{work.item.key}|plain", work, work.prompt_ids, {"flyspec_draft": False}))
            shadow = self._shadow(work)[0]
            record: dict[str, Any] = {"flyspec_record": f"{work.item.key}|base"}
            first.append(
                self._request(f"{work.item.key}|base", work, work.prompt_ids, {**record, "flyspec_shadow": shadow})
            )
        replies = self._submit(first)
        outputs: dict[str, Outputs] = {work.item.key: {} for work in wave}
        second: list[dict[str, Any]] = []
        continuations: dict[str, tuple[Work, Point, list[int]]] = {}
        for work in wave:
            key = work.item.key
            if work.need_plain:
                outputs[key][PLAIN] = self._result(work, replies[f"{key}|plain"]["token_ids"], {}, drafted=False)
            base = replies[f"{key}|base"]
            baseline = self._result(work, base["token_ids"], {})
            outputs[key][BASELINE] = baseline
            names = self._shadow(work)[1]
            for index, start in (base["record"] or {}).get("diverged", {}).items():
                point = self.points[names[int(index)]]
                if int(start) >= baseline.num_new_tokens:
                    continue  # it leaves after the output stopped: the same output
                kept = base["token_ids"][: int(start) - 1]
                extra = {"flyspec_rule": rule_request(point.speculation), "flyspec_record": f"{key}|{point.name}"}
                request_key = f"{key}|{point.name}"
                second.append(self._request(request_key, work, [*work.prompt_ids, *kept], extra, len(kept)))
                continuations[request_key] = (work, point, kept)
            for point in work.pending:
                if not point.lossless:
                    outputs[key][point.name] = baseline  # replaced below where it left the path
        replies = self._submit(second) if second else {}
        for request_key, (work, point, kept) in continuations.items():
            reply = replies[request_key]
            loose = {entry["index"] + len(kept): entry for entry in (reply["record"] or {}).get("loose_accepts", [])}
            outputs[work.item.key][point.name] = self._result(work, [*kept, *reply["token_ids"]], loose)
        return outputs

    def _shadow(self, work: Work) -> tuple[list[list[dict[str, Any]]], list[str]]:
        """The pending lossy points as shadow families (strict to loose), and the point name of each flat index."""
        families: dict[str, list[Point]] = {}
        for point in sorted((p for p in work.pending if not p.lossless), key=lambda p: (p.family, p.order)):
            families.setdefault(point.family, []).append(point)
        request = [[rule_request(point.speculation) for point in family] for family in families.values()]
        return request, [point.name for family in families.values() for point in family]

    def _request(
        self, key: str, work: Work, prompt: list[int], extra: dict[str, Any], skipped: int = 0
    ) -> dict[str, Any]:
        return {"key": key, "prompt": prompt, "max_tokens": work.decode.max_new_tokens - skipped, "extra_args": extra}

    def _submit(self, requests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """One submission (vLLM batches all of it); checks the replayed steps against vLLM's counters."""
        reply = self.worker.request({"requests": requests})
        self.submissions += 1
        self.largest_submission = max(self.largest_submission, len(requests))
        outputs = {output["key"]: output for output in reply["outputs"]}
        drafts = drafted = accepted = slack = 0
        for request in requests:
            if request["extra_args"].get("flyspec_draft") is False:
                continue  # plain decoding: no drafts
            steps = self._steps(request["prompt"], outputs[request["key"]]["token_ids"])
            drafts += sum(bool(step.draft) for step in steps)
            drafted += sum(len(step.draft) for step in steps)
            accepted += sum(step.accepted for step in steps)
            slack += len(steps[-1].draft) - steps[-1].accepted if steps else 0
        # vLLM also counts the draft tokens it accepted past a request's end (EOS, length) in the last step
        if (drafts, drafted) != (reply["drafts"], reply["draft_tokens"]) or not (
            accepted <= reply["accepted"] <= accepted + slack
        ):
            self.counter_mismatches += 1
            logger.warning(
                "vLLM counted %d drafts, %d draft tokens, %d accepted in a submission; the replayed steps %d, %d, %d",
                reply["drafts"], reply["draft_tokens"], reply["accepted"], drafts, drafted, accepted,
            )  # fmt: skip
        return outputs

    def _steps(self, prompt: Sequence[int], output: Sequence[int]) -> list[Step]:
        k, ngram = self.base.num_draft_tokens, self.base.ngram
        return count_steps(prompt, output, k, ngram, self.max_model_len)

    def _result(
        self, work: Work, raw: list[int], loose: dict[int, dict[str, Any]], drafted: bool = True
    ) -> GenerationResult:
        """An output as flyspec's engine would return it: cut by the stopper, its steps counted."""
        stopper = Stopper(
            self.target.tokenizer, self.target.eos_token_ids, work.decode.max_new_tokens, work.decode.stop_strings
        )
        token_ids = stopper.commit(raw)
        kept_loose = {index: entry for index, entry in loose.items() if index < len(token_ids)}
        steps = self._steps(work.prompt_ids, raw) if drafted else [Step(i, (), (), 0) for i in range(len(raw))]
        stats = step_stats(steps, len(token_ids), kept_loose)
        for record in stats.loose_accepts:
            record["draft_text"] = self.target.decode([record["draft_token"]])
            record["target_text"] = self.target.decode([record["target_token"]])
        return GenerationResult(
            stopper.text(),
            token_ids,
            list(work.prompt_ids),
            stats,
            stopper.finish_reason or "length",
            loose_token_indices=sorted(kept_loose),
        )

    def live(self, work: Work, point: Point | None) -> list[int]:
        """One prompt decoded from the start under ``point`` (None: plain decoding), no shadow: the live check."""
        extra: dict[str, Any] = {"flyspec_draft": False} if point is None else {}
        if point is not None and not point.lossless:
            extra = {"flyspec_rule": rule_request(point.speculation)}
        reply = self.worker.request({"requests": [self._request("live", work, work.prompt_ids, extra)]})
        return self._result(work, reply["outputs"][0]["token_ids"], {}, drafted=point is not None).token_ids

    def measure_costs(self, works: list[Work]) -> CostModel:
        """t(n) on vLLM, linear in n, fitted from timed runs of one prompt at a time: plain decoding gives t(1), the
        baseline's steps (the proposer's time included) the slope. The prompts' prefill is cached first."""
        plain_s = exact_s = 0.0
        plain_tokens = forwards = verified = 0
        for work in works:
            self.worker.request({"requests": [self._request("warm", work, work.prompt_ids, {"flyspec_draft": False})]})
            for extra in ({"flyspec_draft": False}, {}):
                reply = self.worker.request({"requests": [self._request("cost", work, work.prompt_ids, extra)]})
                output = reply["outputs"][0]["token_ids"]
                if extra:
                    plain_s, plain_tokens = plain_s + reply["seconds"], plain_tokens + len(output)
                else:
                    steps = self._steps(work.prompt_ids, output)
                    exact_s, forwards = exact_s + reply["seconds"], forwards + len(steps)
                    verified += sum(len(step.draft) for step in steps)
        t1 = plain_s / max(plain_tokens, 1)
        slope = max(0.0, (exact_s / t1 - forwards) / verified) if verified and t1 > 0 else 0.0
        k = self.base.num_draft_tokens
        return CostModel(StepCost((1, k + 1), (t1, t1 * (1 + slope * k)), context=0))
