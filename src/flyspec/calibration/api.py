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
6. ``profile.json`` (``flyspec.profiles.profile``: the chosen point, the best point per rule and the whole
   frontier), ``report.md`` and ``frontier.png`` are written to the output directory (``record.py``).

This module runs them on flyspec's own engine; ``on_vllm.py`` runs them on vLLM (``--engine vllm``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from flyspec.calibration import data as calibration_data
from flyspec.calibration.frontier import PLAIN, choose
from flyspec.calibration.on_vllm import RULES_METHOD, calibrate_on_vllm
from flyspec.calibration.projection import CostModel, measure_draft_cost
from flyspec.calibration.record import (
    PROFILE_FILE,
    STATE_FILE,
    CalibrationResult,
    check_resume,
    checked_names,
    finish,
    live_tally,
    profile_record,
    summarize_frontier,
    warn_if_too_few,
)
from flyspec.calibration.runner import Calibrator, Progress, ReplayEngine, pinned
from flyspec.calibration.settings import CalibrationConfig
from flyspec.calibration.space import RULES, Point
from flyspec.calibration.space import points as grid_points
from flyspec.config import ConfigError, SpeculationConfig
from flyspec.config.names import DISTRIBUTION_DRAFTERS, DISTRIBUTION_VERIFIERS, VERSION
from flyspec.drafters.cross_tokenizer import tokenizers_match
from flyspec.drafters.registry import drafter_levels, make_drafter
from flyspec.resources import ModelRef, Resources
from flyspec.runtime.cached_model import CachedModel
from flyspec.runtime.clock import device_clock
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.sampling.sampler import make_generator

__all__ = ["PROFILE_FILE", "RULES_METHOD", "STATE_FILE", "CalibrationConfig", "CalibrationResult", "calibrate"]

logger = logging.getLogger(__name__)


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
    prompts = calibration_data.load(tasks, config.limit, config.skip_bad_lines)
    items = calibration_data.expand(prompts, list(config.samplings), config.seeds)  # each prompt per sampling, seed
    draft_length = "fixed" if config.engine == "vllm" else config.draft_length  # vLLM: num_speculative_tokens
    # errors before any model loads
    points = grid_points(
        config.speculation, config.grid, config.rules, draft_length, config.exact_first, sampled=config.sampled
    )
    if config.engine == "vllm":
        return calibrate_on_vllm(target, config, tasks, items, points, resources, progress, command)
    resources = resources or Resources()
    target_model = resources.model(target)
    base = _pin_drafter(points[0].speculation, target_model, resources, prompts, config.use_chat)
    points = [dataclasses.replace(point, speculation=_with_drafter(point.speculation, base)) for point in points]
    points = _readable_points(points, target_model, base, resources, config.rules)
    config.out_dir.mkdir(parents=True, exist_ok=True)
    check_resume(config, target_model, base, items)
    engine = ReplayEngine(target_model, base, points, resources)
    calibrator = Calibrator(target_model, points, items, config.budget, config.out_dir, engine, config.use_chat,
                            config.resume)  # fmt: skip
    warn_if_too_few(config, len(prompts))
    cost = _measure_costs(target_model, base, resources, prompts, config.use_chat)  # before the run competes for cores
    calibrator.run(progress)
    frontier = summarize_frontier(calibrator, cost, config.budget, len(items))
    chosen, by_rule = choose(frontier)
    check = _live_check(calibrator, resources, target_model, chosen, items[: config.live_check], config.use_chat)
    draft_model = resources.model(base.draft_model) if base.draft_model and base.models else None
    predicted = any(item.prediction is not None for item in prompts)  # --data edit: decoded with their predictions
    record = profile_record(config, target_model, draft_model, base, [task.name for task in tasks], len(prompts),
                            predicted)  # fmt: skip
    record["engine"] = {"name": "flyspec", "version": VERSION, "batch": 1}
    return finish(record, command, cost, frontier, chosen, by_rule, check, calibrator, config.out_dir)


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


def _readable_points(
    points: list[Point], target: LoadedModel, base: SpeculationConfig, resources: Resources, rules: tuple[str, ...]
) -> list[Point]:
    """``points`` without fsd, cascade and adasd where the draft model speaks another tokenizer than ``target``: its
    drafts are re-tokenized, so it has no distribution over the target's vocabulary to compare. Left out of the
    default rules with a warning; named in ``--rules``, refused in one line."""
    if base.draft_model is None or base.drafter not in DISTRIBUTION_DRAFTERS:
        return points
    draft = resources.model(base.draft_model)
    named = [rule for rule in DISTRIBUTION_VERIFIERS if rule in rules]
    if not named or tokenizers_match(target.tokenizer, draft.tokenizer):
        return points
    reason = f"the draft model {draft.name!r} speaks another tokenizer than {target.name!r}"
    if set(rules) != set(RULES):
        raise ConfigError(
            f"--rules {','.join(named)}: they compare the draft model's distribution with the target's, and {reason}; "
            "drop them from --rules, or use a draft model of the target's tokenizer or --drafter layer-skip"
        )
    logger.warning("rules %s left out: they compare the draft model's distribution with the target's, and %s",
                   ", ".join(named), reason)  # fmt: skip
    return [point for point in points if point.speculation.verifier not in DISTRIBUTION_VERIFIERS]


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
    from flyspec.decoding.generation import Decoder
    from flyspec.decoding.plain import PlainDecoder

    points = {point.name: point for point in calibrator.points}

    def live(work: Any, name: str) -> list[int]:
        decoder: Decoder = (
            PlainDecoder(target, work.decode)
            if name == PLAIN
            else build_decoder(target, points[name].speculation, work.decode, resources=resources)
        )
        return decoder.generate(work.prompt_ids, generator=make_generator(work.item.seed, target.device)).token_ids

    return live_tally(calibrator, checked_names(calibrator, chosen, items, PLAIN), items, live)
