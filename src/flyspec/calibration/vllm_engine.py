"""``flyspec calibrate --engine vllm``: the points of a calibration decoded by vLLM, a wave of prompts at a time.

One engine (``flyspec_vllm.worker --method vllm-flyspec-rules``: flyspec's n-gram drafter, every request with
its own rule through the plugin; ``harness/vllm_session.py``) receives each wave in three submissions, so vLLM
batches across prompts and points:

1. **The shared path.** Per prompt, plain decoding (``flyspec_draft: false``: no drafts, vLLM's own greedy
   decoding), then the lossless baseline (``exact``), the baseline carrying every pending lossy point as a
   *shadow* (``flyspec_vllm.rule``): for each, the step where it would first have kept a draft token the
   baseline rejected. A point that never leaves the path on a prompt has the baseline's output there, token
   for token, and is not decoded at all. The baseline names its plain decoding as the output it will produce
   (``flyspec_reference``), so the plugin cuts each draft a few tokens past where it will first miss: what the
   shadows read there (FLy's window, the guards' n-grams), the same verdicts with fewer token rows. A baseline
   whose output leaves its plain decoding (a near-tie rounded the other way) is decoded again uncut; if most of
   a wave's do, the cut stops for the rest of the run.
2. **The divergent paths.** A point that leaves at the step starting at output index ``s`` is decoded again
   from ``prompt + baseline[:s - 1]``: vLLM's prefill then samples ``baseline[s - 1]`` (the target's argmax,
   as the baseline's step did) and the point's first verification is the very step it left at, with the same
   drafts; from there it runs as it would have from the start. Its output is ``baseline[:s - 1]`` + that. The
   request says where its own prompt ends (``flyspec_prompt_length``), so the guards that look at the prompt
   (copies of it, its names) do not take the resumed output for prompt.

Each output is cut and its steps counted as flyspec's engine counts them (``VllmSession.result``).

Where vLLM and flyspec's engine differ by construction: vLLM's first output token comes from the prefill, so
no draft (and no loose accept) is verified at output index 0; the draft length is fixed (vLLM's
``num_speculative_tokens``); a batch rounds a float32 forward differently from one request alone, so a
near-tie may fall the other way (the live check counts it).
"""

from __future__ import annotations

import logging
from typing import Any

from flyspec.calibration.frontier import BASELINE, PLAIN
from flyspec.calibration.projection import CostModel
from flyspec.calibration.runner import Outputs, Work
from flyspec.calibration.space import Point
from flyspec.decoding.result import GenerationResult
from flyspec.harness.vllm_session import VllmSession
from flyspec.runtime.step_cost import StepCost
from flyspec.verifiers.registry import rule_mapping

logger = logging.getLogger(__name__)
DEFAULT_WAVE = 64  # prompts per wave: vLLM's batch, and how far past a point's stop the work can run


def departure(reply: dict[str, Any]) -> int | None:
    """Where a baseline's output left the plain decoding it named (``flyspec_vllm.reference``); None: it did not."""
    return (reply.get("record") or {}).get("departed")


