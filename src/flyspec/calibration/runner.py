"""The calibration loop: every point on every prompt, replayed, scored against plain decoding as it goes.

Prompt-major: for each prompt the lossless baseline runs first (its target forwards fill the
replay store along the greedy path), plain decoding is replayed from those rows (free: it asks
only what the baseline already asked), then every point still running is replayed, and each output
is scored against plain decoding's with ``flyspec eval``'s scorers (task score, meaning change,
new loop: ``eval/trust.py``) and appended to ``records.jsonl`` at once.

After each prompt every point is judged against the budget (``budget.judge``): a point whose
lower bound on a rate is already above the budget stops, and so do the looser points of its
family (``space.py``). ``resume=True`` reads the records back and skips what is in them.

Sampled items (``data.expand``: a prompt once per temperature and seed) run the same way, every decoder of an item
with the item's seed: coupled sampling makes the lossless baseline's output plain sampling's own, and every point
relaxes that same sample (``sampling/coupled.py``), so a point's output is scored against plain's of the same seed,
and replay shares the paths as it does greedy. Each temperature is judged on its own, with prompts as clusters.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from flyspec.api import build_decoder
from flyspec.calibration.budget import Budget, Verdict, judge
from flyspec.calibration.data import CalibrationItem, sampling_label
from flyspec.calibration.frontier import BASELINE, PLAIN
from flyspec.calibration.replay import DraftStore, ReplayDrafter, ReplayTarget, ScoreStore
from flyspec.calibration.space import Point
from flyspec.config import ConfigError, DecodeConfig, SpeculationConfig
from flyspec.config.names import DISTRIBUTION_VERIFIERS
from flyspec.decoding.generation import Decoder
from flyspec.decoding.plain import PlainDecoder
from flyspec.decoding.result import GenerationResult
from flyspec.decoding.speculative import SpeculativeDecoder
from flyspec.drafters.registry import make_drafter
from flyspec.eval import trust
from flyspec.eval.stats import effective_size
from flyspec.harness.data import RECORDS_FILE, JsonlWriter, read_records
from flyspec.resources import Resources
from flyspec.runtime.loaded_model import LoadedModel, PromptCodec
from flyspec.sampling.coupled import NoiseRows
from flyspec.sampling.sampler import make_generator

logger = logging.getLogger(__name__)

GREEDY_LABEL = "greedy"  # the sampling of a record that names none (every greedy record)

Progress = Callable[[int, int, str], None]  # (prompts done, points running, description)
_KEPT_STATS = (
    "num_new_tokens",
    "num_target_forwards",
    "num_proposed",
    "num_accepted",
    "num_loose_accepts",
    "proposed_per_position",
    "guard_vetoes",
)


@dataclass
class PointState:
    """A point's running counts and standing (``open`` while it runs; ``inside``/``outside``/``pruned``), and per
    sampling (``greedy``, ``T0.7``, ...) its ``(changed, looped, outputs)`` per prompt: the clusters of its bounds."""

    status: str = "open"
    reasons: tuple[str, ...] = ()
    total: int = 0
    changed: int = 0
    looped: int = 0
    clusters: dict[str, dict[str, list[int]]] = field(default_factory=dict)

    def add(self, record: dict[str, Any]) -> None:
        self.total += 1
        self.changed += bool(record["meaning_changed"])
        self.looped += bool(record["loop"])
        prompts = self.clusters.setdefault(record.get("sampling", GREEDY_LABEL), {})
        counts = prompts.setdefault(record.get("prompt", record["item"]), [0, 0, 0])
        counts[0] += bool(record["meaning_changed"])
        counts[1] += bool(record["loop"])
        counts[2] += 1

    def verdicts(self, budget: Budget) -> list[Verdict]:
        """The early-stop verdict of each sampling's outputs so far (``budget.judge``, not finished)."""
        found = []
        for label, prompts in self.clusters.items():
            counts = list(prompts.values())
            changed, looped, total = (sum(count[index] for count in counts) for index in range(3))
            verdict = judge(
                budget,
                changed=changed,
                looped=looped,
                total=total,
                retention_low=None,
                finished=False,
                changed_size=effective_size([(count[0], count[2]) for count in counts]),
                looped_size=effective_size([(count[1], count[2]) for count in counts]),
                label="" if label == GREEDY_LABEL else label,
            )
            found.append(verdict)
        return found


Outputs = dict[str, GenerationResult]  # point name (PLAIN, BASELINE, the points) → its output on one prompt


@dataclass(frozen=True)
class Work:
    """One prompt of a wave: its ids, length and stops, and the points still to run on it."""

    item: CalibrationItem
    prompt: str
    prompt_ids: list[int]
    decode: DecodeConfig
    pending: list[Point]
    need_plain: bool

    @property
    def prediction(self) -> dict[str, str]:
        """``generate``'s prediction argument for a speculative decoder: the item's, if it has one."""
        prediction = self.item.prediction
        return {} if prediction is None else {"prediction": prediction}


class CalibrationEngine(Protocol):
    """Decodes a wave of prompts: plain decoding (where ``need_plain``), the baseline and the pending points."""

    wave_size: int

    def run(self, wave: list[Work]) -> dict[str, Outputs]: ...  # item key → outputs


