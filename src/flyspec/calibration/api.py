"""``flyspec.calibrate(...)``: measure a drafter's operating points on a model and prompts, choose within a budget.

The steps, each in its own module:

1. the prompts (``data.py``) and the points (``space.py``) are resolved, before any model loads;
2. the target (and draft model) load; a layer-skip drafter's skip set is chosen once, on the first
   prompt, and pinned, so every point and the profile use the same drafts;
3. the points run by replay (``runner.py``, ``replay.py``), each judged against the budget as it goes;
4. each point is summarized with its bounds and projected speed (``frontier.py``, ``projection.py``:
   the target's measured t(n) and the drafter's measured cost per draft token), one is chosen or none;
5. a live check re-runs plain decoding and the chosen point for real on the first prompts and
   counts how many outputs equal the replayed ones (replay is exact up to float rounding);
6. ``profile.json`` (``flyspec.profile``: the chosen point, the best point per rule and the whole
   frontier), ``report.md`` and ``frontier.png`` are written to the output directory.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flyspec.calibration import data as calibration_data
from flyspec.calibration.budget import Budget, min_items
from flyspec.calibration.frontier import BASELINE, PLAIN, best_lossless, choose, final_verdict, summarize_point
from flyspec.calibration.projection import CostModel, measure_draft_cost
from flyspec.calibration.report import PLOT_FILE, plot_frontier, write_report
from flyspec.calibration.runner import Calibrator, Progress, pinned
from flyspec.calibration.space import RULES
from flyspec.calibration.space import points as grid_points
from flyspec.config import PROFILE_NONE, ConfigError, DecodeConfig, SpeculationConfig
from flyspec.drafters.registry import drafter_levels, make_drafter
from flyspec.names import VERSION
from flyspec.profile import PROFILE_FORMAT, Profile, breaker_for, identity
from flyspec.resources import ModelRef, Resources
from flyspec.runtime.cached_model import CachedModel
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.loading import cpu_isa, cpu_name

logger = logging.getLogger(__name__)

PROFILE_FILE = "profile.json"
STATE_FILE = "calibration.json"
UNSUPPORTED_DRAFTERS = {
    "ngram-cache": "its drafts depend on earlier generations, so no point can be measured alone; calibrate 'ngram'"
}


@dataclass(frozen=True)
class CalibrationConfig:
    """What to calibrate: the drafter (``speculation``; its verifier settings are ignored), the prompts,
    the budget, the grid of points, and where results go."""

    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    data: str = calibration_data.DEFAULT_DATA
    limit: int | None = calibration_data.DEFAULT_LIMIT
    metric: str = "contains"  # for a JSONL file with references
    budget: Budget = field(default_factory=Budget)
    grid: str = "default"
    rules: tuple[str, ...] = RULES
    out_dir: Path = Path("calibration")
    resume: bool = False
    live_check: int = 20  # prompts re-run live at the end (plain and the chosen point)
    use_chat: bool | None = None
    skip_bad_lines: bool = False

    def __post_init__(self) -> None:
        if self.speculation.drafter in UNSUPPORTED_DRAFTERS:
            raise ConfigError(
                f"flyspec calibrate cannot calibrate drafter {self.speculation.drafter!r}: "
                f"{UNSUPPORTED_DRAFTERS[self.speculation.drafter]}"
            )
        if self.live_check < 0:
            raise ConfigError(f"--live-check must be >= 0 (got {self.live_check})")


@dataclass
class CalibrationResult:
    """The frontier (one summary per point), the chosen point (None: none beats the lossless baseline
    within the budget), the best point per rule, and where the files are."""

    frontier: list[dict[str, Any]]
    chosen: dict[str, Any] | None
    by_rule: dict[str, dict[str, Any] | None]
    baseline: dict[str, Any] | None
    record: dict[str, Any]  # everything frontier.json holds
    out_dir: Path

    @property
    def profile_path(self) -> Path:
        return self.out_dir / PROFILE_FILE


def calibrate(
    target: ModelRef,
    config: CalibrationConfig | None = None,
    *,
    resources: Resources | None = None,
    progress: Progress | None = None,
    command: str | None = None,
) -> CalibrationResult:
    """Calibrate ``config.speculation``'s drafter on ``target``; write the results to ``config.out_dir``."""
    config = config or CalibrationConfig()
    tasks = calibration_data.resolve_tasks(config.data, config.metric)
    items = calibration_data.load(tasks, config.limit, config.skip_bad_lines)
    points = grid_points(config.speculation, config.grid, config.rules)  # errors before any model loads
    resources = resources or Resources()
    target_model = resources.model(target)
    base = _pin_drafter(points[0].speculation, target_model, resources, items, config.use_chat)
    points = [dataclasses.replace(point, speculation=_with_drafter(point.speculation, base)) for point in points]
    config.out_dir.mkdir(parents=True, exist_ok=True)
    _check_resume(config, target_model, base, items)
    calibrator = Calibrator(
        target_model, base, points, items, config.budget, config.out_dir, resources, config.use_chat, config.resume
    )
    if len(items) < min_items(config.budget.max_meaning_change, config.budget.confidence):
        logger.warning(
            "%d prompts cannot show a rate below %.1f%% at %.0f%% confidence (that needs %d): nothing will be chosen",
            len(items), 100 * config.budget.max_meaning_change, 100 * config.budget.confidence,
            min_items(config.budget.max_meaning_change, config.budget.confidence),
        )  # fmt: skip
    cost = _measure_costs(target_model, base, resources, items, config.use_chat)  # before the run competes for cores
    calibrator.run(progress)
    frontier = _frontier(calibrator, cost, config.budget, len(items))
    chosen, by_rule = choose(frontier)
    check = _live_check(calibrator, chosen, items[: config.live_check], config.use_chat)
    draft_model = resources.model(base.draft_model) if base.draft_model and base.models else None
    record = _profile_record(config, target_model, draft_model, base, [task.name for task in tasks], len(items))
    record.update(
        command=command,
        cost_model=cost.to_dict(),
        chosen=_deployable(chosen),
        by_rule={rule: _deployable(summary) for rule, summary in by_rule.items()},
        baseline=best_lossless(frontier),
        live_check=check,
        frontier=frontier,
    )
    _write_outputs(record, calibrator, config.out_dir)
    return CalibrationResult(frontier, chosen, by_rule, best_lossless(frontier), record, config.out_dir)


