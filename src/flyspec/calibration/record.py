"""What a calibration writes and reports, whichever engine decoded it: the points' summaries (the frontier), the
profile record and its files, the resume check and the live check's tally. ``api.py`` (flyspec's engine) and
``on_vllm.py`` (vLLM) both end here."""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from flyspec.calibration.budget import Budget, min_items
from flyspec.calibration.deploy import breaker_for, deployment
from flyspec.calibration.frontier import BASELINE, PLAIN, best_lossless, final_verdict, rank_families, summarize_point
from flyspec.calibration.projection import CostModel
from flyspec.calibration.report import PLOT_FILE, plot_frontier, write_report
from flyspec.calibration.runner import Calibrator
from flyspec.config import PROFILE_NONE, ConfigError, SpeculationConfig
from flyspec.config.names import VERSION
from flyspec.profiles import PROFILE_FORMAT, Profile, identity
from flyspec.runtime.loaded_model import LoadedModel, ServedModel
from flyspec.runtime.loading import cpu_isa, cpu_name

if TYPE_CHECKING:
    from flyspec.calibration.settings import CalibrationConfig

logger = logging.getLogger(__name__)

PROFILE_FILE = "profile.json"
STATE_FILE = "calibration.json"


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


def finish(
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
        chosen=deployable(chosen),
        by_rule={rule: deployable(summary) for rule, summary in by_rule.items()},
        baseline=best_lossless(frontier),
        live_check=check,
        frontier=frontier,
        families=rank_families(frontier),
    )
    record["deploy"] = deployment(record)
    write_outputs(record, calibrator, out_dir)
    return CalibrationResult(frontier, chosen, by_rule, best_lossless(frontier), record, out_dir)


def warn_if_too_few(config: CalibrationConfig, num_items: int) -> None:
    needed = min_items(config.budget.max_meaning_change, config.budget.confidence)
    if num_items < needed:
        logger.warning(
            "%d prompts cannot show a rate below %.1f%% at %.0f%% confidence (that needs %d): nothing will be chosen",
            num_items, 100 * config.budget.max_meaning_change, 100 * config.budget.confidence, needed,
        )  # fmt: skip


def profile_record(
    config: CalibrationConfig,
    target: LoadedModel | ServedModel,
    draft_model: LoadedModel | None,
    base: SpeculationConfig,
    tasks: list[str],
    num_items: int,
    predicted: bool = False,
) -> dict[str, Any]:
    """What a profile says about how it was made (``profiles/profile.py`` reads it): model, dtype, drafter, data, and
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
        # where the points were measured: a profile's lossy point applies only inside it (config.SamplingRange)
        "sampling": {
            "measured": [dataclasses.asdict(sampling) for sampling in config.samplings],
            "seeds": config.seeds,
            "predicted": predicted,  # its prompts carried their prediction: it applies to requests with one
        },
        "budget": config.budget.to_dict(),
        "min_items": min_items(config.budget.max_meaning_change, config.budget.confidence),
    }
    if config.schedule is not None:
        from flyspec.config.schedule import VLLM_KEY, BatchSchedule

        schedule = BatchSchedule.load(config.schedule)
        record["schedule"] = {VLLM_KEY: schedule.to_vllm(), "description": schedule.describe(), "file": config.schedule}
    return record


def write_outputs(record: dict[str, Any], calibrator: Calibrator, out_dir: Path) -> None:
    Profile(record).save(out_dir / PROFILE_FILE)
    write_report(record, list(calibrator.records.values()), out_dir)
    if importlib.util.find_spec("matplotlib") is not None:
        plot_frontier(record, out_dir / PLOT_FILE)
    else:
        logger.warning("no frontier plot: matplotlib is missing (pip install 'flyspec[eval]')")


def deployable(summary: dict[str, Any] | None) -> dict[str, Any] | None:
    """A chosen point as a profile deploys it: its settings with the circuit breaker its calibration implies."""
    if summary is None:
        return None
    spec = SpeculationConfig.from_dict(summary["speculation"])
    spec = dataclasses.replace(spec, breaker=breaker_for(summary), profile=PROFILE_NONE)
    return {**summary, "speculation": spec.to_dict()}


def check_resume(
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
        previous["speculation"] = _with_new_defaults(previous.get("speculation"))
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


def _with_new_defaults(speculation: Any) -> Any:
    """A state file's speculation with the fields added to :class:`SpeculationConfig` since at their defaults (a rule
    added later, such as adasd, was not in the base then and is at its default now): the same drafter, so the same
    calibration. As it was where it does not read as a config (then it differs, and the resume is refused)."""
    try:
        return SpeculationConfig.from_dict(speculation).to_dict()
    except (ConfigError, TypeError, AttributeError):
        return speculation


def summarize_frontier(calibrator: Calibrator, cost: CostModel, budget: Budget, total: int) -> list[dict[str, Any]]:
    records = calibrator.records
    by_point: dict[str, list[dict[str, Any]]] = {point.name: [] for point in calibrator.points}
    plain: dict[str, dict[str, Any]] = {}
    order = {item.key: index for index, item in enumerate(calibrator.items)}
    for (item, name), record in records.items():
        if item not in order:  # resumed with a smaller --limit: the later prompts' records stay in the file only
            continue
        if name == PLAIN:
            plain[item] = record
        elif name in by_point:
            by_point[name].append(record)
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


def checked_names(calibrator: Calibrator, chosen: dict[str, Any] | None, items: list, first: str) -> list[str]:
    """``first``, the chosen point and the lossy point that loosened most on ``items`` (its paths diverge most)."""
    keys = {item.key for item in items}
    loosened: dict[str, int] = {}
    for (item_key, name), record in calibrator.records.items():
        if item_key in keys and name != PLAIN and record["stats"]["num_loose_accepts"]:
            loosened[name] = loosened.get(name, 0) + record["stats"]["num_loose_accepts"]
    loosest = max(loosened, key=lambda name: loosened[name], default=None)
    return list(dict.fromkeys([first, *([chosen["name"]] if chosen else []), *([loosest] if loosest else [])]))


def live_tally(calibrator: Calibrator, names: list[str], items: list, live: Any) -> dict[str, dict[str, int]]:
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
