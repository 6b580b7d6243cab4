"""Prefix reuse (runtime/target.py): a decoder's next generation keeps the cached positions its prompt shares
with the previous generation's committed tokens, prefills only the rest, and decodes as a fresh start."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_gemma3
from flyspec import DecodeConfig, PlainDecoder, SpeculativeDecoder, make_verifier
from flyspec.config import SpeculationConfig
from flyspec.decoding.generation import Decoder
from flyspec.drafters.ngram import NgramDrafter
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.target import Target
from test_kernels import with_kernels

CONFIG = DecodeConfig(max_new_tokens=24, ignore_eos=True)
FIRST = "Once upon a time there was a small model that"


def decoders(target: LoadedModel) -> list[Decoder]:
    speculation = SpeculationConfig(num_draft_tokens=6)
    return [
        PlainDecoder(target, CONFIG),
        SpeculativeDecoder(target, NgramDrafter(), make_verifier("exact"), CONFIG, speculation),
    ]


def prefilled(decoder: Decoder) -> list[int]:
    """Records how many tokens each prefill forward of ``decoder``'s target is given."""
    sizes: list[int] = []
    cached_model = decoder.scorer.cached_model
    forward = cached_model.forward

    def spy(token_ids, logits_to_keep: int = 0):
        if logits_to_keep:
            sizes.append(len(token_ids))
        return forward(token_ids, logits_to_keep)

    cached_model.forward = spy  # type: ignore[method-assign]
    return sizes


@pytest.mark.parametrize("kernels", [False, True], ids=["stock-cache", "in-place-cache"])
def test_the_next_turn_prefills_only_what_is_new_and_decodes_as_a_fresh_start(tiny_target, kernels) -> None:
    target = with_kernels(tiny_target) if kernels else tiny_target
    for index, decoder in enumerate(decoders(target)):
        first = decoder.generate(FIRST, use_chat=False)
        conversation = first.prompt_token_ids + first.token_ids
        follow_up = conversation + target.encode_prompt(" The capital of", use_chat=False)
        sizes = prefilled(decoder)
        second = decoder.generate(follow_up)
        fresh = decoders(target)[index]
        assert second.token_ids == fresh.generate(follow_up).token_ids, type(decoder).__name__
        # everything but the last committed token was cached; the rest is prefilled in one forward, the prompt's
        # last token included (its logits are the first step's)
        reused = len(conversation) - 1
        assert second.stats.num_reused_prompt_tokens == reused
        assert sizes == [len(follow_up) - reused]


def test_only_a_continuation_of_the_conversation_is_reused(tiny_target) -> None:
    decoder = decoders(tiny_target)[1]
    first = decoder.generate(FIRST, use_chat=False)
    prompt, output = first.prompt_token_ids, first.token_ids
    # the conversation goes on, but differs from the cache after 3 tokens of the answer
    detour = prompt + output[:3] + [(output[3] + 1) % 200, 7, 8]
    second = decoder.generate(detour)
    assert second.stats.num_reused_prompt_tokens == len(prompt) + 3
    assert second.token_ids == decoders(tiny_target)[1].generate(detour).token_ids
    # the very same prompt again: all but its last token come from the cache
    assert decoder.generate(detour).stats.num_reused_prompt_tokens == len(detour) - 1
    # a new conversation sharing only a head, even most of the prompt, starts afresh
    head = detour[: len(prompt) - 1] + [7, 8, 9]
    assert decoder.generate(head).stats.num_reused_prompt_tokens == 0
    # a continuation whose new part is longer than what is cached starts afresh too (a slower prefill)
    longer = head + [(token % 150) + 2 for token in range(len(head) + 1)]
    assert decoder.generate(longer).stats.num_reused_prompt_tokens == 0


def test_a_step_left_unfinished_is_not_reused(tiny_target) -> None:
    """A forward without its rollback (a generation stopped mid-step) leaves positions nobody checked:
    the next start begins afresh."""
    target = Target(tiny_target)
    prompt = tiny_target.encode_prompt(FIRST, use_chat=False)
    target.start(prompt)
    target.score(prompt[-1], torch.tensor([11, 12, 13]))  # scored, never rolled back
    assert target.start(prompt + [11, 12, 13, 14]) == 0
    assert target.cached_model.cached_length == len(prompt) + 4  # the whole new prompt, prefilled afresh
    assert target.start(prompt) == 0  # a prefill not followed by its first step is not reused either
    assert target.cached_model.cached_length == len(prompt)


def test_sliding_window_layers_reuse_the_prefix(tokenizer) -> None:
    """Sliding-window layers keep every position in place (cached_model.py), so they rewind like plain ones: a chat's
    next turn, far past the window (8), reuses its prefix and gives a fresh start's tokens."""
    target = make_tiny_gemma3(tokenizer, layer_types=["sliding_attention", "full_attention"])
    decoder = PlainDecoder(target, CONFIG)
    first = decoder.generate(FIRST, use_chat=False)
    follow_up = first.prompt_token_ids + first.token_ids + [7, 8]
    assert len(follow_up) > 4 * target.model.config.sliding_window
    second = decoder.generate(follow_up)
    assert second.stats.num_reused_prompt_tokens == len(follow_up) - 3  # all but the new tokens and the last committed
    assert second.token_ids == PlainDecoder(target, CONFIG).generate(follow_up).token_ids
