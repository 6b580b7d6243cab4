"""Trust guards: which loose accepts a lossy verifier (fly, margin, typical, bild) may keep. flyspec's own.

A lossy rule proposes *candidates*: mismatching draft tokens it would keep. A guard vetoes a
candidate, which is then judged by the strict base rule exactly as if the lossy rule had not kept
it. Guards only remove loose accepts: they never change a lossless verdict and never add an accept.

Always on (also in the paper's bare rule, ``GuardConfig.bare()``), because they are defects, not
trade-offs:

``eos``
    The draft token or the target's top token is an end-of-sequence token. Loosely accepting an
    EOS the target did not choose ends the answer early; loosening past one it did choose writes
    on after the target wanted to stop.
``cache``
    The draft token came from the n-gram cache of *earlier generations* (``Draft.sources``).
    Loose acceptance would turn that memory into an oracle: a token that only the cache (maybe
    another user's prompt) proposed could be emitted although the target never chose it. Cache
    drafts are kept only where the target's own choice agrees.

On by default (``GuardConfig()``), off in ``GuardConfig.bare()``:

``top-k``
    The draft token must be one of the target's ``top_k`` tokens at that position. FLy's entropy
    gate says the target is unsure *among its top 3*; a token outside them is not one it was
    unsure about.
``protect``
    The draft or the target's top token belongs to a protected class (``verifiers/tokens.py``):
    ``digits`` (numbers, dates), ``names`` (identifiers inside code, names and identifiers of
    the prompt), ``identifiers`` (every word: code-only workloads).
``loop``
    The candidate makes the output repeat itself: an n-gram (``repeat_ngram`` tokens) of the
    output that contains the candidate already occurred earlier in the output (or the draft),
    while the target's own choice there would not have repeated it. n-gram drafts are copies, and
    once a copy of the output is committed the target tends to follow it, so the deferred window
    is satisfied by the very repetition it should judge.
``exact-first``
    The candidate would land among the first ``exact_first`` tokens of the output (``GuardConfig.exact_first``,
    default 0: off; in bare rules too, as it is the user's choice, not one of flyspec's guards): the start of
    an answer (a refusal, the first fact) is verified exactly, the correction a comparison of relaxed
    verifiers found to recover most of the safety they lose at almost no speed cost.
``breaker``
    The generation's circuit breaker has tripped (``decoding/breaker.py``; only with a ``BreakerConfig``,
    which a calibration profile sets, in bare rules too): it made far more loose accepts than its
    profile's calibration saw, so every later candidate is refused.
``copy``
    The candidate is part of a copy of the prompt (an n-gram containing it occurs in the prompt)
    and the target does not agree enough: ``p_target(draft token) < copy_ratio · p_target(top)``
    (default ``copy_ratio`` 1.0: only a tie passes). Where the target wanted to leave a copy, the
    window after it is weak evidence for the same reason: the target follows the copy once it is
    committed. Measured: with 0.5, answers that should name one fact copied the whole prompt
    sentence instead ("Sofia Moreno moved from Accra to Nagoya to sell 262 loaves").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flyspec.config import GuardConfig
from flyspec.sampling.acceptance import where_needed
from flyspec.types import CACHE, Draft, VerifyContext
from flyspec.verifiers.tokens import Vocabulary

Vetoes = dict[int, tuple[str, ...]]  # draft position -> the guards that refused its loose accept


def top_k_mask(draft_tokens: torch.Tensor, target_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[k]`` bool: the draft token is among the target's ``top_k`` tokens at its position."""
    k = draft_tokens.shape[0]
    top = torch.topk(target_logits[:k].float(), min(top_k, target_logits.shape[-1]), dim=-1).indices  # [k, top_k]
    return (top == draft_tokens.unsqueeze(-1)).any(-1)


def probability_ratio(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """``[k]``: ``p_target(draft token) / p_target(top token)`` at temperature 1 (= ``exp(z_d - z_max)``)."""
    logits = target_logits[: draft_tokens.shape[0]].float()
    return torch.exp(logits.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1) - logits.max(-1).values)


