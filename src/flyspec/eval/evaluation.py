"""Run plain decoding and each method on the same prompts, write one record per output (made by ``records.py``).

Records go to ``<out>/records.jsonl`` as they are made (one JSON line each, flushed), so an
interrupted run keeps everything it measured; ``resume=True`` skips outputs already recorded.
Plain decoding's outputs are also cached in ``<cache_dir>/baseline.jsonl`` keyed by model,
dtype, task, item, prompt, token limit and prompt format, and reused by later runs with the
same configuration (their timings then come from the run that made them: ``baseline_cached``).
The loop is item-major (plain, then every method, for one item) so a partial run stays paired.

Sampled (``sampling`` at T > 0), each item is decoded under ``seeds`` seeds (0 .. seeds - 1), plain decoding and
every method with the same seed: coupled sampling (``sampling/coupled.py``) makes a lossless method's output plain's
own, so each output is scored against plain's output of the same seed (identical, meaning changed, new loop,
refusals kept), and the rates are judged with prompts as clusters (``stats.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flyspec.api import build_decoder
from flyspec.config import ConfigError, DecodeConfig, SamplingConfig, SpeculationConfig
from flyspec.config.names import DISTRIBUTION_VERIFIERS, LOSSLESS_VERIFIERS, LOSSY_VERIFIERS
from flyspec.decoding.generation import Decoder
from flyspec.decoding.plain import PlainDecoder
from flyspec.eval.data import EvalItem, LoadReport
from flyspec.eval.records import BaselineCache, ItemRun, Output, Scorer, record_key
from flyspec.eval.tasks import Task, load_items
from flyspec.harness.data import RECORDS_FILE, JsonlWriter, read_records
from flyspec.harness.methods import PLAIN, Method
from flyspec.harness.vllm_session import VllmSession
from flyspec.harness.vllm_worker import VllmOptions
from flyspec.profiles import resolve as resolve_profile
from flyspec.resources import Resources
from flyspec.runtime.loaded_model import LoadedModel, ServedModel
from flyspec.sampling.sampler import make_generator
from flyspec.verifiers.registry import rule_mapping

# the lossy rules the flyspec-vllm plugin applies per request: those of the target's logits alone
VLLM_RULES = tuple(name for name in LOSSY_VERIFIERS if name not in DISTRIBUTION_VERIFIERS)
logger = logging.getLogger(__name__)

Progress = Callable[[str], None]  # called once per finished output with a short description


@dataclass(frozen=True)
class EvalConfig:
    """What to evaluate. ``speculation``: the drafter and settings every method runs (each sets its verifier)."""

    tasks: tuple[Task, ...]
    methods: tuple[Method, ...]
    out_dir: Path
    limit: int | None = None
    max_new_tokens: int | None = None  # None: each task's default
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    vllm_venv: str | None = None  # for the vllm-* methods (None: $FLYSPEC_VLLM_VENV or .venv-vllm)
    use_chat: bool | None = None
    similarity: bool = True
    skip_bad_lines: bool = False
    cache_dir: Path | None = None  # None: no baseline cache
    resume: bool = False
    engine: str = "flyspec"  # or "vllm": every method inside vLLM through the plugin, a wave of items at a time
    vllm: VllmOptions = field(default_factory=VllmOptions)
    wave_size: int = 64  # --engine vllm: items per submission (each with plain decoding and every method)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # greedy by default
    seeds: int = 1  # T > 0: each item under seeds 0 .. seeds - 1

    def __post_init__(self) -> None:
        if self.seeds < 1:
            raise ConfigError(f"--seeds must be >= 1 (got {self.seeds})")
        if self.sampling.greedy and self.seeds > 1:
            raise ConfigError("--seeds needs --temperature > 0: greedy decoding draws nothing, every seed is one text")
        if not self.sampling.greedy:
            refused = [m.name for m in self.methods if m.engine != "flyspec"] + (
                ["--engine vllm"] * (self.engine != "flyspec")
            )
            if refused:
                raise ConfigError(
                    f"{refused[0]} at temperature > 0: vLLM's sampling is not coupled by seed, so its outputs cannot "
                    "be compared with plain decoding's of the same seed; evaluate sampled on flyspec's engine"
                )
        if self.engine == "vllm":
            check_vllm_methods(self.methods, self.speculation)

    @property
    def seed_values(self) -> tuple[int, ...]:
        return tuple(range(self.seeds))


def check_vllm_methods(methods: tuple[Method, ...], speculation: SpeculationConfig) -> None:
    """What ``--engine vllm`` can evaluate, refused in one line before anything starts."""
    for method in methods:
        if method.engine != "flyspec":
            raise ConfigError(f"--engine vllm runs every method inside vLLM already: drop {method.name}")
        if method.prediction:
            raise ConfigError(f"--engine vllm: vLLM has no prediction (OpenAI's predicted outputs): drop {method.name}")
        if (method.drafter or speculation.drafter) != "ngram":
            raise ConfigError(f"--engine vllm: {method.name} needs the n-gram drafter (the plugin's proposer)")
        if method.draft_length not in (None, "fixed") or speculation.draft_length.policy not in ("auto", "fixed"):
            raise ConfigError(f"--engine vllm drafts a fixed length (num_speculative_tokens): {method.name} cannot")
        if method.verifier not in (*LOSSLESS_VERIFIERS, *VLLM_RULES):
            raise ConfigError(f"--engine vllm: the plugin cannot apply verifier {method.verifier!r}")


def load_all_items(config: EvalConfig, report: LoadReport) -> dict[str, list[EvalItem]]:
    """Every task's items, read before any model is loaded so that data errors come first."""
    return {task.name: load_items(task, config.limit, config.skip_bad_lines, report) for task in config.tasks}


