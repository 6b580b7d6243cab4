"""flyspec's CPU kernels for the prefill and cached steps of any transformers causal LM (``--kernels auto``).

Four replacements and an allocator setting, each for a measured CPU cost (BENCHMARKS.md, "CPU kernels"),
each falling back to the stock path where it does not apply:

- **Prepacked linears** (``packed_linears.py``). Every ``nn.Linear`` gets its weight reordered once,
  at load, into oneDNN's blocked layout; the stock ``F.linear`` reads the plain layout at every call
  and reaches about half the memory bandwidth. Sibling linears fed the same tensor (query/key/value,
  gate/up) share one packed weight: one call instead of several. Under ``torch.compile`` they are the
  opaque operator ``flyspec::packed_linear``, so ``--compile`` fuses everything around them.
- **Cached-step attention** (``causal_attention.cpp``, the C++ operator ``flyspec_cpp::cached_attention``): a
  step's few queries (one, or a draft's verification) against the cache, read once in its own dtype in blocks of
  64 keys, float32 arithmetic, the query heads of a group stacked as rows, split over (key/value head, 128 keys,
  12 rows) across the threads and combined (flash decoding). Each query row comes out bit for bit as a one-query
  step would compute it, however many queries share the call. Torch's CPU flash-attention kernel costs far more
  than the work for one query against a long cache; two batched matmuls (the form kept where the operator does not
  apply) read a bfloat16 cache through float32 copies and leave a thread idle. Registered with transformers'
  ``AttentionInterface`` as ``flyspec`` (masks as for ``sdpa``); dropout, soft-capping, attention sinks and anything
  else unusual go to ``sdpa`` unchanged.
- **Prefill attention** (the same file, ``flyspec_cpp::causal_attention``): a
  prompt's causal self-attention from an empty cache in one pass over the keys in blocks (flash attention,
  float32 arithmetic, grouped-query heads stacked as rows, no block above the diagonal computed), ~2x as fast
  as torch's CPU kernel and inductor's lowering of sdpa on a 769-token SmolLM2 prompt. Where the mask is
  anything but plain causal (a sliding window that bites, padding, a bidirectional part) it goes to ``sdpa``.
- **An in-place KV cache** (:class:`GrowingLayer`): a buffer that doubles when full, so a step
  writes its keys and values in place instead of copying the whole cache by concatenation, and a
  rollback is a length change. ``cached_model.CachedModel`` uses it on every device, with or without
  the others (so the CPU-only note below is not about it), for eager and compiled steps:
  it reserves room before each step, outside the graph, so a compiled step writes into buffers
  whose strides do not change and never compiles a new graph.

- **Activation memory kept** (``allocator.py``): glibc's malloc is told once to keep freed blocks of up to
  32 MiB in the process instead of unmapping them, so a prefill's megabyte activations do not fault their pages
  in afresh at every forward.

Only on a CPU, in float32 or bfloat16 (where oneDNN supports it). The math is the same up to
floating-point rounding; plain decoding runs the same kernels, so speedups stay like for like.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from flyspec.config import ConfigError
from flyspec.config.names import KERNELS
from flyspec.runtime import cpp_operators
from flyspec.runtime.allocator import keep_freed_memory
from flyspec.runtime.packed_linears import pack_linears

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
        pack_linears(model)
    keep_freed_memory()
    attention_operators()
    if model.config._attn_implementation == "sdpa":  # a model loaded with eager (or flash) attention keeps it
        register_attention()
        model.set_attn_implementation(ATTENTION)
    return True


def register_attention() -> None:
    """Register :func:`decode_attention` under ``flyspec``, with ``sdpa``'s masks (idempotent)."""
    AttentionInterface.register(ATTENTION, decode_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


# Whether flyspec_cpp::causal_attention and cached_attention are built and loaded in this process
# (attention_operators).
_ATTENTION_OPERATORS: list[bool] = []


def attention_operators() -> bool:
    """Build and load ``flyspec_cpp::causal_attention`` and ``cached_attention`` once per process; False, with a
    warning, where they cannot be built (no C++ compiler): prefills then run ``sdpa``, cached steps the matmul form."""
    if not _ATTENTION_OPERATORS:
        try:
            cpp_operators.build("causal_attention.cpp")
            torch.library.register_fake("flyspec_cpp::causal_attention", _causal_attention_shape)
            torch.library.register_fake("flyspec_cpp::cached_attention", _cached_attention_shape)
            _ATTENTION_OPERATORS.append(True)
        except Exception as error:  # noqa: BLE001 - any failure to build leaves sdpa and the matmuls in place
            logger.warning("flyspec kernels: the attention operators were not built (%s); sdpa runs", error)
            _ATTENTION_OPERATORS.append(False)
    return _ATTENTION_OPERATORS[0]


def _causal_attention_shape(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    return query.new_empty((query.shape[0], query.shape[2], query.shape[1], query.shape[3]))


def _cached_attention_shape(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    return _causal_attention_shape(query, key, value, scale)


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
    transformers' other attention functions. A prefill from an empty cache with a plain causal mask goes to
    ``flyspec_cpp::causal_attention``; anything else (a batch, dropout, extra arguments such as soft-capping or
    sinks, more than ``MAX_DECODE_QUERIES`` queries after a cache) is ``sdpa``'s."""
    batch, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    if keys == queries and _is_causal_prefill(module, query, key, value, attention_mask, dropout, kwargs):
        scale = dim**-0.5 if scaling is None else scaling
        return torch.ops.flyspec_cpp.causal_attention(query, key, value, scale), None
    usable = (
        batch == 1
        # a cached step (no past: sdpa's causal prefill); asked first, so that a compiled prefill's graph holds for
        # every prompt length (asked after the query count, it would split that graph at MAX_DECODE_QUERIES)
        and keys > queries
        and 1 <= queries <= MAX_DECODE_QUERIES
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
    if _cached_operator_applies(query, key, value):
        mask = None if attention_mask is None else attention_mask[0, 0, :, -keys:]
        return torch.ops.flyspec_cpp.cached_attention(query, key, value, mask, scale), None
    # where the operator does not take it (not built, float16, another head size, strided rows): head h reads
    # key/value head h // groups; float32 throughout (measured faster than bfloat16 on a strided cache view, which
    # bfloat16 matmuls copy first)
    stacked = query.reshape(kv_heads, groups * queries, dim).float()
    scores = torch.bmm(stacked, key[0].transpose(1, 2).float()).mul_(scale)  # [kv_heads, groups*q, k]
    if attention_mask is not None:
        allowed = attention_mask[0, 0, :, -keys:]  # [q, k]
        scores = scores.view(kv_heads, groups, queries, keys).masked_fill_(~allowed, float("-inf"))
        scores = scores.view(kv_heads, groups * queries, keys)
    weights = torch.softmax(scores, dim=-1)
    out = torch.bmm(weights, value[0].float()).to(query.dtype)  # [kv_heads, groups*q, d]
    return out.view(heads, queries, dim).transpose(0, 1).unsqueeze(0), None


def _cached_operator_applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``flyspec_cpp::cached_attention`` takes a cached step's call (already one :func:`decode_attention`
    handles): built, on the CPU, float32 or bfloat16 throughout, head size a multiple of 16, rows contiguous."""
    return _operators_take(query, key, value) and key.stride(-1) == 1 and value.stride(-1) == 1


def _operators_take(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """What both C++ operators ask: built, on the CPU, float32 or bfloat16 throughout, head size a multiple of 16
    (AVX-512's float32 lanes)."""
    return (
        bool(_ATTENTION_OPERATORS and _ATTENTION_OPERATORS[0])
        and query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.bfloat16)
        and key.dtype == value.dtype == query.dtype
        and query.shape[-1] % 16 == 0
    )


def _is_causal_prefill(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> bool:
    """Whether a call is one that ``sdpa`` runs as ``is_causal=True`` without a mask and
    ``flyspec_cpp::causal_attention`` computes the same: one sequence, as many keys as queries (an empty cache), no
    mask (transformers' ``sdpa_mask`` leaves it out for a plain causal prefill, compiled or not, and builds one for
    padding or a window that bites), a causal module, and what both operators ask (:func:`_operators_take`)."""
    batch, heads, queries, _ = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    is_causal = kwargs.get("is_causal")
    return (
        _operators_take(query, key, value)
        and attention_mask is None
        and batch == 1
        and queries > 1
        and keys == queries
        and dropout == 0.0
        and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
        and heads % kv_heads == 0
        and tuple(value.shape) == tuple(key.shape)
        and {name for name, given in kwargs.items() if given is not None and given is not False} <= _KNOWN_KWARGS
    )


def _buffer_view(index: int, name: str) -> Any:
    """A property: the first ``length`` positions of buffer ``index`` (None before the first write); read-only."""

    def view(layer: GrowingLayer) -> torch.Tensor | None:
        return None if layer._buffers is None else layer._buffers[index][..., : layer.length, :]

    def refuse(layer: GrowingLayer, value: torch.Tensor | None) -> None:
        if value is not None:  # transformers' base class sets them to None
            raise AttributeError(f"GrowingLayer's {name} are a view of its buffer; use update or crop")

    return property(view, refuse)


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values live in a buffer that doubles when full.

    A step writes in place (the stock layer concatenates, copying the whole cache every step) and a
    rollback (``crop``) only shortens the length. ``keys``/``values`` are views of the first
    ``length`` positions, made when read.

    Under ``torch.compile`` the buffers are graph inputs: :meth:`reserve`, called before each step
    outside the graph, makes room for it, so a compiled step never grows them, and the buffers keep
    their strides from one step to the next (a graph guards on strides). A buffer always holds more
    positions than are cached: a view is then never the whole buffer, so its contiguity never
    changes either."""

    INITIAL_CAPACITY = 256  # positions a new buffer holds beyond its first write

    def __init__(self, **kwargs: Any) -> None:
        self.length = 0
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        super().__init__(**kwargs)

    # transformers' layers assign ``keys``/``values``; here they are views of the buffers
    keys = _buffer_view(0, "keys")
    values = _buffer_view(1, "values")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.length = 0
        # room for the first write and INITIAL_CAPACITY more, by a sum, not a max: a compiled prefill makes its
        # buffers inside its graph, and comparing the prompt's length with a constant there would become a guard (a
        # new graph for the prompts on the other side of it)
        capacity = key_states.shape[-2] + self.INITIAL_CAPACITY
        self._buffers = tuple(  # type: ignore[assignment]
            states.new_empty((*states.shape[:-2], capacity, states.shape[-1])) for states in (key_states, value_states)
        )
        self.is_initialized = True

    def reserve(self, positions: int) -> None:
        """Make room for ``positions`` more (and one spare, see the class doc); before a step, outside any graph."""
        buffers = self._buffers
        if buffers is not None and self.length + positions >= buffers[0].shape[-2]:
            self._buffers = self._grown(buffers[0], buffers[1], self.length + positions)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        buffers = self._buffers
        assert buffers is not None
        if end >= buffers[0].shape[-2]:  # an eager step without reserve; a compiled one never gets here
            buffers = self._buffers = self._grown(buffers[0], buffers[1], end)
        buffers[0][..., start:end, :] = key_states
        buffers[1][..., start:end, :] = value_states
        self.length = end
        return buffers[0][..., :end, :], buffers[1][..., :end, :]

    def _grown(self, keys: torch.Tensor, values: torch.Tensor, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers for more than ``needed`` positions (at least twice the old capacity), holding the cached ones."""
        old = self._buffers
        capacity = max(self.INITIAL_CAPACITY, needed + 1, 2 * old[0].shape[-2] if old is not None else 0)
        new = tuple(states.new_empty((*states.shape[:-2], capacity, states.shape[-1])) for states in (keys, values))
        if old is not None:
            for buffer, previous in zip(new, old, strict=True):
                buffer[..., : self.length, :] = previous[..., : self.length, :]
        return new[0], new[1]

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of positions to remove (got {tokens_to_remove})")
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        self.length = 0
        self._buffers = None
        self.is_initialized = False

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("flyspec's in-place cache holds one sequence")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("flyspec's in-place cache holds one sequence")
