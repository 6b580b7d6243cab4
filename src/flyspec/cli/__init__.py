"""The command line (``flyspec``, ``python -m flyspec``): a thin layer over the library API.

- ``app.py``          the parser, ``flyspec generate`` and the dispatch to each command's module
- ``options.py``      the model options every command shares (``--model``, ``--dtype``, ``--device``, ...)
- ``speculation.py``  the speculation and drafting flags and the SpeculationConfig they give
- ``extras.py``       which pip extra each command needs, checked before it imports anything heavy
"""

from flyspec.cli.app import build_parser, main, run

__all__ = ["build_parser", "main", "run"]
