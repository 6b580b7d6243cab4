"""Coupled sampling (``sampling/coupled.py``): the seed decides the text, not the speculation.

- The noise: a function of (key, stream, position) alone, Gumbel-distributed, a row of any vocabulary width a
  prefix of a wider one; the key is one draw of the generator.
- Gumbel-max over the filtered logits is an exact sample of the filtered distribution (χ²), top-k and top-p too.
- End to end on tiny float32 models: plain sampling and speculative decoding with a lossless verifier commit the
  same tokens for the same seed — every drafter, any draft length, top-k / top-p (hypothesis over them).
- The engine's speculative sampling is checked against plain sampling as a distribution as well (χ² on the token
  the first verification decides, after a fixed prompt), for the rules whose text is not plain sampling's own
  (rejection sampling and block verification of a draft model's sampled drafts).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from flyspec import (
    DecodeConfig,
    PlainDecoder,
    SamplingConfig,
    SpeculationConfig,
    SpeculativeDecoder,
    build_decoder,
    make_generator,
)
from flyspec.config import LayerSkipConfig
from flyspec.resources import Resources
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.sampling.coupled import BLOCK, RESIDUAL, TOKEN, CoupledNoise, Draws, block_size
from flyspec.sampling.sampler import logits_to_probs
from flyspec.types import Draft, Verdict

PROMPT = "The capital of France is Paris. The capital of"
DRAFTERS = {
    "ngram": {},
    "ngram-cache": {"drafter": "ngram-cache"},
    "draft-model": {"drafter": "draft-model"},
    "multilevel": {"drafter": "multilevel", "num_proposal_tokens": 3},
    "layer-skip": {"drafter": "layer-skip", "layer_skip": LayerSkipConfig(skip_layers=(1,))},
}
SAMPLINGS = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.7, top_k=20),
    SamplingConfig(temperature=1.3, top_p=0.9),
]


# --------------------------------------------------------------------------- the noise


def test_noise_is_a_function_of_key_stream_and_position_alone() -> None:
    first, again = CoupledNoise(key=11, device=torch.device("cpu")), CoupledNoise(key=11, device=torch.device("cpu"))
    for position in (0, 5, 3):  # asked in another order, and again
        assert torch.equal(first.gumbel(position, 300), again.gumbel(position, 300))
    assert not torch.equal(first.gumbel(5, 300), first.gumbel(6, 300))
    assert not torch.equal(first.gumbel(5, 300, TOKEN), first.gumbel(5, 300, RESIDUAL))
    assert not torch.equal(first.gumbel(5, 300), CoupledNoise(12, torch.device("cpu")).gumbel(5, 300))
    drawn = first.num_rows_drawn
    first.gumbel(5, 300)
    assert first.num_rows_drawn == drawn  # remembered, not drawn again


def test_a_row_is_a_prefix_of_a_wider_one() -> None:
    """A draft model's vocabulary may be padded otherwise than the target's: their common columns share noise."""
    noise = CoupledNoise(key=3, device=torch.device("cpu"))
    for narrow, wide in [(49152, 49280), (BLOCK, 3 * BLOCK + 5), (BLOCK // 2 + 1, BLOCK)]:
        assert block_size(narrow) == block_size(wide) == BLOCK
        assert torch.equal(noise.gumbel(1, wide)[:narrow], CoupledNoise(3, torch.device("cpu")).gumbel(1, narrow))


def test_the_noise_is_gumbel_distributed() -> None:
    values = CoupledNoise(key=5, device=torch.device("cpu")).gumbel(0, 200_000).double().numpy()
    assert values.mean() == pytest.approx(np.euler_gamma, abs=0.01)  # Gumbel(0, 1): mean γ, variance π²/6
    assert values.var() == pytest.approx(np.pi**2 / 6, abs=0.03)
    assert np.isfinite(values).all()


def test_the_key_is_one_draw_of_the_generator() -> None:
    seeded = [CoupledNoise.draw(make_generator(4), "cpu").key for _ in range(2)]
    assert seeded[0] == seeded[1]  # a seed names one key
    reused = make_generator(4)
    assert CoupledNoise.draw(reused, "cpu").key != CoupledNoise.draw(reused, "cpu").key  # a reused one moves on


@pytest.mark.parametrize("sampling", SAMPLINGS[:1] + [SamplingConfig(0.6, top_k=3), SamplingConfig(1.2, top_p=0.7)])
def test_gumbel_max_samples_the_filtered_distribution(sampling: SamplingConfig) -> None:
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.6, 0.0, -0.5]])
    expected = logits_to_probs(logits, sampling)[0].double().numpy()
    counts = np.zeros(6)
    for seed in range(6000):
        counts[int(Draws.seeded(seed, position=9).choose(logits, sampling)[0])] += 1
    kept = expected > 0
    assert counts[~kept].sum() == 0  # a filtered token is never drawn
    assert chisquare(counts[kept], expected[kept] / expected[kept].sum() * counts.sum()).pvalue > 1e-3
    # negative control: the same test rejects these counts as draws of another distribution on the kept tokens
    assert chisquare(counts[kept], np.full(kept.sum(), counts.sum() / kept.sum())).pvalue < 1e-6


# --------------------------------------------------------------------------- one seed, one text


def decoders(
    target: LoadedModel, draft: LoadedModel, drafter: str, verifier: str, k: int, decode: DecodeConfig
) -> SpeculativeDecoder:
    fields = {**DRAFTERS[drafter], "verifier": verifier, "num_draft_tokens": k}
    if drafter in ("draft-model", "multilevel"):
        fields["draft_model"] = draft.name
    return build_decoder(target, SpeculationConfig(**fields), decode, resources=Resources(models=(target, draft)))


def sampled(decoder, prompt, seed: int) -> list[int]:  # noqa: ANN001
    return decoder.generate(prompt, generator=make_generator(seed), use_chat=False).token_ids


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["T1", "T0.7-top_k20", "T1.3-top_p0.9"])
def test_exact_commits_plain_samplings_text_for_every_drafter(
    tiny_target: LoadedModel, tiny_draft: LoadedModel, drafter: str, sampling: SamplingConfig
) -> None:
    decode = DecodeConfig(max_new_tokens=24, ignore_eos=True, sampling=sampling)
    plain = PlainDecoder(tiny_target, decode)
    texts = {seed: sampled(plain, PROMPT, seed) for seed in (1, 2)}
    assert texts[1] != texts[2]  # the seed matters
    for k in (1, 4, 9):
        decoder = decoders(tiny_target, tiny_draft, drafter, "exact", k, decode)
        for seed, expected in texts.items():
            result = decoder.generate(PROMPT, generator=make_generator(seed), use_chat=False)
            assert result.token_ids == expected, (drafter, k, seed)
            if drafter == "draft-model" and k == 4:  # the coupled draft model proposes the target's samples
                assert result.stats.num_accepted > 0


@pytest.mark.parametrize("verifier", ["rejection", "fly", "margin", "bild", "lenience"])
def test_rules_that_take_plain_samplings_token_commit_its_text_with_ngram_drafts(
    tiny_target: LoadedModel, tiny_draft: LoadedModel, verifier: str
) -> None:
    """n-gram drafts are deterministic: rejection sampling is exact match on the coupled sample there, and a lossy
    rule whose loosening never applies (a gate nothing passes) commits plain sampling's text: each relaxes that
    sample, not another draw."""
    decode = DecodeConfig(max_new_tokens=24, ignore_eos=True, sampling=SamplingConfig(temperature=1.0))
    expected = sampled(PlainDecoder(tiny_target, decode), PROMPT, 5)
    strictest = {
        "rejection": {},
        "fly": {"fly": {"entropy_threshold": 1e9}},
        "margin": {"margin": {"logit_ratio": 0.999999}},
        "bild": {"bild": {"rollback_threshold": 1e-9}},
        "lenience": {"lenience": {"lenience": 1.0}},
    }[verifier]
    config = SpeculationConfig.from_dict({"verifier": verifier, "num_draft_tokens": 8, **strictest})
    decoder = build_decoder(tiny_target, config, decode, resources=Resources(models=(tiny_target, tiny_draft)))
    result = decoder.generate(PROMPT, generator=make_generator(5), use_chat=False)
    assert result.stats.num_loose_accepts == 0
    assert result.token_ids == expected, verifier


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(st.integers(min_value=2, max_value=299), min_size=1, max_size=24),
    num_draft_tokens=st.integers(min_value=1, max_value=10),
    drafter=st.sampled_from(sorted(DRAFTERS)),
    temperature=st.sampled_from([0.5, 1.0, 1.5]),
    top_k=st.sampled_from([0, 5, 50]),
    top_p=st.sampled_from([1.0, 0.8]),
    seed=st.integers(min_value=0, max_value=2**31),
    max_new_tokens=st.integers(min_value=1, max_value=20),
)
def test_property_the_seed_decides_the_text(
    tiny_target, tiny_draft, prompt, num_draft_tokens, drafter, temperature, top_k, top_p, seed, max_new_tokens
) -> None:  # noqa: ANN001
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    decode = DecodeConfig(max_new_tokens=max_new_tokens, ignore_eos=True, sampling=sampling)
    expected = sampled(PlainDecoder(tiny_target, decode), prompt, seed)
    decoder = decoders(tiny_target, tiny_draft, drafter, "exact", num_draft_tokens, decode)
    assert sampled(decoder, prompt, seed) == expected
    assert len(expected) == max_new_tokens


def test_rejection_sampling_of_a_draft_models_samples_keeps_one_text_per_seed(
    tiny_target: LoadedModel, tiny_draft: LoadedModel
) -> None:
    """Its text is not plain sampling's (it accepts more), but every draw is keyed by position: one text per seed
    and draft length, whatever ran before in the process."""
    decode = DecodeConfig(max_new_tokens=24, ignore_eos=True, sampling=SamplingConfig(temperature=1.0))
    decoder = decoders(tiny_target, tiny_draft, "draft-model", "rejection", 4, decode)
    first = sampled(decoder, PROMPT, 3)
    torch.rand(100)  # torch's global generator moves: nothing here reads it
    assert sampled(decoders(tiny_target, tiny_draft, "draft-model", "rejection", 4, decode), PROMPT, 3) == first
    assert sampled(decoder, PROMPT, 4) != first


# --------------------------------------------------------------------------- the distribution, engine end to end


def next_token_distribution(target: LoadedModel, prompt_ids: list[int], sampling: SamplingConfig) -> np.ndarray:
    """The exact distribution of the second generated token: ``Σ_a p(a) p(b | a)`` (one batched forward)."""
    with torch.no_grad():
        first = logits_to_probs(target.model(torch.tensor([prompt_ids])).logits[0, -1], sampling)  # [vocab]
        vocab = first.shape[0]
        batch = torch.cat([torch.tensor([prompt_ids]).expand(vocab, -1), torch.arange(vocab).unsqueeze(1)], dim=1)
        second = logits_to_probs(target.model(batch).logits[:, -1], sampling)  # [vocab, vocab]
    return (first.double().unsqueeze(1) * second.double()).sum(0).numpy()


class KeepsEveryDraftToken:
    """Broken on purpose (the control): commits the drafts unchecked, so the draft model's distribution."""

    name, lossless, min_draft_tokens = "keep-all", False, 1

    def new_state(self) -> None:
        return None

    def verify(self, draft: Draft, target_logits, sampling, draws, context=None) -> Verdict:  # noqa: ANN001
        return Verdict(draft.tokens.tolist() + [int(target_logits[-1].argmax())], draft.num_tokens, bonus=True)


