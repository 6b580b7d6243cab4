"""Logits → probabilities (temperature, top-k, top-p), and draws from a ``torch.Generator``'s stream.

Pure tensor functions. The target's choice of a token (its argmax, or its sample keyed by position) is
``coupled.choose_tokens``; the greedy path (``SamplingConfig.greedy``: temperature below 1e-5) never draws a random
number.
"""

from __future__ import annotations

import torch

from flyspec.config import SamplingConfig


def filtered_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Temperature-scaled logits with ``-inf`` where top-k / top-p drop the token. ``[..., vocab]`` → same shape,
    float32; their softmax is the distribution sampling draws from (:func:`logits_to_probs`). Every step is
    row-wise, so a row's values do not depend on the other rows of its batch."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(torch.softmax(logits, dim=-1), dim=-1, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def logits_to_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Filtered, temperature-scaled probabilities. ``logits``: ``[..., vocab]`` → same shape, float32.

    When greedy (temperature below 1e-5) the result is one-hot on the argmax (the greedy distribution).
    """
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.float().argmax(-1), logits.shape[-1]).float()
    return torch.softmax(filtered_logits(logits, sampling), dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from ``generator``'s stream (block verification's fresh draws). ``[..., vocab]`` →
    ``[...]`` int64."""
    flat = probs.reshape(-1, probs.shape[-1])
    tokens = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return tokens.reshape(probs.shape[:-1])


def uniform(
    shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device | None = None
) -> torch.Tensor:
    """Uniform [0, 1) draws from ``generator``'s stream (block verification's), on ``device`` (default: the
    generator's, else the CPU)."""
    if device is None:
        device = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(shape, generator=generator, device=device)


def same_device(first: torch.device | str, second: torch.device | str) -> bool:
    """Whether two devices are one: ``cuda`` (no index) is the current CUDA device, as torch places it."""

    def resolved(device: torch.device | str) -> torch.device:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device

    return resolved(first) == resolved(second)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``, or from the OS's entropy when ``seed`` is None.

    Random numbers are drawn where the target's probabilities are (``Decoder.device``), so a CUDA
    target needs a CUDA generator. The same seed gives different draws on different devices.
    """
    generator = torch.Generator(device=device)
    if seed is not None:
        generator.manual_seed(seed)
    else:
        generator.seed()
    return generator
