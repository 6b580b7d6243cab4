"""Method specs: a verifier name, optionally with the protected-token guard.

``VERIFIER[+GUARD]`` where ``VERIFIER`` is one of ``flyspec.verifiers.VERIFIERS`` and ``GUARD``:

``+guard``
    digits on every task, digits and identifiers on code tasks (HumanEval);
``+digits`` / ``+identifiers``
    that token class on every task.

Examples: ``exact``, ``fly``, ``fly+guard``, ``margin+digits``. Plain decoding (``plain``) is
always run: it is the baseline every method is compared with.
"""

from __future__ import annotations

from dataclasses import dataclass

from flyspec.config import PROTECT_CLASSES, ConfigError
from flyspec.verifiers.registry import LOSSLESS_VERIFIERS, VERIFIERS

BASELINE = "plain"
DEFAULT_METHODS = ("exact", "fly", "fly+guard", "margin")
GUARDS = ("guard", *PROTECT_CLASSES)


@dataclass(frozen=True)
class Method:
    name: str
    verifier: str
    guard: str | None = None  # one of GUARDS

    @property
    def lossless(self) -> bool:
        return self.verifier in LOSSLESS_VERIFIERS

    def protect(self, task_kind: str) -> tuple[str, ...]:
        """The token classes the guard protects on a task of this kind."""
        if self.guard is None:
            return ()
        if self.guard == "guard":
            return ("digits", "identifiers") if task_kind == "code" else ("digits",)
        return (self.guard,)


def parse_method(spec: str) -> Method:
    verifier, _, guard = spec.strip().partition("+")
    if verifier not in VERIFIERS:
        raise ConfigError(
            f"unknown method {spec!r}: the verifier must be one of {', '.join(VERIFIERS)}, "
            f"optionally with +{'/+'.join(GUARDS)} (e.g. fly+guard)"
        )
    if guard and guard not in GUARDS:
        raise ConfigError(f"unknown guard {guard!r} in method {spec!r}; choose +{', +'.join(GUARDS)}")
    if guard and verifier in LOSSLESS_VERIFIERS:
        raise ConfigError(f"method {spec!r}: {verifier} is lossless and never loosely accepts, so a guard does nothing")
    return Method(spec.strip(), verifier, guard or None)


def parse_methods(specs: str) -> list[Method]:
    """Comma-separated method specs, duplicates dropped, order kept."""
    names = [spec.strip() for spec in specs.split(",") if spec.strip()]
    if not names:
        raise ConfigError("no methods given; e.g. --methods exact,fly,fly+guard,margin")
    if BASELINE in names:
        raise ConfigError("'plain' is the baseline and always runs; list only the methods to compare with it")
    return [parse_method(name) for name in dict.fromkeys(names)]
