"""``python -m flyspec``: the same command line as ``flyspec``."""

from flyspec.cli.main import main

raise SystemExit(main())
