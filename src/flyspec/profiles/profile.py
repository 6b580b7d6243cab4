"""Calibration profiles: the operating point ``flyspec calibrate`` measured inside a quality budget.

A profile is a JSON file: the model's identity (name, a fingerprint of its weights, a fingerprint of
its tokenizer), the dtype, the drafter (with a layer-skip set pinned, and the draft model's identity),
the sampling it was measured at (``sampling``: greedy, temperatures, filters and seeds; a profile without one
was measured greedy), the budget, the data and its size, the date, the flyspec version and the machine, the chosen point
(None when no lossy point beat the lossless baseline inside the budget), the best point of each
rule, the circuit breaker's limit, and the whole frontier. ``profile.json`` in a calibration's output
directory is one; flyspec ships one per packaged model pair beside this file. How a
:class:`SpeculationConfig` uses one (its ``profile`` field): ``decision.py``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from flyspec.config import ConfigError, SamplingConfig, SamplingRange, SpeculationConfig
from flyspec.config.names import LOSSY_RULE_FIELDS
from flyspec.runtime.loaded_model import LoadedModel, ServedModel

logger = logging.getLogger(__name__)

PROFILE_FORMAT = 1
# (weights fingerprint, drafter, dtype) whose calibrations on flyspec's engine and on vLLM were run side by side and
# agreed (the same choice; per point the same counts, or each difference traced to its prompt): a profile made on
# either engine is used on the other. Evidence: EVALUATION.md, "Calibrating on vLLM".
AGREED: dict[tuple[str, str, str], str] = {
    # SmolLM2-135M-Instruct (the packaged GGUF), n-gram drafts, float32: 400 prompts, 56 points, both engines on
    # 2026-11-25; 20,847 outputs compared, 25 differ, every one within k tokens of the token limit; same choice
    ("13f516a0785c7cf2d9bc61a1da3fdecc", "ngram", "float32"): "EVALUATION.md, Calibrating on vLLM (2026-11-25)",
}
SHIPPED = Path(__file__).parent  # the shipped profiles lie beside this file
# what a profile's point decides (the rest of a SpeculationConfig is the drafter, which must match)
RULE_FIELDS = (*LOSSY_RULE_FIELDS, "breaker", "num_draft_tokens", "draft_length")


def identity(model: LoadedModel | ServedModel) -> dict[str, str]:
    """What a profile records of a model: its name and fingerprints (``LoadedModel.fingerprints``)."""
    return {"name": model.name, **model.fingerprints}


@dataclasses.dataclass(frozen=True)
class Profile:
    """A calibration profile as read from its file (``record``: the JSON; ``path``: where it came from)."""

    record: dict[str, Any]
    path: str = ""

    @staticmethod
    def load(path: str | Path) -> Profile:
        return _load(str(Path(path).expanduser()))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.record, indent=1) + "\n")

    @property
    def name(self) -> str:
        return Path(self.path).name if self.path else "profile"

    @property
    def model(self) -> dict[str, str]:
        return self.record["model"]

    @property
    def dtype(self) -> str:
        return self.record["dtype"]

    @property
    def drafter(self) -> str:
        return self.record["drafter"]["drafter"]

    @property
    def chosen(self) -> dict[str, Any] | None:
        return self.record["chosen"]

    @property
    def sampling_range(self) -> SamplingRange:
        """Where its points were measured (``SamplingRange``): greedy for a profile that says nothing of sampling, and
        without predictions for one that does not say its prompts carried them."""
        sampling = self.record.get("sampling") or {}
        measured = sampling.get("measured") or [{}]
        return SamplingRange.of([SamplingConfig(**each) for each in measured], bool(sampling.get("predicted", False)))

    @property
    def engine(self) -> str:
        """The engine the profile was measured on: ``flyspec`` (its own, the default of older profiles) or ``vllm``."""
        return str((self.record.get("engine") or {}).get("name", "flyspec"))

    def check_engine(self, engine: str) -> None:
        """Refuse a profile measured on another engine, except for a model and drafter whose two calibrations were
        shown to agree (:data:`AGREED`: same choice, per point the same counts or each difference explained)."""
        if self.engine == engine:
            return
        key = (self.model.get("weights", ""), self.drafter, self.dtype)
        if key in AGREED:
            logger.info("%s was measured on %s; on %s it agrees for this model and drafter (%s)",
                        self.name, self.engine, engine, AGREED[key])  # fmt: skip
            return
        names = {"flyspec": "flyspec's engine", "vllm": "vLLM"}
        raise ConfigError(
            f"profile {self.path or self.name} was calibrated on {names.get(self.engine, self.engine)}, and for "
            f"{self.model['name']} with drafter {self.drafter!r} in {self.dtype} no calibration has shown that "
            f"{names.get(engine, engine)} agrees; calibrate there: flyspec calibrate --engine {engine}"
        )

    def point(self, rule: str | None = None) -> dict[str, Any] | None:
        """The chosen point, or with ``rule`` that rule's best in-budget point (None: none)."""
        return self.chosen if rule is None else self.record["by_rule"].get(rule)

    def calibrated(self, rule: str) -> bool:
        """Whether the calibration measured ``rule`` at all (a profile made before a rule existed did not)."""
        return rule in self.record["by_rule"]

    def speculation(self, spec: SpeculationConfig, rule: str | None = None) -> SpeculationConfig | None:
        """``spec`` (its drafter) at the profile's point for ``rule`` (None: the chosen point); with no such
        point, ``spec`` verified by ``exact``, or None when a ``rule`` was asked for."""
        point = self.point(rule)
        if point is None:
            return None if rule is not None else dataclasses.replace(spec, verifier="exact")
        settings = SpeculationConfig.from_dict(point["speculation"])
        chosen = {name: getattr(settings, name) for name in RULE_FIELDS}
        return dataclasses.replace(spec, **chosen, sampling_range=self.sampling_range)

    def describe(self) -> str:
        """One line: the chosen point and what it measured (or that none was chosen)."""
        budget = self.record["budget"]
        data = self.record["data"]
        where = f"{self.model['name']} {self.dtype} {self.drafter}, n={data['n']}"
        where += f", budget {budget['max_meaning_change']:.0%}, {self.sampling_range.describe()}"
        seeds = (self.record.get("sampling") or {}).get("seeds", 1)
        where += f" × {seeds} seeds" if seeds > 1 else ""
        chosen = self.chosen
        if chosen is None:
            return f"{self.name} ({where}): no lossy point beat exact inside the budget: exact"
        return (
            f"{self.name} ({where}): {chosen['name']}, τ {chosen['tau_gain']:+.0%} over exact, projected "
            f"{chosen['projected_speedup']:.2f}x over plain, meaning changed in {chosen['meaning_changed']['count']} "
            f"of {chosen['n']} (bound {chosen['meaning_changed']['high']:.2%})"
        )

    def check(
        self,
        target: LoadedModel | ServedModel,
        spec: SpeculationConfig,
        draft: LoadedModel | None = None,
        engine: str = "flyspec",
    ) -> None:
        """Refuse, naming what differs, a model, tokenizer, dtype, drafter or draft model other than the profile's,
        or a profile measured on another engine than ``engine`` that was not shown to agree (:meth:`check_engine`)."""
        self.check_engine(engine)
        problems = _identity_problems(self.model, target, "model")
        dtype = str(target.dtype).removeprefix("torch.")
        if dtype != self.dtype:
            problems.append(f"it was calibrated in {self.dtype}, this model runs in {dtype} (use --dtype {self.dtype})")
        drafter = self.record["drafter"]
        if spec.drafter != drafter["drafter"]:
            problems.append(
                f"it was calibrated with drafter {drafter['drafter']!r} (use --drafter {drafter['drafter']})"
            )
        elif draft is not None and drafter.get("draft_model"):
            problems += _identity_problems(drafter["draft_model"], draft, "draft model")
        if problems:
            raise ConfigError(f"profile {self.path or self.name} does not fit: {'; '.join(problems)}")

    def matches(
        self, target: LoadedModel | ServedModel, spec: SpeculationConfig, draft: LoadedModel | None, engine: str
    ) -> bool:
        try:
            self.check(target, spec, draft, engine)
        except ConfigError:
            return False
        return True


