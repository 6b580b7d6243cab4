"""The stages of ``scripts/gpu_check.py`` after ``environment``: each takes the results folder and ``smoke`` and
returns a dict with ``ok`` (or ``status``), a one-line ``summary`` and markdown ``details``. They run in a child
process whose environment has ``src/`` and ``tests/`` on ``PYTHONPATH`` and no network."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
# the device-parametrised tests (conftest.DEVICES adds cuda where a GPU is visible) and the sync budgets
GPU_TESTS = ("test_devices.py", "test_reference.py", "test_rejection_sampling.py", "test_verifiers.py", "test_syncs.py")
SMOKE_TESTS = (
    "test_syncs.py::test_the_counter_sees_every_kind_of_sync",  # a plain test and a device one
    "test_devices.py::test_generate_runs_on_every_available_device",
)
SMOKE_SYNCS = (("ngram", "exact", 0.0), ("ngram", "fly", 0.0))
COST_MODEL = "llama-3.1-8b"
# a small model for the end-to-end stage: SmolLM2-135M's shape (its config.json) over the byte tokenizer
SMALL = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
         "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 259, "max_position_embeddings": 2048,
         "tie_word_embeddings": True}  # fmt: skip
# the random head x 8: on SmolLM2's shape (float32, CPU, one Spec-Bench prompt) the top-2 logit gap's median is 2.6 and
# no gap is under NEAR_TIE, the top-3 entropy's median 0.5 nats: greedy is well defined and FLy's gate (0.3) opens
HEAD_SCALE = 8.0
NEAR_TIE = 1e-3  # a departure from greedy closer than this to the argmax is rounding, not the rule


def device_name() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class Outcomes:
    """A pytest plugin: each test's outcome, and which are the ``cuda`` cases of ``conftest.on_devices``. Where a GPU
    is visible their ``cpu`` twins are deselected (the CPU's suite runs them), so the time goes to the GPU."""

    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}
        self.cuda: set[str] = set()
        self.skips: dict[str, int] = {}
        self.deselected = 0

    def pytest_collection_modifyitems(self, config: Any, items: list[Any]) -> None:
        from conftest import DEVICES

        kept, dropped = [], []
        for item in items:
            device = getattr(getattr(item, "callspec", None), "params", {}).get("device")
            on_devices = any(mark.args[:1] == ("device",) and tuple(mark.args[1]) == DEVICES
                             for mark in item.iter_markers("parametrize"))  # fmt: skip
            if on_devices and device == "cuda":
                self.cuda.add(item.nodeid)
            (dropped if on_devices and device == "cpu" and "cuda" in DEVICES else kept).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
            self.deselected = len(dropped)

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed:
            self.outcomes[report.nodeid] = "failed"
        elif report.skipped:
            self.outcomes.setdefault(report.nodeid, "skipped")
            reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
            self.skips[reason] = self.skips.get(reason, 0) + 1
        elif report.when == "call":
            self.outcomes.setdefault(report.nodeid, "passed")


def tests(out: Path, smoke: bool) -> dict[str, Any]:
    """pytest on the GPU tests (a JUnit file beside): counts, the cuda cases among them, the failures by name."""
    import pytest

    files = [str(REPO / "tests" / name) for name in (SMOKE_TESTS if smoke else GPU_TESTS)]
    plugin = Outcomes()
    options = ["-q", "-p", "no:cacheprovider", f"--rootdir={REPO}", f"--junitxml={out / 'tests.xml'}"]
    returncode = pytest.main([*options, *files], plugins=[plugin])
    counts = {name: sum(outcome == name for outcome in plugin.outcomes.values()) for name in ("passed", "failed",
                                                                                              "skipped")}  # fmt: skip
    cuda = {name: sum(plugin.outcomes.get(node) == name for node in plugin.cuda) for name in counts}
    failures = [node for node, outcome in plugin.outcomes.items() if outcome == "failed"]
    where = (f"cuda cases: {cuda['passed']} passed, {cuda['failed']} failed ({plugin.deselected} cpu twins left to the "
             "CPU suite)" if plugin.cuda else "no cuda cases: no GPU visible, the cpu cases only")  # fmt: skip
    details = [f"- {', '.join(Path(f).name for f in files)}: {counts}", f"- {where}"]
    details += [f"- failed: `{name}`" for name in failures[:20]]
    details += [f"- skipped ({count}): {reason}" for reason, count in plugin.skips.items()]
    return {"ok": returncode == 0 and counts["passed"] > 0, "counts": counts, "cuda": cuda, "failures": failures,
            "summary": f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped; {where}",
            "details": details}  # fmt: skip


