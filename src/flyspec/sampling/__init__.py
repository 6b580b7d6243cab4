"""The math drafters and verifiers share: logits → probabilities, draws, and acceptance masks.

- ``sampler.py``     logits → probabilities (temperature, top-k, top-p), greedy choice, seeded sampling
- ``acceptance.py``  acceptance masks and residual sampling (verifiers, and stack levels checking a proposal)
"""

from flyspec.sampling.sampler import choose_tokens, logits_to_probs, make_generator, sample, uniform

__all__ = ["choose_tokens", "logits_to_probs", "make_generator", "sample", "uniform"]
