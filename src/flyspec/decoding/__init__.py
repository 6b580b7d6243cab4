"""The decode loops and the parts of one generation: the data flow of ARCHITECTURE.md, step by step.

- ``speculative.py``  SpeculativeDecoder: draft → score → verify → commit → roll back → stop
- ``plain.py``        PlainDecoder: one target forward per token (the speedup denominator)
- ``generation.py``   Generation (one call's state) and the Decoder front end: encode, stop, stream
- ``stopping.py`` · ``streaming.py`` · ``result.py``   when to stop; text as it settles; what a call returns
- ``stats.py`` · ``draft_length.py`` · ``breaker.py``  what a generation observes and what it adapts to
"""

from flyspec.decoding.plain import PlainDecoder
from flyspec.decoding.speculative import SpeculativeDecoder

__all__ = ["PlainDecoder", "SpeculativeDecoder"]
