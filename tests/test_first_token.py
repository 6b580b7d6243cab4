"""The first token (runtime/target.py): the prefill runs the whole prompt and its logits are the first step's, so no
forward runs the last prompt token twice; the time to the first token is in every generation's statistics."""

from __future__ import annotations

import torch
from flyspec.generation import Decoder

from conftest import noisy_copy
from flyspec import DecodeConfig, PlainDecoder, SpeculativeDecoder, make_verifier
from flyspec.config import SpeculationConfig
from flyspec.drafters.draft_model import DraftModelDrafter
from flyspec.runtime.cached_model import CachedModel
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.target import Target

CONFIG = DecodeConfig(max_new_tokens=6, ignore_eos=True)
PROMPT = "the cat sat on the mat and the cat sat on the"  # repeats: an n-gram draft from the first step on


def forwards(decoder: Decoder) -> list[tuple[int, int]]:
    """Records (tokens, logits_to_keep) of every forward of ``decoder``'s target."""
    calls: list[tuple[int, int]] = []
    cached_model = decoder.scorer.cached_model
    forward = cached_model.forward

    def spy(token_ids, logits_to_keep: int = 0):
        calls.append((len(token_ids), logits_to_keep))
        return forward(token_ids, logits_to_keep)

    cached_model.forward = spy  # type: ignore[method-assign]
    return calls


def test_plain_decoding_runs_one_forward_per_token_the_prefill_giving_the_first(tiny_target: LoadedModel) -> None:
    decoder = PlainDecoder(tiny_target, CONFIG)
    calls = forwards(decoder)
    result = decoder.generate(PROMPT, use_chat=False)
    assert len(result.token_ids) == 6
    assert calls == [(len(result.prompt_token_ids), 1)] + [(1, 0)] * 5
    assert result.stats.num_target_forwards == 6  # the first step counts, though the prefill ran it


def test_the_first_token_comes_from_the_prefill_and_the_first_draft_follows_it(tiny_target: LoadedModel) -> None:
    """As in vLLM: no draft is scored before the first token, which the prefill's logits decide alone."""
    speculation = SpeculationConfig(num_draft_tokens=4)
    drafter = DraftModelDrafter(noisy_copy(tiny_target, 0.05, seed=1))  # drafts every step
    decoder = SpeculativeDecoder(tiny_target, drafter, make_verifier("exact"), CONFIG, speculation)
    calls = forwards(decoder)
    drafts: list[tuple[int, int]] = []  # (committed tokens when drafting, draft length)
    propose = decoder.drafter.propose

    def spy(token_ids, *args):
        draft = propose(token_ids, *args)
        drafts.append((len(token_ids), draft.num_tokens))
        return draft

    decoder.drafter.propose = spy  # type: ignore[method-assign]
    result = decoder.generate(PROMPT, use_chat=False)
    prompt_length = len(result.prompt_token_ids)
    assert calls[0] == (prompt_length, 1)  # the prefill, then no forward before the first token
    assert drafts[0][0] == prompt_length + 1  # the first draft sees the first token
    assert drafts[0][1] > 0 and calls[1] == (1 + drafts[0][1], 0)  # the first token and the draft, one forward
    assert result.stats.num_target_forwards == len(calls)  # the first step counts, though the prefill ran it
    assert result.token_ids == PlainDecoder(tiny_target, CONFIG).generate(PROMPT, use_chat=False).token_ids


def test_the_prefills_logits_are_those_of_a_separate_step(tiny_target: LoadedModel) -> None:
    """Prefilling the last prompt token with the rest gives the logits a step of its own would (float32, rounding)."""
    prompt = tiny_target.encode_prompt(PROMPT, use_chat=False)
    target = Target(tiny_target)
    target.start(prompt)
    draft = torch.tensor([5, 6, 7])
    together = target.score(prompt[-1], draft)  # [4, vocab]: the prefill's row, then the draft's
    separate = CachedModel(tiny_target)
    separate.forward(prompt[:-1], logits_to_keep=1)
    expected = separate.forward(torch.cat([torch.tensor(prompt[-1:]), draft]))
    torch.testing.assert_close(together, expected, atol=1e-5, rtol=1e-5)
    assert target.cached_model.cached_length == len(prompt) + 3
    target.rollback(prompt + [5, 6])
    assert target.cached_model.cached_length == len(prompt) + 1


def test_the_time_to_first_token_is_recorded_when_it_is_committed(tiny_target: LoadedModel) -> None:
    stream = PlainDecoder(tiny_target, DecodeConfig(max_new_tokens=40, ignore_eos=True)).stream(PROMPT, use_chat=False)
    stats = stream._stats
    assert stats.time_to_first_token_s is None
    pieces = iter(stream)
    next(pieces)  # the first settled text: at least one token was committed before it
    first = stats.time_to_first_token_s
    assert first is not None and first > 0
    for _ in pieces:
        pass
    assert stats.time_to_first_token_s == first  # set once, not moved by later steps
    assert first < stats.wall_time_s
    assert stats.to_dict()["time_to_first_token_s"] == first
