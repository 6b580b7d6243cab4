"""Slim install: the core needs no extra, and a command whose extra is missing says which to install."""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from flyspec.cli.app import main
from flyspec.cli.extras import EXTRA_MODULES, MissingExtraError, require_extra

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "flyspec"
ALL_EXTRA_MODULES = {module for modules in EXTRA_MODULES.values() for module in modules}
# the package directory whose modules may use an extra's libraries
EXTRA_OF_PACKAGE = {"server": "serve", "bench": "bench", "eval": "eval", "calibration": "eval"}


def test_extra_modules_match_pyproject() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, modules in EXTRA_MODULES.items():
        distributions = {requirement.split(">")[0].split("=")[0].strip() for requirement in extras[extra]}
        assert {name.replace("-", "_") for name in distributions} == set(modules), extra
    assert extras["all"] == ["flyspec[serve,bench,eval]"]


def _imported_top_levels(path: Path, *, module_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_extra_libraries_are_imported_only_where_their_extra_is_required(path: Path) -> None:
    relative = path.relative_to(PACKAGE)
    extra = EXTRA_OF_PACKAGE.get(relative.parts[0]) if len(relative.parts) > 1 else None
    allowed = set(EXTRA_MODULES[extra]) if extra else set()
    used = _imported_top_levels(path, module_level_only=False) & ALL_EXTRA_MODULES
    assert used <= allowed, f"{relative} imports {sorted(used - allowed)} outside the extra's commands"
    if relative.name == "command.py":  # imported by `flyspec --help`: extras only inside the handler
        assert not _imported_top_levels(path, module_level_only=True) & ALL_EXTRA_MODULES


@pytest.mark.parametrize("extra", sorted(EXTRA_MODULES))
def test_require_extra_names_the_extra_of_a_missing_module(monkeypatch: pytest.MonkeyPatch, extra: str) -> None:
    require_extra(extra, f"flyspec {extra}")  # the dev install has every extra
    missing = EXTRA_MODULES[extra][-1]
    monkeypatch.setitem(sys.modules, missing, None)  # what `import` sees for a module that is not installed
    with pytest.raises(MissingExtraError) as error:
        require_extra(extra, f"flyspec {extra}")
    assert str(error.value) == (
        f"flyspec {extra} needs the '{extra}' extra: pip install 'flyspec[{extra}]' (missing: {missing})"
    )


@pytest.mark.parametrize(
    ("argv", "extra", "module"),
    [
        (["serve", "--port", "0"], "serve", "fastapi"),
        (["bench", "--quick"], "bench", "rich"),
        (["eval", "--report-only", "--out", "nowhere"], "eval", "sacrebleu"),
    ],
)
def test_a_command_without_its_extra_exits_2_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], extra: str, module: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        f"flyspec: error: flyspec {argv[0]} needs the '{extra}' extra: pip install 'flyspec[{extra}]' "
        f"(missing: {module})\n"
    )


def test_the_core_and_generate_need_no_extra() -> None:
    """With every extra's modules hidden, the public API and the `generate` parser still work."""
    hide = "; ".join(f"sys.modules[{name!r}] = None" for name in sorted(ALL_EXTRA_MODULES))
    code = (
        f"import sys; {hide}\n"
        "import flyspec\n"
        "[getattr(flyspec, name) for name in flyspec.__all__]\n"
        "from flyspec.cli.app import build_parser\n"
        "args = build_parser().parse_args(['generate', 'hi', '--verifier', 'fly'])\n"
        "print(args.verifier)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "fly"
