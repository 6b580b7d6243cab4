"""Lossless identity against an independent reference: no flyspec code on the reference side.

``naive_greedy`` recomputes the whole sequence with the Hugging Face model at every step (no
cache, no Target, no Stopper, no Decoder), and transformers' own ``generate(do_sample=False)``
is a second, separately written reference. A bug shared by flyspec's fast path and its
``PlainDecoder`` cannot pass these tests. Float32 tiny random models, so argmaxes are exact.
"""

from __future__ import annotations

import pytest
import torch

from conftest import on_device, on_devices
from flyspec import (
    DecodeConfig,
    LayerSkipConfig,
    Resources,
    SpeculationConfig,
    build_decoder,
)
from flyspec.runtime.loaded_model import LoadedModel

PROMPTS = ("The capital of France is", "def add(a, b):", "Once upon a time there was")
MAX_NEW_TOKENS = 24


@torch.no_grad()
def naive_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Full recompute, argmax of the last position, append; nothing else."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids], device=model.device)).logits[0, -1]  # [vocab]
        ids.append(int(logits.argmax()))
    return ids[len(prompt_ids) :]


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    output = model.generate(
        torch.tensor([prompt_ids], device=model.device),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=model.device),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=0,
    )
    return output[0, len(prompt_ids) :].tolist()


_REFERENCES: dict[str, dict[str, list[int]]] = {}


def references_on(target: LoadedModel) -> dict[str, list[int]]:
    """The naive reference of every prompt, computed on the target's own device (once per device)."""
    key = str(target.device)
    if key not in _REFERENCES:
        found = {}
        for prompt in PROMPTS:
            ids = target.tokenizer.encode(prompt)
            naive = naive_greedy(target.model, ids, MAX_NEW_TOKENS)
            hf = hf_greedy(target.model, ids, MAX_NEW_TOKENS)  # stops after EOS; the decoder runs with ignore_eos
            assert len(hf) > 5 and naive[: len(hf)] == hf, "the two references disagree"
            found[prompt] = naive
        _REFERENCES[key] = found
    return _REFERENCES[key]


@pytest.fixture(scope="module")
def references(tiny_target: LoadedModel) -> dict[str, list[int]]:
    return references_on(tiny_target)


@pytest.mark.parametrize("verifier", ["exact", "rejection"])
@pytest.mark.parametrize(
    ("drafter", "stack"),
    [
        ("ngram", ()),
        ("ngram-cache", ()),
        ("draft-model", ()),
        ("multilevel", ()),
        ("layer-skip", ()),
        ("stack", ("ngram", "DRAFT", "layer-skip")),
    ],
)
@pytest.mark.parametrize("num_draft_tokens", [1, 4])
@on_devices
def test_lossless_equals_the_independent_reference(
    tiny_target: LoadedModel,
    tiny_draft: LoadedModel,
    verifier: str,
    drafter: str,
    stack: tuple[str, ...],
    num_draft_tokens: int,
    device: str,
) -> None:
    tiny_target, tiny_draft = on_device(tiny_target, device), on_device(tiny_draft, device)
    references = references_on(tiny_target)
    spec = SpeculationConfig(
        drafter=drafter,
        verifier=verifier,
        num_draft_tokens=num_draft_tokens,
        draft_model=tiny_draft.name,
        stack=tuple(tiny_draft.name if level == "DRAFT" else level for level in stack),
        num_proposal_tokens=2,
        layer_skip=LayerSkipConfig(skip_layers=(1,)),  # the tiny target has 2 layers: too few to calibrate
    )
    resources = Resources(models=(tiny_target, tiny_draft))
    decoder = build_decoder(
        tiny_target, spec, DecodeConfig(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True), resources=resources
    )
    for prompt, expected in references.items():
        ids = tiny_target.tokenizer.encode(prompt)
        assert decoder.generate(ids).token_ids == expected, (drafter, verifier, prompt, device)


def test_the_reference_can_fail(tiny_target: LoadedModel, references: dict[str, list[int]]) -> None:
    """A decoder that drifts by one token is caught (the comparison is not vacuous)."""
    prompt, expected = next(iter(references.items()))
    assert naive_greedy(tiny_target.model, tiny_target.tokenizer.encode(prompt)[:-1], MAX_NEW_TOKENS) != expected
