"""``flyspec calibrate --engine vllm --derive-schedule``: the profile's batch schedule, measured on the calibration's
own engine right after the calibration (issue 37).

The sweep is ``flyspec bench --concurrency ... --derive-schedule``'s (:func:`flyspec.bench.load.sweep`): throughput
at every concurrency with at most k drafts per request, k = 0 included, every request decoded with the chosen
point's rule (``exact`` when nothing was chosen); :func:`flyspec.config.schedule.derive_schedule` turns it into vLLM's
``num_speculative_tokens_per_batch_size``. The prompts are the calibration's own, as its engine saw them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from flyspec.bench.load import DEFAULT_CONCURRENCIES, LoadSettings, sweep
from flyspec.config import SpeculationConfig
from flyspec.config.schedule import VLLM_KEY, BatchSchedule
from flyspec.harness.vllm_worker import VllmWorker
from flyspec.verifiers.registry import rule_mapping

logger = logging.getLogger(__name__)
SCHEDULE_FILE = "schedule.json"
SCHEDULE_NEW_TOKENS = 64  # per request in the sweep: enough steps for a batch to settle, as bench's runs


def derive_for_profile(
    worker: VllmWorker,
    prompts: list[list[int]],
    chosen: dict[str, Any] | None,
    concurrencies: tuple[int, ...] = DEFAULT_CONCURRENCIES,
    num_draft_tokens: int = 15,
    machine: dict[str, Any] | None = None,
    new_tokens: int = SCHEDULE_NEW_TOKENS,
    min_prompts: int = LoadSettings.min_prompts,
) -> dict[str, Any]:
    """The profile's ``schedule`` entry: vLLM's key, its description, and the sweep it came from."""
    settings = LoadSettings(concurrencies=concurrencies, max_new_tokens=new_tokens, min_prompts=min_prompts,
                            num_draft_tokens=num_draft_tokens,
                            draft_lengths=tuple(k for k in LoadSettings().draft_lengths if k <= num_draft_tokens),
                            derive=True)  # fmt: skip
    wanted = max(settings.prompts_at(c) for c in concurrencies)
    batch = [prompts[index % len(prompts)] for index in range(wanted)]  # fewer prompts than a wave: reused
    rule = {"flyspec_rule": rule_mapping(SpeculationConfig.from_dict(chosen["speculation"]))} if chosen else None
    rows, schedule = sweep(worker, batch, settings, extra_args=rule, on_row=logger.info)
    return {
        VLLM_KEY: schedule.to_vllm(),
        "description": schedule.describe(),
        "derived": {
            "rule": chosen["name"] if chosen else "exact",
            "concurrencies": list(concurrencies),
            "new_tokens": new_tokens,
            "machine": machine or {},
            "sweep": [
                {key: row[key] for key in ("concurrency", "k", "tokens_per_s", "tokens_per_s_runs")} for row in rows
            ],  # fmt: skip
        },
    }


def write_schedule_file(entry: dict[str, Any], record: dict[str, Any], out_dir: Path) -> Path:
    """``schedule.json`` beside the profile, in the format ``--schedule`` and ``$FLYSPEC_VLLM_SCHEDULE`` read."""
    measured = {
        "date": record["created"],
        "machine": record["machine"],
        "target": record["model"]["name"],
        "dtype": record["dtype"],
        "engine": record.get("engine", {}).get("version"),
    }
    method = f"flyspec calibrate --derive-schedule ({entry['derived']['rule']})"
    return BatchSchedule.from_entries(entry[VLLM_KEY]).save(out_dir / SCHEDULE_FILE, measured, method)


def schedule_lines(entry: dict[str, Any] | None) -> list[str]:
    """The report's section on the schedule the profile carries (none: no lines)."""
    if not entry:
        return []
    lines = ["## Batch schedule", ""]
    derived = entry.get("derived")
    if not derived:
        return [*lines, f"Carried from `{entry.get('file')}` (not measured in this run): {entry['description']}.", ""]
    ks = sorted({row["k"] for row in derived["sweep"]})
    table = {(row["concurrency"], row["k"]): row["tokens_per_s"] for row in derived["sweep"]}
    lines += [
        f"Measured after the calibration on its engine, every request with `{derived['rule']}`, "
        f"{derived['new_tokens']} new tokens, at most k drafts per request (tokens/s):",
        "",
        "| c | " + " | ".join(f"k = {k}" for k in ks) + " |",
        "|---:|" + "---:|" * len(ks),
    ]
    for concurrency in derived["concurrencies"]:
        lines.append(f"| {concurrency} | " + " | ".join(f"{table.get((concurrency, k), 0):.1f}" for k in ks) + " |")
    lines += ["", f"Schedule: {entry['description']} (`{SCHEDULE_FILE}`; the deploy blocks carry it).", ""]
    return lines
