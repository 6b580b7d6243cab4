"""Run plain decoding and each method on the same prompts, score them, write one record per output.

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

import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flyspec.api import build_decoder
from flyspec.config import ConfigError, DecodeConfig, SamplingConfig, SpeculationConfig
from flyspec.config.names import DISTRIBUTION_VERIFIERS, LOSSLESS_VERIFIERS, LOSSY_VERIFIERS
from flyspec.decoding.generation import Decoder
from flyspec.decoding.plain import PlainDecoder
from flyspec.decoding.result import GenerationResult
from flyspec.eval import fidelity, trust
from flyspec.eval.data import EvalItem, LoadReport
from flyspec.eval.tasks import PROMPT_FORMAT, Task, load_items
from flyspec.harness.data import JsonlWriter, read_records
from flyspec.harness.methods import PLAIN, Method
from flyspec.harness.vllm_session import VllmSession
from flyspec.harness.vllm_worker import VllmOptions
from flyspec.profiles import resolve as resolve_profile
from flyspec.resources import Resources
from flyspec.runtime.loaded_model import LoadedModel, ServedModel
from flyspec.sampling.coupled import COUPLED_SAMPLING
from flyspec.sampling.sampler import make_generator
from flyspec.verifiers.registry import rule_mapping

# the lossy rules the flyspec-vllm plugin applies per request: those of the target's logits alone
VLLM_RULES = tuple(name for name in LOSSY_VERIFIERS if name not in DISTRIBUTION_VERIFIERS)
logger = logging.getLogger(__name__)

RECORDS_FILE = "records.jsonl"
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
        if (method.drafter or speculation.drafter) != "ngram":
            raise ConfigError(f"--engine vllm: {method.name} needs the n-gram drafter (the plugin's proposer)")
        if method.draft_length not in (None, "fixed") or speculation.draft_length.policy not in ("auto", "fixed"):
            raise ConfigError(f"--engine vllm drafts a fixed length (num_speculative_tokens): {method.name} cannot")
        if method.verifier not in (*LOSSLESS_VERIFIERS, *VLLM_RULES):
            raise ConfigError(f"--engine vllm: the plugin cannot apply verifier {method.verifier!r}")


def load_all_items(config: EvalConfig, report: LoadReport) -> dict[str, list[EvalItem]]:
    """Every task's items, read before any model is loaded so that data errors come first."""
    return {task.name: load_items(task, config.limit, config.skip_bad_lines, report) for task in config.tasks}


def _record_key(task: str, method: str, item_id: str, seed: int = 0) -> str:
    return f"{task}\t{method}\t{item_id}\t{seed}"


class BaselineCache:
    """Plain decoding outputs keyed by everything that determines them."""

    def __init__(self, directory: Path | None) -> None:
        self.path = directory / "baseline.jsonl" if directory else None
        self.entries = {entry["key"]: entry for entry in read_records(self.path)} if self.path else {}
        self.writer = JsonlWriter(self.path, append=True) if self.path else None

    @staticmethod
    def key(
        target: LoadedModel,
        task: Task,
        item_id: str,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        seed: int = 0,
    ) -> str:
        fields = [target.name, str(target.dtype), task.name, item_id, max_new_tokens, task.stop, PROMPT_FORMAT]
        if target.device.type != "cpu":  # a GPU rounds differently; CPU keys stay as they were
            fields.append(target.device.type)
        if sampling is not None and not sampling.greedy:  # greedy keys stay as they were
            fields += ["sampled", sampling.temperature, sampling.top_k, sampling.top_p, seed, COUPLED_SAMPLING]
        return hashlib.sha256(json.dumps([*fields, prompt_ids]).encode()).hexdigest()

    def get(self, key: str) -> dict[str, Any] | None:
        return self.entries.get(key)

    def put(self, key: str, entry: dict[str, Any]) -> None:
        self.entries[key] = {"key": key, **entry}
        if self.writer:
            self.writer.write(self.entries[key])

    def close(self) -> None:
        if self.writer:
            self.writer.close()


@dataclass
class Output:
    """One generation, as stored (a cached baseline has no live GenerationResult)."""

    text: str
    token_ids: list[int]
    loose_token_indices: list[int]
    stats: dict[str, Any]
    finish_reason: str
    cached: bool = False

    @staticmethod
    def of(result: GenerationResult) -> Output:
        return Output(
            result.text,
            result.token_ids,
            list(result.loose_token_indices),
            result.stats.to_dict(),
            result.finish_reason,
        )