class ReplayEngine:
    """flyspec's own engine, one prompt at a time: the baseline's target forwards fill the replay store, plain
    decoding and every point replay from it and add only the forwards of their own divergent paths."""

    wave_size = 1

    def __init__(self, target: LoadedModel, base: SpeculationConfig, points: list[Point], resources: Resources) -> None:
        self.target, self.points, self.resources = target, points, resources
        self.scores = ScoreStore(target)
        # sampled: every decoder of an item samples with the item's seed, the same noise rows (a function of the
        # seed and the position): drawn once per item, not once per point
        self.noise_rows = NoiseRows(limit=None)
        keep = any(point.speculation.verifier in DISTRIBUTION_VERIFIERS for point in points)  # fsd, cascade, adasd
        self.drafts = DraftStore(make_drafter(base, target, resources, keep_distribution=keep))
        self.decoders: dict[str, Decoder] = {PLAIN: self._replayed(PlainDecoder(target))}
        for point in points:
            decoder = build_decoder(target, point.speculation, resources=resources)
            self.decoders[point.name] = self._replayed(decoder)

    def _replayed(self, decoder: Decoder) -> Decoder:
        decoder.scorer = ReplayTarget(self.scores)  # type: ignore[assignment]
        decoder.noise_rows = self.noise_rows
        if isinstance(decoder, SpeculativeDecoder):
            decoder.drafter = ReplayDrafter(self.drafts, decoder.drafter.name)
        return decoder

    def run(self, wave: list[Work]) -> dict[str, Outputs]:
        return {work.item.key: self._run_one(work) for work in wave}

    def _run_one(self, work: Work) -> Outputs:
        self.scores.begin(work.prompt_ids)  # keeps the rows when only the seed or the sampling changed
        self.noise_rows.clear()  # another item: another seed or prompt (keyed by seed, so only for memory)
        self.drafts.begin(work.prompt_ids)  # not the drafts: a model drafter samples with the seed's noise
        outputs = {BASELINE: self._generate(BASELINE, work)}  # fills the store along the greedy path
        if work.need_plain:
            outputs[PLAIN] = self._generate(PLAIN, work)
        for point in work.pending:
            if point.name != BASELINE:
                outputs[point.name] = self._generate(point.name, work)
        return outputs

    def _generate(self, name: str, work: Work) -> GenerationResult:
        generator = make_generator(work.item.seed, self.target.device)  # every decoder the same seed: coupled
        predicted = work.prediction if name != PLAIN else {}  # plain decoding drafts nothing
        return self.decoders[name].generate(work.prompt_ids, config=work.decode, generator=generator, **predicted)


