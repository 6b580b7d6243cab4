"""Host–device syncs per decode step, held to written budgets (issue 39: GPU-ready by construction).

Counted on the CPU with ``flyspec.runtime.syncs.SyncCounter`` along the path a GPU takes
(``acceptance.SELECT_ROWS_ON`` emptied: on a CPU the lossy rules first find the few rows they need, a
sync that is free there). A new ``.item()``/``.tolist()``/``.cpu()``/``bool(tensor)``/``nonzero`` in the
hot path fails a budget here. The measured counts are published in DEPLOYMENT.md ("What was checked
for GPUs and how"); ``python tests/test_syncs.py`` prints them.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations" / "vllm" / "src"))

from flyspec_vllm.rule import RequestRule, apply_batch, judge, keep_draft_tokens  # noqa: E402

from flyspec.api import build_decoder  # noqa: E402
from flyspec.config import DecodeConfig, GuardConfig, SamplingConfig, SpeculationConfig  # noqa: E402
from flyspec.resources import Resources  # noqa: E402
from flyspec.runtime.loaded_model import LoadedModel  # noqa: E402
from flyspec.runtime.syncs import SyncCounter, counting_steps  # noqa: E402
from flyspec.sampling import acceptance  # noqa: E402
from flyspec.types import VerifyContext  # noqa: E402
from flyspec.verifiers.guard import prepare as prepare_guards  # noqa: E402

K = 8
PROMPT = "the cat sat on the mat the cat sat on the mat the cat sat"
# (drafter, verifier, temperature) -> the most host syncs one whole decode step may make
BUDGETS = {
    ("ngram", "exact", 0.0): 1,  # the verdict's one transfer (verifiers/base.py build_verdict)
    ("ngram-cache", "exact", 0.0): 1,
    ("ngram", "fly", 0.0): 2,  # + the trust guards' one transfer (verifiers/guard.py)
    ("ngram", "margin", 0.0): 2,
    ("ngram", "typical", 0.0): 2,
    ("ngram", "bild", 0.0): 2,
    ("ngram", "rejection", 0.8): 2,  # + the recovered or bonus token's draw
    ("draft-model", "exact", 0.0): K + 1,  # + one per draft forward (each drafted token picks the next input)
    ("draft-model", "fly", 0.0): K + 2,
    ("draft-model", "rejection", 0.8): K + 2,
}


@pytest.fixture
def gpu_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(acceptance, "SELECT_ROWS_ON", frozenset())


def step_syncs(target: LoadedModel, draft: LoadedModel, drafter: str, verifier: str, temperature: float) -> list[int]:
    spec = SpeculationConfig(
        drafter=drafter,
        verifier=verifier,
        num_draft_tokens=K,
        draft_model=draft.name if drafter == "draft-model" else None,
    )
    decode = DecodeConfig(max_new_tokens=32, sampling=SamplingConfig(temperature=temperature))
    decoder = build_decoder(target, spec, decode, resources=Resources("float32", models=(target, draft)))
    with counting_steps(decoder) as counter:
        decoder.generate(PROMPT, generator=torch.Generator().manual_seed(0))
    steps = counter.per_step()
    assert len(steps) >= 3, "too few steps to judge"
    return [len(step) for step in steps]


@pytest.mark.parametrize(("drafter", "verifier", "temperature"), list(BUDGETS))
def test_each_decode_step_stays_within_its_sync_budget(
    tiny_target, tiny_draft, gpu_path, drafter: str, verifier: str, temperature: float
) -> None:
    counts = step_syncs(tiny_target, tiny_draft, drafter, verifier, temperature)
    assert max(counts) <= BUDGETS[(drafter, verifier, temperature)], counts


def test_the_counter_sees_every_kind_of_sync() -> None:
    """Each way code waits for a device is counted once (so the budgets above can fail)."""
    tensor = torch.arange(6)
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy", "to")}
    own = set(vars(torch.Tensor))  # some are inherited from torch._C.TensorBase: they must stay so
    cases = {
        "scalar read (.item/bool/int/float)": lambda: tensor[0].item(),
        "tolist": lambda: tensor.tolist(),
        "cpu": lambda: tensor.cpu(),
        "numpy": lambda: tensor.numpy(),
        'to("cpu")': lambda: tensor.to("cpu", torch.int32),
        "nonzero": lambda: torch.nonzero(tensor),
        "boolean-mask index": lambda: tensor[tensor > 2],
        "masked_select": lambda: torch.masked_select(tensor, tensor > 2),
        "unique": lambda: torch.unique(tensor),
    }
    for kind, call in cases.items():
        with SyncCounter() as counter:
            call()
        assert counter.by_kind() == {kind: 1}, (kind, counter.by_kind())
    with SyncCounter() as counter:
        bool(tensor[1] == 1)
        int(tensor[2])
        tensor.to(torch.device("cpu"))  # a model's device object: a move, not a host read (see syncs.py)
        tensor + 1
    assert counter.by_kind() == {"scalar read (.item/bool/int/float)": 2}
    assert {name: getattr(torch.Tensor, name) for name in originals} == originals  # the methods are restored
    assert set(vars(torch.Tensor)) == own


def plugin_batch(batch: int, seed: int = 0) -> tuple[torch.Tensor, list[int], torch.Tensor, int]:
    """A batch of ``batch`` requests with k = 15 drafts: the target's argmax mostly, some misses."""
    from test_guard import VOCAB  # the guards' word vocabulary

    generator = torch.Generator().manual_seed(seed)
    vocab, k = VOCAB, 15
    logits = torch.randn((batch * k, vocab), generator=generator) * 3
    draft = logits.argmax(-1)
    misses = torch.rand(batch * k, generator=generator) < 0.08
    misses[3] = True  # the first request misses at least once
    draft = torch.where(misses, logits.topk(2, dim=-1).indices[:, 1], draft)
    mismatching = int(misses.view(batch, k).any(-1).sum())
    return draft, [k] * batch, logits, mismatching


