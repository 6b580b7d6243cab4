"""The uniform numbers vLLM's V2 rejection kernel draws, drawn again with vLLM's own generator.

``_rejection_kernel`` (``vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py``) accepts a sampled draft token
where ``log p(x) > log u + log q(x)``, with ``u = tl_rand32(seed, pos)``: Philox keyed by the request's seed and the
position, no state. :func:`rejection_uniforms` calls the same ``tl_rand32`` for every row, so the plugin knows which
draft tokens the kernel will accept before it runs (``v2.py``: where FLy's deferred window holds). Imported only
where vLLM's V2 runner runs (it needs vLLM's Triton).
"""

from __future__ import annotations

import torch
from vllm.triton_utils import tl, triton
from vllm.v1.worker.gpu.sample.gumbel import tl_rand32


@triton.jit
def _uniform_kernel(uniform_ptr, seed_ptr, pos_ptr, expanded_idx_mapping_ptr):
    logit_idx = tl.program_id(0)
    req_state_idx = tl.load(expanded_idx_mapping_ptr + logit_idx).to(tl.int64)
    seed = tl.load(seed_ptr + req_state_idx)
    pos = tl.load(pos_ptr + logit_idx)
    tl.store(uniform_ptr + logit_idx, tl_rand32(seed, pos, includes_zero=False))


def rejection_uniforms(
    seed: torch.Tensor,  # [max_num_reqs]
    pos: torch.Tensor,  # [num_logits]
    expanded_idx_mapping: torch.Tensor,  # [num_logits]
) -> torch.Tensor:
    """``[num_logits]`` float32: the ``u`` the V2 rejection kernel draws at each row (without block verification)."""
    uniforms = torch.empty(pos.shape[0], dtype=torch.float32, device=pos.device)
    if pos.shape[0]:
        _uniform_kernel[(pos.shape[0],)](uniforms, seed, pos, expanded_idx_mapping)
    return uniforms
