"""flyspec's CPU kernels for the cached steps of any transformers causal LM (``--kernels auto``).

Three replacements, each for a measured CPU cost (BENCHMARKS.md, "CPU kernels"), each falling back
to the stock path where it does not apply:

- **Prepacked linears.** Every ``nn.Linear`` becomes a :class:`PackedLinear` whose weight oneDNN
  has reordered once, at load, into its blocked layout; the stock ``F.linear`` reads the plain
  layout at every call and reaches about half the memory bandwidth. Under ``torch.compile`` it is
  the opaque operator ``flyspec::packed_linear``, so ``--compile`` fuses everything around it.
- **Sibling linears fused.** Linears of one module that a probe forward feeds the same tensor
  (attention's query/key/value, an MLP's gate/up) share one packed weight, their outputs stacked:
  one oneDNN call instead of several (:class:`SharedLinears`). Found by running the model once,
  not from its source, and checked against the unshared computation before it is kept.
- **Decode attention.** A few queries against a long cache run as two batched matmuls per key/value
  head, with the query heads of a group stacked as rows, instead of torch's CPU flash-attention
  kernel, whose cost for one query grows with the cache far faster than the work does. Registered
  with transformers' ``AttentionInterface`` as ``flyspec`` (masks as for ``sdpa``); prefill,
  dropout, soft-capping, attention sinks and anything else unusual go to ``sdpa`` unchanged.
- **An in-place KV cache** (:class:`GrowingLayer`): a buffer that doubles when full, so a step
  writes its keys and values in place instead of copying the whole cache by concatenation, and a
  rollback is a length change. ``cached_model.CachedModel`` uses it for eager steps (compiled
  graphs guard on the cache's shapes, so ``--compile`` keeps transformers' cache).

Only on a CPU, in float32 or bfloat16 (where oneDNN supports it). The math is the same up to
floating-point rounding; plain decoding runs the same kernels, so speedups stay like for like.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from flyspec.config import ConfigError
from flyspec.names import KERNELS

logger = logging.getLogger(__name__)

ATTENTION = "flyspec"
# Queries per step up to which the matmul attention runs (a draft's verification); more go to sdpa.
MAX_DECODE_QUERIES = 64
# Keyword arguments the decode attention may be given (others, unless None or False, send a call to sdpa;
# the mask already carries a sliding window).
_KNOWN_KWARGS = frozenset({"sliding_window", "position_ids", "cache_position", "is_causal", "use_cache"})


def check_kernels(kernels: str) -> str:
    if kernels not in KERNELS:
        raise ConfigError(f"unknown kernels {kernels!r}; choose one of: {', '.join(KERNELS)}")
    return kernels


def applicable(model: PreTrainedModel, kernels: str) -> str | None:
    """Why flyspec's kernels are not used for ``model`` (None: they are)."""
    if check_kernels(kernels) == "stock":
        return "--kernels stock"
    parameter = next(model.parameters())
    if parameter.device.type != "cpu":
        return f"the model is on {parameter.device.type}, not the CPU"
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    if parameter.dtype == torch.float32:
        return None
    if parameter.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return f"oneDNN has no {parameter.dtype} linear on this CPU"


def install(model: PreTrainedModel, kernels: str = "auto") -> bool:
    """Swap ``model``'s linears and attention for flyspec's kernels where they apply (in place).

    Returns whether they were installed; the caller's ``CachedModel`` then uses :class:`GrowingLayer`.
    Call after the model is on its device, in eval mode, with its final weights.
    """
    reason = applicable(model, kernels)
    if reason is not None:
        logger.info("flyspec kernels not used: %s", reason)
        return False
    with torch.inference_mode():
        siblings = _siblings(model)
        fused = _pack_linears(model, siblings)
        if fused and not _sharing_holds(model, fused):
            _unfuse(model, fused)
    if model.config._attn_implementation == "sdpa":  # a model loaded with eager (or flash) attention keeps it
        register_attention()
        model.set_attn_implementation(ATTENTION)
    return True


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
_LIBRARY.define("packed_linear(Tensor rows, int handle, int out_features, Tensor? bias) -> Tensor")
_LIBRARY.impl("packed_linear", _packed_linear, "CPU")
torch.library.register_fake("flyspec::packed_linear", _packed_linear_shape, lib=_LIBRARY)