def fly_rules(batch: int) -> tuple[SpeculationConfig, list[RequestRule]]:
    """Guarded FLy for every request, the guards' token tables built first (the plugin does at start-up)."""
    from test_guard import VOCABULARY

    rule = SpeculationConfig(verifier="fly", guard=GuardConfig())
    prepare_guards(VOCABULARY, rule.guard)
    return rule, [RequestRule(rule=rule, context=VerifyContext([1, 2, 3, 4, 19, 13], 4, VOCABULARY))] * batch


@pytest.mark.parametrize("batch", [1, 32])
def test_the_plugins_rule_syncs_once_per_batch_and_boundedly_per_missed_request(gpu_path, batch: int) -> None:
    """The vLLM plugin's FLy (guards on): no copy of the logits to the host; one sync for the batch, then at most
    four per request whose draft misses the target somewhere (none for the others)."""
    draft, sizes, logits, mismatching = plugin_batch(batch)
    rule, rules = fly_rules(batch)
    with SyncCounter() as counter:
        outcome = apply_batch(draft, sizes, logits, rules)
        keep_draft_tokens(logits, draft, outcome.loose_positions)
    assert "cpu" not in counter.by_kind(), counter.by_site()
    assert counter.total <= 1 + 4 * mismatching, (mismatching, counter.by_site())
    # exactly: per missed request its masks, then the guards and what they kept where a candidate could be
    # committed, then the evidence where something was kept loosely
    expected = 1
    for index in range(batch):
        tokens, rows = draft[index * 15 : (index + 1) * 15], logits[index * 15 : (index + 1) * 15]
        if bool((tokens != rows.argmax(-1)).any()):
            judgement = judge(tokens, rows, rule, rules[index].context)
            expected += 1 + 2 * bool(judgement.candidates) + bool(judgement.loose)
    assert counter.total == expected, counter.by_site()


