"""Calibration profiles: the lossy settings ``flyspec calibrate`` chose inside a quality budget, and the limits
they set. flyspec ships one per packaged model pair (the ``*.json`` files here).

- ``profile.py``     Profile: load, save, describe, check against a model; the shipped profiles
- ``decision.py``  what a profile decides for a SpeculationConfig (:func:`decide`), once, before any model loads
- ``limits.py``      which settings are looser than a profile's (a profile refuses them)
"""

from flyspec.profiles.decision import (
    Decision,
    DtypeChoice,
    Resolution,
    decide,
    load_dtype,
    lossy_settings_are_defaults,
    resolution,
    resolve,
)
from flyspec.profiles.limits import looser
from flyspec.profiles.profile import PROFILE_FORMAT, Profile, identity, shipped

__all__ = [
    "PROFILE_FORMAT",
    "Decision",
    "DtypeChoice",
    "Profile",
    "Resolution",
    "decide",
    "identity",
    "load_dtype",
    "looser",
    "lossy_settings_are_defaults",
    "resolution",
    "resolve",
    "shipped",
]
