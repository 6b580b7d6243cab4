"""What ``flyspec bench`` and ``flyspec eval`` share: method names, data files, run metadata.

* :mod:`flyspec.harness.methods`: one grammar of method names (``drafter+verifier[+modifier]``,
  ``plain``, peers) for both harnesses;
* :mod:`flyspec.harness.data`: vendored dataset paths, JSONL reading with ``file:line`` errors,
  incremental JSONL records;
* :mod:`flyspec.harness.meta`: what every run records about itself (command, date, machine,
  versions, model and dtype);
* :mod:`flyspec.harness.edits`: the edit workload, requests to edit a function with the prediction a client
  would send (generated from the vendored HumanEval; ``python -m flyspec.harness.edits`` rebuilds the file).
"""
