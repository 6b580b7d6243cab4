"""flyspec's n-gram drafter as a vLLM proposer (``speculative_config={"method": "custom_class", ...}``).

Use ``"model": "flyspec_vllm.NgramProposer"``. The lookup is flyspec's own ``ngram_lookup``
(most recent match, LZ77-style periodic extension; ``drafters/ngram.py``), so vLLM and
``flyspec generate --drafter ngram`` propose the same tokens. n-gram sizes: vLLM's
``prompt_lookup_max`` / ``prompt_lookup_min`` where given, else flyspec's ``NgramConfig``. A request that
asks for none (``extra_args={"flyspec_draft": false}``) gets no drafts: plain decoding in the same engine.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flyspec_vllm._flyspec import NgramConfig, ngram_lookup


class NgramProposer:
    """Proposes, per request, a continuation of an earlier occurrence of its last n tokens."""

    def __init__(self, vllm_config: Any) -> None:
        speculative = vllm_config.speculative_config
        defaults = NgramConfig()
        self.num_draft_tokens = int(speculative.num_speculative_tokens)
        self.max_ngram = int(getattr(speculative, "prompt_lookup_max", None) or defaults.max_ngram)
        self.min_ngram = int(getattr(speculative, "prompt_lookup_min", None) or defaults.min_ngram)
        self.max_model_len = int(vllm_config.model_config.max_model_len)

    def propose(
        self,
        sampled_token_ids: list[list[int]],  # [batch][tokens committed last step]; empty: nothing new
        num_tokens_no_spec: np.ndarray,  # [max_batch] committed tokens per request
        token_ids_cpu: np.ndarray,  # [max_batch, max_model_len]
        slot_mappings: Any = None,  # unused (no KV cache)
    ) -> list[list[int]]:
        drafts: list[list[int]] = []
        from flyspec_vllm.patch import draftless as draftless_rows  # set by the _sample wrapper this step

        draftless = draftless_rows()  # rows whose request asked for plain decoding (flyspec_draft: false)
        for index, sampled in enumerate(sampled_token_ids):
            num_tokens = int(num_tokens_no_spec[index])
            room = min(self.num_draft_tokens, self.max_model_len - num_tokens - 1)
            if not sampled or room <= 0 or index in draftless:
                drafts.append([])
                continue
            context = token_ids_cpu[index, :num_tokens]
            drafts.append([int(t) for t in ngram_lookup(context, room, self.max_ngram, self.min_ngram)])
        return drafts

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No model to load."""
