"""The lm-evaluation-harness model ``flyspec`` on the five-question task in examples/lm_eval (offline)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install 'flyspec[lmeval]' (make setup does)")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from conftest import on_device, on_devices  # noqa: E402
from flyspec.config import ConfigError  # noqa: E402
from flyspec.integrations.lmeval import FlyspecLM, main, speculation_from_args  # noqa: E402
from flyspec.runtime.loaded_model import LoadedModel  # noqa: E402

TASK_DIR = Path(__file__).resolve().parent.parent / "examples" / "lm_eval"
TASK = "flyspec_arithmetic"
UNTIL = ["\n", ".", "Question:", "Answer:", "\n\n", "Q:"]


@pytest.fixture(scope="module")
def task_manager() -> TaskManager:
    return TaskManager(include_path=str(TASK_DIR), include_defaults=False)


def _responses(model, task_manager: TaskManager, **options) -> tuple[list[str], dict]:
    results = lm_eval.simple_evaluate(model=model, tasks=[TASK], task_manager=task_manager, log_samples=True, **options)
    samples = sorted(results["samples"][TASK], key=lambda sample: sample["doc_id"])
    return [sample["resps"][0][0] for sample in samples], results["results"][TASK]


def test_greedy_exact_generation_equals_lm_evals_hf_model(tiny_target: LoadedModel, task_manager: TaskManager) -> None:
    flyspec_lm = FlyspecLM(target=tiny_target, verifier="exact", drafter="ngram", num_draft_tokens=4)
    flyspec_responses, flyspec_metrics = _responses(flyspec_lm, task_manager)
    hf_responses, hf_metrics = _responses(
        HFLM(pretrained=tiny_target.model, tokenizer=tiny_target.tokenizer), task_manager
    )
    assert len(flyspec_responses) == 5
    assert flyspec_responses == hf_responses  # lossless: `--model hf` generates the same text
    assert flyspec_metrics["exact_match,last-number"] == hf_metrics["exact_match,last-number"]


def test_loglikelihood_is_the_targets_whatever_the_verifier(tiny_target: LoadedModel) -> None:
    requests = [
        Instance("loglikelihood", doc={}, arguments=("The capital of France is", " Paris"), idx=0),
        Instance("loglikelihood", doc={}, arguments=("def add(a, b):", " return"), idx=1),
    ]
    hf = HFLM(pretrained=tiny_target.model, tokenizer=tiny_target.tokenizer).loglikelihood(requests)
    fly = FlyspecLM(target=tiny_target, verifier="fly", num_draft_tokens=8).loglikelihood(requests)
    assert [logprob for logprob, _ in fly] == pytest.approx([logprob for logprob, _ in hf])
    assert [greedy for _, greedy in fly] == [greedy for _, greedy in hf]
    assert all(logprob < 0 for logprob, _ in fly)


def test_sampled_generation_is_seeded_and_honours_max_gen_toks(tiny_target: LoadedModel) -> None:
    model = FlyspecLM(target=tiny_target, verifier="rejection", num_draft_tokens=4, seed=7)
    kwargs = {"until": ["\n\n"], "do_sample": True, "temperature": 0.8, "top_p": 0.9, "max_gen_toks": 6}
    requests = [Instance("generate_until", doc={}, arguments=("Once upon a time", kwargs), idx=0)]
    results = []
    generate = model.decoder.generate
    model.decoder.generate = lambda *args, **options: results.append(generate(*args, **options)) or results[-1]
    first, second = model.generate_until(requests), model.generate_until(requests)
    assert first == second
    assert [result.token_ids for result in results[:1]] == [result.token_ids for result in results[1:]]
    assert [len(result.token_ids) for result in results] == [6, 6]  # no "\n\n" from the random model
    decode, until = model.decode_config(kwargs, eos="</s>")
    assert (decode.max_new_tokens, decode.sampling.temperature, decode.sampling.top_p) == (6, 0.8, 0.9)
    assert until == ["\n\n", "</s>"]


def test_unsupported_generation_options_are_refused(tiny_target: LoadedModel) -> None:
    model = FlyspecLM(target=tiny_target, num_draft_tokens=4)
    with pytest.raises(ConfigError, match="num_beams, repetition_penalty"):
        model.decode_config({"until": ["\n"], "num_beams": 4, "repetition_penalty": 1.1}, eos="</s>")
    with pytest.raises(ConfigError, match="temperature > 0"):
        model.decode_config({"do_sample": True, "temperature": 0.0}, eos="</s>")


def test_model_args_build_the_speculation_config(tiny_target: LoadedModel) -> None:
    spec = speculation_from_args(
        {"verifier": "fly", "window_size": 3, "stack": "ngram+draft-a", "drafter": "stack", "protect": "digits"}
    )
    assert (spec.verifier, spec.fly.window_size, spec.stack, spec.guard.protect) == (
        "fly",
        3,
        ("ngram", "draft-a"),
        ("digits",),
    )
    from_json = speculation_from_args({"speculative_config": '{"method": "ngram", "num_speculative_tokens": 5}'})
    assert from_json.num_draft_tokens == 5
    with pytest.raises(ConfigError, match="unknown flyspec model_args pretrained"):
        FlyspecLM(target=tiny_target, pretrained="gpt2")
    with pytest.raises(ConfigError, match="window_size"):
        speculation_from_args({"window_size": -1})


def test_command_line_runs_the_task(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``python -m flyspec.integrations.lmeval`` is lm-eval's CLI with ``--model flyspec`` registered."""
    model_args = f"target={tiny_model_dir},verifier=fly,num_draft_tokens=8,dtype=float32"
    main(
        ["--model", "flyspec", "--model_args", model_args, "--include_path", str(TASK_DIR), "--tasks", TASK]
        + ["--device", "cpu", "--output_path", str(tmp_path), "--log_samples"]
    )
    (results_file,) = tmp_path.rglob("results_*.json")
    results = json.loads(results_file.read_text())
    assert results["results"][TASK]["exact_match,last-number"] in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    assert results["config"]["model"] == "flyspec"
    (samples_file,) = tmp_path.rglob(f"samples_{TASK}_*.jsonl")
    assert len(samples_file.read_text().splitlines()) == 5