def _profile_record(
    config: CalibrationConfig,
    target: LoadedModel,
    draft_model: LoadedModel | None,
    base: SpeculationConfig,
    tasks: list[str],
    num_items: int,
) -> dict[str, Any]:
    """What a profile says about how it was made (``flyspec.profile`` reads it): model, dtype, drafter, data."""
    return {
        "flyspec_profile": PROFILE_FORMAT,
        "created": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "flyspec_version": VERSION,
        "model": identity(target),
        "dtype": str(target.dtype).removeprefix("torch."),
        "machine": {"cpu": cpu_name(), "isa": cpu_isa(), "cores": os.cpu_count(), "threads": torch.get_num_threads()},
        "drafter": {
            "drafter": base.drafter,
            "draft_model": identity(draft_model) if draft_model else None,
            "speculation": base.to_dict(),
        },
        "data": {"sources": config.data, "tasks": tasks, "n": num_items, "limit": config.limit},
        "budget": config.budget.to_dict(),
        "min_items": min_items(config.budget.max_meaning_change, config.budget.confidence),
    }


def _write_outputs(record: dict[str, Any], calibrator: Calibrator, out_dir: Path) -> None:
    Profile(record).save(out_dir / PROFILE_FILE)
    write_report(record, list(calibrator.records.values()), out_dir)
    if importlib.util.find_spec("matplotlib") is not None:
        plot_frontier(record, out_dir / PLOT_FILE)
    else:
        logger.warning("no frontier plot: matplotlib is missing (pip install 'flyspec[eval]')")


def _deployable(summary: dict[str, Any] | None) -> dict[str, Any] | None:
    """A chosen point as a profile deploys it: its settings with the circuit breaker its calibration implies."""
    if summary is None:
        return None
    spec = SpeculationConfig.from_dict(summary["speculation"])
    spec = dataclasses.replace(spec, breaker=breaker_for(summary), profile=PROFILE_NONE)
    return {**summary, "speculation": spec.to_dict()}


def _measure_costs(
    target: LoadedModel, base: SpeculationConfig, resources: Resources, items: list, use_chat: bool | None
) -> CostModel:
    """The projection's costs: the target's t(n) (cached per machine) and the drafter's seconds per draft token.

    The draft cost is measured in units of a one-token target step timed beside each draft, then scaled by
    the cached t(1): a ratio taken in one moment holds when the machine is busy, an absolute time does not."""
    step_cost = resources.step_cost(target, base.num_draft_tokens + 1)
    prompts = [target.encode_prompt(item.task.prompt(item.item), use_chat) for item in items[:3]]
    cached = CachedModel(target)

    @torch.inference_mode()
    def target_step(context: list[int]) -> float:  # one cached one-token forward after ``context``
        cached.reset()
        cached.forward(context[:-1], logits_to_keep=1)
        started = time.perf_counter()
        cached.forward(context[-1:], logits_to_keep=1)
        return time.perf_counter() - started

    drafter = make_drafter(base, target, resources)
    ratio = measure_draft_cost(drafter, prompts, base.num_draft_tokens, target_step)
    return CostModel(step_cost, step_cost(1) * ratio)


