"""Batches of random verification steps, verified by vLLM 0.33's unmodified rejection samplers (V1 and V2).

A *step* is one request's draft and the target's logits at its positions. :func:`v1_verify` runs a batch through
``vllm.v1.sample.rejection_sampler.rejection_sample`` (V1 model runner; FLy as a pre-pass of two kernels),
:func:`v2_verify` through ``vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils.rejection_sample`` (V2 model
runner, FLy inside the rejection kernel). Both return what each request commits. Logits are *processed* logits (what
vLLM's sampler hands its rejection sampler: divided by the temperature at T > 0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from vllm.triton_utils import tl, triton
from vllm.v1.sample import rejection_sampler as v1
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils as v2

VOCAB = 40


@triton.jit
def interpreted_log1p(x):  # noqa: ANN001, ANN201 - libdevice's log1p (a compiled op) for Triton's interpreter
    return tl.log(1.0 + x)


@dataclass
class Step:
    draft: torch.Tensor  # [k] int64
    logits: torch.Tensor  # [k + 1, vocab] float32, processed (the last row: the bonus position)
    temperature: float  # 0: greedy
    seed: int


def random_step(generator: torch.Generator, k: int, temperature: float, vocab: int = VOCAB) -> Step:
    """Mostly the argmax, some runners-up, misses, masked (-inf) tokens, flat and peaked rows."""
    scale = torch.rand((k + 1, 1), generator=generator) * 5
    logits = torch.randn((k + 1, vocab), generator=generator) * scale
    masked = torch.rand((k + 1, vocab), generator=generator) < 0.05
    logits = logits.masked_fill(masked, float("-inf"))
    logits[:, 0] = logits[:, 0].clamp_min(-30.0)  # at least one finite logit per row
    top2 = logits[:k].topk(2, dim=-1).indices
    choice = torch.randint(0, 10, (k,), generator=generator)
    draft = torch.where(choice < 6, top2[:, 0], torch.where(choice < 9, top2[:, 1], torch.randint(0, vocab, (k,))))
    if temperature > 0:
        logits = logits / temperature
    return Step(draft, logits.float(), temperature, int(torch.randint(0, 2**31, (1,), generator=generator)))


def random_batch(generator: torch.Generator, size: int, temperatures: Sequence[float]) -> list[Step]:
    steps = []
    for index in range(size):
        k = int(torch.randint(2, 12, (1,), generator=generator))
        steps.append(random_step(generator, k, temperatures[index % len(temperatures)]))
    return steps


def v1_metadata(steps: Sequence[Step]) -> tuple[SamplingMetadata, dict[int, torch.Tensor]]:
    """vLLM's sampling metadata for the batch, and the uniform numbers V1 will draw for each sampled request."""
    temperatures = [step.temperature for step in steps]
    generators = {i: torch.Generator().manual_seed(step.seed) for i, step in enumerate(steps) if step.temperature}
    uniforms = {  # generate_uniform_probs: each seeded request's slice, float64, from its own generator
        i: torch.empty(len(steps[i].draft), dtype=torch.float64).uniform_(
            generator=torch.Generator().set_state(generator.get_state())
        )
        for i, generator in generators.items()
    }
    zeros = torch.zeros(len(steps))
    metadata = SamplingMetadata(
        temperature=torch.tensor(temperatures, dtype=torch.float32),
        all_greedy=all(t == 0 for t in temperatures),
        all_random=all(t > 0 for t in temperatures),
        top_p=None,
        top_k=None,
        generators=generators,
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=zeros,
        presence_penalties=zeros,
        repetition_penalties=zeros,
        output_token_ids=[[] for _ in steps],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )
    return metadata, uniforms


def v1_arguments(steps: Sequence[Step]) -> tuple[tuple, SamplingMetadata, dict[int, torch.Tensor]]:
    """``rejection_sample``'s positional arguments for the batch (as ``RejectionSampler.forward`` passes them)."""
    sizes = [len(step.draft) for step in steps]
    draft = torch.cat([step.draft for step in steps]).to(torch.int32)
    cu_num = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    target_logits = torch.cat([step.logits[:-1] for step in steps]).contiguous()
    bonus = torch.tensor([[int(step.logits[-1].argmax())] for step in steps], dtype=torch.int32)
    metadata, uniforms = v1_metadata(steps)
    return (draft, sizes, max(sizes), cu_num, None, target_logits, bonus, metadata), metadata, uniforms


