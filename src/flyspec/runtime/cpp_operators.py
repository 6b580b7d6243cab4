"""flyspec's C++ operators (``flyspec_cpp::``), each built from a ``.cpp`` file beside this one on first use.

Inductor's own C++ builder compiles them (with the vector instructions it picked for this CPU, as for
``--compile``'s kernels) into its cache, so a later process only loads them. The libraries register their
operators with the dispatcher when loaded (``TORCH_LIBRARY_FRAGMENT``): graphs compiled with a C++ wrapper call
them without Python.
"""

from __future__ import annotations

from pathlib import Path


def build(filename: str) -> None:
    """Build (or load from inductor's cache) ``runtime/<filename>`` and load it into this process."""
    from torch._inductor.codecache import CppCodeCache

    class _Builder(CppCodeCache):  # a cache of its own: the library is loaded with ctypes, not as a wrapper
        cache: dict = {}
        cpp_compile_command_flags = {"include_pytorch": True, "shared": True}

    _Builder.load(Path(__file__).with_name(filename).read_text())
