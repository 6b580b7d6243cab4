"""How a :class:`SpeculationConfig` uses a calibration profile (its ``profile`` field; ``--profile``, the server's
``--profile``, vLLM's ``speculative_config`` key ``profile``): decided once, by :func:`decide`, before any model
loads, then held against the loaded models by :meth:`Decision.confirm`.

- ``"none"``: the config as given (the papers' default settings).
- a file: the model, tokenizer, dtype, drafter and draft model must be the profile's, else a
  :class:`ConfigError` says which differs. The verifier's settings come from the profile: its chosen
  point (a lossless verifier where it chose none), or with a lossy verifier named, that rule's best
  point (an error where it has none). Settings the caller changed from the defaults are kept when
  they are no looser than the profile's point (:func:`looser`), else refused: a profile is a limit.
- ``"auto"`` (the default): a lossy verifier left at its default settings runs at the best point of
  its rule in the profile flyspec ships for this model, drafter and dtype, if there is one; where
  that profile found no point of the rule inside its budget, the verifier falls back to ``exact``
  (said in one line). Anything else is left as given.

A profile brings its dtype: a run given ``--dtype auto`` (the API's ``dtype="auto"``) loads its models in the
dtype of the profile that will decide its lossy settings, a file or the shipped one, and says so in one line;
an explicit other dtype is refused by :meth:`Profile.check`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

import torch

from flyspec.config import DEFAULT_DEVICE, DEFAULT_DTYPE, PROFILE_AUTO, PROFILE_NONE, ConfigError, SpeculationConfig
from flyspec.config.names import LOSSLESS_VERIFIERS
from flyspec.profiles.limits import looser
from flyspec.profiles.profile import RULE_FIELDS, Profile, shipped
from flyspec.runtime.loaded_model import LoadedModel, ServedModel
from flyspec.runtime.loading import resolve_device, resolve_dtype

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the profile decides for one config, found once: the config to build (the profile applied,
    ``profile="none"``), the profile that decided it (None: none did), the dtype the models load in, and the lines
    that say what the profile changed (a front end says them once)."""

    spec: SpeculationConfig
    profile: Profile | None = None
    dtype: str | torch.dtype = DEFAULT_DTYPE
    notes: tuple[str, ...] = ()
    asked: SpeculationConfig | None = None  # with a shipped profile: the config as given (``profile="none"``)

    def confirm(
        self, target: LoadedModel | ServedModel, draft: LoadedModel | None = None, engine: str = "flyspec"
    ) -> Decision:
        """This decision held against the loaded models: a profile file that does not fit them is refused
        (:meth:`Profile.check`); a shipped profile whose model, dtype, drafter or engine differ decides nothing."""
        if self.profile is None:
            return self
        if self.asked is None:
            self.profile.check(target, self.spec, draft, engine)
            return self
        if self.profile.matches(target, self.asked, draft, engine):
            return self
        return Decision(self.asked, None, self.dtype)

    def announce(self) -> None:
        for note in self.notes:
            logger.warning("%s", note)


def decide(
    spec: SpeculationConfig,
    target: str | LoadedModel | ServedModel,
    dtype: str | torch.dtype = DEFAULT_DTYPE,
    device: str | torch.device = DEFAULT_DEVICE,
    choose_dtype: bool = True,
) -> Decision:
    """The profile's decision for ``spec`` on ``target`` (a name, or a loaded model), before any model loads.

    ``dtype``/``device``: what the models load in and on; with ``choose_dtype`` and ``dtype="auto"``, a profile of
    another dtype than ``auto`` means on this machine brings its own (a loaded target keeps its dtype)."""
    if spec.profile == PROFILE_NONE:
        return Decision(spec, None, dtype)
    done = dataclasses.replace(spec, profile=PROFILE_NONE)
    name = target if isinstance(target, str) else target.name
    here = _dtype_here(target, dtype, device)
    free = choose_dtype and isinstance(target, str) and isinstance(dtype, str) and dtype == DEFAULT_DTYPE
    if spec.profile == PROFILE_AUTO:
        profile = _shipped_for(spec, name, here, any_dtype=free)
        if profile is None:
            return Decision(done, None, dtype)
        resolved, notes = _at_shipped_point(profile, done, spec.verifier, name)
        dtype, notes = _brought_dtype(profile, name, dtype, here, free, notes)
        return Decision(resolved, profile, dtype, notes, asked=done)
    profile = Profile.load(spec.profile)
    dtype, notes = _brought_dtype(profile, name, dtype, here, free, ())
    return Decision(_within_file(profile, spec, done), profile, dtype, notes)


def _dtype_here(target: str | LoadedModel | ServedModel, dtype: str | torch.dtype, device: str | torch.device) -> str:
    """The dtype the models run in unless a profile brings its own (``auto`` resolved for this machine)."""
    if not isinstance(target, str) and isinstance(getattr(target, "dtype", None), torch.dtype):
        return str(target.dtype).removeprefix("torch.")
    return str(resolve_dtype(dtype, resolve_device(device))).removeprefix("torch.")