def _identity_problems(expected: dict[str, str], model: LoadedModel | ServedModel, what: str) -> list[str]:
    found = model.fingerprints
    problems = []
    if found["tokenizer"] != expected["tokenizer"]:
        problems.append(f"its {what} {expected['name']!r} has another tokenizer than {model.name!r}")
    elif found["weights"] != expected["weights"]:
        problems.append(f"its {what} is {expected['name']!r}, not {model.name!r} (the weights differ)")
    return problems


def _load(path: str) -> Profile:
    """A profile file, read afresh each time (a few ms): no process-wide cache of files to invalidate."""
    if not Path(path).is_file():
        raise ConfigError(f"profile {path} does not exist; give a profile.json written by flyspec calibrate")
    try:
        record = json.loads(Path(path).read_text())
    except OSError as error:
        raise ConfigError(f"cannot read profile {path}: {error.strerror or error}; give a profile.json file") from error
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"profile {path} is not JSON ({error}); give a profile.json from flyspec calibrate"
        ) from error
    if not isinstance(record, dict) or record.get("flyspec_profile") != PROFILE_FORMAT:
        raise ConfigError(f"{path} is not a flyspec profile (format {PROFILE_FORMAT}); make one with flyspec calibrate")
    missing = [key for key in ("model", "dtype", "drafter", "chosen", "by_rule", "budget", "data") if key not in record]
    if missing:
        raise ConfigError(f"profile {path} lacks {', '.join(missing)}; make it again with flyspec calibrate")
    return Profile(record, path)


def shipped() -> list[Profile]:
    """The profiles flyspec ships (``flyspec/profiles/*.json``)."""
    return [_load(str(path)) for path in sorted(SHIPPED.glob("*.json"))]
