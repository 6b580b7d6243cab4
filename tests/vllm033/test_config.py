"""What vLLM 0.33's real config code decides for the plugin, read from it (not from our notes), so that a later vLLM
that moves a decision fails here: which model runner an engine gets (``VllmConfig.use_v2_model_runner``), that the
batch schedule is dropped for ``custom_class`` on V1 (``_maybe_disable_dynamic_sd_for_v1``, the plugin's proposer
then reads ``FLYSPEC_VLLM_SCHEDULE``), and the plugin's line or refusal at engine start for each runner."""

from __future__ import annotations

import logging
import types
from types import SimpleNamespace

import pytest
from flyspec_vllm import internals, proposer, startup
from plugin_harness import installed
from vllm.config import VllmConfig
from vllm.config.speculative import SpeculativeConfig

SCHEDULE = [(1, 4, 8), (5, 64, 0)]


class Config:
    """The fields of a ``VllmConfig`` that 0.33's runner choice and schedule check read, with its real property and
    methods (a whole ``VllmConfig`` needs a model)."""

    use_v2_model_runner = VllmConfig.use_v2_model_runner
    _get_v2_model_runner_unsupported_features = VllmConfig._get_v2_model_runner_unsupported_features
    _maybe_disable_dynamic_sd_for_v1 = VllmConfig._maybe_disable_dynamic_sd_for_v1

    def __init__(self, method: str, schedule: list | None = None, rejection: str = "standard") -> None:
        self.attention_config = SimpleNamespace(hisparse_config=None)
        self.watermark_config = None
        self.parallel_config = SimpleNamespace(distributed_executor_backend="mp", pipeline_parallel_size=1,
                                               use_ubatching=False, data_parallel_size=1)  # fmt: skip
        speculative = SimpleNamespace(method=method, parallel_drafting=False, use_heterogeneous_vocab=False,
                                      num_speculative_tokens=8, num_speculative_tokens_per_batch_size=schedule,
                                      rejection_sample_method=rejection, prompt_lookup_max=None,
                                      prompt_lookup_min=None)  # fmt: skip
        speculative.uses_dynamic_speculative_decoding = types.MethodType(
            SpeculativeConfig.uses_dynamic_speculative_decoding, speculative
        )
        self.speculative_config = speculative
        self.model_config = SimpleNamespace(max_model_len=64)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3", "mtp"])
def test_vllm_033_runs_its_own_drafters_on_the_v2_runner(monkeypatch, method: str) -> None:
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert internals.runner_of(Config(method)) == internals.V2
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert internals.runner_of(Config(method)) == internals.V1


@pytest.mark.parametrize("method", ["custom_class", "suffix"])
def test_vllm_033_runs_custom_class_and_suffix_on_the_v1_runner(monkeypatch, method: str) -> None:
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert internals.runner_of(Config(method)) == internals.V1


def test_the_schedule_reaches_the_plugins_proposer_although_vllm_033_drops_it(monkeypatch) -> None:
    """0.33 keeps num_speculative_tokens_per_batch_size for its n-gram proposer and drops it for custom_class; the
    profile's deploy block carries it in FLYSPEC_VLLM_SCHEDULE, which the proposer reads."""
    from flyspec.calibration.deploy import deployment

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    ngram = Config("ngram", list(SCHEDULE))
    ngram._maybe_disable_dynamic_sd_for_v1()
    assert ngram.speculative_config.num_speculative_tokens_per_batch_size == SCHEDULE
    entries = [list(entry) for entry in SCHEDULE]
    schedule = {"num_speculative_tokens_per_batch_size": entries}
    record = {"chosen": None, "engine": {"name": "vllm"}, "schedule": schedule}
    block = deployment(record)["vllm_plugin"]
    ours = Config(block["speculative_config"]["method"], [list(entry) for entry in SCHEDULE])
    ours._maybe_disable_dynamic_sd_for_v1()
    assert ours.speculative_config.num_speculative_tokens_per_batch_size is None  # dropped (vLLM warns)
    monkeypatch.delenv(proposer.SCHEDULE_VARIABLE, raising=False)
    assert proposer.NgramProposer(ours).schedule is None  # what the key alone would have given
    for name, value in block["environment"].items():
        monkeypatch.setenv(name, value)
    drafter = proposer.NgramProposer(ours)
    assert [drafter.draft_limit(batch) for batch in (1, 4, 5, 64)] == [8, 8, 0, 0]


def test_at_engine_start_the_plugin_says_what_it_does_on_the_runner_vllm_chose(monkeypatch, caplog) -> None:
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    with installed(monkeypatch), caplog.at_level(logging.INFO, logger="flyspec_vllm"):
        assert getattr(VllmConfig.__post_init__, internals.MARK, False)  # runs at the end of every VllmConfig
        startup.check_engine(Config("ngram", rejection="fly"))
        assert "V2 model runner: vLLM's own FLy with flyspec's trust guards" in caplog.records[-1].getMessage()
        startup.check_engine(Config("custom_class"))
        assert "V1 model runner: flyspec's per-request rules" in caplog.records[-1].getMessage()
        assert startup.SETUP is not None
        monkeypatch.setitem(startup.SETUP.problems, internals.V2, ["RejectionSampler._verify: changed"])
        with pytest.raises(ValueError, match="V2 model runner differs.*VLLM_USE_V2_MODEL_RUNNER=0"):
            startup.check_engine(Config("ngram", rejection="fly"))  # vLLM's FLy would run without the guards
        startup.check_engine(Config("ngram"))  # no FLy of vLLM's, switch 'request': said, not refused
        assert "not hooked" in caplog.records[-1].getMessage() and caplog.records[-1].levelno == logging.WARNING