class DeferringKernel:
    """vLLM's greedy FLy pre-pass as it is launched (``kernel[grid](*args)``), writing the draft token over the
    target's argmax at fixed positions: device work only, like the real kernel."""

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions

    def __getitem__(self, grid: object):  # noqa: ANN204
        return self.launch

    def launch(self, cu_num, draft, target_argmax, *args, **kwargs) -> None:  # noqa: ANN001
        target_argmax[self.positions] = draft[self.positions].to(target_argmax.dtype)


@pytest.mark.parametrize("batch", [1, 32])
def test_the_guards_on_vllms_own_fly_sync_once_per_batch_and_twice_per_loose_request(gpu_path, batch: int) -> None:
    """Issue 52: the native veto (``native.py``) keeps the logits on the device: no row goes to the host; one sync
    for the batch, then two per request where vLLM's FLy kept something (the guards', and what they kept)."""
    from types import SimpleNamespace

    from flyspec_vllm import native

    draft, sizes, logits, _ = plugin_batch(batch)
    argmax = logits.argmax(-1)
    draft = torch.where(torch.arange(draft.shape[0]) % 15 == 4, logits.topk(2, dim=-1).indices[:, 1], argmax)
    loose = (draft != argmax).nonzero().squeeze(-1)[: max(1, batch // 2)]  # vLLM's FLy defers at half the requests
    sampler = SimpleNamespace(apply_fly_greedy_acceptance_kernel=DeferringKernel(loose),
                              apply_fly_random_acceptance_kernel=DeferringKernel(loose))  # fmt: skip
    _, plugin_rules = fly_rules(batch)  # the guards' tables built; with vLLM's FLy each request carries the guards
    rules = [RequestRule(context=rule.context, guard=GuardConfig()) for rule in plugin_rules]
    native.install(sampler, lambda: rules)
    cu_num = torch.tensor(sizes).cumsum(0)
    decided = argmax.clone()
    with SyncCounter() as counter:
        sampler.apply_fly_greedy_acceptance_kernel[(batch,)](cu_num, draft, decided, logits, None, None, 40, 0.1)
    kinds = counter.by_kind()
    assert not {"cpu", 'to("cpu")', "numpy"} & set(kinds), counter.by_site()  # no logits row on the host
    assert counter.total == 1 + 2 * len(loose), counter.by_site()


def test_a_batch_without_lossy_requests_costs_the_plugin_no_sync() -> None:
    draft, sizes, logits, _ = plugin_batch(8)
    with SyncCounter() as counter:
        apply_batch(draft, sizes, logits, [RequestRule()] * 8)
    assert counter.total == 0


def main() -> None:  # the table in DEPLOYMENT.md
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import make_tiny_model, make_tokenizer, noisy_copy

    acceptance.SELECT_ROWS_ON = frozenset()
    target = make_tiny_model(make_tokenizer(), seed=0, name="tiny-target")
    draft = noisy_copy(target, scale=0.3, seed=1)
    print(f"| drafter + verifier (T) | syncs per step: max / median (k = {K}) | budget |")
    print("|---|---:|---:|")
    for (drafter, verifier, temperature), budget in BUDGETS.items():
        counts = sorted(step_syncs(target, draft, drafter, verifier, temperature))
        print(f"| {drafter} + {verifier} (T = {temperature}) | {counts[-1]} / {counts[len(counts) // 2]} | {budget} |")
    for batch in (1, 32):
        draft_ids, sizes, logits, mismatching = plugin_batch(batch)
        _, rules = fly_rules(batch)
        with SyncCounter() as counter:
            apply_batch(draft_ids, sizes, logits, rules)
        kinds = collections.Counter(counter.by_kind())
        print(f"| plugin FLy + guards, batch {batch} ({mismatching} requests missed) | {counter.total} | "
              f"{1 + 4 * mismatching} | {dict(kinds)}")  # fmt: skip


if __name__ == "__main__":
    main()
