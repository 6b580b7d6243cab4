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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flyspec.calibration import data as calibration_data
from flyspec.calibration.budget import Budget, min_items
from flyspec.calibration.deploy import breaker_for, deployment
from flyspec.calibration.frontier import BASELINE, PLAIN, best_lossless, choose, final_verdict, summarize_point
from flyspec.calibration.projection import CostModel, measure_draft_cost
from flyspec.calibration.report import PLOT_FILE, plot_frontier, write_report
from flyspec.calibration.runner import Calibrator, Progress, ReplayEngine, pinned
from flyspec.calibration.space import RULES
from flyspec.calibration.space import points as grid_points
from flyspec.calibration.vllm_engine import DEFAULT_WAVE, VllmEngine
from flyspec.config import PROFILE_NONE, ConfigError, SpeculationConfig
from flyspec.drafters.registry import drafter_levels, make_drafter
from flyspec.harness.vllm_session import VllmSession
from flyspec.harness.vllm_worker import VllmOptions, VllmWorker, check_venv, venv_python
from flyspec.names import VERSION
from flyspec.profile import PROFILE_FORMAT, Profile, identity
from flyspec.resources import ModelRef, Resources
from flyspec.runtime.cached_model import CachedModel
from flyspec.runtime.clock import device_clock
from flyspec.runtime.loaded_model import LoadedModel, ServedModel
from flyspec.runtime.loading import cpu_isa, cpu_name, load_served

RULES_METHOD = "vllm-flyspec-rules"  # flyspec_vllm.worker's method: each request's own rule, trusted

logger = logging.getLogger(__name__)

PROFILE_FILE = "profile.json"
STATE_FILE = "calibration.json"
ENGINES = ("flyspec", "vllm")
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
    engine: str = "flyspec"  # ENGINES: flyspec's own (replay, one prompt at a time) or vLLM (vllm_engine.py)
    draft_length: str | None = None  # the points' policy (space.base_speculation); None: the engine's default
    vllm: VllmOptions = field(default_factory=VllmOptions)  # --engine vllm: how its engine runs
    wave_size: int = DEFAULT_WAVE  # --engine vllm: prompts per wave (vLLM batches each wave's requests)
    schedule: str | None = None  # a batch schedule file (bench --derive-schedule's) for the profile to carry

    def __post_init__(self) -> None:
        if self.speculation.drafter in UNSUPPORTED_DRAFTERS:
            raise ConfigError(
                f"flyspec calibrate cannot calibrate drafter {self.speculation.drafter!r}: "
                f"{UNSUPPORTED_DRAFTERS[self.speculation.drafter]}"
            )
        if self.live_check < 0:
            raise ConfigError(f"--live-check must be >= 0 (got {self.live_check})")
        if self.engine not in ENGINES:
            raise ConfigError(f"unknown engine {self.engine!r}; choose one of {', '.join(ENGINES)}")
        if self.wave_size < 1:
            raise ConfigError(f"--wave must be >= 1 (got {self.wave_size})")
        if self.schedule is not None:
            from flyspec.batch_schedule import BatchSchedule

            BatchSchedule.load(self.schedule)  # refused before any work when unreadable
        if self.engine == "vllm":
            _check_vllm_calibration(self.speculation)
            if self.draft_length not in (None, "fixed"):
                raise ConfigError("--engine vllm drafts a fixed length (num_speculative_tokens): drop --draft-length")


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
    draft_length = "fixed" if config.engine == "vllm" else config.draft_length  # vLLM: num_speculative_tokens
    points = grid_points(config.speculation, config.grid, config.rules, draft_length)  # errors before any model loads
    if config.engine == "vllm":
        return _calibrate_on_vllm(target, config, tasks, items, points, resources, progress, command)
    resources = resources or Resources()
    target_model = resources.model(target)
    base = _pin_drafter(points[0].speculation, target_model, resources, items, config.use_chat)
    points = [dataclasses.replace(point, speculation=_with_drafter(point.speculation, base)) for point in points]
    config.out_dir.mkdir(parents=True, exist_ok=True)
    _check_resume(config, target_model, base, items)
    engine = ReplayEngine(target_model, base, points, resources)
    calibrator = Calibrator(target_model, points, items, config.budget, config.out_dir, engine, config.use_chat,
                            config.resume)  # fmt: skip
    _warn_if_too_few(config, len(items))
    cost = _measure_costs(target_model, base, resources, items, config.use_chat)  # before the run competes for cores
    calibrator.run(progress)
    frontier = _frontier(calibrator, cost, config.budget, len(items))
    chosen, by_rule = choose(frontier)
    check = _live_check(calibrator, resources, target_model, chosen, items[: config.live_check], config.use_chat)
    draft_model = resources.model(base.draft_model) if base.draft_model and base.models else None
    record = _profile_record(config, target_model, draft_model, base, [task.name for task in tasks], len(items))
    record["engine"] = {"name": "flyspec", "version": VERSION, "batch": 1}
    return _finish(record, command, cost, frontier, chosen, by_rule, check, calibrator, config.out_dir)


