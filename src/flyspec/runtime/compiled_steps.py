"""The cached-step forward compiled by ``torch.compile`` (``--compile``): :func:`compile_steps`.

``loading.load_model(compile=True)`` calls it: it turns a loaded model into one whose cached steps
run through a compiled graph, compiled at load (the warm-up), with dynamo's guards on the model's
modules skipped from a code object private to the model.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import types
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from flyspec.runtime.cached_model import CachedModel
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.packed_linears import use_cpp_operator


def compile_steps(loaded: LoadedModel) -> LoadedModel:
    """``loaded`` with its cached-step forward compiled by ``torch.compile`` (inductor).

    ``dynamic=True``: one graph for every number of scored tokens and cache length, so a draft of
    any length reuses it. With flyspec's kernels (``loaded.kernels``) the linears are already packed
    and stay opaque operators; inductor fuses the rest (norms, rotary embeddings, activations) and
    removes the per-operator Python cost. Without them, ``freezing`` makes the weights constants,
    which lets inductor prepack them for oneDNN on the CPU (BENCHMARKS.md, "A compiled forward").
    It compiles here, before returning (minutes on 2 cores), so that no
    generation stalls on a compile. A prefill from an empty cache runs a graph of its own
    (``prefill_forward``, dynamic in the prompt's length: one graph for every prompt of 2 tokens or more),
    which fuses the norms, rotary embeddings and activations of every prompt position as the steps' graph
    does for a step's (BENCHMARKS.md, "Time to first token"); a prefill that continues a cache (prefix
    reuse) stays eager.
    Plain decoding uses the same compiled forward, so speedups stay like for like. The model must
    not change afterwards (weights, modules, hooks): its graphs skip dynamo's guards on its modules
    (:func:`_private_step`). Any causal LM that ``torch.compile`` can trace works; one it
    cannot falls back to eager per graph break (``torch._dynamo`` decides; outputs are the same
    up to floating-point rounding).
    """
    options = compile_options(loaded)
    if loaded.kernels and loaded.device.type == "cpu":
        use_cpp_operator(loaded.model)  # the packed linears reached from the C++ wrapper without Python
    # two code objects: the prefill's graph (prompt length dynamic, no cache, the last row's logits) is compiled
    # and looked up apart from the steps', so neither counts against the other's recompile limit
    step, prefill = (torch.compile(_private_step(), dynamic=True, options=options) for _ in range(2))
    compiled = dataclasses.replace(
        loaded,
        step_forward=functools.partial(step, loaded.model),
        prefill_forward=functools.partial(prefill, loaded.model),
    )
    _warm_up(compiled)
    return compiled


def compile_options(loaded: LoadedModel) -> dict[str, Any]:
    """Inductor's options for ``loaded``'s graphs.

    On the CPU the graphs get a C++ wrapper (``cpp_wrapper``): the code that calls a step's fused kernels and its
    ~120 linears runs in C++ instead of Python, 7-8 % off a SmolLM2 bf16 step (BENCHMARKS.md, issue 53). Built
    apart from the kernels (``cpp_wrapper_build_separate``: the wrapper at -O1), which costs no compile time over
    the Python wrapper where the one-piece build costs ~100 s more per model on 2 cores. On a GPU the graphs keep
    the Python wrapper (not measured there with the C++ one)."""
    options: dict[str, Any] = {"guard_filter_fn": _skip_guards_on_the_model}
    if not loaded.kernels:
        options["freezing"] = True
    if loaded.device.type == "cpu":
        options["cpp_wrapper"] = True
        options["cpp_wrapper_build_separate"] = True
    return options


# The compiled step's argument holding the model: it names the guards of the step's own frame.
_STEP_MODEL = "flyspec_step_model"
_private_steps = itertools.count()


def _step(flyspec_step_model: PreTrainedModel, **kwargs: Any) -> Any:
    return flyspec_step_model(**kwargs)


def _private_step() -> Callable[..., Any]:
    """:func:`_step` with a code object of its own, so dynamo's graphs for it (kept on the code
    object) belong to one model. Their guards can then skip the model's modules
    (:func:`_skip_guards_on_the_model`): most of dynamo's ~7,700 guards per SmolLM2 graph, and
    most of the ~1.3 ms their check took per step (BENCHMARKS.md). With a shared code object, two
    models of one class would share graphs that hold one model's weights."""
    code = _step.__code__.replace(co_name=f"flyspec_step_{next(_private_steps)}")
    return types.FunctionType(code, _step.__globals__, code.co_name)


def _skip_guards_on_the_model(entries: list[Any]) -> list[bool]:
    """Which of a frame's guards to keep (``torch.compile``'s ``guard_filter_fn``): in the private
    step's frame, not those on the model's modules (attributes, hooks, parameters); every other
    guard, and every guard of any other frame (one after a graph break, whose code is shared), stays."""
    own_frame = any(entry.name.startswith((_STEP_MODEL, f"L['{_STEP_MODEL}']")) for entry in entries)
    return [not (own_frame and entry.orig_guard.source.is_unspecialized_nn_module()) for entry in entries]


# Step sizes of the warm-up, in order: 1-token steps at two cache lengths (torch specialises a size
# of 1, so they get their own graph, and a second length makes it dynamic in the length), then
# several-token steps at growing lengths (one graph, dynamic in both).
WARM_UP_STEPS = (1, 1, 2, 3, 2, 5)


def _warm_up(loaded: LoadedModel) -> None:
    """Compile now, not in the middle of a generation, every graph generation needs: a prefill, then the
    steps of :data:`WARM_UP_STEPS`, run by ``CachedModel`` as generation runs them (fresh
    inference tensors, the same kind of cache). A graph guards on sizes, strides, storage offsets
    and inference-ness; a step that differs in any of them compiles a new graph (tens of seconds),
    which ``tests/test_compile.py`` checks never happens during a generation."""
    # a model with sliding-window layers (Gemma-3) masks differently once the context reaches the window
    # (transformers' ``_ignore_causal_mask_sdpa``: ``kv_length >= local_attention_size``), a guard on the length:
    # the steps past the window get graphs of their own, compiled here too (35 s at Gemma-3-270M's 512, in its
    # first generation past the window otherwise)
    window = getattr(loaded.model.config, "sliding_window", None)
    prefills = (6,) if not isinstance(window, int) or window <= 0 else (6, window + 2)
    with torch._dynamo.config.patch(specialize_float=True):  # the model's floats as constants (below)
        for prefill in prefills:
            cached = CachedModel(loaded)
            cached.forward([0] * prefill, logits_to_keep=1)
            for size in WARM_UP_STEPS:
                cached.forward([0] * size)


# The model's float attributes (each norm's epsilon, each attention's scaling, the rotary scaling: 93 in SmolLM2) are
# constants of its graphs, not inputs. ``dynamic=True`` alone makes every one an input that dynamo reads through its
# modules and wraps in a new float64 tensor at every call: 0.11 ms (float32) to 0.18 ms (bf16) a SmolLM2 step, of the
# ~2 ms a step spends outside inductor's C++ code (benchmarks/2026-11-28-constant-floats). The graphs are traced under
# ``specialize_float=True`` (dynamo's own setting, patched for the warm-up only: a graph compiled later, which
# test_compile checks generation never needs, would only be slower); the guards that would check those constants are
# on the model's modules, skipped like the rest (the model must not change).