class VllmEngine:
    """The calibration's engine on vLLM (see the module docstring); ``wave_size`` prompts per wave."""

    def __init__(self, session: VllmSession, points: list[Point], wave_size: int = DEFAULT_WAVE) -> None:
        self.session = session
        self.wave_size = wave_size
        self.points = {point.name: point for point in points}
        self.cut_drafts = True  # the baselines' drafts cut to what their shadows read, while that pays (run)

    def run(self, wave: list[Work]) -> dict[str, Outputs]:
        request = self.session.request
        outputs: dict[str, Outputs] = {work.item.key: {} for work in wave}
        plain = [work for work in wave if work.need_plain]
        no_drafts = {"flyspec_draft": False}
        requests = [request(f"{w.item.key}|plain", w.prompt_ids, w.decode.max_new_tokens, no_drafts) for w in plain]
        replies = self.session.submit(requests) if requests else {}
        references: dict[str, list[int]] = {}  # item key -> plain decoding, the output its baseline will produce
        for work in plain:
            references[work.item.key] = replies[f"{work.item.key}|plain"]["token_ids"]
            outputs[work.item.key][PLAIN] = self._result(work, references[work.item.key], {}, drafted=False)
        cut = self.cut_drafts
        replies = self.session.submit(
            [self._baseline(work, references.get(work.item.key) if cut else None) for work in wave]
        )
        departed = [work for work in wave if departure(replies[f"{work.item.key}|base"]) is not None]
        if departed:  # a step may have been judged on a cut draft: decode these baselines again, uncut
            replies |= self.session.submit([self._baseline(work, None) for work in departed])
            self.session.redecoded += len(departed)
            if 2 * len(departed) > len(references):
                self.cut_drafts = False  # most outputs leave their plain decoding here: the cut no longer pays
                logger.warning(
                    "vLLM: %d of %d baselines left their plain decoding; their drafts are no longer cut",
                    len(departed), len(references),
                )  # fmt: skip
        second: list[dict[str, Any]] = []
        continuations: dict[str, tuple[Work, Point, list[int]]] = {}
        for work in wave:
            key = work.item.key
            base = replies[f"{key}|base"]
            baseline = self._result(work, base["token_ids"], {})
            outputs[key][BASELINE] = baseline
            names = self._shadow(work)[1]
            for index, start in (base["record"] or {}).get("diverged", {}).items():
                point = self.points[names[int(index)]]
                if int(start) >= baseline.num_new_tokens:
                    continue  # it leaves after the output stopped: the same output
                kept = base["token_ids"][: int(start) - 1]
                extra = {
                    "flyspec_rule": rule_mapping(point.speculation),
                    "flyspec_record": f"{key}|{point.name}",
                    "flyspec_prompt_length": len(work.prompt_ids),  # the guards see the prompt as it was
                }
                max_tokens = work.decode.max_new_tokens - len(kept)
                second.append(request(f"{key}|{point.name}", [*work.prompt_ids, *kept], max_tokens, extra))
                continuations[f"{key}|{point.name}"] = (work, point, kept)
            for point in work.pending:
                if not point.lossless:
                    outputs[key][point.name] = baseline  # replaced below where it left the path
        replies = self.session.submit(second) if second else {}
        for request_key, (work, point, kept) in continuations.items():
            reply = replies[request_key]
            loose = {entry["index"]: entry for entry in (reply["record"] or {}).get("loose_accepts", [])}  # absolute
            outputs[work.item.key][point.name] = self._result(work, [*kept, *reply["token_ids"]], loose)
        return outputs

    def _baseline(self, work: Work, reference: list[int] | None) -> dict[str, Any]:
        """The lossless baseline of a prompt, carrying its pending lossy points as shadows; with its plain decoding
        as ``reference``, its drafts are cut to what the shadows read (``flyspec_vllm.reference``)."""
        extra: dict[str, Any] = {"flyspec_record": f"{work.item.key}|base", "flyspec_shadow": self._shadow(work)[0]}
        if reference is not None and extra["flyspec_shadow"]:
            extra["flyspec_reference"] = reference
        return self.session.request(f"{work.item.key}|base", work.prompt_ids, work.decode.max_new_tokens, extra)

    def _shadow(self, work: Work) -> tuple[list[list[dict[str, Any]]], list[str]]:
        """The pending lossy points as shadow families (strict to loose), and the point name of each flat index."""
        families: dict[str, list[Point]] = {}
        for point in sorted((p for p in work.pending if not p.lossless), key=lambda p: (p.family, p.order)):
            families.setdefault(point.family, []).append(point)
        request = [[rule_mapping(point.speculation) for point in family] for family in families.values()]
        return request, [point.name for family in families.values() for point in family]

    def _result(
        self, work: Work, raw: list[int], loose: dict[int, dict[str, Any]], drafted: bool = True
    ) -> GenerationResult:
        return self.session.result(work.prompt_ids, work.decode, raw, loose, drafted)

    def live(self, runs: list[tuple[Work, Point]]) -> list[list[int]]:
        """Prompts decoded from the start under a point each, no shadow, no continuation, in one submission: the
        live check of the stitched outputs."""
        if not runs:
            return []
        requests = []
        for index, (work, point) in enumerate(runs):
            extra = {} if point.lossless else {"flyspec_rule": rule_mapping(point.speculation)}
            requests.append(self.session.request(f"live|{index}", work.prompt_ids, work.decode.max_new_tokens, extra))
        replies = self.session.worker.request({"requests": requests})["outputs"]
        return [
            self._result(work, reply["token_ids"], {}).token_ids for (work, _), reply in zip(runs, replies, strict=True)
        ]

    def measure_costs(self, works: list[Work]) -> CostModel:
        """t(n) on vLLM, linear in n, fitted from timed runs of one prompt at a time: plain decoding gives t(1), the
        baseline's steps (the proposer's time included) the slope. The prompts' prefill is cached first."""
        plain_s = exact_s = 0.0
        plain_tokens = forwards = verified = 0
        worker, request = self.session.worker, self.session.request
        for work in works:
            max_tokens = work.decode.max_new_tokens
            worker.request({"requests": [request("warm", work.prompt_ids, 1, {"flyspec_draft": False})]})
            for extra in ({"flyspec_draft": False}, {}):
                reply = worker.request({"requests": [request("cost", work.prompt_ids, max_tokens, extra)]})
                output = reply["outputs"][0]["token_ids"]
                if extra:
                    plain_s, plain_tokens = plain_s + reply["seconds"], plain_tokens + len(output)
                else:
                    steps = self.session.steps(work.prompt_ids, output)
                    exact_s, forwards = exact_s + reply["seconds"], forwards + len(steps)
                    verified += sum(len(step.draft) for step in steps)
        t1 = plain_s / max(plain_tokens, 1)
        slope = max(0.0, (exact_s / t1 - forwards) / verified) if verified and t1 > 0 else 0.0
        k = self.session.base.num_draft_tokens
        return CostModel(StepCost((1, k + 1), (t1, t1 * (1 + slope * k)), context=0))
