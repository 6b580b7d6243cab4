"""flyspec for a model loaded with transformers: ``from_transformers`` and ``model.generate(custom_generate=...)``.

The reference is transformers' own ``generate`` on the same float32 model (it shares no code with flyspec).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import flyspec
from conftest import on_devices
from flyspec.config import ConfigError, SpeculationConfig
from flyspec.resources import Resources
from flyspec.runtime.loaded_model import LoadedModel

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> tuple[torch.nn.Module, object]:
    """A user's model and tokenizer, loaded with transformers (the tiny random Llama, saved by conftest)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def _ids(tokenizer, text: str = PROMPT) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt")["input_ids"]


def test_from_transformers_is_a_target(hf) -> None:
    model, tokenizer = hf
    target = flyspec.from_transformers(model, tokenizer, name="mine")
    assert (target.model, target.tokenizer, target.name) == (model, tokenizer, "mine")
    result = flyspec.generate(PROMPT, target, max_new_tokens=10, use_chat=False, num_draft_tokens=4)
    expected = model.generate(_ids(tokenizer), do_sample=False, max_new_tokens=10)[0, _ids(tokenizer).shape[1] :]
    assert result.token_ids == expected.tolist()


@pytest.mark.parametrize("drafter", ["ngram", "ngram-cache"])
def test_greedy_custom_generate_equals_transformers_generate(hf, drafter: str) -> None:
    model, tokenizer = hf
    for prompt in (PROMPT, "def add(a, b):\n    return", "Once upon a time"):
        input_ids = _ids(tokenizer, prompt)
        expected = model.generate(input_ids, do_sample=False, max_new_tokens=24)
        spec = SpeculationConfig(drafter=drafter, verifier="exact", num_draft_tokens=4)
        got = model.generate(
            input_ids,
            do_sample=False,
            max_new_tokens=24,
            custom_generate=flyspec.custom_generate,
            speculation=spec,
        )
        assert got.tolist() == expected.tolist()


def test_eos_and_stop_strings_as_transformers(hf) -> None:
    model, tokenizer = hf
    input_ids = _ids(tokenizer, "Once upon a time")
    plain = model.generate(input_ids, do_sample=False, max_new_tokens=20)[0, input_ids.shape[1] :].tolist()
    # a token from the middle of the plain output as EOS: both stop there, keeping it
    eos = plain[5]
    expected = model.generate(input_ids, eos_token_id=eos, do_sample=False, max_new_tokens=20)
    got = model.generate(
        input_ids, eos_token_id=eos, do_sample=False, max_new_tokens=20, custom_generate=flyspec.custom_generate
    )
    assert got.tolist() == expected.tolist() and got.shape[1] < input_ids.shape[1] + 20
    # stop strings: transformers 5 drops tokenizer= before a custom_generate callable, and says so itself
    text = tokenizer.decode(plain)
    stop = next(text[i : i + 3] for i in range(4, len(text)) if "\ufffd" not in text[i : i + 3])
    with pytest.raises(ValueError, match="could not locate a tokenizer"):
        model.generate(input_ids, stop_strings=stop, tokenizer=tokenizer, custom_generate=flyspec.custom_generate)
    # ... so stop strings go through from_transformers, cut where transformers cuts
    expected = model.generate(input_ids, stop_strings=stop, tokenizer=tokenizer, do_sample=False, max_new_tokens=20)
    target = flyspec.from_transformers(model, tokenizer)
    result = flyspec.generate("Once upon a time", target, max_new_tokens=20, stop_strings=(stop,), use_chat=False)
    assert result.finish_reason == "stop"
    assert result.token_ids == expected[0, input_ids.shape[1] :].tolist()


