"""Peer: llama.cpp through llama-cpp-python, plain and with prompt lookup decoding.

Optional (``pip install 'flyspec[llamacpp]'``). It runs the GGUF file itself, so its weights are
the quantized originals that flyspec dequantizes to float32: same model, different arithmetic
(quantized kernels), so outputs are compared with flyspec's by re-encoding the text, and its own
speedup is reported against ``llamacpp-plain``.
"""

from __future__ import annotations

import time

import torch

from flyspec.bench.backends import BackendSettings, TurnOutput
from flyspec.config import ConfigError
from flyspec.harness.methods import Method
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.loading import find_gguf

N_CTX = 4096


class LlamaCppBackend:
    """``llamacpp-plain`` or ``llamacpp-lookup`` (``LlamaPromptLookupDecoding``)."""

    def __init__(self, method: Method, target: LoadedModel, settings: BackendSettings) -> None:
        try:
            from llama_cpp import Llama  # optional dependency
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError:
            raise ConfigError(
                f"{method.name} needs llama-cpp-python: pip install 'flyspec[llamacpp]' (or drop it from --methods)"
            ) from None
        gguf = find_gguf(target.name)
        if gguf is None:
            raise ConfigError(
                f"{method.name} needs a GGUF target (a packaged name or a .gguf file), not {target.name!r}"
            )
        self.method = method
        self.target = target
        self.sampling = settings.sampling
        draft = (
            LlamaPromptLookupDecoding(num_pred_tokens=settings.hf_lookup_tokens) if "lookup" in method.name else None
        )
        # With a draft model llama-cpp-python keeps logits for every position it evaluates; without
        # logits_all its score buffer has only n_batch rows and a prompt past 512 tokens fails
        # ("could not broadcast ... into shape (0,)").
        self.llm = Llama(
            model_path=str(gguf),
            n_ctx=N_CTX,
            n_threads=torch.get_num_threads(),
            draft_model=draft,
            logits_all=draft is not None,
            verbose=False,
        )

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, seed: int, prediction: str | None = None
    ) -> TurnOutput:
        self.llm.reset()
        started = time.perf_counter()
        completion = self.llm.create_completion(
            prompt=prompt_ids,
            max_tokens=max_new_tokens,
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p,
            top_k=self.sampling.top_k or 1_000_000,
            min_p=0.0,  # llama-cpp-python's default 0.05 cuts the distribution flyspec samples from (greedy: no-op)
            seed=seed,
        )
        wall = time.perf_counter() - started
        assert isinstance(completion, dict)  # not streamed: one response, not an iterator of chunks
        choice = completion["choices"][0]
        token_ids = self.target.tokenizer.encode(choice["text"], add_special_tokens=False)
        if choice["finish_reason"] == "stop" and self.target.eos_token_ids:
            token_ids.append(min(self.target.eos_token_ids))
        return TurnOutput(token_ids, choice["text"], wall)
