"""Prepacked linears for flyspec's CPU kernels (``kernels.py``, ``--kernels auto``).

- :class:`PackedLinear`: an ``nn.Linear`` whose weight oneDNN reordered once into its blocked
  layout; under ``torch.compile`` the opaque operator ``flyspec::packed_linear``, or, once
  :func:`use_cpp_operator` ran (``--compile`` on the CPU), ``flyspec_cpp::packed_linear``: the same
  call from C++ (``packed_linear.cpp``), so the compiled graphs' C++ wrapper reaches oneDNN without Python, and
  a cached step's few rows are read out of the packed weight by the operator itself (no oneDNN bookkeeping) where
  its layout is the one the operator reads; eager forwards then call the same operator.
- :class:`SharedLinears`: sibling linears that one probe forward fed the same tensor (attention's
  query/key/value, an MLP's gate/up) share one packed weight, their outputs stacked: one oneDNN
  call instead of several. Found by running the model, not from its source, and kept only where
  the logits with shared outputs equal those of each member computing its own.
"""

from __future__ import annotations

import functools
import itertools
import logging
import weakref
from collections import Counter

import torch
from torch import nn
from transformers import PreTrainedModel

from flyspec.runtime import cpp_operators

logger = logging.getLogger(__name__)


# Packed weights by handle, for the compiled graphs' operator (a oneDNN tensor cannot be a graph
# input: it has no storage to fake). Weak: a weight lives as long as its PackedLinear.
_PACKED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