def _brought_dtype(
    profile: Profile, target: str, dtype: str | torch.dtype, here: str, free: bool, notes: tuple[str, ...]
) -> tuple[str | torch.dtype, tuple[str, ...]]:
    if not free or profile.dtype == here:
        return dtype, notes
    note = (
        f"loading {target} in {profile.dtype}, the dtype profile {profile.name} was calibrated in "
        f"(--dtype auto means {here} on this machine; pass --dtype to choose)"
    )
    return profile.dtype, (note, *notes)


def _shipped_for(spec: SpeculationConfig, target: str, here: str, any_dtype: bool) -> Profile | None:
    """The shipped profile ``profile="auto"`` applies to ``spec`` on a model named ``target``, judged by names: the
    one in ``here``'s dtype, or with ``any_dtype`` any dtype's where none is in ``here``'s."""
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
    preferred = [profile for profile in candidates if profile.dtype == here]
    return next(iter(preferred or (candidates if any_dtype else [])), None)


def _at_shipped_point(
    profile: Profile, done: SpeculationConfig, verifier: str, target: str
) -> tuple[SpeculationConfig, tuple[str, ...]]:
    """A shipped profile's best point of ``verifier``'s rule; ``exact`` where it has none (said in one line)."""
    resolved = profile.speculation(done, verifier)
    if resolved is not None:
        return resolved, ()
    if not profile.calibrated(verifier):
        note = (
            f"{profile.name} did not calibrate {verifier} (the rule was not in its grid); {verifier} runs as exact "
            f"(lossless). Pass --profile none for its default settings, or calibrate it: flyspec calibrate "
            f"--rules {verifier}"
        )
    else:
        note = (
            f"{profile.name}: no {verifier} setting was measured inside its "
            f"{100 * profile.record['budget']['max_meaning_change']:.0f}% quality budget and faster than exact on "
            f"{target}; {verifier} runs as exact (lossless). Pass --profile none for the paper's settings."
        )
    return dataclasses.replace(done, verifier="exact"), (note,)


def _within_file(profile: Profile, spec: SpeculationConfig, done: SpeculationConfig) -> SpeculationConfig:
    """A profile file's point for ``spec``, or ``spec`` itself where it stays inside the profile's limit."""
    lossy = spec.verifier not in LOSSLESS_VERIFIERS
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
        return resolved
    if lossy and not profile.calibrated(spec.verifier):
        raise ConfigError(
            f"profile {profile.path} did not calibrate {spec.verifier}, so it sets no limit for it; calibrate it "
            f"(flyspec calibrate --rules {spec.verifier}) or pass --profile none"
        )
    limit = profile.speculation(done, spec.verifier if lossy else None) or dataclasses.replace(done, verifier="exact")
    reasons = looser(limit, done)
    if reasons:
        raise ConfigError(f"these settings are looser than profile {profile.path} allows: {'; '.join(reasons)}")
    return dataclasses.replace(done, sampling_range=profile.sampling_range)  # its loose accepts only where measured


def lossy_settings_are_defaults(spec: SpeculationConfig) -> bool:
    """The caller left every setting a profile decides at its default (any verifier)."""
    defaults = SpeculationConfig()
    return all(getattr(spec, name) == getattr(defaults, name) for name in RULE_FIELDS if name != "verifier")


@dataclasses.dataclass(frozen=True)
class DtypeChoice:
    """The dtype a run loads its models in, and the one line saying a profile chose it (None: it did not)."""

    dtype: str
    note: str | None = None


def load_dtype(
    specs: Iterable[SpeculationConfig], target: Any, dtype: str = DEFAULT_DTYPE, device: str = DEFAULT_DEVICE
) -> DtypeChoice:
    """The dtype a front end loads its models in, for the first of ``specs`` whose profile brings one
    (:func:`decide`); ``target`` that is not a name (a loaded model) keeps its own dtype."""
    if not isinstance(dtype, str) or dtype != DEFAULT_DTYPE or not isinstance(target, str):
        return DtypeChoice(dtype)
    for spec in specs:
        if spec.profile == PROFILE_NONE:
            continue
        decision = decide(spec, target, dtype, device)
        if decision.dtype != dtype:
            return DtypeChoice(str(decision.dtype), decision.notes[0])
    return DtypeChoice(dtype)


@dataclasses.dataclass(frozen=True)
class Resolution:
    """A config with its profile applied (``profile="none"``), and the profile that decided it (None: none did)."""

    spec: SpeculationConfig
    profile: Profile | None = None


def resolution(
    spec: SpeculationConfig,
    target: LoadedModel | ServedModel,
    draft: LoadedModel | None = None,
    engine: str = "flyspec",
) -> Resolution:
    """``spec`` on loaded models, the profile applied and confirmed (said once), with the profile that decided (a
    server keeps it as the limit of its requests). ``engine``: where it will run (``flyspec`` or ``vllm``), so that
    a profile measured on the other one is refused unless they agree."""
    decision = decide(spec, target, choose_dtype=False).confirm(target, draft, engine)
    decision.announce()
    return Resolution(decision.spec, decision.profile)


def resolve(
    spec: SpeculationConfig,
    target: LoadedModel | ServedModel,
    draft: LoadedModel | None = None,
    engine: str = "flyspec",
) -> SpeculationConfig:
    """:func:`resolution`'s config alone."""
    return resolution(spec, target, draft, engine).spec
