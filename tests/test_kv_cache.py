"""One KV cache for every device (issue 39): a step writes in place, it does not copy the whole cache.

transformers' ``DynamicLayer`` concatenates each step's keys and values onto the cache: a copy of the
whole cache per step and per layer (about 270 MB a step for an 8B model at 2k context), whatever the
device. ``CachedModel`` uses flyspec's ``GrowingLayer`` everywhere now, not only with the CPU kernels:
here the bytes a one-token step writes stay flat as the context grows, and the concatenating layer
(``in_place=False``, the reference) shows the measure would catch a copy.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flyspec.runtime.cached_model import CachedModel
from flyspec.runtime.kernels import GrowingLayer
from flyspec.runtime.loaded_model import LoadedModel


class WrittenElements(TorchDispatchMode):
    """Elements written by concatenations and copies (what a cache update costs), per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.cat.default, torch.ops.aten.copy_.default, torch.ops.aten.clone.default):
            self.elements += (out if isinstance(out, torch.Tensor) else args[0]).numel()
        return out


def written_by_one_step(cached: CachedModel, context: int) -> int:
    cached.reset()
    cached.forward([(7 * index) % 200 + 2 for index in range(context)], logits_to_keep=1)
    counter = WrittenElements()
    with counter:
        cached.forward([5])
    return counter.elements


def test_a_steps_cache_writes_stay_flat_as_the_context_grows(tiny_target: LoadedModel) -> None:
    in_place = CachedModel(tiny_target)  # no CPU kernels on this model: the in-place cache all the same
    assert not tiny_target.kernels and isinstance(in_place.cache.layers[0], GrowingLayer)
    short, long = written_by_one_step(in_place, 40), written_by_one_step(in_place, 200)
    assert long == short, (short, long)
    concatenating = CachedModel(tiny_target, in_place=False)
    assert written_by_one_step(concatenating, 200) > written_by_one_step(concatenating, 40) + 100 * 2


def test_the_in_place_cache_scores_like_the_concatenating_one_through_rollbacks(tiny_target: LoadedModel) -> None:
    reference, in_place = CachedModel(tiny_target, in_place=False), CachedModel(tiny_target)
    for cached in (reference, in_place):
        cached.forward([3, 4, 5, 6, 7, 8], logits_to_keep=1)
    for step, size in enumerate([1, 5, 1, 16, 2, 9] * 50):  # past the initial capacity of 256
        tokens = [(step * 11 + offset) % 200 + 2 for offset in range(size)]
        torch.testing.assert_close(in_place.forward(tokens), reference.forward(tokens), atol=1e-5, rtol=1e-5)
        keep = reference.cached_length - step % 4
        reference.crop_to(keep)
        in_place.crop_to(keep)
    buffers = in_place.cache.layers[0]._buffers
    assert buffers is not None and buffers[0].shape[-2] >= in_place.cached_length


def test_its_memory_grows_by_doubling_only(tiny_target: LoadedModel) -> None:
    """Across a long generation the buffers are reallocated O(log n) times, never per step."""
    cached = CachedModel(tiny_target)
    cached.forward([3, 4, 5], logits_to_keep=1)
    capacities = []
    for step in range(900):
        cached.forward([step % 200 + 2])
        if step % 3 == 2:
            cached.crop_to(cached.cached_length - 1)  # a rollback: a length change
        capacities.append(cached.cache.layers[0]._buffers[0].shape[-2])
    assert len(set(capacities)) <= 3, sorted(set(capacities))  # 256 -> 512 -> 1024 at most