class Evaluation:
    """One evaluation run: the configured tasks × (plain + methods) on one target model."""

    def __init__(
        self,
        config: EvalConfig,
        target: LoadedModel | ServedModel,
        items: dict[str, list[EvalItem]],
        resources: Resources | None = None,
        session: VllmSession | None = None,
    ) -> None:
        self.config = config
        self.target = target
        self.items = items
        self.session = session  # --engine vllm: every output comes from it
        if isinstance(target, LoadedModel):
            shared = resources or Resources(models=(target,))
            # each method drafts from n-gram caches of its own (one method's outputs must not feed another's)
            self.resources = {method.name: shared.isolated() for method in config.methods}
        # plain outputs are cached per engine: vLLM's are vLLM's (a batch rounds differently)
        self.cache = BaselineCache(config.cache_dir if session is None else None)
        records_path = config.out_dir / RECORDS_FILE
        self.done = {
            record_key(r["task"], r["method"], r["item_id"], r.get("seed", 0))
            for r in read_records(records_path)
            if config.resume
        }
        self.writer = JsonlWriter(records_path, append=config.resume)
        self.skipped: list[str] = []  # items that could not run (and why)
        self.engines: dict[str, Any] = {}  # vllm-* method → its vLLM worker, started once for every task
        self.scorer = Scorer(target, config.similarity)

    @property
    def loaded(self) -> LoadedModel:
        """The target in this process (flyspec's engine); with ``--engine vllm`` only its tokenizer is here."""
        assert isinstance(self.target, LoadedModel), "flyspec's engine needs the model loaded here"
        return self.target

    @property
    def total_outputs(self) -> int:
        return sum(len(items) for items in self.items.values()) * (1 + len(self.config.methods)) * self.config.seeds

    def run(self, progress: Progress | None = None) -> None:
        try:
            for task in self.config.tasks:
                if self.session is not None:
                    self._run_task_on_vllm(task, self.session, progress or (lambda description: None))
                else:
                    self._run_task(task, progress or (lambda description: None))
        finally:
            self.writer.close()
            self.cache.close()
            for engine in self.engines.values():
                engine.close()

    def _max_new_tokens(self, task: Task) -> int:
        return self.config.max_new_tokens or task.max_new_tokens

    def _decoders(self, task: Task) -> dict[str, Decoder]:
        max_new_tokens = self._max_new_tokens(task)
        sampling = self.config.sampling
        plain_config = DecodeConfig(max_new_tokens=max_new_tokens, stop_strings=task.stop, sampling=sampling)
        decoders: dict[str, Decoder] = {PLAIN: PlainDecoder(self.loaded, plain_config)}
        for method in self.config.methods:
            if method.engine == "vllm":
                decoders[method.name] = self._vllm_decoder(method, plain_config)
                continue
            decode = DecodeConfig(max_new_tokens=max_new_tokens, stop_strings=task.stop, sampling=sampling)
            spec = self.method_spec(method, task)
            decoders[method.name] = build_decoder(self.loaded, spec, decode, resources=self.resources[method.name])
        for decoder in decoders.values():  # warm-up: the first call pays one-off costs
            warm = DecodeConfig(max_new_tokens=2, sampling=sampling)
            decoder.generate(
                "Hello", config=warm, generator=make_generator(0, self.loaded.device), use_chat=self.config.use_chat
            )
        return decoders

    def method_spec(self, method: Method, task: Task) -> SpeculationConfig:
        """What flyspec method ``method`` speculates with on ``task`` (its verifier, guards, draft length)."""
        return method.speculation(self.config.speculation, task.kind)

    def check_methods(self) -> None:
        """Refuse now, before any output, a method a calibration profile does not allow (``profile.resolve``)."""
        for task in self.config.tasks:
            for method in self.config.methods:
                if method.engine != "vllm":
                    resolve_profile(self.method_spec(method, task), self.target, engine=self.config.engine)

    def _run_task_on_vllm(self, task: Task, session: VllmSession, progress: Progress) -> None:
        """``task`` on vLLM: a wave of items at a time, plain decoding and every method in one submission."""
        max_new_tokens = self._max_new_tokens(task)
        decode = DecodeConfig(max_new_tokens=max_new_tokens, stop_strings=task.stop)
        rules: dict[str, dict[str, Any]] = {}
        for method in self.config.methods:
            spec = resolve_profile(self.method_spec(method, task), self.target, engine="vllm")
            rules[method.name] = {} if spec.verifier in LOSSLESS_VERIFIERS else {"flyspec_rule": rule_mapping(spec)}
        items = self.items[task.name]
        for start in range(0, len(items), self.config.wave_size):
            runs: list[tuple[EvalItem, str, list[int]]] = []
            requests = []
            for item in items[start : start + self.config.wave_size]:
                prompt = task.prompt(item)
                try:
                    prompt_ids = self.target.encode_prompt(prompt, self.config.use_chat)
                except ConfigError as error:
                    logger.warning("skipping %s %s: %s", task.name, item.id, error)
                    self.skipped.append(f"{task.name} {item.id}: {error}")
                    continue
                runs.append((item, prompt, prompt_ids))
                requests.append(
                    session.request(f"{item.id}|plain", prompt_ids, max_new_tokens, {"flyspec_draft": False})
                )
                for method in self.config.methods:
                    if record_key(task.name, method.name, item.id) not in self.done:
                        extra = {**rules[method.name], "flyspec_record": f"{item.id}|{method.name}"}
                        requests.append(session.request(f"{item.id}|{method.name}", prompt_ids, max_new_tokens, extra))
            replies = session.submit(requests) if requests else {}
            for item, prompt, prompt_ids in runs:
                plain = Output.of(session.result(prompt_ids, decode, replies[f"{item.id}|plain"]["token_ids"], {},
                                                 drafted=False))  # fmt: skip
                run = ItemRun(task, item, prompt, prompt_ids, plain)
                self._write(run, None, plain)
                progress(f"{task.name} {item.id} plain")
                for method in self.config.methods:
                    reply = replies.get(f"{item.id}|{method.name}")
                    if reply is not None:
                        loose = {entry["index"]: entry for entry in (reply["record"] or {}).get("loose_accepts", [])}
                        self._write(
                            run, method, Output.of(session.result(prompt_ids, decode, reply["token_ids"], loose))
                        )
                    progress(f"{task.name} {item.id} {method.name}")

    def _vllm_decoder(self, method: Method, config: DecodeConfig) -> Any:
        from flyspec.eval.vllm import VllmDecoder, start_engine  # only with vllm-* methods

        if method.name not in self.engines:
            k = self.config.speculation.num_draft_tokens
            self.engines[method.name] = start_engine(method, self.loaded, k, self.config.vllm_venv)
        return VllmDecoder(self.engines[method.name], self.loaded, config)

    def _run_task(self, task: Task, progress: Progress) -> None:
        decoders = self._decoders(task)
        for item in self.items[task.name]:
            prompt = task.prompt(item)
            for seed in self.config.seed_values:
                label = f"{task.name} {item.id}" + (f" seed {seed}" if self.config.seeds > 1 else "")
                try:
                    prompt_ids = self.target.encode_prompt(prompt, self.config.use_chat)
                    plain = self._plain_output(task, item, decoders[PLAIN], prompt_ids, seed)
                except ConfigError as error:  # e.g. a prompt longer than the model's context window
                    logger.warning("skipping %s %s: %s", task.name, item.id, error)
                    self.skipped.append(f"{task.name} {item.id}: {error}")
                    for _ in range(len(self.config.seed_values) * (1 + len(self.config.methods))):
                        progress(f"{label} skipped")
                    break
                run = ItemRun(task, item, prompt, prompt_ids, plain, seed)
                self._write(run, None, plain)
                progress(f"{label} plain")
                for method in self.config.methods:
                    if record_key(task.name, method.name, item.id, seed) not in self.done:
                        generator = make_generator(seed, self.loaded.device)  # plain's seed: coupled (coupled.py)
                        # a prediction+... method is given the item's prediction (the edit task's), no other
                        predicted = {"prediction": item.extra["prediction"]} if self._predicts(method, item) else {}
                        result = decoders[method.name].generate(prompt_ids, generator=generator, **predicted)
                        self._write(run, method, Output.of(result))
                    progress(f"{label} {method.name}")

    @staticmethod
    def _predicts(method: Method, item: EvalItem) -> bool:
        """Whether ``method`` is given ``item``'s prediction: a ``prediction+...`` method on an item that has one."""
        return method.prediction and item.extra.get("prediction") is not None

    def _plain_output(
        self, task: Task, item: EvalItem, decoder: Decoder, prompt_ids: list[int], seed: int = 0
    ) -> Output:
        max_new_tokens = self._max_new_tokens(task)
        key = BaselineCache.key(self.loaded, task, item.id, prompt_ids, max_new_tokens, self.config.sampling, seed)
        entry = self.cache.get(key)
        if entry is not None:
            return Output(**{**entry["output"], "cached": True})
        output = Output.of(decoder.generate(prompt_ids, generator=make_generator(seed, self.loaded.device)))
        self.cache.put(key, {"task": task.name, "item_id": item.id, "output": output.__dict__})
        return output

    def _write(self, run: ItemRun, method: Method | None, output: Output) -> None:
        """Score one output, compare it with plain decoding's, and append its record."""
        key = record_key(run.task.name, method.name if method else PLAIN, run.item.id, run.seed)
        if key not in self.done:
            self.writer.write(self.scorer.record(run, method, output))
            self.done.add(key)
