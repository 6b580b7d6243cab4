"""Calibration profiles: the lossy settings ``flyspec calibrate`` chose inside a quality budget, and the limits
they set. flyspec ships one per packaged model pair (the ``*.json`` files here).

- ``profile.py``  Profile (load, save, check against a model), the shipped profiles, and their resolution
- ``limits.py``   which settings are looser than a profile's (a profile refuses them)
"""

from flyspec.profiles.limits import looser
from flyspec.profiles.profile import Profile

__all__ = ["Profile", "looser"]
