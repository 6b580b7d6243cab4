"""Exact match: keep a draft token only if it equals the target's own choice. Lossless.

Greedy (T=0) the target's choice is its argmax, which is standard greedy speculative decoding.
At T>0 the target's choice at every position is its coupled sample there (``sampling/coupled.py``: Gumbel-max
with noise keyed by the seed and the position), and the first mismatch commits that sample: every committed token
is the token plain sampling commits at that position for the same seed, so **the output is plain sampling's text**,
whatever the drafter and the draft length (in float32, where the target's logits do not depend on the forward's
batch shape). A draft model that draws with the same noise proposes that token wherever its distribution is close
to the target's. This is :class:`StrictRule`'s default rule: nothing to add.
"""

from __future__ import annotations

from dataclasses import dataclass

from flyspec.verifiers.base import StrictRule


@dataclass(frozen=True)
class ExactVerifier(StrictRule):
    name: str = "exact"