def _first_starts(sequence: Sequence[int], n: int) -> dict[tuple[int, ...], int]:
    """Each n-gram of ``sequence`` → where it first starts."""
    starts: dict[tuple[int, ...], int] = {}
    for start in range(len(sequence) - n + 1):
        starts.setdefault(tuple(sequence[start : start + n]), start)
    return starts


def repeats_earlier(sequence: Sequence[int], index: int, n: int) -> bool:
    """Some n-gram of ``sequence`` containing ``index`` also starts earlier than it does."""
    starts = _first_starts(sequence, n)
    for start in range(max(0, index - n + 1), min(index, len(sequence) - n) + 1):
        if starts[tuple(sequence[start : start + n])] < start:
            return True
    return False


def occurs_in(sequence: Sequence[int], index: int, n: int, ngrams: set[tuple[int, ...]]) -> bool:
    """Some n-gram of ``sequence`` containing ``index`` is in ``ngrams``."""
    starts = range(max(0, index - n + 1), min(index, len(sequence) - n) + 1)
    return any(tuple(sequence[start : start + n]) in ngrams for start in starts)


def _prompt_ngrams(context: VerifyContext, n: int) -> set[tuple[int, ...]]:
    key = f"prompt-{n}-grams"
    if key not in context.memo:
        context.memo[key] = set(_first_starts(context.prompt_ids, n))
    return context.memo[key]


def _prompt_names(context: VerifyContext) -> tuple[frozenset[int], bool]:
    if "prompt-names" not in context.memo:
        vocabulary = context.vocabulary
        context.memo["prompt-names"] = (
            vocabulary.prompt_names(context.prompt_ids),
            vocabulary.prompt_is_code(context.prompt_ids),
        )
    return context.memo["prompt-names"]


def _wide_classes(config: GuardConfig) -> tuple[str, ...]:
    """The protected classes decided by the token alone (``names`` also depends on the prompt)."""
    return tuple(name for name in config.protect if name != "names")


def prepare(vocabulary: Vocabulary, config: GuardConfig) -> None:
    """Build now the token-class masks these guards will look up: a scan of the whole vocabulary
    (about a second for SmolLM2's 49k tokens), which would otherwise stall the first generation that
    meets a loose candidate (a server's first request, a benchmark's first timed prompt)."""
    wide = _wide_classes(config)
    if wide:
        vocabulary.contains(wide, 0)
    if "names" in config.protect:
        vocabulary.contains(("identifiers",), 0)


def _protected(token: int, position: int, draft_ids: list[int], config: GuardConfig, context: VerifyContext) -> bool:
    vocabulary = context.vocabulary
    wide = _wide_classes(config)
    if wide and vocabulary.contains(wide, token):
        return True
    if "names" not in config.protect:
        return False
    names, prompt_is_code = _prompt_names(context)
    if token in names:
        return True
    if not vocabulary.contains(("identifiers",), token):
        return False
    in_code = prompt_is_code != vocabulary.opens_code(context.output_ids + draft_ids[:position])
    return in_code


def _vetoes_at(
    position: int,
    draft: Draft,
    draft_ids: list[int],  # the draft tokens, on the host
    target_token: int,  # the target's top token at ``position``
    target_logits: torch.Tensor,
    config: GuardConfig,
    context: VerifyContext | None,
) -> list[str]:
    """The guards that refuse a loose accept of draft token ``position`` (empty: it may be kept)."""
    draft_token = draft_ids[position]
    reasons = []
    if draft.source(position) == CACHE:
        reasons.append("cache")
    if context is None or context.vocabulary is None:
        return reasons
    if draft_token in context.vocabulary.eos_token_ids or target_token in context.vocabulary.eos_token_ids:
        reasons.append("eos")
    if config.protect and any(_protected(t, position, draft_ids, config, context) for t in (draft_token, target_token)):
        reasons.append("protect")
    if config.repeat_ngram:
        reasons.extend(_repetition_vetoes(position, target_token, draft, draft_ids, target_logits, config, context))
    return reasons


