"""The math drafters and verifiers share: logits → probabilities, draws, and acceptance masks.

- ``sampler.py``     logits → probabilities (temperature, top-k, top-p), a generator's own draws
- ``coupled.py``     coupled sampling: the target's (and drafters') choice per position, noise keyed by (seed, position)
- ``acceptance.py``  acceptance masks and residual sampling (verifiers, and stack levels checking a proposal)
"""

from flyspec.sampling.coupled import CoupledNoise, Draws, choose_tokens
from flyspec.sampling.sampler import logits_to_probs, make_generator, sample, uniform

__all__ = ["CoupledNoise", "Draws", "choose_tokens", "logits_to_probs", "make_generator", "sample", "uniform"]