def cost(out: Path, smoke: bool) -> dict[str, Any]:
    """``scripts/gpu_bench.py``: t(n), n = 1..64, of Llama-3.1-8B's shape in bfloat16, and the decoders briefly."""
    device = device_name()
    if device == "cpu" and not smoke:
        return {"status": "skipped", "reason": f"no CUDA device: {COST_MODEL} in bfloat16 needs a GPU (--smoke runs "
                "a tiny config on the CPU)"}  # fmt: skip
    folder = out / "cost"
    if smoke:
        options = ["--smoke", "--device", device, "--dtype", "float32"]
    else:
        options = ["--device", "cuda", "--dtype", "bfloat16", "--models", COST_MODEL, "--max-size", "64",
                   "--per-category", "1", "--max-prompts", "6", "--max-new-tokens", "64",
                   "--repeats", "10"]  # fmt: skip
    sys.path[:0] = [str(REPO / "scripts")]
    import gpu_bench

    returncode = gpu_bench.main(["--out", str(folder), *options])
    if returncode != 0 or not (folder / "results.json").is_file():
        return {"ok": False, "error": f"gpu_bench exited {returncode} (its output: the stage's log)"}
    results = json.loads((folder / "results.json").read_text())
    name, model = next(iter(results["models"].items()))
    curve = model["t_ms"]
    shown = [n for n in ("1", "8", "16", "32", "64") if n in curve]
    rates = ", ".join(f"{method} {row['tokens_per_s']:.1f}" for method, row in model["flyspec"].items())
    summary = (f"{name}, {results['meta']['dtype']}: " + ", ".join(f"t({n}) {curve[n]:.2f} ms" for n in shown)
               + f"; tok/s (random weights) {rates}")  # fmt: skip
    details = ["| n | " + " | ".join(curve) + " |", "|---|" + "---|" * len(curve),
               "| t(n) ms | " + " | ".join(f"{t:.2f}" for t in curve.values()) + " |",
               "", f"The whole measurement: `cost/report.md` ({results['meta']['machine']})."]  # fmt: skip
    return {"ok": True, "model": name, "t_ms": curve, "flyspec": model["flyspec"], "summary": summary,
            "details": details}  # fmt: skip


