"""The benchmark loop: the methods to run, warm up, then every method on every prompt, interleaved or in blocks.

Interleaving (prompt by prompt, with the method order rotated each time and reversed every other time, the
default) makes machine drift and thermal effects hit every method alike, instead of favouring whichever ran first or
after whom. Blocks (``--order blocks``) run each method on the first half of the prompts back to back, method after
method, then on the second half in the reverse method order: each engine meets its prompts as a server's steady
state would, not right after another process ran (on a 2-core VM that switch costs the next request several tens
of milliseconds, and the methods of one process pay it less often than those of several: BENCHMARKS.md, issue 53),
while drift still falls on the first half of one method and the second half of another.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flyspec.bench.backends import Backend, BackendSettings, FlyspecBackend, HFGenerateBackend, PromptOutput, run_prompt
from flyspec.bench.data import BenchPrompt
from flyspec.bench.nll import NllCounts, NllScorer
from flyspec.bench.report import ORDERS
from flyspec.config import ConfigError
from flyspec.harness.methods import PEERS, PLAIN, Method, parse_methods
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.step_cost import measure

logger = logging.getLogger(__name__)

WARMUP_TOKENS = 8
Record = dict[str, Any]
DEFAULT_METHODS = (
    PLAIN,
    "ngram+exact",
    "ngram+fly",
    "ngram+fly+bare",
    "ngram+margin",
    "ngram+typical",
    "hf-plain",
    "hf-lookup",
)
DEFAULT_DRAFT_METHODS = ("draft+exact", "draft+fly", "multilevel+fly", "hf-assisted")
# the edit workload's: plain, context drafts, the prediction beside them, transformers' prompt lookup
EDIT_METHODS = (PLAIN, "ngram+exact", "prediction+exact", "hf-lookup")
EDIT_WORKLOAD = "edit"


def bench_methods(text: str | None, *, has_draft_model: bool, workload: str = "spec-bench") -> list[Method]:
    """``--methods`` (default: ours and the HF peers, the draft-model methods with a draft model; the edit
    workload's :data:`EDIT_METHODS`).

    ``plain`` is always run (first), since every speedup is relative to it.
    """
    if text is None and workload == EDIT_WORKLOAD:
        text = ",".join(EDIT_METHODS)
    elif text is None:
        text = ",".join(DEFAULT_METHODS + (DEFAULT_DRAFT_METHODS if has_draft_model else ()))
    methods = parse_methods(text, PEERS)
    methods = [Method(PLAIN)] + [method for method in methods if not method.is_plain]
    missing_draft = [method.name for method in methods if method.needs_draft_model and not has_draft_model]
    if missing_draft:
        raise ConfigError(f"{', '.join(missing_draft)} need(s) a draft model: pass --draft-model")
    return methods


@dataclass(frozen=True)
class BenchSettings:
    max_new_tokens: int = 128
    repeats: int = 1
    warmup: bool = True
    seed: int = 0
    order: str = "interleaved"  # or "blocks" (report.ORDERS; the module docstring)


@dataclass(frozen=True)
class VllmSettings:
    venv: str | None = None  # None: $FLYSPEC_VLLM_VENV or .venv-vllm
    eager: bool = False  # vLLM's enforce_eager: starts ~3x faster, runs ~15 % slower


def make_backends(
    methods: list[Method],
    target: LoadedModel,
    draft: LoadedModel | None,
    settings: BackendSettings,
    vllm: VllmSettings | None = None,
    skipped: dict[str, str] | None = None,
) -> dict[str, Backend]:
    """One backend per method (``ConfigError`` if a method cannot run here).

    vLLM methods without their venv are left out, with a one-line reason in ``skipped``.
    """
    backends: dict[str, Backend] = {}
    vllm = vllm or VllmSettings()
    for method in methods:
        if method.engine == "vllm":
            from flyspec.bench import vllm as vllm_peer

            python = vllm_peer.venv_python(vllm.venv)
            reason = vllm_peer.unavailable_reason(python, target)
            try:
                if reason is None:
                    backends[method.name] = vllm_peer.VllmBackend(method, target, settings, python, vllm.eager)
            except (RuntimeError, ConfigError) as error:  # a peer's engine that does not start must not lose the run
                reason = f"start-up failed: {error}"
            if reason is not None:
                logger.warning("skipping %s: %s", method.name, reason)
                if skipped is not None:
                    skipped[method.name] = reason
        elif method.engine == "hf":
            backends[method.name] = HFGenerateBackend(method, target, draft, settings)
        elif method.engine == "llamacpp":
            from flyspec.bench.llamacpp import LlamaCppBackend  # optional dependency

            backends[method.name] = LlamaCppBackend(method, target, settings)
        else:
            backends[method.name] = FlyspecBackend(method, target, draft, settings)
    return backends


def run_bench(
    prompts: list[BenchPrompt],
    backends: dict[str, Backend],
    target: LoadedModel,
    settings: BenchSettings,
    use_chat: bool | None,
    on_record: Callable[[Record], None],
    on_prompt_done: Callable[[], None] = lambda: None,
    failures: dict[str, str] | None = None,
    scorer: NllScorer | None = None,
) -> list[Record]:
    """Run everything; ``on_record`` gets each record as soon as it exists (incremental output).

    A peer that raises is dropped for the rest of the run (its error goes into ``failures``; its
    earlier records stay, and its speedup is computed over the prompts it completed). A failure
    of flyspec's own methods is a bug and propagates. ``scorer`` (at temperature > 0): every output's NLL under
    the target (``bench/nll.py``), computed between generations, outside every timed span.
    """
    failures = {} if failures is None else failures
    names = list(backends)

    def run_or_drop(name: str, prompt: BenchPrompt, max_new_tokens: int, seed: int) -> PromptOutput | None:
        backend = backends[name]
        if not backend.method.peer:
            return run_prompt(backend, target, prompt, max_new_tokens, seed, use_chat)
        try:
            return run_prompt(backend, target, prompt, max_new_tokens, seed, use_chat)
        except Exception as error:  # a peer's failure must not lose the run
            message = f"{type(error).__name__}: {error}"
            logger.warning("peer %s failed on prompt %s and is dropped from the run: %s", name, prompt.id, message)
            failures[name] = f"prompt {prompt.id}: {message}"
            names.remove(name)
            return None

    if settings.warmup:
        warmup = BenchPrompt("warmup", "warmup", ("Hello! Say something short.",))
        for name in list(names):
            run_or_drop(name, warmup, WARMUP_TOKENS, settings.seed)
    records: list[Record] = []
    outputs: dict[tuple[int, int], dict[str, PromptOutput]] = {}
    emitted: set[tuple[int, int, str]] = set()
    done: set[int] = set()

    def emit(index: int, repeat: int) -> None:
        """Records for what ran on (prompt, repeat), once plain's output is there to compare with."""
        ran = outputs.get((index, repeat), {})
        if PLAIN not in ran:
            return
        for name in [name for name in names if name in ran and (index, repeat, name) not in emitted]:
            emitted.add((index, repeat, name))
            nll = scorer.score(ran[name].generations) if scorer is not None else None
            record = make_record(prompts[index], backends[name].method, repeat, ran[name], ran[PLAIN], nll)
            records.append(record)
            on_record(record)

    def finish_prompts() -> None:
        for index in range(len(prompts)):
            whole = all((index, r, name) in emitted for r in range(settings.repeats) for name in names)
            if index not in done and whole:
                done.add(index)
                on_prompt_done()

    for index, repeat, name in run_order(len(prompts), settings.repeats, list(names), settings.order):
        if name not in names:  # a peer dropped earlier in the run
            continue
        output = run_or_drop(name, prompts[index], settings.max_new_tokens, settings.seed + index)
        if output is not None:
            outputs.setdefault((index, repeat), {})[name] = output
        emit(index, repeat)
        finish_prompts()
    return records


def run_order(num_prompts: int, repeats: int, names: list[str], order: str) -> list[tuple[int, int, str]]:
    """(prompt index, repeat, method) in the order they run: ``interleaved`` (``method_order`` per round) or
    ``blocks`` (each method on the first half of the prompts, then each on the second half in reverse order)."""
    if order == "interleaved":
        return [
            (index, repeat, name)
            for index in range(num_prompts)
            for repeat in range(repeats)
            for name in method_order(names, index * repeats + repeat)
        ]
    if order != "blocks":
        raise ConfigError(f"unknown bench order {order!r}: choose one of {', '.join(ORDERS)}")
    half = (num_prompts + 1) // 2
    first = [(i, r, name) for name in names for i in range(half) for r in range(repeats)]
    return first + [(i, r, name) for name in names[::-1] for i in range(half, num_prompts) for r in range(repeats)]


def method_order(names: list[str], round_: int) -> list[str]:
    """The methods' order in one round: rotated every two rounds, and reversed every other round.

    Rotation alone keeps a cyclic order (each method always runs right after the same one); reversing every other
    round puts each after different neighbours. It matters where methods run in separate processes (flyspec's
    engine, vLLM's worker): the first forward after another process ran measured up to twice a warm one's time
    to the first token on a 2-core VM (BENCHMARKS.md, issue 53)."""
    shift = (round_ // 2) % len(names)
    order = names[shift:] + names[:shift]
    return order[::-1] if round_ % 2 else order


def make_record(
    prompt: BenchPrompt,
    method: Method,
    repeat: int,
    output: PromptOutput,
    baseline: PromptOutput,
    nll: NllCounts | None = None,
) -> Record:
    """One (prompt, method, repeat) measurement; counters a peer does not expose are ``None``. ``nll``: the sampled
    text's scores (temperature > 0 only: greedy records have no NLL fields)."""
    turns = output.turns
    num_new_tokens = sum(len(turn.token_ids) for turn in turns)
    wall = sum(turn.wall_time_s for turn in turns)
    record: Record = {
        "prompt_id": prompt.id,
        "category": prompt.category,
        "method": method.name,
        "lossless": method.lossless,
        "repeat": repeat,
        "num_turns": len(turns),
        "num_prompt_tokens": output.num_prompt_tokens,
        "num_new_tokens": num_new_tokens,
        "wall_time_s": wall,
        "tokens_per_s": num_new_tokens / wall if wall > 0 else 0.0,
        # per turn, as each turn is a request of its own (None where the method does not measure it)
        "time_to_first_token_s": [turn.time_to_first_token_s for turn in turns],
        "identical_to_baseline": output.token_ids == baseline.token_ids,
        "texts": output.texts,
    }
    for key in (
        "num_target_forwards",
        "num_proposed",
        "num_accepted",
        "num_loose_accepts",
        "prefill_time_s",
        "num_reused_prompt_tokens",
        "target_time_s",
        "draft_time_s",
        "num_accepted_prediction_tokens",
        "num_rejected_prediction_tokens",
    ):
        values = [getattr(turn, key) for turn in turns]
        record[key] = None if any(value is None for value in values) else sum(values)
    forwards = record["num_target_forwards"]
    record["mean_acceptance_length"] = num_new_tokens / forwards if forwards else None
    record["accepted_per_position"] = _sum_lists([turn.accepted_per_position for turn in turns])
    record["proposed_per_position"] = _sum_lists([turn.proposed_per_position for turn in turns])
    lengths: dict[int, int] = {}
    for turn in turns:
        for length, count in turn.requested_draft_lengths.items():
            lengths[length] = lengths.get(length, 0) + count
    record["requested_draft_lengths"] = {str(length): count for length, count in sorted(lengths.items())}
    record["drafter_stats"] = [turn.drafter_stats for turn in turns]
    if nll is not None:
        record.update(nll.record())
    return record


def _sum_lists(lists: list[list[int]]) -> list[int]:
    total = [0] * max((len(values) for values in lists), default=0)
    for values in lists:
        for position, value in enumerate(values):
            total[position] += value
    return total


def forward_times(
    target: LoadedModel, context: list[int], sizes: tuple[int, ...], repeats: int = 9
) -> dict[int, float]:
    """Median seconds of one target forward of each size after ``context`` cached tokens
    (``step_cost.measure``, which the cost-aware draft length uses too).

    The τ-limit of a method is τ × t(1) / t(k+1): its speedup if every step cost one
    (k+1)-token forward and nothing else (no drafting, no engine overhead).
    """
    cost = measure(target, max(sizes), rounds=repeats + 1, context=context, sizes=sizes)
    return dict(zip(cost.sizes, cost.seconds, strict=True))