def _repetition_vetoes(
    position: int,
    target_token: int,
    draft: Draft,
    draft_ids: list[int],
    target_logits: torch.Tensor,
    config: GuardConfig,
    context: VerifyContext,
) -> list[str]:
    """``loop`` or ``copy`` (see the module docstring), judged on the n-grams that contain the candidate."""
    n = config.repeat_ngram
    ahead = draft_ids[: position + n]  # the candidate, the draft before it and up to n - 1 after
    output = context.output_ids + ahead
    index = len(context.output_ids) + position
    if repeats_earlier(output, index, n) and not repeats_earlier([*output[:index], target_token], index, n):
        return ["loop"]
    if config.copy_ratio <= 0:
        return []
    sequence = context.token_ids + ahead
    if not occurs_in(sequence, len(context.token_ids) + position, n, _prompt_ngrams(context, n)):
        return []
    candidate = slice(position, position + 1)
    ratio = float(probability_ratio(draft.tokens[candidate], target_logits[candidate]))
    return ["copy"] if ratio < config.copy_ratio else []


def guard_loose_mask(
    base_accept: torch.Tensor,  # [k] bool, the strict base rule's acceptance
    loose: torch.Tensor,  # [k] bool, candidates: mismatches the lossy rule would keep
    draft: Draft,
    target_logits: torch.Tensor,  # [k (+1), vocab]
    config: GuardConfig,
    context: VerifyContext | None,
) -> tuple[torch.Tensor, Vetoes]:
    """``([k] bool, vetoes)``: the candidates that survive the guards, and why the others did not.

    Candidates are judged in order up to the first position that ends the accepted prefix
    (nothing after it can be committed). Without a ``context`` (a verifier used on its own) only
    the guards that need neither the generation so far nor the vocabulary apply (``cache``, ``top-k``).
    """
    kept = loose & ~base_accept
    k = draft.num_tokens
    if config.top_k:  # judged at the candidates only (acceptance.where_needed), as is the argmax below

        def in_top_k(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return top_k_mask(draft.tokens[positions], rows, config.top_k)

        kept &= where_needed(kept, target_logits, in_top_k, False)
    # the target's choices at the candidates, for the loop below (-1 elsewhere: never read)
    target_tokens = where_needed(kept, target_logits, lambda rows, _: rows.argmax(-1), -1)
    # one device-to-host transfer for the loop below (indexing device tensors would sync per position)
    host = torch.cat([base_accept.long(), loose.long(), kept.long(), draft.tokens, target_tokens]).tolist()
    base_host, loose_host, kept_host = host[:k], host[k : 2 * k], host[2 * k : 3 * k]
    draft_ids, target_ids = host[3 * k : 4 * k], host[4 * k :]
    vetoes: Vetoes = {}
    tripped = context is not None and context.breaker is not None and context.breaker.tripped
    # output tokens before this draft: the exact-first correction reads where each draft token would land (without
    # a context, a verifier used on its own, every draft counts as the output's start: stricter, never looser)
    written = len(context.token_ids) - context.prompt_length if context is not None else 0
    for position in range(k):
        if base_host[position]:
            continue
        if not kept_host[position]:
            if loose_host[position]:
                vetoes[position] = ("top-k",)
            break  # the accepted prefix ends here
        if written + position < config.exact_first:
            reasons = ["exact-first"]
        elif tripped:
            reasons = ["breaker"]
        else:
            reasons = _vetoes_at(position, draft, draft_ids, target_ids[position], target_logits, config, context)
        if reasons:
            kept_host[position] = 0
            vetoes[position] = tuple(reasons)
            break
    return torch.tensor(kept_host, dtype=torch.bool, device=kept.device), vetoes