def rows(output: torch.Tensor) -> list[list[int]]:
    return [[int(token) for token in row if token >= 0] for row in output]


def v1_verify(
    steps: Sequence[Step],
    window: int | None,
    threshold: float = 0.3,
    sample: Callable[..., torch.Tensor] | None = None,
) -> tuple[list[list[int]], dict[int, torch.Tensor]]:
    """What V1 commits per request (``window=None``: FLy off), and the uniforms its sampled requests drew."""
    arguments, _, uniforms = v1_arguments(steps)
    fly = {} if window is None else {"fly_window_size": window, "fly_entropy_threshold": threshold}
    output = (sample or v1.rejection_sample)(*arguments, **fly)
    return rows(output), uniforms


@dataclass
class V2Batch:
    """``rejection_sample``'s inputs on the V2 runner: one logits row per draft token plus the bonus row."""

    target_logits: torch.Tensor  # [num_logits, vocab]
    draft_sampled: torch.Tensor  # [num_logits]: row i + 1 holds the draft token verified at row i
    cu_num_logits: torch.Tensor  # [num_reqs + 1]
    pos: torch.Tensor  # [num_logits]
    idx_mapping: torch.Tensor  # [num_reqs]: batch row -> request state index
    expanded_idx_mapping: torch.Tensor  # [num_logits]
    expanded_local_pos: torch.Tensor  # [num_logits]
    temperature: torch.Tensor  # [max_num_reqs]
    seed: torch.Tensor  # [max_num_reqs]
    num_speculative_steps: int

    def arguments(self) -> tuple:
        return (
            self.target_logits, None, self.draft_sampled, self.cu_num_logits, self.pos, self.idx_mapping,
            self.expanded_idx_mapping, self.expanded_local_pos, self.temperature, self.seed,
            self.num_speculative_steps,
        )  # fmt: skip


def v2_batch(steps: Sequence[Step], state_offset: int = 3, start_positions: Sequence[int] | None = None) -> V2Batch:
    """The batch as V2 lays it out; request ``i`` lives in state slot ``i + state_offset`` (slots are not rows)."""
    sizes = [len(step.draft) + 1 for step in steps]
    cu = torch.tensor([0, *sizes]).cumsum(0)
    starts = start_positions or [10 + 7 * i for i in range(len(steps))]
    draft_sampled, pos, local = [], [], []
    for step, size, start in zip(steps, sizes, starts, strict=True):
        draft_sampled += [7, *step.draft.tolist()]  # row 0: the last committed token (its value is not read)
        pos += list(range(start, start + size))
        local += list(range(size))
    max_reqs = len(steps) + state_offset
    temperature, seed = torch.zeros(max_reqs), torch.zeros(max_reqs, dtype=torch.int64)
    for i, step in enumerate(steps):
        temperature[i + state_offset] = step.temperature
        seed[i + state_offset] = step.seed
    idx = torch.arange(len(steps), dtype=torch.int32) + state_offset
    return V2Batch(
        target_logits=torch.cat([step.logits for step in steps]).contiguous(),
        draft_sampled=torch.tensor(draft_sampled, dtype=torch.int64),
        cu_num_logits=cu.to(torch.int32),
        pos=torch.tensor(pos, dtype=torch.int64),
        idx_mapping=idx,
        expanded_idx_mapping=torch.repeat_interleave(idx, torch.tensor(sizes)),
        expanded_local_pos=torch.tensor(local, dtype=torch.int32),
        temperature=temperature,
        seed=seed,
        num_speculative_steps=max(sizes) - 1,
    )


def v2_verify(steps: Sequence[Step], window: int, threshold: float = 0.3) -> list[list[int]]:
    """What V2 commits per request (``window=0``: FLy off)."""
    batch = v2_batch(steps)
    sampled, num_sampled = v2.rejection_sample(
        *batch.arguments(), fly_window_size=window, fly_entropy_threshold=threshold
    )
    return [sampled[i, : int(n)].tolist() for i, n in enumerate(num_sampled)]