def test_sampling_follows_torch_manual_seed_and_the_config(hf) -> None:
    model, tokenizer = hf
    input_ids = _ids(tokenizer)
    options = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9, "max_new_tokens": 12}
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(model.generate(input_ids, custom_generate=flyspec.custom_generate, **options))
    assert runs[0].tolist() == runs[1].tolist() and runs[0].shape[1] <= input_ids.shape[1] + 12
    output = model.generate(input_ids, custom_generate=flyspec.custom_generate, return_dict_in_generate=True, **options)
    assert (
        output.sequences.shape[0] == 1 and output.sequences[0, : input_ids.shape[1]].tolist() == input_ids[0].tolist()
    )


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_beams": 2}, "num_beams=2 is not supported"),
        ({"do_sample": True, "num_return_sequences": 2}, "num_return_sequences=2"),
        ({"repetition_penalty": 1.3}, "RepetitionPenaltyLogitsProcessor"),
        ({"min_new_tokens": 3}, "MinNewTokensLengthLogitsProcessor"),
        ({"do_sample": True, "min_p": 0.1}, "MinPLogitsWarper"),
        ({"max_time": 10.0}, "MaxTimeCriteria"),
        ({"return_dict_in_generate": True, "output_scores": True}, "output_scores"),
    ],
)
def test_unsupported_generation_options_are_refused(hf, options: dict, message: str) -> None:
    model, tokenizer = hf
    with pytest.raises(ConfigError, match=message):
        model.generate(_ids(tokenizer), max_new_tokens=5, custom_generate=flyspec.custom_generate, **options)


def test_batches_padding_and_a_missing_tokenizer_are_refused(hf, tiny_target: LoadedModel) -> None:
    model, tokenizer = hf
    batch = torch.cat([_ids(tokenizer), _ids(tokenizer)])
    with pytest.raises(ConfigError, match="one prompt at a time"):
        model.generate(batch, max_new_tokens=5, custom_generate=flyspec.custom_generate)
    input_ids = _ids(tokenizer)
    mask = torch.ones_like(input_ids)
    mask[0, 0] = 0
    with pytest.raises(ConfigError, match="padding"):
        model.generate(input_ids, attention_mask=mask, max_new_tokens=5, custom_generate=flyspec.custom_generate)
    in_memory = tiny_target.model  # built in memory: no directory holds its tokenizer
    with pytest.raises(ConfigError, match="could not load the tokenizer.*from_transformers"):
        in_memory.generate(input_ids, max_new_tokens=5, custom_generate=flyspec.custom_generate, tokenizer=tokenizer)


def test_each_call_keeps_its_own_eos_when_resources_are_shared(hf) -> None:
    """``resources=`` shares drafters' state between calls, never the first call's generation config."""
    model, tokenizer = hf
    input_ids = _ids(tokenizer, "Once upon a time")
    plain = model.generate(input_ids, do_sample=False, max_new_tokens=20)[0, input_ids.shape[1] :].tolist()
    eos = plain[5]
    shared = Resources(models=())
    options = {"do_sample": False, "max_new_tokens": 20, "custom_generate": flyspec.custom_generate}
    first = model.generate(input_ids, eos_token_id=eos, resources=shared, **options)
    second = model.generate(input_ids, eos_token_id=plain[-1] + 10_000, resources=shared, **options)
    assert first.shape[1] < input_ids.shape[1] + 20  # stopped at its EOS
    assert second[0, input_ids.shape[1] :].tolist() == plain  # the second call's EOS never comes: full length


@on_devices
def test_sampling_draws_on_the_models_device(tiny_model_dir: Path, device: str) -> None:
    """Inputs on the CPU with the model elsewhere (transformers accepts that): the generator follows the model."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().to(device)
    input_ids = _ids(AutoTokenizer.from_pretrained(tiny_model_dir))  # on the CPU
    torch.manual_seed(0)
    output = model.generate(
        input_ids, do_sample=True, temperature=0.9, max_new_tokens=6, custom_generate=flyspec.custom_generate
    )
    assert output.shape[1] <= input_ids.shape[1] + 6
    assert output[0, : input_ids.shape[1]].tolist() == input_ids[0].tolist()
