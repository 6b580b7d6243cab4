"""`flyspec --version`, `--help` and `import flyspec` do not import torch or transformers."""

import subprocess
import sys

import pytest

import flyspec

HEAVY = ("torch", "transformers")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)


def _imported(importtime_stderr: str) -> set[str]:
    """Top-level module names from ``python -X importtime`` output (``import time: self | total | name``)."""
    lines = importtime_stderr.splitlines()
    names = (line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import time"))
    return {name.split(".")[0] for name in names}


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["generate", "--help"], ["serve", "--help"]])
def test_version_and_help_import_neither_torch_nor_transformers(argv: list[str]) -> None:
    done = _run("-X", "importtime", "-m", "flyspec", *argv)
    assert done.returncode == 0
    imported = _imported(done.stderr)
    assert "flyspec" in imported  # the parse worked: the output lists what was imported
    assert not imported & set(HEAVY), f"flyspec {' '.join(argv)} imported {sorted(imported & set(HEAVY))}"


def test_import_flyspec_and_build_parser_stay_light_until_a_public_name_is_used() -> None:
    code = (
        "import sys, flyspec\n"
        "from flyspec.cli.app import build_parser\n"
        "build_parser().parse_args(['generate', 'hi', '--verifier', 'fly', '-k', '4'])\n"
        f"print(flyspec.__version__, [name for name in {HEAVY!r} if name in sys.modules])\n"
        "flyspec.SpeculativeDecoder\n"
        f"print([name for name in {HEAVY!r} if name in sys.modules])\n"
    )
    done = _run("-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"{flyspec.__version__} []", str(list(HEAVY))]


def test_every_public_name_resolves_to_its_module() -> None:
    assert sorted(flyspec._EXPORTS) == sorted(flyspec.__all__)
    for name in flyspec.__all__:
        value = getattr(flyspec, name)
        assert getattr(sys.modules[flyspec._EXPORTS[name]], name) is value
    assert set(flyspec.__all__) <= set(dir(flyspec))


def test_unknown_names_are_attribute_errors_and_submodules_import() -> None:
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        flyspec.no_such_name  # noqa: B018
    assert flyspec.config.names.DEFAULT_MODEL == flyspec.DEFAULT_MODEL
