"""The served model's token facts for the trust guards (EOS ids, token classes), built once per model runner."""

from __future__ import annotations

from typing import Any

from flyspec_vllm._flyspec import ConfigError, Vocabulary, tokenizer_fingerprint


def vocabulary_of(runner: Any, state: Any) -> Vocabulary:
    """The target's token facts (EOS ids, token classes) for the guards, built once per model runner."""
    key = id(runner)
    if key not in state.vocabularies:
        from transformers import AutoTokenizer, GenerationConfig  # only where FLy runs

        model_config = runner.vllm_config.model_config
        tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer)
        eos: set[int] = set()
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        try:
            generation_eos = GenerationConfig.from_pretrained(model_config.model).eos_token_id
        except OSError:
            generation_eos = None
        if isinstance(generation_eos, int):
            eos.add(generation_eos)
        elif generation_eos:
            eos.update(int(token) for token in generation_eos)
        vocab_size = int(model_config.get_vocab_size())
        if state.profile is not None and tokenizer_fingerprint(tokenizer) != state.profile.tokenizer:
            raise ConfigError(f"the profile {state.profile.name} was calibrated for another tokenizer")
        state.vocabularies[key] = Vocabulary(tokenizer, frozenset(eos), vocab_size)
    return state.vocabularies[key]