def _packed_linear(rows: torch.Tensor, handle: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``rows`` [n, in] times the packed weight registered under ``handle``, plus ``bias``: [n, out]."""
    return torch.ops.mkldnn._linear_pointwise(rows, _PACKED[handle], bias, "none", [], "")


def _packed_linear_shape(rows: torch.Tensor, handle: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], out_features))


# A plain library operator with a CPU kernel, not ``torch.library.custom_op``: measured 5 µs less per
# call (211 calls per SmolLM2 step), and nothing here needs autograd.
_LIBRARY = torch.library.Library("flyspec", "DEF")
# oneDNN's batch-size hint for the weights' layout: 4 measured as fast as the others for 1..16 rows (a cached step)
PACKING_HINT = 4
_LIBRARY.define("packed_linear(Tensor rows, int handle, int out_features, Tensor? bias) -> Tensor")
_LIBRARY.impl("packed_linear", _packed_linear, "CPU")
torch.library.register_fake("flyspec::packed_linear", _packed_linear_shape, lib=_LIBRARY)


@functools.cache
def cpp_operator() -> bool:
    """Build and load ``flyspec_cpp::packed_linear`` (``packed_linear.cpp``) once per process; False, with a
    warning, where it cannot be built (no C++ compiler, a torch without inductor's builder): the graphs then call
    the Python operator, ~14 µs a linear slower (BENCHMARKS.md, issue 53). The build (~10 s on 2 cores) is kept in
    inductor's cache, as the compiled graphs are."""
    try:
        _build_cpp_operator()
    except Exception as error:  # noqa: BLE001 - any failure to build leaves the Python operator in place
        logger.warning("flyspec kernels: the linears' C++ operator was not built (%s); the Python one runs", error)
        return False
    return True


_CPP_FAKE: list[bool] = []  # the C++ operator's shape function is registered (once per process)


def _build_cpp_operator() -> None:
    cpp_operators.build("packed_linear.cpp")
    if not _CPP_FAKE:
        torch.library.register_fake("flyspec_cpp::packed_linear", _packed_linear_shape)
        _CPP_FAKE.append(True)


def use_cpp_operator(model: nn.Module) -> bool:
    """Make the packed linears of ``model`` call ``flyspec_cpp::packed_linear`` under ``torch.compile``
    (before compiling: a graph keeps the operator it was traced with). False where it is not available."""
    if not cpp_operator():
        return False
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.use_cpp()
        elif isinstance(module, SharedLinear):
            module.group.linear.use_cpp()
    return True


class PackedLinear(nn.Module):
    """``nn.Linear`` with its weight in oneDNN's blocked layout (reordered once, here).

    The packed weight is an opaque oneDNN tensor, held as a plain attribute: the module cannot be
    moved to another device or trained. Outputs equal ``F.linear``'s up to rounding."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """``weight`` [out, in] and ``bias`` [out] as ``nn.Linear`` holds them."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_HINT)
        self.bias = None if bias is None else bias.detach()
        self.handle = next(_HANDLES)
        _PACKED[self.handle] = self.packed
        self.cpp = False  # compiled graphs call flyspec_cpp::packed_linear (use_cpp)

    def use_cpp(self) -> None:
        """Hand the packed weight to the C++ operator (:func:`cpp_operator` must have built it); it drops the
        weight when this module is collected."""
        if not self.cpp:  # the unpacked copy lets it check the packed layout, value by value (packed_linear.cpp)
            torch.ops.flyspec_cpp.remember(self.handle, self.packed, self.packed.to_dense())
            weakref.finalize(self, torch.ops.flyspec_cpp.forget, self.handle)
            self.cpp = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.cpp:  # compiled or eager, the same operator: a step's rows come out the same either way
            out = torch.ops.flyspec_cpp.packed_linear(rows, self.handle, self.out_features, self.bias)
        elif torch.compiler.is_compiling():
            out = torch.ops.flyspec.packed_linear(rows, self.handle, self.out_features, self.bias)
        else:  # eager: the oneDNN call itself, without the custom operator's dispatch
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class SharedLinears:
    """Sibling linears fed the same input, run as one: their weights stacked and packed once.

    The first member called with a tensor computes every member's output; the others, called with
    that same tensor object, take their slice; a tensor not seen before is computed afresh, so a
    member called out of turn is still right, only slower. The last member (in the probe's order)
    drops the slices, so no activations are held between steps. The input and its outputs are one
    attribute, read once per call: threads sharing the model may recompute, never mix them up."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        first = linears[0]
        weight = torch.cat([linear.weight.detach() for linear in linears])
        bias = None if first.bias is None else torch.cat([linear.bias.detach() for linear in linears])
        self.in_features = first.in_features
        self.sizes = [linear.out_features for linear in linears]
        self.linear = PackedLinear(weight, bias)
        self.share = True  # False: every member computes the stacked output itself (the check in install)
        self._last: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None  # an input and its outputs

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        last = self._last
        if last is None or last[0] is not x or not self.share:
            last = (x, self.linear(x).split(self.sizes, dim=-1))
            self._last = last
        if index == len(self.sizes) - 1:
            self._last = None
        return last[1][index]


class SharedLinear(nn.Module):
    """One member of a :class:`SharedLinears` (``in_features``/``out_features`` as the linear it replaced)."""

    def __init__(self, group: SharedLinears, index: int) -> None:
        super().__init__()
        self.group, self.index = group, index
        self.in_features, self.out_features = group.in_features, group.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.index)

    def extra_repr(self) -> str:
        shared = f"shared {self.index + 1} of {len(self.group.sizes)}"
        return f"in_features={self.in_features}, out_features={self.out_features}, {shared}"


# A sibling group: the parent module and its children's names, in the order the probe called them.
Siblings = tuple[nn.Module, tuple[str, ...]]


def _probe(model: PreTrainedModel) -> torch.Tensor:
    """The model's logits for a few tokens (no cache): the forward that finds and checks sibling linears."""
    device = next(model.parameters()).device
    ids = torch.tensor([[1, 2, 3, 4]], dtype=torch.long, device=device) % max(
        int(getattr(model.config, "vocab_size", 0) or 5), 5
    )
    return model(input_ids=ids, use_cache=False).logits


def _siblings(model: PreTrainedModel) -> list[Siblings]:
    """Groups of ``nn.Linear`` children of one module that one probe forward fed the same tensor object.

    A linear called more than once, or whose siblings differ in input size, dtype or having a bias,
    stays alone. A model the probe cannot run gets no groups (and a log line)."""
    calls: list[tuple[nn.Module, str, nn.Linear, torch.Tensor]] = []
    hooks = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                hook = child.register_forward_pre_hook(
                    lambda module, args, parent=parent, name=name: calls.append((parent, name, module, args[0]))
                )
                hooks.append(hook)
    try:
        _probe(model)
    except Exception as error:  # noqa: BLE001 - any model the probe cannot run keeps unfused linears
        logger.info("flyspec kernels: sibling linears not fused (the probe forward failed: %s)", error)
        return []
    finally:
        for hook in hooks:
            hook.remove()
    times_called = Counter(id(linear) for _, _, linear, _ in calls)
    by_input: dict[tuple[int, int], list[tuple[nn.Module, str, nn.Linear]]] = {}
    for parent, name, linear, x in calls:  # ``calls`` holds every input, so ids stay unique
        if times_called[id(linear)] == 1 and isinstance(x, torch.Tensor):
            by_input.setdefault((id(parent), id(x)), []).append((parent, name, linear))
    groups = []
    for members in by_input.values():
        first = members[0][2]
        alike = all(
            linear.in_features == first.in_features
            and linear.weight.dtype == first.weight.dtype
            and (linear.bias is None) == (first.bias is None)
            for _, _, linear in members
        )
        if len(members) > 1 and alike:
            groups.append((members[0][0], tuple(name for _, name, _ in members)))
    return groups


# What fusing replaced: per group, its parent and the linears by name (to undo it).
Fused = list[tuple[SharedLinears, nn.Module, dict[str, nn.Linear]]]


def pack_linears(model: PreTrainedModel) -> None:
    """Pack every plain ``nn.Linear`` of ``model`` in place; sibling groups share one packed weight
    where the check holds (see the module docstring). Call in inference mode."""
    fused = _pack_linears(model, _siblings(model))
    if fused and not _sharing_holds(model, fused):
        _unfuse(model, fused)


def _pack_linears(module: nn.Module, siblings: list[Siblings]) -> Fused:
    """Pack every plain ``nn.Linear`` under ``module``; each sibling group shares one packed weight."""
    fused: Fused = []
    for parent, names in siblings:
        linears = {name: getattr(parent, name) for name in names}
        group = SharedLinears(list(linears.values()))
        for index, name in enumerate(names):
            setattr(parent, name, SharedLinear(group, index))
        fused.append((group, parent, linears))
    _pack_rest(module)
    return fused


def _pack_rest(module: nn.Module) -> None:
    for name, child in module.named_children():
        if type(child) is nn.Linear:  # subclasses (quantized, LoRA, ...) keep their own forward
            setattr(module, name, PackedLinear(child.weight, child.bias))
        else:
            _pack_rest(child)


def _sharing_holds(model: PreTrainedModel, fused: Fused) -> bool:
    """Whether the model's logits are the same with the groups' outputs shared and with each member
    computing them itself: a model that changes a linear's input in place between siblings, or
    reshapes an output in a way a slice cannot take, fails it."""
    try:
        for group, _, _ in fused:
            group.share = False
        alone = _probe(model)
        for group, _, _ in fused:
            group.share = True
        shared = _probe(model)
    except Exception as error:  # noqa: BLE001 - a model that cannot take the slices keeps unfused linears
        logger.info("flyspec kernels: sibling linears not fused (%s)", error)
        return False
    if not torch.equal(alone, shared):
        logger.info("flyspec kernels: sibling linears not fused (sharing their outputs changes the logits)")
        return False
    return True


def _unfuse(model: PreTrainedModel, fused: Fused) -> None:
    for _, parent, linears in fused:
        for name, linear in linears.items():
            setattr(parent, name, PackedLinear(linear.weight, linear.bias))
