"""``python -m flyspec`` is the ``flyspec`` command."""

import subprocess
import sys

import flyspec


def test_python_dash_m_prints_the_version() -> None:
    done = subprocess.run([sys.executable, "-m", "flyspec", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert done.stdout.strip() == f"flyspec {flyspec.__version__}"


def test_python_dash_m_bad_option_is_one_line_and_exit_code_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "flyspec", "generate", "hi", "--verifier", "nonsense"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "nonsense" in done.stderr
