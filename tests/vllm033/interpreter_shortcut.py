"""A shortcut in Triton's interpreter for these tests (installed by ``conftest.py``; ``test_interpreter.py`` checks it).

Triton's interpreter patches ``triton.language`` again at every call of a device function inside a kernel
(``inspect.getmembers`` over the module: ~0.7 ms a call). One test here made 64,000 such calls: 40 % of its time.
Within one launch a module already patched stays patched (the interpreter never restores a device function's patch),
so with :func:`patch_lang_once_per_launch` only a call that sees a language module not yet patched in this launch
patches. The kernels, and what the interpreter does with them, are unchanged.
"""

from __future__ import annotations

import inspect
from typing import Any

import triton.language as tl
from triton.runtime import interpreter

# the interpreter's own functions; the shortcut calls them through this dict (test_interpreter.py counts the calls)
STOCK: dict[str, Any] = {"patch": interpreter._patch_lang, "launch": interpreter.GridExecutor.__call__}
_LAUNCHES: list[set[int]] = []  # per running launch: the language modules (ids) patched in it
_LANGS: dict[Any, frozenset[int]] = {}  # per function: the language modules it sees (as the interpreter finds them)


def _langs(fn: Any) -> frozenset[int]:
    if fn not in _LANGS:
        _LANGS[fn] = frozenset(
            id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core)
        )
    return _LANGS[fn]


def _patch_lang(fn: Any) -> Any:
    langs = _langs(fn)
    if _LAUNCHES and langs and langs <= _LAUNCHES[-1]:
        return interpreter._LangPatchScope()  # patched in this launch already: nothing to do or restore
    if _LAUNCHES:
        _LAUNCHES[-1].update(langs)
    return STOCK["patch"](fn)


def _launch(self: Any, *args: Any, **kwargs: Any) -> Any:
    _LAUNCHES.append(set())
    try:
        return STOCK["launch"](self, *args, **kwargs)
    finally:
        _LAUNCHES.pop()


def patch_lang_once_per_launch() -> None:
    interpreter._patch_lang, interpreter.GridExecutor.__call__ = _patch_lang, _launch