def _finish(
    record: dict[str, Any],
    command: str | None,
    cost: CostModel,
    frontier: list[dict[str, Any]],
    chosen: dict[str, Any] | None,
    by_rule: dict[str, dict[str, Any] | None],
    check: dict[str, Any],
    calibrator: Calibrator,
    out_dir: Path,
) -> CalibrationResult:
    record.update(
        command=command,
        cost_model=cost.to_dict(),
        chosen=_deployable(chosen),
        by_rule={rule: _deployable(summary) for rule, summary in by_rule.items()},
        baseline=best_lossless(frontier),
        live_check=check,
        frontier=frontier,
    )
    record["deploy"] = deployment(record)
    _write_outputs(record, calibrator, out_dir)
    return CalibrationResult(frontier, chosen, by_rule, best_lossless(frontier), record, out_dir)


def _warn_if_too_few(config: CalibrationConfig, num_items: int) -> None:
    needed = min_items(config.budget.max_meaning_change, config.budget.confidence)
    if num_items < needed:
        logger.warning(
            "%d prompts cannot show a rate below %.1f%% at %.0f%% confidence (that needs %d): nothing will be chosen",
            num_items, 100 * config.budget.max_meaning_change, 100 * config.budget.confidence, needed,
        )  # fmt: skip


def _check_vllm_calibration(spec: SpeculationConfig) -> None:
    """What ``--engine vllm`` can calibrate, refused in one line before anything starts."""
    if spec.drafter != "ngram":
        raise ConfigError(
            f"--engine vllm calibrates the n-gram drafter (the plugin's proposer), not {spec.drafter!r}; "
            "use --drafter ngram, or --engine flyspec"
        )
    if spec.ngram.match != "recent" or not spec.ngram.extend:
        raise ConfigError("--engine vllm: the plugin's proposer takes the most recent match, extended (the defaults)")


def _calibrate_on_vllm(
    target: ModelRef,
    config: CalibrationConfig,
    tasks: list,
    items: list,
    points: list,
    resources: Resources | None,
    progress: Progress | None,
    command: str | None,
) -> CalibrationResult:
    """:func:`calibrate` on vLLM (``vllm_engine.py``): only the tokenizer and fingerprints are loaded here."""
    if not isinstance(target, str):
        raise ConfigError("--engine vllm takes a model name or directory, not a loaded model")
    python = venv_python(config.vllm.venv)
    check_venv(python)
    served = load_served(target, resources.dtype if resources is not None else "auto")
    base = points[0].speculation
    config.out_dir.mkdir(parents=True, exist_ok=True)
    _check_resume(config, served, base, items)
    worker = VllmWorker(python, served.path, RULES_METHOD, served.dtype_name, base.num_draft_tokens, config.vllm)
    try:
        session = VllmSession(worker, served, base, config.vllm.max_model_len)
        engine = VllmEngine(session, points, config.wave_size)
        calibrator = Calibrator(served, points, items, config.budget, config.out_dir, engine, config.use_chat,
                                config.resume)  # fmt: skip
        _warn_if_too_few(config, len(items))
        cost = engine.measure_costs([work for item in items[:3] if (work := calibrator.work_for(item)) is not None])
        calibrator.run(progress)
        frontier = _frontier(calibrator, cost, config.budget, len(items))
        chosen, by_rule = choose(frontier)
        check = _live_check_vllm(calibrator, engine, chosen, items[: config.live_check])
        record = _profile_record(config, served, None, base, [task.name for task in tasks], len(items))
        record["engine"] = {
            "name": "vllm",
            "version": worker.vllm_version,
            "wave_size": config.wave_size,
            **session.to_dict(),
            "startup_s": round(worker.startup_s, 1),
            **config.vllm.to_dict(),
        }
        return _finish(record, command, cost, frontier, chosen, by_rule, check, calibrator, config.out_dir)
    finally:
        worker.close()


