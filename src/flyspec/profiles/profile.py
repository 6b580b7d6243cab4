"""Calibration profiles: the operating point ``flyspec calibrate`` measured inside a quality budget.

A profile is a JSON file: the model's identity (name, a fingerprint of its weights, a fingerprint of
its tokenizer), the dtype, the drafter (with a layer-skip set pinned, and the draft model's identity),
the budget, the data and its size, the date, the flyspec version and the machine, the chosen point
(None when no lossy point beat the lossless baseline inside the budget), the best point of each
rule, the circuit breaker's limit, and the whole frontier. ``profile.json`` in a calibration's output
directory is one; flyspec ships one per packaged model pair in ``flyspec/profiles/``.

How a :class:`SpeculationConfig` uses one (its ``profile`` field; ``--profile``, the server's
``--profile``, vLLM's ``speculative_config`` key ``profile``), by :func:`resolve`, when the decoder is
built and the model is known:

- ``"none"``: the config as given (the papers' default settings).
- a file: the model, tokenizer, dtype, drafter and draft model must be the profile's, else a
  :class:`ConfigError` says which differs. The verifier's settings come from the profile: its chosen
  point (a lossless verifier where it chose none), or with a lossy verifier named, that rule's best
  point (an error where it has none). Settings the caller changed from the defaults are kept when
  they are no looser than the profile's point (:func:`looser`), else refused: a profile is a limit.
- ``"auto"`` (the default): a lossy verifier left at its default settings runs at the best point of
  its rule in the profile flyspec ships for this model, drafter and dtype, if there is one; where
  that profile found no point of the rule inside its budget, the verifier falls back to ``exact``
  (logged). Anything else is left as given.

A profile brings its dtype (:func:`load_dtype`): a run given ``--dtype auto`` (the API's ``dtype="auto"``)
loads its models in the dtype of the profile that will decide its lossy settings, a file or the shipped
one, and says so in one line; an explicit other dtype is refused by :meth:`Profile.check`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from flyspec.config import (
    DEFAULT_DEVICE,
    DEFAULT_DTYPE,
    PROFILE_AUTO,
    PROFILE_NONE,
    ConfigError,
    SpeculationConfig,
)
from flyspec.config.names import LOSSLESS_VERIFIERS, LOSSY_RULE_FIELDS
from flyspec.profiles.limits import looser as looser  # re-exported: the limit a profile sets
from flyspec.runtime.loaded_model import LoadedModel, ServedModel
from flyspec.runtime.loading import resolve_device, resolve_dtype

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
        return dataclasses.replace(spec, **{name: getattr(settings, name) for name in RULE_FIELDS})

    def describe(self) -> str:
        """One line: the chosen point and what it measured (or that none was chosen)."""
        budget = self.record["budget"]
        data = self.record["data"]
        where = f"{self.model['name']} {self.dtype} {self.drafter}, n={data['n']}"
        where += f", budget {budget['max_meaning_change']:.0%}"
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


def find_shipped(
    target: LoadedModel | ServedModel,
    spec: SpeculationConfig,
    draft: LoadedModel | None = None,
    engine: str = "flyspec",
) -> Profile | None:
    """The shipped profile for this model, tokenizer, dtype, drafter (and draft model) and engine, if any."""
    for profile in shipped():
        if profile.model["name"] == target.name and profile.matches(target, spec, draft, engine):
            return profile
    return None


def _shipped_for(spec: SpeculationConfig, target: str, preferred_dtype: str) -> Profile | None:
    """The shipped profile ``profile="auto"`` would apply to ``spec`` on a model named ``target``, judged by
    names alone (before any model loads): the one in ``preferred_dtype`` if there is one, else any dtype's."""
    if spec.verifier in LOSSLESS_VERIFIERS or not lossy_settings_are_defaults(spec):
        return None
    draft_name = spec.draft_model if spec.models else None
    candidates = [
        profile
        for profile in shipped()
        if profile.model["name"] == target
        and profile.drafter == spec.drafter
        and (profile.record["drafter"].get("draft_model") or {}).get("name") == draft_name
    ]
    preferred = [profile for profile in candidates if profile.dtype == preferred_dtype]
    return next(iter(preferred or candidates), None)


@dataclasses.dataclass(frozen=True)
class DtypeChoice:
    """The dtype a run loads its models in, and the one line saying a profile chose it (None: it did not)."""

    dtype: str
    note: str | None = None


