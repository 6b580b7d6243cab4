"""Count host–device synchronisations on the CPU, where they cost nothing and so are never noticed.

On a GPU every read of a device value from the host — ``.item()``, ``bool(tensor)``, ``int(tensor)``,
``.tolist()``, ``.cpu()``, ``.numpy()``, ``.to("cpu")`` — and every op whose output size depends on the
data (``nonzero``, a boolean-mask index, ``masked_select``, ``unique``, ``repeat_interleave`` without a
size) makes the host wait for the device's queue to drain: the next kernels cannot be launched ahead.
This project never gets a GPU (issue 39), so :class:`SyncCounter` counts those calls while code runs on
the CPU, and the tests hold the decode loop and the vLLM plugin's rule to written budgets
(``tests/test_syncs.py``; the measured counts: DEPLOYMENT.md, "What was checked for GPUs").

How: a ``TorchDispatchMode`` sees the ops (``.item()``/``bool``/``int``/``float`` all reach
``aten._local_scalar_dense``), and ``Tensor.tolist``/``cpu``/``numpy``/``to`` are wrapped while counting
(they dispatch nothing on the CPU). ``.to(device)`` counts only when ``device`` is the *string* ``"cpu"``
(or ``torch.device("cpu")`` built at the call): moving to a model's device is written with that model's
``torch.device`` in flyspec, which on this machine is the CPU too and must not count. Each sync is
attributed to the innermost frame of flyspec's own code (``flyspec/…`` or ``flyspec_vllm/…``) and to
the library it happened in, if not flyspec (``transformers``: the model's own).
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# data-dependent ops: on a GPU the host waits for the result's size (or value)
SYNCING_OPS: dict[Any, str] = {
    aten._local_scalar_dense.default: "scalar read (.item/bool/int/float)",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.repeat_interleave.Tensor: "repeat_interleave",
}
WRAPPED_METHODS = ("tolist", "cpu", "numpy", "to")
OWN_CODE = ("/flyspec/", "/flyspec_vllm/")
THIS_FILE = __file__


@dataclass(frozen=True)
class Sync:
    kind: str  # what synchronised: "tolist", "cpu", "nonzero", "scalar read (...)", ...
    site: str  # flyspec's innermost frame: "flyspec/verifiers/exact.py:41 verify"
    library: str  # where it ran, if not in flyspec's own code ("transformers", "torch"); "" otherwise


@dataclass
class SyncCounter(TorchDispatchMode):
    """``with SyncCounter() as syncs: ...`` then ``syncs.events`` (in order), ``syncs.total``, ``syncs.by_kind()``."""

    events: list[Sync] = field(default_factory=list)
    marks: list[int] = field(default_factory=list)  # indices into events where a step began (:meth:`mark`)
    _originals: dict[str, Callable[..., Any]] = field(default_factory=dict)
    _inherited: set[str] = field(default_factory=set)  # methods torch.Tensor inherits (from TensorBase): deleted after
    _depth: int = 0  # inside a wrapped method: what it dispatches is the same sync

    def __post_init__(self) -> None:
        super().__init__()

    # -- counting -----------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = SYNCING_OPS.get(func)
        if kind is None and func is aten.index.Tensor and _has_mask_index(args):
            kind = "boolean-mask index"
        if kind is not None and not self._depth:
            self._add(kind)
        return func(*args, **kwargs)

    def _add(self, kind: str) -> None:
        site, library = _site()
        self.events.append(Sync(kind, site, library))

    def mark(self) -> None:
        """A step begins here (the decode loop's verify call, say): :meth:`per_step` splits at the marks."""
        self.marks.append(len(self.events))

    # -- reading ------------------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return len(self.events)

    def by_kind(self, events: list[Sync] | None = None) -> collections.Counter[str]:
        return collections.Counter(event.kind for event in (self.events if events is None else events))

    def by_site(self, events: list[Sync] | None = None) -> collections.Counter[str]:
        return collections.Counter(
            event.site + (f" (in {event.library})" if event.library else "")
            for event in (self.events if events is None else events)
        )

    def per_step(self) -> list[list[Sync]]:
        """The syncs of each whole step: from one mark to the next (before the first mark and after the last
        are the prefill and the ending, not steps)."""
        return [self.events[start:end] for start, end in zip(self.marks, self.marks[1:], strict=False)]

    # -- the wrapped methods ------------------------------------------------------------------------
    def __enter__(self) -> SyncCounter:
        for name in WRAPPED_METHODS:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original
            if name not in vars(torch.Tensor):
                self._inherited.add(name)
            setattr(torch.Tensor, name, self._wrap(name, original))
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for name, original in self._originals.items():
            if name in self._inherited:
                delattr(torch.Tensor, name)  # torch.Tensor as it was: inheriting it again
            else:
                setattr(torch.Tensor, name, original)
        self._originals.clear()
        self._inherited.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        def wrapped(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if name != "to" or _to_host(args, kwargs):
                if not counter._depth:
                    counter._add(name if name != "to" else 'to("cpu")')
                counter._depth += 1
                try:
                    return original(tensor, *args, **kwargs)
                finally:
                    counter._depth -= 1
            return original(tensor, *args, **kwargs)

        return wrapped


def _has_mask_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in indices or ())


def _to_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``.to("cpu")``, ``.to("cpu", dtype)``, ``.to(device="cpu")``: a host copy written as such."""
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, str) and target.split(":")[0] == "cpu"


def _site() -> tuple[str, str]:
    """flyspec's innermost frame on the stack, and the library the sync happened in (if not flyspec)."""
    frame = sys._getframe(2)
    library = ""
    first = True
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename != THIS_FILE:
            if any(part in filename for part in OWN_CODE):
                short = filename[filename.rfind("flyspec") :]
                return f"{short}:{frame.f_lineno} {frame.f_code.co_name}", library
            if first:
                library = _library(filename)
                first = False
        frame = frame.f_back  # type: ignore[assignment]
    return "(outside flyspec)", library


def _library(filename: str) -> str:
    for name in ("transformers", "torch", "numpy"):
        if f"/{name}/" in filename:
            return name
    return "other"


@contextmanager
def counting_steps(decoder: Any) -> Iterator[SyncCounter]:
    """Count a speculative decoder's syncs, marking a step at each verify call (``decoding/speculative.py``'s loop)."""
    verifier = decoder.verifier
    verify = verifier.verify
    counter = SyncCounter()

    def marked(*args: Any, **kwargs: Any) -> Any:
        counter.mark()
        return verify(*args, **kwargs)

    object.__setattr__(verifier, "verify", marked)
    try:
        with counter:
            yield counter
    finally:
        object.__setattr__(verifier, "verify", verify)
