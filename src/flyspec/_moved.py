"""The modules that moved into rooms (issue 54), still importable by their old names.

``import flyspec.stats`` or ``from flyspec.profile import Profile`` written before the move gives the module at its
new place, the same object (no second copy, so ``isinstance`` and monkeypatching keep working), and
``python -m flyspec.lmeval`` still runs. New code imports the new paths (:data:`MOVED`); the package face of each
room (``flyspec.config``, ``flyspec.decoding``, ...) re-exports its public names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import CodeType, ModuleType

# old name → the module's place now
MOVED = {
    "flyspec.acceptance": "flyspec.sampling.acceptance",
    "flyspec.baseline": "flyspec.decoding.plain",
    "flyspec.batch_schedule": "flyspec.config.schedule",
    "flyspec.breaker": "flyspec.decoding.breaker",
    "flyspec.cli_options": "flyspec.cli.options",
    "flyspec.cli_speculation": "flyspec.cli.speculation",
    "flyspec.config_mapping": "flyspec.config.mapping",
    "flyspec.detokenize": "flyspec.runtime.detokenize",
    "flyspec.draft_length": "flyspec.decoding.draft_length",
    "flyspec.drafter_config": "flyspec.config.drafters",
    "flyspec.extras": "flyspec.cli.extras",
    "flyspec.generation": "flyspec.decoding.generation",
    "flyspec.hf_generate": "flyspec.integrations.hf_generate",
    "flyspec.lmeval": "flyspec.integrations.lmeval",
    "flyspec.names": "flyspec.config.names",
    "flyspec.profile": "flyspec.profiles",
    "flyspec.profile_limits": "flyspec.profiles.limits",
    "flyspec.result": "flyspec.decoding.result",
    "flyspec.rule_config": "flyspec.config.rules",
    "flyspec.stats": "flyspec.decoding.stats",
    "flyspec.stopping": "flyspec.decoding.stopping",
    "flyspec.streaming": "flyspec.decoding.streaming",
}


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name of :data:`MOVED` and loads it as the module at its new place."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, origin=MOVED[fullname])

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__  # the import system stamps the old name's spec on it next
        return module

    def exec_module(self, module: ModuleType) -> None:
        alias = module.__spec__
        if alias is not None and alias.loader_state is not None:
            module.__spec__ = alias.loader_state  # give the module back its own spec

    def get_code(self, fullname: str) -> CodeType | None:
        """``python -m <old name>`` (runpy asks the loader for the module's code)."""
        spec = importlib.util.find_spec(MOVED[fullname])
        loader = spec.loader if spec is not None else None
        return loader.get_code(MOVED[fullname]) if isinstance(loader, importlib.abc.InspectLoader) else None


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``flyspec/__init__.py`` calls this)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
