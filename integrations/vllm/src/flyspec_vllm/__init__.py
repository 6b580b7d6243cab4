"""flyspec inside vLLM: flyspec's drafters as vLLM proposers, FLy with flyspec's trust guards.

Registered through the ``vllm.general_plugins`` entry point (:func:`register`), which vLLM calls
in every process it starts. See DEPLOYMENT.md at the repository root.
"""

from __future__ import annotations

from flyspec_vllm.proposer import NgramProposer

__all__ = ["NgramProposer", "register"]


def register() -> None:
    """vLLM's plugin hook: check each model runner's internals and wrap those that pass (one warning per runner
    that does not); at engine start the plugin says what it does on the runner vLLM chose, or refuses to start."""
    import logging

    from flyspec_vllm.patch import install  # keeps `import flyspec_vllm` light

    ours, vllms = logging.getLogger("flyspec_vllm"), logging.getLogger("vllm")
    if not ours.handlers and vllms.handlers:  # speak through vLLM's configured log handlers
        for handler in vllms.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False
    install()
