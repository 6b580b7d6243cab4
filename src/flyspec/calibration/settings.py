"""``CalibrationConfig``: what ``flyspec calibrate`` calibrates, checked before any model loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from flyspec.calibration import data as calibration_data
from flyspec.calibration.budget import Budget
from flyspec.calibration.space import RULES
from flyspec.calibration.vllm_engine import DEFAULT_WAVE
from flyspec.config import ConfigError, SamplingConfig, SpeculationConfig
from flyspec.harness.vllm_worker import VllmOptions

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
    exact_first: tuple[int, ...] = (0,)  # the exact-first axis: every lossy point once per value (space.points)
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
    derive_schedule: tuple[int, ...] | None = None  # --engine vllm: measure one at these concurrencies afterwards
    # how the outputs are decoded: each sampling measured (greedy by default), the sampled ones under `seeds` seeds
    samplings: tuple[SamplingConfig, ...] = (SamplingConfig(),)
    seeds: int = 1

    @property
    def sampled(self) -> bool:
        return any(not sampling.greedy for sampling in self.samplings)

    def __post_init__(self) -> None:
        if not self.samplings:
            raise ConfigError("--temperature needs a value; 0 is greedy")
        if self.seeds < 1:
            raise ConfigError(f"--seeds must be >= 1 (got {self.seeds})")
        if self.seeds > 1 and not self.sampled:
            raise ConfigError(
                "--seeds needs a --temperature > 0: greedy decoding draws nothing, every seed is one text"
            )
        if self.sampled and self.engine == "vllm":
            raise ConfigError(
                "--engine vllm at temperature > 0: vLLM's sampling is not coupled by seed, so a point's outputs cannot "
                "be compared with plain decoding's of the same seed; calibrate sampled on flyspec's engine"
            )
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
            from flyspec.config.schedule import BatchSchedule

            BatchSchedule.load(self.schedule)  # refused before any work when unreadable
        if self.derive_schedule is not None and (self.engine != "vllm" or self.schedule is not None):
            raise ConfigError(
                "--derive-schedule measures on vLLM: add --engine vllm"
                if self.engine != "vllm"
                else "--derive-schedule measures a schedule, --schedule carries a given one: choose one"
            )
        if self.engine == "vllm":
            check_vllm_calibration(self.speculation)
            if self.draft_length not in (None, "fixed"):
                raise ConfigError("--engine vllm drafts a fixed length (num_speculative_tokens): drop --draft-length")


def check_vllm_calibration(spec: SpeculationConfig) -> None:
    """What ``--engine vllm`` can calibrate, refused in one line before anything starts."""
    if spec.drafter != "ngram":
        raise ConfigError(
            f"--engine vllm calibrates the n-gram drafter (the plugin's proposer), not {spec.drafter!r}; "
            "use --drafter ngram, or --engine flyspec"
        )
    if spec.ngram.match != "recent" or not spec.ngram.extend:
        raise ConfigError("--engine vllm: the plugin's proposer takes the most recent match, extended (the defaults)")