@contextlib.contextmanager
def cuda_syncs(device: str) -> Iterator[list[int]]:
    """CUDA's own count of the syncs in the block (``torch.cuda.set_sync_debug_mode``), in ``[0]`` at its end."""
    found = [0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    found[0] = sum("synchroniz" in str(warning.message) for warning in caught)


def syncs(out: Path, smoke: bool) -> dict[str, Any]:
    """Per decode step on the device, the budgets of tests/test_syncs.py; beside them CUDA's own count."""
    import test_syncs
    from conftest import make_tiny_model, make_tokenizer, noisy_copy, on_device
    from flyspec.api import build_decoder
    from flyspec.config import DecodeConfig, SamplingConfig, SpeculationConfig
    from flyspec.resources import Resources
    from flyspec.runtime.syncs import SyncCounter, counting_steps
    from flyspec.sampling import acceptance
    from flyspec.sampling.sampler import make_generator

    device = device_name()
    if device == "cpu":
        acceptance.SELECT_ROWS_ON = frozenset()  # the path a GPU takes (as the test does)
    tiny = make_tiny_model(make_tokenizer(), seed=0, name="tiny-target")
    target, draft = on_device(tiny, device), on_device(noisy_copy(tiny, scale=0.3, seed=1), device)
    shown = (lambda count: str(count)) if device == "cuda" else (lambda count: "-")
    rows, over = [], []
    chosen = SMOKE_SYNCS if smoke else tuple(test_syncs.BUDGETS)
    for (drafter, verifier, temperature), budget in [(key, test_syncs.BUDGETS[key]) for key in chosen]:
        spec = SpeculationConfig(drafter=drafter, verifier=verifier, num_draft_tokens=test_syncs.K,
                                 draft_model=draft.name if drafter == "draft-model" else None)  # fmt: skip
        decode = DecodeConfig(max_new_tokens=32, sampling=SamplingConfig(temperature=temperature))
        decoder = build_decoder(target, spec, decode, resources=Resources("float32", models=(target, draft)))
        generator = make_generator(0, device)
        with cuda_syncs(device) as cuda, counting_steps(decoder) as counter:
            decoder.generate(test_syncs.PROMPT, generator=generator)
        steps = sorted(len(step) for step in counter.per_step())
        if steps and steps[-1] > budget:
            over.append(f"{drafter}+{verifier}")
        most, median = (steps[-1], steps[len(steps) // 2]) if steps else ("-", "-")
        rows.append(f"| {drafter} + {verifier} (T = {temperature}) | {most} / {median} | {budget} | {counter.total} | "
                    f"{shown(cuda[0])} |")  # fmt: skip
    for batch in (1,) if smoke else (1, 32):
        ids, sizes, logits, missed = test_syncs.plugin_batch(batch)
        ids, logits, rules = ids.to(device), logits.to(device), test_syncs.fly_rules(batch)[1]
        with cuda_syncs(device) as cuda, SyncCounter() as counter:
            test_syncs.apply_batch(ids, sizes, logits, rules)
        rows.append(f"| plugin FLy + guards, batch {batch} ({missed} missed) | {counter.total} | {1 + 4 * missed} | "
                    f"{counter.total} | {shown(cuda[0])} |")  # fmt: skip
        if counter.total > 1 + 4 * missed:
            over.append(f"plugin batch {batch}")
    cuda_note = "" if device == "cuda" else "; CUDA's own count: no GPU (the CPU counter only)"
    header = ["| drafter + verifier (T) | flyspec's syncs per step: max / median | budget | whole generation "
              "(prefill included) | CUDA's own count, whole generation |", "|---|---:|---:|---:|---:|"]  # fmt: skip
    return {"ok": not over, "device": device, "over_budget": over,
            "summary": f"on {device}: {len(rows) - len(over)} of {len(rows)} within budget{cuda_note}",
            "details": header + rows}  # fmt: skip


def small_model(device: str, dtype: torch.dtype, smoke: bool) -> Any:
    """A random-weight model of ``SMALL``'s shape (on a CPU or with ``smoke``: ``gpu_bench.SMOKE_CONFIG``'s), its head
    scaled."""
    sys.path[:0] = [str(REPO / "scripts")]
    import gpu_bench

    full = device == "cuda" and not smoke  # on a CPU: the tiny one
    values = {**(SMALL if full else gpu_bench.SMOKE_CONFIG), "vocab_size": 259}
    name = "random, SmolLM2-135M's shape" if full else "random, tiny (no GPU or --smoke)"
    target = gpu_bench.random_target(name, values, torch.device(device), dtype)
    with torch.no_grad():
        target.model.get_output_embeddings().weight.mul_(HEAD_SCALE)
    return target


def departures(target: Any, prompt: list[int], output: list[int]) -> tuple[list[int], list[int]]:
    """The output indices where ``output`` leaves the target's greedy choice (one cache-free forward), and those
    among them that are near-ties."""
    with torch.no_grad():
        ids = torch.tensor([prompt + output], device=target.device)
        logits = target.model(ids).logits[0, len(prompt) - 1 : -1].float()  # [len(output), vocab]
    chosen = logits.gather(-1, torch.tensor(output, device=target.device)[:, None])[:, 0]
    gaps = (logits.max(-1).values - chosen).tolist()
    left = [index for index, gap in enumerate(gaps) if gap > 0]
    return left, [index for index in left if gaps[index] < NEAR_TIE]


def cli_compare(target: Any, device: str, new_tokens: int) -> tuple[bool, str]:
    """``flyspec generate --compare --json`` on ``target`` saved to a folder: (identical to plain, a detail line)."""
    with tempfile.TemporaryDirectory() as folder:
        target.model.save_pretrained(folder)
        target.tokenizer.save_pretrained(folder)
        command = [sys.executable, "-m", "flyspec", "generate", "Count: 1, 2, 3, 4, 5, 6, 1, 2, 3,", "--model",
                   folder, "--device", device, "--dtype", "float32", "--no-chat", "--json", "--compare",
                   "--max-new-tokens", str(new_tokens)]  # fmt: skip
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    record = json.loads(done.stdout) if done.returncode == 0 and done.stdout.startswith("{") else {}
    line = (f"- `flyspec generate --device {device} --dtype float32 --compare --json`: exit {done.returncode}, "
            f"identical to plain: {record.get('identical_to_baseline')}, τ {record.get('mean_acceptance_length')}"
            + ("" if record else f" ({done.stderr.strip()[-300:]})"))  # fmt: skip
    return bool(record.get("identical_to_baseline")), line


def end_to_end(out: Path, smoke: bool) -> dict[str, Any]:
    """``flyspec generate --compare`` (exact = plain), then plain, exact and FLy decoders on a few prompts: exact is
    plain token for token; FLy leaves greedy only at its loose accepts (float32; bfloat16's exact reported)."""
    from flyspec.api import build_decoder
    from flyspec.bench.data import load_prompts
    from flyspec.config import DecodeConfig, FlyConfig, GuardConfig, SpeculationConfig
    from flyspec.decoding.plain import PlainDecoder
    from flyspec.resources import Resources

    device, new_tokens = device_name(), 16 if smoke else 64
    decode = DecodeConfig(max_new_tokens=new_tokens, ignore_eos=True)
    target = small_model(device, torch.float32, smoke)
    identical, line = cli_compare(target, device, new_tokens)
    problems, details = ([] if identical else ["flyspec generate --compare: not identical to plain"]), [line]
    prompts = [target.tokenizer(p.turns[0])["input_ids"][:96] for p in load_prompts(None, limit=1)[: 2 if smoke else 3]]
    exact = SpeculationConfig(drafter="ngram")
    fly = SpeculationConfig(drafter="ngram", verifier="fly", fly=FlyConfig(window_size=0, entropy_threshold=0.3),
                            guard=GuardConfig.bare())  # fmt: skip
    specs = {"exact": exact, "fly W0 bare": fly}
    if not smoke:
        specs["fly (defaults, guarded)"] = SpeculationConfig(drafter="ngram", verifier="fly")
    decoders = {"plain": PlainDecoder(target, decode)} | {
        name: build_decoder(target, spec, decode, resources=Resources(models=(target,))) for name, spec in specs.items()
    }
    outputs = {name: [decoder.generate(ids) for ids in prompts] for name, decoder in decoders.items()}
    if [result.token_ids for result in outputs["exact"]] != [result.token_ids for result in outputs["plain"]]:
        problems.append("exact differs from plain decoding (float32)")
    loose_total = sum(len(result.loose_token_indices) for result in outputs["fly W0 bare"])
    for prompt, result in zip(prompts, outputs["fly W0 bare"], strict=True):
        left, ties = departures(target, prompt, result.token_ids)
        unexplained = sorted(set(left) - set(result.loose_token_indices) - set(ties))
        if unexplained:
            problems.append(f"FLy left greedy at {unexplained}, not loose accepts")
    if loose_total == 0:
        problems.append("FLy W0 kept no loose accept: the check above would be empty")
    for name, results in outputs.items():
        tokens = sum(result.num_new_tokens for result in results)
        forwards = sum(result.stats.num_target_forwards for result in results)
        details.append(f"- {name}: τ {tokens / max(forwards, 1):.2f}, "
                       f"{sum(r.stats.num_loose_accepts for r in results)} loose accepts, "
                       f"{sum(r.stats.wall_time_s for r in results):.2f} s for {tokens} tokens")  # fmt: skip
    if device == "cuda":
        half = small_model(device, torch.bfloat16, smoke)
        plain = PlainDecoder(half, decode).generate(prompts[0]).token_ids
        same = build_decoder(half, exact, decode, resources=Resources(models=(half,))).generate(prompts[0]).token_ids
        details.append(f"- bfloat16: exact {'=' if same == plain else '≠ (rounding of batched forwards)'} plain")
    size = sum(parameter.numel() for parameter in target.model.parameters()) / 1e6
    summary = (f"on {device}, {target.name} ({size:.2f} M parameters, float32): exact = plain, FLy {loose_total} "
               "loose accepts all explained" if not problems else "; ".join(problems))  # fmt: skip
    return {"ok": not problems, "device": device, "summary": summary, "details": details}
