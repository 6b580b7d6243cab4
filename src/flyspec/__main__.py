"""``python -m flyspec``: the same command line as ``flyspec``."""

from flyspec.cli import main

raise SystemExit(main())