@dataclass(frozen=True)
class ItemRun:
    """One item in progress: its task, its prompt (text and ids) and plain decoding's output (the reference)."""

    task: Task
    item: EvalItem
    prompt: str
    prompt_ids: list[int]
    plain: Output
    seed: int = 0  # the seed every output of this run samples with (T > 0)


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
            _record_key(r["task"], r["method"], r["item_id"], r.get("seed", 0))
            for r in read_records(records_path)
            if config.resume
        }
        self.writer = JsonlWriter(records_path, append=config.resume)
        self.skipped: list[str] = []  # items that could not run (and why)
        self.engines: dict[str, Any] = {}  # vllm-* method → its vLLM worker, started once for every task
        self.similarity_model = fidelity.SimilarityModel()

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
                    if _record_key(task.name, method.name, item.id) not in self.done:
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
                    if _record_key(task.name, method.name, item.id, seed) not in self.done:
                        generator = make_generator(seed, self.loaded.device)  # plain's seed: coupled (coupled.py)
                        self._write(
                            run, method, Output.of(decoders[method.name].generate(prompt_ids, generator=generator))
                        )
                    progress(f"{label} {method.name}")

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
        name = method.name if method else PLAIN
        key = _record_key(run.task.name, name, run.item.id, run.seed)
        if key in self.done:
            return
        score = run.task.score(run.item, output.text)
        record: dict[str, Any] = {
            "task": run.task.name,
            "task_kind": run.task.kind,
            "item_id": run.item.id,
            "seed": run.seed,
            "method": name,
            "verifier": method.verifier if method else PLAIN,
            "protect": list(method.protect(run.task.kind)) if method else [],
            "lossless": method.lossless if method else True,
            "scores": score.values,
            "score_detail": score.detail,
            "text": output.text,
            "token_ids": output.token_ids,
            "loose_token_indices": output.loose_token_indices,
            "finish_reason": output.finish_reason,
            "baseline_cached": output.cached,
            "stats": output.stats,
            "fidelity": {**self._fidelity(output, run.plain, run.prompt_ids), **self._trust(output, run)},
        }
        if "category" in run.item.extra:  # the adversarial set's
            record["category"] = run.item.extra["category"]
        if method is not None and output.token_ids != run.plain.token_ids:
            record["segments"] = fidelity.highlight_segments(self.target, output.token_ids, output.loose_token_indices)
        self.writer.write(record)
        self.done.add(key)

    def _fidelity(self, output: Output, plain: Output, prompt_ids: list[int]) -> dict[str, Any]:
        identical = output.token_ids == plain.token_ids
        similarity = None
        if self.config.similarity or identical:
            similarity = self.similarity_model.similarity(output.text, plain.text)
        return {
            "identical": identical,
            "similarity": similarity,
            "token_agreement": fidelity.token_agreement(output.token_ids, plain.token_ids),
            "common_prefix": fidelity.common_prefix(output.token_ids, plain.token_ids),
            # the target's weights are only in vLLM's process with --engine vllm: no likelihood there
            "log_likelihood": fidelity.mean_log_likelihood(self.target, prompt_ids, output.token_ids)
            if isinstance(self.target, LoadedModel)
            else None,
        }

    def _trust(self, output: Output, run: ItemRun) -> dict[str, Any]:
        """Meaning change and new loop against plain decoding's output (see ``trust.py``)."""
        change = trust.meaning_change(
            output.text,
            run.plain.text,
            run.prompt,
            method_truncated=output.finish_reason == "length",
            plain_truncated=run.plain.finish_reason == "length",
        )
        loop = trust.new_loop(output.token_ids, run.plain.token_ids)
        return {
            "meaning_changed": change.changed,
            "meaning_diff": change.to_dict(),
            "loop": loop is not None,
            "loop_text": self.target.decode(list(loop)) if loop else None,
        }


def iter_pairs(records: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """``(plain record, method record)`` for every method output whose item (and seed) also has a plain record."""

    def key(record: dict[str, Any]) -> tuple[str, str, int]:
        return record["task"], record["item_id"], record.get("seed", 0)

    plain = {key(r): r for r in records if r["method"] == PLAIN}
    for record in records:
        if record["method"] != PLAIN and key(record) in plain:
            yield plain[key(record)], record
