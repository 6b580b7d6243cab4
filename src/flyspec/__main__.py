"""``python -m flyspec``: the same command line as ``flyspec``."""

from flyspec.cli.app import run

run()
