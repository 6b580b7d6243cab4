"""The memory floor of a one-token step (runtime/memory_floor.py): the weights' bytes and the read bandwidth."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flyspec.runtime import memory_floor as floors
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.loading import load_model


def _llama(tied: bool, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_reads_every_weight_once_and_one_row_of_an_untied_embedding_table(dtype: torch.dtype) -> None:
    untied, tied = _llama(False, dtype), _llama(True, dtype)
    size = 2 if dtype == torch.bfloat16 else 4
    table = 300 * 32  # the embedding table's values; the head's are as many
    layers = sum(p.numel() for name, p in untied.named_parameters() if not name.startswith(("model.embed", "lm_head")))
    # untied: the head whole, the table's one row; tied: the shared table once (it is the head)
    assert floors.step_weight_bytes(untied) == size * (layers + table + 32)
    assert floors.step_weight_bytes(tied) == size * (layers + table)


def test_the_loaded_model_keeps_the_count_its_kernels_packed_away(tiny_model_dir: Path) -> None:
    packed = load_model(str(tiny_model_dir), dtype="float32", kernels="auto")
    stock = load_model(str(tiny_model_dir), dtype="float32", kernels="stock")
    assert stock.weight_bytes == floors.step_weight_bytes(stock.model) > 0
    assert packed.weight_bytes == stock.weight_bytes
    if packed.kernels:  # the packed linears are no parameters any more: counting them now would miss them
        assert floors.step_weight_bytes(packed.model) < packed.weight_bytes


def test_the_bandwidth_is_the_buffers_bytes_over_its_fastest_read(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = iter([0.0, 0.5, 1.0, 1.25, 2.0, 2.75])  # three reads: 0.5, 0.25 and 0.75 seconds
    monkeypatch.setattr(floors, "device_clock", lambda device: next(reads))
    assert floors.read_bandwidth("cpu", buffer_bytes=4096, rounds=3) == pytest.approx(4096 / 0.25)
    with pytest.raises(ValueError, match="at least one float and one round"):
        floors.read_bandwidth("cpu", buffer_bytes=4096, rounds=0)


def test_the_floor_is_the_weights_over_the_bandwidth_measured_here(tiny_target: LoadedModel) -> None:
    floor = floors.memory_floor(tiny_target.model, "cpu", weight_bytes=8_000_000)
    assert floor.weight_bytes == 8_000_000 and floor.bandwidth > 1e8  # any CPU streams more than 100 MB/s
    figures = floor.as_dict()
    assert figures["floor_ms"] == pytest.approx(1e3 * 8_000_000 / floor.bandwidth)
    assert figures["weight_mb"] == 8.0 and figures["read_gb_s"] == pytest.approx(floor.bandwidth / 1e9)
    counted = floors.memory_floor(tiny_target.model, "cpu")
    assert counted.weight_bytes == floors.step_weight_bytes(tiny_target.model)