def second_token_p_value(decoder, prompt_ids: list[int], expected: np.ndarray, trials: int) -> float:  # noqa: ANN001
    counts = np.bincount([sampled(decoder, prompt_ids, seed)[1] for seed in range(trials)], minlength=len(expected))
    bins = expected * trials >= 5  # cells expected at least 5 times, the rest pooled
    observed = np.append(counts[bins], counts[~bins].sum())
    wanted = np.append(expected[bins], expected[~bins].sum())
    return float(chisquare(observed, wanted / wanted.sum() * trials).pvalue)


@pytest.mark.parametrize(
    ("drafter", "verifier"), [("draft-model", "rejection"), ("draft-model", "block"), ("draft-model", "exact")]
)
def test_speculative_sampling_follows_the_targets_distribution(
    tiny_target: LoadedModel, tiny_draft: LoadedModel, drafter: str, verifier: str
) -> None:
    """χ² on the token the first verification decides (the first comes from the prefill alone), against its exact
    distribution under the target; a decoder that keeps its drafts unchecked fails the same test."""
    sampling = SamplingConfig(temperature=0.6)
    prompt_ids = tiny_target.encode_prompt("The capital of", use_chat=False)
    expected = next_token_distribution(tiny_target, prompt_ids, sampling)
    decode = DecodeConfig(max_new_tokens=2, ignore_eos=True, sampling=sampling)
    decoder = decoders(tiny_target, tiny_draft, drafter, verifier, 4, decode)
    assert second_token_p_value(decoder, prompt_ids, expected, trials=2000) > 1e-3
    draft_expected = next_token_distribution(tiny_draft, prompt_ids, sampling)
    assert 0.5 * np.abs(draft_expected - expected).sum() > 0.1  # the two models really differ here
    broken = SpeculativeDecoder(
        tiny_target, decoder.drafter, KeepsEveryDraftToken(), decode, SpeculationConfig(num_draft_tokens=4)
    )
    assert second_token_p_value(broken, prompt_ids, expected, trials=2000) < 1e-6
