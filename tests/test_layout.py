"""The layout of ``src/flyspec`` (ARCHITECTURE.md): rooms by layer, each importing only the rooms below it, no
import circle, and a top floor that holds the public face only.

The import graph is read from the source with ``ast``, so it sees every import: at module level, inside
functions (imported late to keep start-up light), and under ``if TYPE_CHECKING:``. An import of
``a.b.c`` from outside the package ``a.b`` also runs ``a/b/__init__.py``, so it depends on that too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

from flyspec._moved import MOVED

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src"
# The floors, bottom first: a room may import its own floor's rooms only where a row says so, and every room of the
# floors below. ``config`` is the torch-free declarations every layer shares (ConfigError, the defaults, the option
# names): the runtime raises ConfigError, loads with the default dtype and device, and checks names the CLI lists
# without torch. ``api`` and ``resources`` are the library's face; the front ends (the CLI, the server, the
# harnesses, the integrations with other libraries) stand on top, and no library room imports them.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("config",),  # torch-free: imports nothing else of flyspec
    ("runtime", "types"),  # the model runtime, knowing nothing of speculation; what passes between stages
    ("sampling", "profiles"),  # the math drafters and verifiers share; calibration profiles
    ("drafters", "verifiers"),  # propose tokens / decide which to keep: never each other
    ("decoding", "resources"),  # the loops and one generation's parts; models, caches, costs a front end owns
    ("api",),
    ("harness",),  # what bench, eval and calibration share
    ("cli",),
    ("integrations", "server", "bench", "eval", "calibration"),  # front ends
    ("__main__", "__init__"),  # the package's face (its public names, imported on first use) and `python -m flyspec`
)
SAME_FLOOR = {"bench": {"eval"}, "eval": {"bench"}, "calibration": {"bench", "eval"}}  # front ends may share code
TOP_FLOOR_LIMIT = 10  # modules directly in src/flyspec: the public face, and what a reader should meet first
RUNTIME = "flyspec.runtime"


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


def room(module: str) -> str:
    """The room a module stands in: its folder under ``flyspec/``, or its own name on the top floor."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def floor_of(room_name: str) -> int:
    for index, rooms in enumerate(FLOORS):
        if room_name in rooms:
            return index
    raise AssertionError(f"the room {room_name!r} stands on no floor: add it to FLOORS (tests/test_layout.py)")


def test_each_room_imports_only_the_rooms_below_it() -> None:
    wrong = set()
    for module, targets in GRAPH.items():
        here = room(module)
        for target in targets:
            there = room(target)
            if there == here or there == "_moved":
                continue
            if floor_of(there) > floor_of(here) or (
                floor_of(there) == floor_of(here) and there not in SAME_FLOOR.get(here, set())
            ):
                wrong.add(f"{module} → {target}")
    assert sorted(wrong) == []


def test_the_top_floor_holds_the_public_face_only() -> None:
    top = sorted(path.name for path in (SOURCE / "flyspec").glob("*.py"))
    assert len(top) <= TOP_FLOOR_LIMIT, top
    assert {"__init__.py", "api.py", "types.py"} <= set(top)


def test_the_runtime_and_the_declarations_import_nothing_above_them() -> None:
    """The two bottom rooms checked by name too (the table above could be edited to let them climb)."""
    assert floor_of("config") == 0 and floor_of("runtime") == 1
    runtime = {module for module in GRAPH if module == RUNTIME or module.startswith(RUNTIME + ".")}
    assert {f"{RUNTIME}.loading", f"{RUNTIME}.cached_model", f"{RUNTIME}.target"} <= runtime
    above = {module: sorted(t for t in GRAPH[module] if room(t) not in {"runtime", "config"}) for module in runtime}
    assert {module: targets for module, targets in above.items() if targets} == {}
    config = {module for module in GRAPH if room(module) == "config"}
    assert {module: sorted(GRAPH[module] - config) for module in config if GRAPH[module] - config} == {}


def test_a_room_that_climbs_is_caught(tmp_path: Path) -> None:
    """The floor check can fail: a verifier importing a drafter, and the runtime importing decoding, are named."""
    files = {
        "flyspec/__init__.py": "",
        "flyspec/runtime/__init__.py": "",
        "flyspec/runtime/target.py": "from flyspec.decoding.stats import S\n",
        "flyspec/decoding/__init__.py": "",
        "flyspec/decoding/stats.py": "S = 1\n",
        "flyspec/verifiers/__init__.py": "",
        "flyspec/verifiers/fly.py": "from flyspec.drafters.ngram import N\n",
        "flyspec/drafters/__init__.py": "",
        "flyspec/drafters/ngram.py": "N = 1\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(module_files(tmp_path))
    climbs = sorted(
        f"{module} → {target}"
        for module, targets in graph.items()
        for target in targets
        if room(target) != room(module)
        and (floor_of(room(target)) > floor_of(room(module)) or floor_of(room(target)) == floor_of(room(module)))
    )
    assert climbs == [
        "flyspec.runtime.target → flyspec.decoding",
        "flyspec.runtime.target → flyspec.decoding.stats",
        "flyspec.verifiers.fly → flyspec.drafters",
        "flyspec.verifiers.fly → flyspec.drafters.ngram",
    ]


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
        for imported, attribute in imported_names(ast.parse(path.read_text()), "tests", False):
            if imported != "flyspec" and not imported.startswith("flyspec."):
                continue
            name = MOVED.get(imported, imported)  # an old name imports the moved module (_moved.py)
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


def test_the_old_module_names_still_import_the_moved_modules() -> None:
    """Code written before the rooms (``import flyspec.stats``, ``from flyspec.profile import Profile``) gets the
    module at its new place: the same object, with its own spec; and the old names are gone from the top floor."""
    import importlib
    import sys

    for old, new in MOVED.items():
        module = importlib.import_module(old)
        assert module is importlib.import_module(new) is sys.modules[old]
        assert module.__spec__ is not None and module.__spec__.name == new
        assert not (SOURCE / (old.replace(".", "/") + ".py")).exists()
        assert new in module_files()
    from flyspec.profile import Profile

    from flyspec.profiles import Profile as Moved

    assert Profile is Moved


def test_python_m_runs_a_moved_module_by_its_old_name() -> None:
    """``python -m flyspec.lmeval`` (documented before the move) still runs lm-eval's command line."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "flyspec.lmeval", "--help"], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "lm-eval" in result.stdout


def test_no_package_face_hides_a_module_of_its_room() -> None:
    """A face that re-exports a name its room also has as a module (``flyspec.cli.app``: the module, or the
    function?) makes ``import flyspec.cli.app as m`` give the function: every module stays reachable by its path."""
    import importlib

    for module in module_files():
        if module.count(".") < 2:
            continue
        package, _, name = module.rpartition(".")
        assert getattr(importlib.import_module(package), name, None) in (None, importlib.import_module(module)), module