def test_local_completions_against_flyspec_serve(
    tiny_target: LoadedModel, tiny_model_dir: Path, task_manager: TaskManager
) -> None:
    """lm-eval's own ``local-completions`` model (token-id prompts, its stop words + EOS, seed) on ``flyspec serve``."""
    from flyspec.config import SpeculationConfig
    from flyspec.server.app import create_app
    from server_helpers import RunningServer

    app = create_app(tiny_target, SpeculationConfig(num_draft_tokens=4), served_model_name="tiny")
    with RunningServer(app) as server:
        model_args = {
            "model": "tiny",
            "base_url": f"{server.url}/v1/completions",
            "tokenizer": str(tiny_model_dir),
            "tokenizer_backend": "huggingface",
            "max_retries": 1,
        }
        # more stop strings than OpenAI's 4, and a vLLM extra at its no-op value, as tasks send them
        served, _ = _responses(
            "local-completions", task_manager, model_args=model_args, gen_kwargs={"until": UNTIL, "min_p": 0.0}
        )
    local_lm = FlyspecLM(target=tiny_target, verifier="exact", num_draft_tokens=4)
    local, _ = _responses(local_lm, task_manager, gen_kwargs={"until": UNTIL})
    assert len(served) == 5
    assert served == local  # the same lossless generation, over HTTP


def test_repeated_sampled_requests_draw_different_samples(tiny_target: LoadedModel) -> None:
    """A task with ``repeats: k`` sends the same request k times in one call: k samples, not one sample k times."""
    model = FlyspecLM(target=tiny_target, verifier="rejection", num_draft_tokens=4, seed=7)
    kwargs = {"until": ["\n\n"], "do_sample": True, "temperature": 1.0, "max_gen_toks": 8}
    requests = [Instance("generate_until", doc={}, arguments=("Once upon a time", kwargs), idx=0)] * 3
    results = []
    generate = model.decoder.generate
    model.decoder.generate = lambda *args, **options: results.append(generate(*args, **options)) or results[-1]
    first = model.generate_until(requests)
    assert len({tuple(result.token_ids) for result in results}) > 1
    assert model.generate_until(requests) == first  # each call is reproducible from `seed`


def test_max_gen_toks_that_leaves_no_room_for_the_prompt_is_refused(tiny_target: LoadedModel) -> None:
    model = FlyspecLM(target=tiny_target, num_draft_tokens=4, max_length=64)
    kwargs = {"until": ["\n\n"], "max_gen_toks": 64}
    requests = [Instance("generate_until", doc={}, arguments=("Once upon a time", kwargs), idx=0)]
    with pytest.raises(ConfigError, match="max_gen_toks 64 .* max_length 64"):
        model.generate_until(requests)


def test_truncation_option_reaches_the_prompt_encoding(tiny_target: LoadedModel) -> None:
    model = FlyspecLM(target=tiny_target, num_draft_tokens=4, truncation=True)
    seen = []
    encode = model.tok_batch_encode
    model.tok_batch_encode = lambda *args, **options: seen.append(options) or encode(*args, **options)
    kwargs = {"until": ["\n\n"], "max_gen_toks": 4}
    model.generate_until([Instance("generate_until", doc={}, arguments=("Once upon a time", kwargs), idx=0)])
    assert seen and seen[0].get("truncation") is True


def test_command_line_reports_a_config_error_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(
            ["--model", "flyspec", "--model_args", "target=x,window_size=-1", "--include_path", str(TASK_DIR)]
            + ["--tasks", TASK, "--device", "cpu"]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "window_size" in err and "Traceback" not in err


@on_devices
def test_sampling_draws_on_the_targets_device(tiny_target: LoadedModel, device: str, monkeypatch) -> None:
    """A CUDA target needs a CUDA generator (flyspec refuses another); the CPU case checks what is asked for."""
    import flyspec.integrations.lmeval as lmeval_module

    model = FlyspecLM(target=on_device(tiny_target, device), verifier="rejection", num_draft_tokens=4, seed=3)
    made = []
    make = lmeval_module.make_generator
    monkeypatch.setattr(lmeval_module, "make_generator", lambda *args: made.append(args) or make(*args))
    kwargs = {"until": ["\n\n"], "do_sample": True, "temperature": 0.8, "max_gen_toks": 4}
    model.generate_until([Instance("generate_until", doc={}, arguments=("Once upon a time", kwargs), idx=0)])
    assert model.decoder.device.type == torch.device(device).type
    assert made == [(3, model.decoder.device)]