def _pin_drafter(
    spec: SpeculationConfig, target: LoadedModel, resources: Resources, items: list, use_chat: bool | None
) -> SpeculationConfig:
    """The drafter as every point runs it: a calibrated layer-skip set chosen once (on the first prompt) and fixed."""
    if "layer-skip" not in drafter_levels(spec) or spec.layer_skip.skip_layers is not None:
        return spec
    first = items[0]
    prompt_ids = target.encode_prompt(first.task.prompt(first.item), use_chat)
    calibration, _ = resources.calibrations.get(target, prompt_ids, spec.num_draft_tokens, spec.layer_skip)
    return pinned(spec, calibration.skip_layers)


def _with_drafter(point_spec: SpeculationConfig, base: SpeculationConfig) -> SpeculationConfig:
    return dataclasses.replace(point_spec, layer_skip=base.layer_skip)


def _check_resume(config: CalibrationConfig, target: LoadedModel, base: SpeculationConfig, items: list) -> None:
    """A resumed run must calibrate what the first one did; a new one starts a fresh state file."""
    state: dict[str, Any] = {
        "target": target.name,
        "dtype": str(target.dtype),
        "speculation": base.to_dict(),
        "items": [item.key for item in items],
        "budget": config.budget.to_dict(),
    }
    path = config.out_dir / STATE_FILE
    if config.resume and path.is_file():
        previous = json.loads(path.read_text())
        changed = [key for key in ("target", "dtype", "speculation", "budget") if previous.get(key) != state[key]]
        if previous.get("items", [])[: len(state["items"])] != state["items"][: len(previous.get("items", []))]:
            changed.append("prompts")
        if changed:
            raise ConfigError(
                f"--resume: {config.out_dir} holds a calibration of other {', '.join(changed)}; "
                "use another --out or drop --resume"
            )
    path.write_text(json.dumps(state) + "\n")


def _frontier(calibrator: Calibrator, cost: CostModel, budget: Budget, total: int) -> list[dict[str, Any]]:
    records = calibrator.records
    by_point: dict[str, list[dict[str, Any]]] = {point.name: [] for point in calibrator.points}
    plain: dict[str, dict[str, Any]] = {}
    for (item, name), record in records.items():
        if name == PLAIN:
            plain[item] = record
        elif name in by_point:
            by_point[name].append(record)
    order = {item.key: index for index, item in enumerate(calibrator.items)}
    baseline = {record["item"]: record for record in by_point[BASELINE]}
    summaries = []
    for point in calibrator.points:
        point_records = sorted(by_point[point.name], key=lambda record: order.get(record["item"], len(order)))
        state = calibrator.states[point.name]
        summary = summarize_point(point, point_records, baseline, plain, cost, budget, state.status, state.reasons)
        if point.lossless:
            summary["status"], summary["reasons"] = "lossless", []
        elif state.status == "open":
            summary["status"], summary["reasons"] = final_verdict(summary, budget, total)
        summaries.append(summary)
    return summaries


def _live_check(
    calibrator: Calibrator, chosen: dict[str, Any] | None, items: list, use_chat: bool | None
) -> dict[str, Any]:
    """Plain decoding, the chosen point and the lossy point that loosened most re-run live (no replay) on
    ``items``: how many outputs match replay's (the loosest point's paths diverge most from the others')."""
    from flyspec.api import build_decoder
    from flyspec.baseline import PlainDecoder
    from flyspec.generation import Decoder

    target = calibrator.target
    keys = {item.key for item in items}
    loosened: dict[str, int] = {}
    for (item_key, name), record in calibrator.records.items():
        if item_key in keys and name != PLAIN and record["stats"]["num_loose_accepts"]:
            loosened[name] = loosened.get(name, 0) + record["stats"]["num_loose_accepts"]
    loosest = max(loosened, key=lambda name: loosened[name], default=None)
    names = list(dict.fromkeys([PLAIN, *([chosen["name"]] if chosen else []), *([loosest] if loosest else [])]))
    points = {point.name: point for point in calibrator.points}
    matches = {name: 0 for name in names}
    checked = {name: 0 for name in names}
    for item in items:
        prompt_ids = target.encode_prompt(item.task.prompt(item.item), use_chat)
        decode = DecodeConfig(max_new_tokens=item.task.max_new_tokens, stop_strings=item.task.stop)
        for name in names:
            replayed = calibrator.records.get((item.key, name))
            if replayed is None:
                continue
            decoder: Decoder = (
                PlainDecoder(target, decode)
                if name == PLAIN
                else build_decoder(target, points[name].speculation, decode, resources=calibrator.resources)
            )
            # a point's record keeps its token ids only where they differ from plain decoding's
            plain_ids = calibrator.records[(item.key, PLAIN)]["token_ids"]
            expected = replayed.get("token_ids", plain_ids)
            matches[name] += decoder.generate(prompt_ids).token_ids == expected
            checked[name] += 1
    return {name: {"checked": checked[name], "identical": matches[name]} for name in names}