def load_dtype(
    specs: Iterable[SpeculationConfig], target: Any, dtype: str = DEFAULT_DTYPE, device: str = DEFAULT_DEVICE
) -> DtypeChoice:
    """A profile brings its dtype: with ``dtype`` ``auto``, the dtype of the profile that will decide the lossy
    settings of one of ``specs`` (a ``--profile`` file, or the shipped profile ``profile="auto"`` picks for a
    lossy verifier at its defaults), where it differs from what ``auto`` means on this machine.

    An explicit dtype is kept as given: a profile of another dtype refuses it when the decoder is built
    (:meth:`Profile.check`). ``target`` that is not a name (a loaded model) keeps its own dtype.
    """
    if not isinstance(dtype, str) or dtype != DEFAULT_DTYPE or not isinstance(target, str):
        return DtypeChoice(dtype)
    here = str(resolve_dtype(dtype, resolve_device(device))).removeprefix("torch.")
    for spec in specs:
        if spec.profile == PROFILE_NONE:
            continue
        profile = Profile.load(spec.profile) if spec.profile != PROFILE_AUTO else _shipped_for(spec, target, here)
        if profile is not None and profile.dtype != here:
            return DtypeChoice(
                profile.dtype,
                f"loading {target} in {profile.dtype}, the dtype profile {profile.name} was calibrated in "
                f"(--dtype auto means {here} on this machine; pass --dtype to choose)",
            )
    return DtypeChoice(dtype)


def lossy_settings_are_defaults(spec: SpeculationConfig) -> bool:
    """The caller left every setting a profile decides at its default (any verifier)."""
    defaults = SpeculationConfig()
    return all(getattr(spec, name) == getattr(defaults, name) for name in RULE_FIELDS if name != "verifier")


@dataclasses.dataclass(frozen=True)
class Resolution:
    """A config with its profile applied (``profile="none"``), and the profile that decided it (None: none did)."""

    spec: SpeculationConfig
    profile: Profile | None = None


def resolve(
    spec: SpeculationConfig,
    target: LoadedModel | ServedModel,
    draft: LoadedModel | None = None,
    engine: str = "flyspec",
) -> SpeculationConfig:
    """``spec`` with its profile applied (see the module docstring); ``profile="none"`` afterwards. ``engine``: where
    it will run (``flyspec`` or ``vllm``), so that a profile measured on the other one is refused unless they agree."""
    return resolution(spec, target, draft, engine).spec


def resolution(
    spec: SpeculationConfig,
    target: LoadedModel | ServedModel,
    draft: LoadedModel | None = None,
    engine: str = "flyspec",
) -> Resolution:
    """:func:`resolve`, also saying which profile decided (a server keeps it as the limit of its requests)."""
    if spec.profile == PROFILE_NONE:
        return Resolution(spec)
    done = dataclasses.replace(spec, profile=PROFILE_NONE)
    lossy = spec.verifier not in LOSSLESS_VERIFIERS
    if spec.profile == PROFILE_AUTO:
        profile = find_shipped(target, spec, draft, engine) if lossy and lossy_settings_are_defaults(spec) else None
        if profile is None:
            return Resolution(done)
        resolved = profile.speculation(done, spec.verifier)
        if resolved is None and not profile.calibrated(spec.verifier):
            logger.warning(
                "%s did not calibrate %s (the rule was not in its grid); %s runs as exact (lossless). "
                "Pass --profile none for its default settings, or calibrate it: flyspec calibrate --rules %s",
                profile.name, spec.verifier, spec.verifier, spec.verifier,
            )  # fmt: skip
            resolved = dataclasses.replace(done, verifier="exact")
        elif resolved is None:
            logger.warning(
                "%s: no %s setting was measured inside its %.0f%% quality budget and faster than exact on %s; "
                "%s runs as exact (lossless). "
                "Pass --profile none for the paper's settings.",
                profile.name, spec.verifier, 100 * profile.record["budget"]["max_meaning_change"], target.name,
                spec.verifier,
            )  # fmt: skip
            resolved = dataclasses.replace(done, verifier="exact")
        return Resolution(resolved, profile)
    profile = Profile.load(spec.profile)
    profile.check(target, spec, draft, engine)
    if lossy_settings_are_defaults(spec):
        resolved = profile.speculation(done, spec.verifier if lossy else None)
        if resolved is None and not profile.calibrated(spec.verifier):
            raise ConfigError(
                f"profile {profile.path} did not calibrate {spec.verifier}; calibrate it (flyspec calibrate --rules "
                f"{spec.verifier}), leave out --verifier to use the profile's chosen point, or pass --profile none"
            )
        if resolved is None:
            raise ConfigError(
                f"profile {profile.path} found no {spec.verifier} setting inside its budget; leave out --verifier "
                "to use its chosen point, or choose a lossless verifier"
            )
        return Resolution(resolved, profile)
    if lossy and not profile.calibrated(spec.verifier):
        raise ConfigError(
            f"profile {profile.path} did not calibrate {spec.verifier}, so it sets no limit for it; calibrate it "
            f"(flyspec calibrate --rules {spec.verifier}) or pass --profile none"
        )
    limit = profile.speculation(done, spec.verifier if lossy else None) or dataclasses.replace(done, verifier="exact")
    reasons = looser(limit, done)
    if reasons:
        raise ConfigError(f"these settings are looser than profile {profile.path} allows: {'; '.join(reasons)}")
    return Resolution(done, profile)
