"""The layout of ``src/flyspec`` (ARCHITECTURE.md): no import circle, and a model runtime that imports nothing above it.

The import graph is read from the source with ``ast``, so it sees every import: at module level, inside
functions (imported late to keep start-up light), and under ``if TYPE_CHECKING:``. An import of
``a.b.c`` from outside the package ``a.b`` also runs ``a/b/__init__.py``, so it depends on that too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src"
RUNTIME = "flyspec.runtime"
# The torch-free declarations every layer shares: ConfigError, the defaults and the option names.
# The runtime raises ConfigError (so the CLI exits with 2 and the server answers 400), loads with the
# default dtype and device, and checks names (dtypes, devices, kernels, packaged models) the CLI lists
# without torch, so they cannot move into the runtime. They import nothing else of flyspec (checked below).
SHARED_DECLARATIONS = frozenset(
    {"flyspec.config", "flyspec.config_mapping", "flyspec.names", "flyspec.rule_config", "flyspec.drafter_config"}
)


def module_files(source: Path = SOURCE) -> dict[str, Path]:
    """Every module under ``source/flyspec`` by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted((source / "flyspec").rglob("*.py")):
        parts = list(path.relative_to(source).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterable[tuple[str, str | None]]:
    """(module, name) for every import in ``tree``: ``import m`` gives (m, None), ``from m import n`` (m, n)."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1 packages
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            yield from ((base, alias.name) for alias in node.names)


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the flyspec modules (and packages) importing it runs."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets: set[str] = set()
        for name, attribute in imported_names(ast.parse(path.read_text()), module, path.name == "__init__.py"):
            if name != "flyspec" and not name.startswith("flyspec."):
                continue
            submodule = f"{name}.{attribute}"  # from package import submodule
            targets.add(submodule if attribute is not None and submodule in modules else name)
        for target in list(targets):  # the packages whose __init__ the import runs, from outside them
            parts = target.split(".")
            for end in range(2, len(parts)):
                parent = ".".join(parts[:end])
                if not (module == parent or module.startswith(parent + ".")):
                    targets.add(parent)
        graph[module] = {target for target in targets if target in modules} - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


GRAPH = import_graph(module_files())


def test_no_import_cycle_among_flyspec_modules() -> None:
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import circle: " + " → ".join(cycle or [])


def test_the_runtime_imports_nothing_above_it() -> None:
    runtime = {module for module in GRAPH if module == RUNTIME or module.startswith(RUNTIME + ".")}
    assert {f"{RUNTIME}.loading", f"{RUNTIME}.cached_model", f"{RUNTIME}.target"} <= runtime
    above = {
        module: sorted(target for target in GRAPH[module] if target not in runtime | SHARED_DECLARATIONS)
        for module in runtime
    }
    assert {module: targets for module, targets in above.items() if targets} == {}
    shared = {module: sorted(GRAPH[module] - SHARED_DECLARATIONS) for module in SHARED_DECLARATIONS}
    assert {module: targets for module, targets in shared.items() if targets} == {}
    # moved, not copied: no module of the runtime is left beside the decoding concepts
    assert not [module for module in runtime if (SOURCE / "flyspec" / f"{module.rpartition('.')[2]}.py").exists()]


def defined_names(path: Path) -> set[str]:
    """The names a module defines or imports, at any depth (``TYPE_CHECKING`` blocks and functions too)."""
    tree = ast.parse(path.read_text())
    names = {
        alias.asname or alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    names |= {
        node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    names |= {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    names |= {
        node.target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    return names


def test_every_flyspec_import_names_something_that_exists() -> None:
    """mypy skips a missing module (``ignore_missing_imports``, for optional peers), so a moved one is caught here:
    every ``import flyspec.x`` names a module, every ``from flyspec.x import y`` a submodule or a name x defines."""
    modules = module_files()
    files = [
        *modules.values(),
        *(ROOT / "tests").rglob("*.py"),
        *(ROOT / "scripts").glob("*.py"),
        *(ROOT / "integrations" / "vllm" / "src").rglob("*.py"),
    ]
    defined = {module: defined_names(path) for module, path in modules.items()}
    missing = set()
    for path in files:
        for name, attribute in imported_names(ast.parse(path.read_text()), "tests", False):
            if name != "flyspec" and not name.startswith("flyspec."):
                continue
            if name not in modules:
                missing.add(f"{path.relative_to(ROOT)}: {name}")
            elif (
                attribute not in (None, "*") and f"{name}.{attribute}" not in modules and attribute not in defined[name]
            ):
                missing.add(f"{path.relative_to(ROOT)}: {name}.{attribute}")
    assert sorted(missing) == []


def test_the_graph_sees_late_and_type_only_imports_and_the_packages_they_run(tmp_path: Path) -> None:
    """The checks above can fail: a circle through a function-level import, a ``TYPE_CHECKING`` import
    and a package's ``__init__`` is found, and a package's modules importing each other make none."""
    files = {
        "flyspec/__init__.py": "",
        "flyspec/a.py": "def late():\n    from flyspec.c import C\n",
        "flyspec/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from flyspec.pkg.d import D\nC = 1\n",
        "flyspec/pkg/__init__.py": "from flyspec.pkg.b import B\n",
        "flyspec/pkg/b.py": "import flyspec.a\nfrom flyspec.pkg import d\nB = 1\n",
        "flyspec/pkg/d.py": "D = 1\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(module_files(tmp_path))
    assert graph["flyspec.a"] == {"flyspec.c"}
    assert graph["flyspec.c"] == {"flyspec.pkg", "flyspec.pkg.d"}  # d's package runs first
    assert graph["flyspec.pkg.b"] == {"flyspec.a", "flyspec.pkg.d"}  # inside its package: not the package
    assert find_cycle(graph) == ["flyspec.a", "flyspec.c", "flyspec.pkg", "flyspec.pkg.b", "flyspec.a"]
    (tmp_path / "flyspec/pkg/b.py").write_text("from flyspec.pkg import d\nB = 1\n")
    assert find_cycle(import_graph(module_files(tmp_path))) is None