@dataclass
class Calibrator:
    """Runs ``points`` on ``items`` with ``engine`` (wave by wave), writing ``out_dir/records.jsonl``.

    Records are written and the points judged prompt by prompt, in order, whatever the engine's wave: a point
    that leaves the budget at a prompt keeps no record of the later prompts of its wave, so the records (and
    the verdicts) are those a prompt-at-a-time run would write.
    """

    target: PromptCodec
    points: list[Point]
    items: list[CalibrationItem]
    budget: Budget
    out_dir: Path
    engine: CalibrationEngine
    use_chat: bool | None = None
    resume: bool = False
    states: dict[str, PointState] = field(init=False)

    def __post_init__(self) -> None:
        if self.points[0].name != BASELINE:
            raise ValueError("the first point must be the lossless baseline")
        self.states = {point.name: PointState() for point in self.points}
        path = self.out_dir / RECORDS_FILE
        self.records: dict[tuple[str, str], dict[str, Any]] = {}
        if self.resume:
            for record in read_records(path):
                self.records[(record["item"], record["point"])] = record
        self.writer = JsonlWriter(path, append=self.resume)
        self._replay_states()

    def _replay_states(self) -> None:
        """Counts and standings from the records already written (``resume``), in prompt order."""
        for item in self.items:
            for point in self.points:
                record = self.records.get((item.key, point.name))
                if record is not None and self.states[point.name].status == "open":
                    self.states[point.name].add(record)
            self._judge()

    @property
    def running(self) -> list[Point]:
        return [point for point in self.points if self.states[point.name].status == "open"]

    def run(self, progress: Progress | None = None) -> None:
        try:
            size = max(1, self.engine.wave_size)
            for start in range(0, len(self.items), size):
                wave = [work for item in self.items[start : start + size] if (work := self.work_for(item)) is not None]
                outputs = self.engine.run(wave) if wave else {}
                for index, item in enumerate(self.items[start : start + size], start=start):
                    if item.key in outputs:
                        self._write_item(item, outputs[item.key])
                        self._judge()
                    if progress:
                        progress(index + 1, len(self.running), item.key)
        finally:
            self.writer.close()

    def work_for(self, item: CalibrationItem, fresh: bool = False) -> Work | None:
        """``item`` as a prompt to decode, with the points still to run on it (None: none); ``fresh``: as a
        prompt to decode again whatever was recorded (the live check, the cost measurement)."""
        pending = [p for p in self.running if (item.key, p.name) not in self.records]
        if not pending and not fresh:
            return None
        prompt = item.task.prompt(item.item)
        try:
            prompt_ids = self.target.encode_prompt(prompt, self.use_chat)
        except ConfigError as error:
            raise ConfigError(f"calibration prompt {item.key}: {error}") from error
        decode = DecodeConfig(
            max_new_tokens=item.task.max_new_tokens, stop_strings=item.task.stop, sampling=item.sampling
        )
        return Work(item, prompt, prompt_ids, decode, pending, (item.key, PLAIN) not in self.records)

    def _write_item(self, item: CalibrationItem, outputs: Outputs) -> None:
        """The records of one prompt, for the points still running when its turn comes (in prompt order)."""
        prompt = item.task.prompt(item.item)
        plain = self.records.get((item.key, PLAIN))
        if plain is None:
            plain = self._plain_record(item, len(self.target.encode_prompt(prompt, self.use_chat)), outputs[PLAIN])
        for point in self.running:
            if (item.key, point.name) not in self.records and point.name in outputs:
                self._write(self._record(item, point, prompt, outputs[point.name], plain))

    def _plain_record(self, item: CalibrationItem, prompt_tokens: int, result: GenerationResult) -> dict[str, Any]:
        record = {
            "item": item.key,
            **sampled_fields(item),
            "task": item.task.name,
            "point": PLAIN,
            "prompt_tokens": prompt_tokens,
            "text": result.text,
            "token_ids": result.token_ids,
            "finish_reason": result.finish_reason,
            "score": self._primary_score(item, result.text),
            "num_new_tokens": result.stats.num_new_tokens,
        }
        self._write(record)
        return record

    @staticmethod
    def _primary_score(item: CalibrationItem, text: str) -> float | None:
        metric = item.task.primary_metric
        values = item.task.score(item.item, text).values
        return values.get(metric) if metric else None

    def _record(
        self, item: CalibrationItem, point: Point, prompt: str, result: GenerationResult, plain: dict[str, Any]
    ) -> dict[str, Any]:
        identical = result.token_ids == plain["token_ids"]
        change = trust.meaning_change(
            result.text,
            plain["text"],
            prompt,
            method_truncated=result.finish_reason == "length",
            plain_truncated=plain["finish_reason"] == "length",
        )
        stats = result.stats.to_dict()
        record: dict[str, Any] = {
            "item": item.key,
            **sampled_fields(item),
            "task": item.task.name,
            "point": point.name,
            "stats": {key: stats[key] for key in _KEPT_STATS},
            "score": self._primary_score(item, result.text),
            "identical": identical,
            "meaning_changed": change.changed,
            "loop": trust.new_loop(result.token_ids, plain["token_ids"]) is not None,
            "loose_accepts": [_loose(entry) for entry in stats["loose_accepts"]],
        }
        if not identical:
            record.update(text=result.text, token_ids=result.token_ids, meaning_diff=change.to_dict())
        return record

    def _write(self, record: dict[str, Any]) -> None:
        self.records[(record["item"], record["point"])] = record
        self.writer.write(record)
        if record["point"] in self.states and self.states[record["point"]].status == "open":
            self.states[record["point"]].add(record)

    def _judge(self) -> None:
        """Stop the points already decisively outside the budget, and the looser points of their families."""
        for point in self.points:
            state = self.states[point.name]
            if state.status != "open" or point.lossless:
                continue
            outside = [verdict for verdict in state.verdicts(self.budget) if verdict.status == "outside"]
            if outside:
                state.status, state.reasons = "outside", tuple(reason for v in outside for reason in v.reasons)
                self._prune_looser(point)

    def _prune_looser(self, point: Point) -> None:
        for other in self.points:
            state = self.states[other.name]
            if other.family == point.family and other.order > point.order and state.status == "open":
                state.status = "pruned"
                state.reasons = (f"looser than {point.name}, which is outside the budget",)


def sampled_fields(item: CalibrationItem) -> dict[str, Any]:
    """What a sampled item's record says besides its key: the prompt (its cluster), the sampling and the seed.
    Greedy records stay as they were."""
    if item.sampling.greedy:
        return {}
    return {"prompt": item.prompt_key, "sampling": sampling_label(item.sampling), "seed": item.seed}


def _loose(entry: dict[str, Any]) -> dict[str, Any]:
    """A loose accept as the report needs it: where, what was kept instead of what, and the rule's evidence."""
    return {
        key: entry.get(key)
        for key in ("index", "draft_token", "target_token", "evidence", "source", "draft_text", "target_text")
    }


def pinned(spec: SpeculationConfig, calibration_skip_layers: tuple[int, ...] | None) -> SpeculationConfig:
    """``spec`` with the layer-skip drafter's skip set fixed (chosen on the first prompt, kept for all)."""
    if calibration_skip_layers is None or spec.layer_skip.skip_layers is not None:
        return spec
    return dataclasses.replace(
        spec, layer_skip=dataclasses.replace(spec.layer_skip, skip_layers=calibration_skip_layers)
    )
