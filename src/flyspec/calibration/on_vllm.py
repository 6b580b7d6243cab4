"""``flyspec calibrate --engine vllm``: the calibration's points decoded by vLLM through the flyspec-vllm plugin
(``vllm_engine.py``), one engine in the vLLM venv; only the tokenizer and fingerprints load here. What it writes
is ``record.py``'s, as on flyspec's engine; ``--derive-schedule`` adds the batch schedule (``schedule.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flyspec.calibration.frontier import BASELINE, choose
from flyspec.calibration.record import (
    CalibrationResult,
    check_resume,
    checked_names,
    deployable,
    finish,
    live_tally,
    profile_record,
    summarize_frontier,
    warn_if_too_few,
)
from flyspec.calibration.runner import Calibrator, Progress
from flyspec.calibration.schedule import derive_for_profile, write_schedule_file
from flyspec.calibration.vllm_engine import VllmEngine
from flyspec.config import ConfigError
from flyspec.harness.vllm_session import VllmSession
from flyspec.harness.vllm_worker import VllmWorker, check_venv, venv_python
from flyspec.resources import ModelRef, Resources
from flyspec.runtime.loading import load_served

if TYPE_CHECKING:
    from flyspec.calibration.settings import CalibrationConfig

RULES_METHOD = "vllm-flyspec-rules"  # flyspec_vllm.worker's method: each request's own rule, trusted


def calibrate_on_vllm(
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
    if any(item.prediction is not None for item in items):
        raise ConfigError(
            "--engine vllm: the calibration's prompts carry predictions (--data edit), which flyspec's vLLM "
            "calibration worker does not send; calibrate predicted work on flyspec's engine (leave out --engine vllm)"
        )
    python = venv_python(config.vllm.venv)
    check_venv(python)
    served = load_served(target, resources.dtype if resources is not None else "auto")
    base = points[0].speculation
    config.out_dir.mkdir(parents=True, exist_ok=True)
    check_resume(config, served, base, items)
    worker = VllmWorker(python, served.path, RULES_METHOD, served.dtype_name, base.num_draft_tokens, config.vllm)
    try:
        session = VllmSession(worker, served, base, config.vllm.max_model_len)
        engine = VllmEngine(session, points, config.wave_size)
        calibrator = Calibrator(served, points, items, config.budget, config.out_dir, engine, config.use_chat,
                                config.resume)  # fmt: skip
        warn_if_too_few(config, len(items))
        cost = engine.measure_costs([work for item in items[:3] if (work := calibrator.work_for(item)) is not None])
        calibrator.run(progress)
        frontier = summarize_frontier(calibrator, cost, config.budget, len(items))
        chosen, by_rule = choose(frontier)
        check = live_check_vllm(calibrator, engine, chosen, items[: config.live_check])
        record = profile_record(config, served, None, base, [task.name for task in tasks], len(items))
        record["engine"] = {
            "name": "vllm",
            "version": worker.vllm_version,
            "wave_size": config.wave_size,
            **session.to_dict(),
            "startup_s": round(worker.startup_s, 1),
            **config.vllm.to_dict(),
        }
        if config.derive_schedule:
            wanted = items[: max(8, *config.derive_schedule)]  # the sweep's largest wave at most
            prompts = [work.prompt_ids for item in wanted if (work := calibrator.work_for(item, fresh=True))]
            record["schedule"] = derive_for_profile(worker, prompts, deployable(chosen), config.derive_schedule,
                                                    base.num_draft_tokens, record["machine"])  # fmt: skip
            write_schedule_file(record["schedule"], record, config.out_dir)
        return finish(record, command, cost, frontier, chosen, by_rule, check, calibrator, config.out_dir)
    finally:
        worker.close()


def live_check_vllm(
    calibrator: Calibrator, engine: VllmEngine, chosen: dict[str, Any] | None, items: list
) -> dict[str, Any]:
    """On vLLM: the baseline, the chosen point and the loosest decoded from the start, each request alone (no
    shadow, no continuation): how many outputs match the calibration's (which stitched divergent paths)."""
    points = {point.name: point for point in calibrator.points}
    names = checked_names(calibrator, chosen, items, BASELINE)
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

    return live_tally(calibrator, names, items, live)