class PackedLinear(nn.Module):
    """``nn.Linear`` with its weight in oneDNN's blocked layout (reordered once, here).

    The packed weight is an opaque oneDNN tensor, held as a plain attribute: the module cannot be
    moved to another device or trained. Outputs equal ``F.linear``'s up to rounding."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """``weight`` [out, in] and ``bias`` [out] as ``nn.Linear`` holds them."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # batch size hint 4: measured as fast as the others for 1..16 rows (the sizes of a cached step)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 4)
        self.bias = None if bias is None else bias.detach()
        self.handle = next(_HANDLES)
        _PACKED[self.handle] = self.packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
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
    times_called: dict[int, int] = {}
    for _, _, linear, _ in calls:
        times_called[id(linear)] = times_called.get(id(linear), 0) + 1
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


def register_attention() -> None:
    """Register :func:`decode_attention` under ``flyspec``, with ``sdpa``'s masks (idempotent)."""
    AttentionInterface.register(ATTENTION, decode_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def decode_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention for a cached step: ``query`` [1, heads, q, d] against ``key``/``value`` [1, kv_heads, k, d].

    Scores are computed per key/value head with its query heads stacked as rows, so grouped-query
    attention needs no repeated keys; the arithmetic is float32. Returns [1, q, heads, d] like
    transformers' other attention functions. Anything else (prefill, a batch, dropout, extra
    arguments such as soft-capping or sinks) is ``sdpa``'s."""
    batch, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    usable = (
        batch == 1
        and 1 <= queries <= MAX_DECODE_QUERIES
        and keys > queries  # a cached step (no past: sdpa's causal prefill)
        and heads % kv_heads == 0
        and dropout == 0.0
        and (attention_mask.dtype == torch.bool if attention_mask is not None else queries == 1)
        and value.shape[-1] == dim
        and {name for name, given in kwargs.items() if given is not None and given is not False} <= _KNOWN_KWARGS
    )
    if not usable:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    groups = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    # head h reads key/value head h // groups; float32 throughout (measured faster than bfloat16 on a
    # strided cache view, which bfloat16 matmuls copy first)
    stacked = query.reshape(kv_heads, groups * queries, dim).float()
    scores = torch.bmm(stacked, key[0].transpose(1, 2).float()).mul_(scale)  # [kv_heads, groups*q, k]
    if attention_mask is not None:
        allowed = attention_mask[0, 0, :, -keys:]  # [q, k]
        scores = scores.view(kv_heads, groups, queries, keys).masked_fill_(~allowed, float("-inf"))
        scores = scores.view(kv_heads, groups * queries, keys)
    weights = torch.softmax(scores, dim=-1)
    out = torch.bmm(weights, value[0].float()).to(query.dtype)  # [kv_heads, groups*q, d]
    return out.view(heads, queries, dim).transpose(0, 1).unsqueeze(0), None


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values live in a buffer that doubles when full.

    A step writes in place (the stock layer concatenates, copying the whole cache every step) and a
    rollback (``crop``) only shortens the length. ``keys``/``values`` are views of the first
    ``length`` positions."""

    INITIAL_CAPACITY = 256

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length = 0
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        buffers = self._buffers
        if buffers is None or end > buffers[0].shape[-2]:
            buffers = self._buffers = self._grown(key_states, value_states, end)
        buffers[0][..., start:end, :] = key_states
        buffers[1][..., start:end, :] = value_states
        return self._set_length(end)

    def _grown(
        self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """New buffers of at least twice the old capacity (and ``needed``), holding the cached positions."""
        old = self._buffers
        capacity = max(self.INITIAL_CAPACITY, needed, 2 * old[0].shape[-2] if old is not None else 0)
        new = tuple(
            states.new_empty((*states.shape[:-2], capacity, states.shape[-1])) for states in (key_states, value_states)
        )
        if old is not None:
            for buffer, previous in zip(new, old, strict=True):
                buffer[..., : self.length, :] = previous[..., : self.length, :]
        return new[0], new[1]

    def _set_length(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the first ``length`` positions become ``keys`` and ``values`` (and are returned)."""
        assert self._buffers is not None
        self.length = length
        keys, values = self._buffers[0][..., :length, :], self._buffers[1][..., :length, :]
        self.keys, self.values = keys, values
        return keys, values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of positions to remove (got {tokens_to_remove})")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._set_length(max(0, self.length + tokens_to_remove))

    def reset(self) -> None:
        self.length = 0
        self._buffers = None
        super().reset()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("flyspec's in-place cache holds one sequence")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("flyspec's in-place cache holds one sequence")
