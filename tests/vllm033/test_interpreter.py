"""The conftest's shortcut in Triton's interpreter (``interpreter_shortcut.py``: a language module is patched once
per kernel launch, not again at every device-function call) changes no result: vLLM 0.33's V2 rejection sampler and
the plugin's uniforms (both call nested device functions: Philox through ``tl_rand32``) give the same tensors with it
and with the interpreter's own functions, and the shortcut does skip the repeated patches."""

from __future__ import annotations

import pytest
import torch
from flyspec_vllm.v2_random import rejection_uniforms
from interpreter_shortcut import STOCK
from kernels import random_batch, v2_batch, v2_verify
from triton.runtime import interpreter


def run_kernels() -> tuple[torch.Tensor, list[list[int]]]:
    generator = torch.Generator().manual_seed(11)
    steps = random_batch(generator, 4, [1.0, 0.7, 0.0])
    batch = v2_batch(steps)
    uniforms = rejection_uniforms(batch.seed, batch.pos, batch.expanded_idx_mapping)
    return uniforms, v2_verify(steps, 3, 0.3)


def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the interpreter's real patches (the stock ``_patch_lang``) from now on."""
    calls = [0]
    stock = STOCK["patch"]

    def counting(fn):  # noqa: ANN001, ANN202
        calls[0] += 1
        return stock(fn)

    monkeypatch.setitem(STOCK, "patch", counting)  # what the shortcut calls when it does patch
    return calls


def test_the_interpreter_shortcut_changes_no_kernels_result(monkeypatch: pytest.MonkeyPatch) -> None:
    shortcut_patches = counted(monkeypatch)
    uniforms, committed = run_kernels()
    shortcut = shortcut_patches[0]  # (the stock run below goes through this counter too)
    with monkeypatch.context() as stock:  # the interpreter's own functions, patching at every call (counted)
        stock_patches = counted(stock)
        stock.setattr(interpreter, "_patch_lang", STOCK["patch"])
        stock.setattr(interpreter.GridExecutor, "__call__", STOCK["launch"])
        stock_uniforms, stock_committed = run_kernels()
    assert torch.equal(uniforms, stock_uniforms) and committed == stock_committed
    assert 0 < shortcut * 20 < stock_patches[0], (shortcut, stock_patches)