def _profile_record(
    config: CalibrationConfig,
    target: LoadedModel | ServedModel,
    draft_model: LoadedModel | None,
    base: SpeculationConfig,
    tasks: list[str],
    num_items: int,
) -> dict[str, Any]:
    """What a profile says about how it was made (``flyspec.profile`` reads it): model, dtype, drafter, data, and
    the batch schedule it carries (``--schedule``: measured by ``flyspec bench --concurrency --derive-schedule``)."""
    record = {
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
    if config.schedule is not None:
        from flyspec.batch_schedule import VLLM_KEY, BatchSchedule

        schedule = BatchSchedule.load(config.schedule)
        record["schedule"] = {VLLM_KEY: schedule.to_vllm(), "description": schedule.describe(), "file": config.schedule}
    return record


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
        started = device_clock(cached.device)
        cached.forward(context[-1:], logits_to_keep=1)
        return device_clock(cached.device) - started

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


def _check_resume(
    config: CalibrationConfig, target: LoadedModel | ServedModel, base: SpeculationConfig, items: list
) -> None:
    """A resumed run must calibrate what the first one did; a new one starts a fresh state file."""
    state: dict[str, Any] = {
        "target": target.name,
        "engine": config.engine,
        "dtype": str(target.dtype),
        "speculation": base.to_dict(),
        "items": [item.key for item in items],
        "budget": config.budget.to_dict(),
    }
    path = config.out_dir / STATE_FILE
    if config.resume and path.is_file():
        previous = json.loads(path.read_text())
        keys = ("target", "engine", "dtype", "speculation", "budget")
        changed = [key for key in keys if previous.get(key, "flyspec" if key == "engine" else None) != state[key]]
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


def _checked_names(calibrator: Calibrator, chosen: dict[str, Any] | None, items: list, first: str) -> list[str]:
    """``first``, the chosen point and the lossy point that loosened most on ``items`` (its paths diverge most)."""
    keys = {item.key for item in items}
    loosened: dict[str, int] = {}
    for (item_key, name), record in calibrator.records.items():
        if item_key in keys and name != PLAIN and record["stats"]["num_loose_accepts"]:
            loosened[name] = loosened.get(name, 0) + record["stats"]["num_loose_accepts"]
    loosest = max(loosened, key=lambda name: loosened[name], default=None)
    return list(dict.fromkeys([first, *([chosen["name"]] if chosen else []), *([loosest] if loosest else [])]))


def _live_tally(calibrator: Calibrator, names: list[str], items: list, live: Any) -> dict[str, dict[str, int]]:
    """How many of ``items``' recorded outputs of each point ``live(work, name)`` reproduces, token for token."""
    matches = {name: 0 for name in names}
    checked = {name: 0 for name in names}
    for item in items:
        work = calibrator.work_for(item, fresh=True)
        for name in names:
            recorded = calibrator.records.get((item.key, name))
            if recorded is None or work is None:
                continue
            # a point's record keeps its token ids only where they differ from plain decoding's
            expected = recorded.get("token_ids", calibrator.records[(item.key, PLAIN)]["token_ids"])
            matches[name] += live(work, name) == expected
            checked[name] += 1
    return {name: {"checked": checked[name], "identical": matches[name]} for name in names}


def _live_check(
    calibrator: Calibrator,
    resources: Resources,
    target: LoadedModel,
    chosen: dict[str, Any] | None,
    items: list,
    use_chat: bool | None,
) -> dict[str, Any]:
    """Plain decoding, the chosen point and the lossy point that loosened most re-run live (no replay) on
    ``items``: how many outputs match replay's (the loosest point's paths diverge most from the others')."""
    from flyspec.api import build_decoder
    from flyspec.baseline import PlainDecoder
    from flyspec.generation import Decoder

    points = {point.name: point for point in calibrator.points}

    def live(work: Any, name: str) -> list[int]:
        decoder: Decoder = (
            PlainDecoder(target, work.decode)
            if name == PLAIN
            else build_decoder(target, points[name].speculation, work.decode, resources=resources)
        )
        return decoder.generate(work.prompt_ids).token_ids

    return _live_tally(calibrator, _checked_names(calibrator, chosen, items, PLAIN), items, live)


def _live_check_vllm(
    calibrator: Calibrator, engine: VllmEngine, chosen: dict[str, Any] | None, items: list
) -> dict[str, Any]:
    """On vLLM: the baseline, the chosen point and the loosest decoded from the start, each request alone (no
    shadow, no continuation): how many outputs match the calibration's (which stitched divergent paths)."""
    points = {point.name: point for point in calibrator.points}
    names = _checked_names(calibrator, chosen, items, BASELINE)
    runs = [
        (work, name)
        for item in items
        if (work := calibrator.work_for(item, fresh=True)) is not None
        for name in names
        if (item.key, name) in calibrator.records
    ]
    outputs = dict(zip([(work.item.key, name) for work, name in runs], engine.live([(w, points[n]) for w, n in runs]),
                       strict=True))  # fmt: skip

    def live(work: Any, name: str) -> list[int]:
        return outputs[(work.item.key, name)]

    return _live_tally(calibrator, names, items, live)
