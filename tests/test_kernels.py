"""flyspec's CPU kernels (runtime/kernels.py): each piece against the stock path it replaces, then end to end.

Float32 throughout where identity is claimed: the kernels change rounding, not the math.
"""

from __future__ import annotations

import copy
import platform
import types

import pytest
import torch
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import flyspec.runtime.allocator as allocator
import flyspec.runtime.kernels as kernels
import flyspec.runtime.packed_linears as packed_linears
from conftest import make_tiny_gemma3, make_tiny_model
from flyspec import DecodeConfig, NgramDrafter, PlainDecoder, SpeculativeDecoder, make_verifier
from flyspec.config import ConfigError, SpeculationConfig
from flyspec.runtime.cached_model import CachedModel
from flyspec.runtime.kernels import GrowingLayer, decode_attention
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.loading import cpu_isa
from flyspec.runtime.packed_linears import PackedLinear, SharedLinear, SharedLinears

PROMPT = "Once upon a time there was a small model that The capital of"


def with_kernels(loaded: LoadedModel) -> LoadedModel:
    """A copy of ``loaded`` with flyspec's kernels installed."""
    model = copy.deepcopy(loaded.model)
    assert kernels.install(model, "auto")
    return LoadedModel(model=model, tokenizer=loaded.tokenizer, name=f"{loaded.name}-kernels", kernels=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(dtype: torch.dtype, bias: bool) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80, bias=bias).to(dtype)
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no oneDNN bfloat16 linear (AVX512-BF16 or AMX): flyspec's kernels stay off in bf16")
    packed = PackedLinear(linear.weight, linear.bias)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for shape in [(1, 48), (1, 7, 48), (2, 3, 48)]:
        x = torch.randn(shape, dtype=dtype)
        with torch.inference_mode():
            expected, got = linear(x), packed(x)
        assert got.shape == expected.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_shared_linears_match_each_linear_however_they_are_called() -> None:
    torch.manual_seed(0)
    linears = [torch.nn.Linear(24, size, bias=True) for size in (16, 8, 8)]
    group = SharedLinears(linears)
    members = [SharedLinear(group, index) for index in range(3)]
    x, y = torch.randn(1, 3, 24), torch.randn(1, 3, 24)
    with torch.inference_mode():
        expected = [[linear(inputs) for linear in linears] for inputs in (x, y)]
        # in turn, out of turn (a new input before the others took theirs), and a member twice
        calls = [(0, x), (1, x), (2, x), (1, y), (0, x), (0, y), (2, y), (2, y), (1, x), (2, x)]
        for index, inputs in calls:
            got = members[index](inputs)
            assert got.shape == (1, 3, linears[index].out_features)
            torch.testing.assert_close(got, expected[0 if inputs is x else 1][index], atol=1e-5, rtol=1e-5)
    assert group._last is None  # the last member took its slice: no activation held


def test_fused_model_holds_no_activations_between_steps(tiny_target: LoadedModel) -> None:
    installed = with_kernels(tiny_target)
    groups = {module.group for module in installed.model.modules() if isinstance(module, SharedLinear)}
    assert groups
    CachedModel(installed).forward([5, 6, 7])
    assert all(group._last is None for group in groups)


def mutate_mlp_input(loaded: LoadedModel) -> None:
    """Patch every MLP to change its input in place between its gate and up projections."""

    def forward(mlp, x):
        gate = mlp.gate_proj(x)
        x.mul_(2.0)
        return mlp.down_proj(mlp.act_fn(gate) * mlp.up_proj(x))

    for layer in loaded.model.model.layers:  # bound methods: a deep copy binds them to the copied module
        layer.mlp.forward = types.MethodType(forward, layer.mlp)


def test_siblings_are_not_fused_where_sharing_would_change_the_logits(
    tiny_target: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    mutated = LoadedModel(model=copy.deepcopy(tiny_target.model), tokenizer=tiny_target.tokenizer, name="mutated")
    mutate_mlp_input(mutated)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        expected = mutated.model(ids).logits
    installed = with_kernels(mutated)
    assert not any(isinstance(module, SharedLinear) for module in installed.model.modules())
    with torch.inference_mode():
        torch.testing.assert_close(installed.model(ids).logits, expected, atol=1e-4, rtol=1e-4)
    # without the check, the shared outputs go stale and the logits change: the check is what kept them
    monkeypatch.setattr(packed_linears, "_sharing_holds", lambda model, fused: True)
    unchecked = with_kernels(mutated)
    with torch.inference_mode():
        assert not torch.allclose(unchecked.model(ids).logits, expected, atol=1e-3, rtol=1e-3)


def test_a_linear_called_twice_is_not_fused(tiny_target: LoadedModel) -> None:
    twice = LoadedModel(model=copy.deepcopy(tiny_target.model), tokenizer=tiny_target.tokenizer, name="twice")

    def forward(mlp, x):
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x) + 0 * mlp.gate_proj(x))

    for layer in twice.model.model.layers:
        layer.mlp.forward = types.MethodType(forward, layer.mlp)
    installed = with_kernels(twice)
    shared = {
        name.rsplit(".", 1)[-1] for name, module in installed.model.named_modules() if isinstance(module, SharedLinear)
    }
    assert shared == {"q_proj", "k_proj", "v_proj"}


def attention_inputs(queries: int, keys: int, heads: int, kv_heads: int):
    torch.manual_seed(queries * 100 + keys)
    query = torch.randn(1, queries, heads, 16).transpose(1, 2)  # as a model hands it over: not contiguous
    # keys and values as views of a longer buffer, as GrowingLayer hands them over
    key = torch.randn(1, kv_heads, keys + 5, 16)[:, :, :keys]
    value = torch.randn(1, kv_heads, keys + 5, 16)[:, :, :keys]
    return query, key, value


class Module(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize(("queries", "keys"), [(1, 9), (3, 9), (5, 40), (16, 17)])
@pytest.mark.parametrize("window", [None, 6])
def test_decode_attention_matches_sdpa(kv_heads: int, queries: int, keys: int, window: int | None) -> None:
    heads = 4
    query, key, value = attention_inputs(queries, keys, heads, kv_heads)
    # sdpa's boolean mask (True: attend) for the last `queries` positions of `keys`, causal, optionally windowed
    rows = torch.arange(keys - queries, keys)[:, None]
    columns = torch.arange(keys)[None, :]
    allowed = columns <= rows
    if window is not None:
        allowed &= columns > rows - window
    mask = allowed[None, None]
    if queries == 1 and window is None:
        mask = None  # transformers skips the mask for one query without a window; all keys are attended
    module = Module(heads // kv_heads)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    got, weights = decode_attention(module, query, key, value, mask, scaling=0.3, sliding_window=window)
    assert weights is None and got.shape == (1, queries, heads, 16)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def assert_near_sdpa(
    module: Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
    times: float, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """decode_attention's result, sdpa not called, within ``times`` sdpa's own error (same dtype) of sdpa's result in
    float64 from the same inputs, plus a margin."""
    expected, _ = sdpa_attention_forward(module, query.double(), key.double(), value.double(), mask, scaling=0.3)
    sdpa, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "sdpa_attention_forward", None)  # a call to it would fail
        got, weights = decode_attention(module, query, key, value, mask, scaling=0.3)
    assert weights is None and got.dtype == query.dtype and got.shape == query.transpose(1, 2).shape
    error, sdpa_error = ((result.double() - expected).abs().max().item() for result in (got, sdpa))
    margin = 1e-6 if query.dtype == torch.float32 else 4e-3
    assert error <= times * sdpa_error + margin, (error, sdpa_error)


def cache_views(kv_heads: int, keys: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as GrowingLayer hands them over: views of the first ``keys`` positions of longer buffers."""
    key, value = ((torch.randn(1, kv_heads, keys + 37, dim) * scale).to(dtype)[:, :, :keys] for scale in (2, 1))
    return key, value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("queries", "keys", "heads", "kv_heads", "dim"), [(1, 2, 4, 4, 16), (1, 129, 9, 3, 64),
    (1, 700, 8, 1, 128), (3, 64, 6, 2, 32), (16, 300, 9, 3, 64), (64, 200, 4, 2, 16)])  # fmt: skip
@pytest.mark.parametrize("masked", [False, True])
def test_cached_attention_matches_sdpa(
    dtype: torch.dtype, queries: int, keys: int, heads: int, kv_heads: int, dim: int, masked: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A cached step's attention (``flyspec_cpp::cached_attention``): sdpa's result in float64 from the same inputs,
    one query or a draft's, over the operator's block (64 keys) and item (128 keys, 12 rows) edges, grouped-query
    heads, head sizes 16 to 128; causal (the mask transformers hands over, or none for one query) or with a window
    that hides the first keys. sdpa is not called."""
    assert kernels.attention_operators()
    torch.manual_seed(queries * 1000 + keys)
    query = (torch.randn(1, queries, heads, dim) * 2).to(dtype).transpose(1, 2)
    key, value = cache_views(kv_heads, keys, dim, dtype)
    rows, columns = torch.arange(keys - queries, keys)[:, None], torch.arange(keys)[None, :]
    allowed = (columns <= rows) & (columns > rows - 50 if masked else True)
    mask = allowed[None, None] if masked or queries > 1 else None
    # float32 rounding: within a few times sdpa's own (logits reach ~50 here; the sums run in another order)
    assert_near_sdpa(Module(heads // kv_heads), query, key, value, mask, 4, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_drafts_rows_come_out_as_one_query_steps_would(dtype: torch.dtype) -> None:
    """Verification computes each draft position bit for bit as the one-query step at that position would: the
    same blocks and items whatever the number of queries and of keys past a row's own."""
    assert kernels.attention_operators()
    torch.manual_seed(7)
    queries, keys, module = 16, 300, Module(3)
    query = torch.randn(1, queries, 9, 64).to(dtype).transpose(1, 2)
    key, value = cache_views(3, keys, 64, dtype)
    mask = (torch.arange(keys)[None, :] <= torch.arange(keys - queries, keys)[:, None])[None, None]
    together, _ = decode_attention(module, query, key, value, mask)
    for i in range(queries):
        seen = keys - queries + i + 1
        alone, _ = decode_attention(module, query[:, :, i : i + 1], key[:, :, :seen], value[:, :, :seen], None)
        assert torch.equal(alone[0, 0], together[0, i]), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_steps_call_the_cached_operator(dtype: torch.dtype) -> None:
    """Under torch.compile (inductor) a step's attention is the operator on the cache views, as eagerly."""
    assert kernels.attention_operators()
    module = Module(3)
    query = torch.randn(1, 4, 6, 16).to(dtype).transpose(1, 2)
    key, value = cache_views(2, 150, 16, dtype)
    mask = (torch.arange(150)[None, :] <= torch.arange(146, 150)[:, None])[None, None]
    step = torch.compile(lambda q, k, v, m: decode_attention(module, q, k, v, m, scaling=0.3)[0], fullgraph=True)
    eager, _ = decode_attention(module, query, key, value, mask, scaling=0.3)
    assert torch.equal(step(query, key, value, mask), eager)


def test_a_cached_step_runs_the_matmuls_where_the_operator_was_not_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_ATTENTION_OPERATORS", [False])
    monkeypatch.setattr(torch.ops.flyspec_cpp, "cached_attention", None, raising=False)  # a call would fail
    query, key, value = attention_inputs(3, 20, 4, 2)
    mask = (torch.arange(20)[None, :] <= torch.arange(17, 20)[:, None])[None, None]
    module = Module(2)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    got, _ = decode_attention(module, query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_c_operator_equals_the_python_one_and_drops_a_collected_weight() -> None:
    linear = torch.nn.Linear(24, 40)
    packed = PackedLinear(linear.weight, linear.bias)
    rows = torch.randn(70, 24)  # more rows than a cached step's: oneDNN's call, as the Python operator makes it
    assert packed_linears.cpp_operator()
    packed.use_cpp()
    handle = packed.handle
    expected = torch.ops.flyspec.packed_linear(rows, handle, 40, packed.bias)
    assert torch.equal(torch.ops.flyspec_cpp.packed_linear(rows, handle, 40, packed.bias), expected)
    torch.testing.assert_close(expected, linear(rows), atol=1e-5, rtol=1e-5)
    step = torch.ops.flyspec_cpp.packed_linear(rows[:5], handle, 40, packed.bias)  # a step's rows: maybe streamed
    torch.testing.assert_close(step, expected[:5], atol=1e-5, rtol=1e-5)
    del packed
    with pytest.raises(RuntimeError, match="no packed weight under handle"):
        torch.ops.flyspec_cpp.packed_linear(rows, handle, 40, None)


# weights [out, in]: whole blocks of 64 outputs, a padded block and padded inputs, one block, a head's width
STREAMED_SHAPES = [(960, 576), (100, 70), (32, 32), (4096, 64)]
STEP_ROWS = {torch.float32: 64, torch.bfloat16: 4}  # packed_linear.cpp: the rows it reads itself


def _packed_for_steps(out_features: int, in_features: int, dtype: torch.dtype, bias: bool) -> PackedLinear:
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no oneDNN bfloat16 linear (AVX512-BF16 or AMX): flyspec's kernels stay off in bf16")
    torch.manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features).to(dtype)
    packed = PackedLinear(weight, torch.randn(out_features).to(dtype) if bias else None)
    assert packed_linears.cpp_operator()
    packed.use_cpp()
    return packed


def _reference(packed: PackedLinear, rows: torch.Tensor) -> torch.Tensor:
    weight = packed.packed.to_dense().double()
    return rows.double() @ weight.t() + (packed.bias.double() if packed.bias is not None else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", STREAMED_SHAPES, ids=lambda shape: "x".join(map(str, shape)))
def test_a_steps_rows_are_read_from_the_packed_weight_as_accurately_as_onednn(
    shape: tuple[int, int], dtype: torch.dtype
) -> None:
    """Where the C++ operator reads a step's rows out of oneDNN's packed weight itself, it is as close to float64 as
    oneDNN's own call (the same float32 accumulation); on a CPU whose oneDNN packs another way, oneDNN's call stays."""
    packed = _packed_for_steps(*shape, dtype, bias=shape[0] == 100)
    streamed = torch.ops.flyspec_cpp.streamed(packed.handle)
    if dtype == torch.float32 and cpu_isa() in {"AVX512", "AVX512-BF16", "AMX"}:
        assert streamed  # the layout packed_linear.cpp reads is what oneDNN gives float32 weights on AVX-512
    for count in (1, 3, STEP_ROWS[dtype], 64, 65):
        rows = torch.randn(count, shape[1]).to(dtype)
        got = torch.ops.flyspec_cpp.packed_linear(rows, packed.handle, shape[0], packed.bias)
        onednn = torch.ops.mkldnn._linear_pointwise(rows, packed.packed, packed.bias, "none", [], "")
        reference = _reference(packed, rows)
        error, onednn_error = ((result.double() - reference).abs().max().item() for result in (got, onednn))
        assert got.dtype == dtype and got.shape == (count, shape[0])
        assert error <= 4 * onednn_error + 1e-6, (count, error, onednn_error)
        if count > STEP_ROWS[dtype] or not streamed:
            assert torch.equal(got, onednn)  # a prompt's rows (or a layout it does not read): oneDNN's call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_steps_rows_each_come_out_as_a_one_row_step_would(dtype: torch.dtype) -> None:
    """Each output is summed over its inputs in one order whatever the number of rows: a draft's verification gives
    each position the bits a one-token step gives it (float32 up to 64 rows, bf16 up to 4)."""
    packed = _packed_for_steps(960, 576, dtype, bias=True)
    if not torch.ops.flyspec_cpp.streamed(packed.handle):
        pytest.skip("this CPU's oneDNN packs weights in a layout packed_linear.cpp does not read")
    rows = torch.randn(STEP_ROWS[dtype], 576).to(dtype)
    together = torch.ops.flyspec_cpp.packed_linear(rows, packed.handle, 960, packed.bias)
    for index in range(rows.shape[0]):
        alone = torch.ops.flyspec_cpp.packed_linear(rows[index : index + 1], packed.handle, 960, packed.bias)
        assert torch.equal(together[index], alone[0]), index


def test_a_layout_the_operator_does_not_read_keeps_onednns_call() -> None:
    """The check at ``remember`` compares the packed weight with its unpacked copy value by value: a copy that
    differs (as another layout would read) leaves that weight to oneDNN, with the same results."""
    packed = _packed_for_steps(960, 576, torch.float32, bias=False)
    dense = packed.packed.to_dense()
    dense[5, 7] += 1.0
    torch.ops.flyspec_cpp.remember(packed.handle, packed.packed, dense)
    assert not torch.ops.flyspec_cpp.streamed(packed.handle)
    rows = torch.randn(2, 576)
    onednn = torch.ops.mkldnn._linear_pointwise(rows, packed.packed, None, "none", [], "")
    assert torch.equal(torch.ops.flyspec_cpp.packed_linear(rows, packed.handle, 960, None), onednn)


def test_without_a_c_operator_the_python_one_stays(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    def no_compiler() -> None:
        raise RuntimeError("no C++ compiler")

    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    packed_linears._pack_rest(model)
    monkeypatch.setattr(packed_linears, "_build_cpp_operator", no_compiler)
    packed_linears.cpp_operator.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=packed_linears.__name__):
            assert not packed_linears.use_cpp_operator(model)
        assert "no C++ compiler" in caplog.text and model[0].cpp is False
    finally:
        packed_linears.cpp_operator.cache_clear()  # the next caller builds (or loads) it again


def test_decode_attention_leaves_what_it_does_not_handle_to_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict] = []

    def spy(module, query, key, value, mask, dropout=0.0, scaling=None, **kwargs):
        calls.append(kwargs)
        return torch.zeros(1), None

    monkeypatch.setattr(kernels, "sdpa_attention_forward", spy)
    module = Module(2)
    query, key, value = attention_inputs(4, 4, 4, 2)
    decode_attention(module, query, key, value, torch.ones(1, 1, 4, 4, dtype=torch.bool))  # a prefill with a mask
    query, key, value = attention_inputs(2, 9, 4, 2)
    decode_attention(module, query, key, value, None)  # several queries and no mask
    query, key, value = attention_inputs(1, 9, 4, 2)
    decode_attention(module, query, key, value, None, dropout=0.1)
    decode_attention(module, query, key, value, None, softcap=30.0)  # anything it does not know
    decode_attention(module, query, key, value, None, s_aux=torch.zeros(4))
    assert len(calls) == 5
    decode_attention(module, query, key, value, None, softcap=None, output_attentions=False, use_cache=True)
    assert len(calls) == 5  # unset extras do not matter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("length", "heads", "kv_heads", "dim"), [(2, 4, 4, 16), (33, 6, 2, 32), (97, 9, 3, 64),
                                                                  (300, 8, 1, 128)])  # fmt: skip
def test_prefill_attention_matches_sdpa(
    dtype: torch.dtype, length: int, heads: int, kv_heads: int, dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt's causal attention from an empty cache (``flyspec_cpp::causal_attention``): sdpa's result computed in
    float64 from the same inputs, over block edges (32 queries, 64 keys a block), grouped-query heads, head sizes
    16 to 128; the query strided as a model hands it over. sdpa is not called."""
    assert kernels.attention_operators()
    torch.manual_seed(length)
    query = (torch.randn(1, length, heads, dim) * 2).to(dtype).transpose(1, 2)
    key, value = ((torch.randn(1, kv_heads, length, dim) * scale).to(dtype) for scale in (2, 1))
    # no further from the float64 result than sdpa in the same dtype (its rounding, plus a margin)
    assert_near_sdpa(Module(heads // kv_heads), query, key, value, None, 2, monkeypatch)


def test_a_prefill_runs_sdpa_where_the_operator_was_not_built(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def spy(module, query, key, value, mask, dropout=0.0, scaling=None, **kwargs):
        calls.append(query.shape[2])
        return torch.zeros(1), None

    monkeypatch.setattr(kernels, "sdpa_attention_forward", spy)
    query, key, value = attention_inputs(6, 6, 4, 2)
    monkeypatch.setattr(kernels, "_ATTENTION_OPERATORS", [False])
    decode_attention(Module(2), query, key, value, None)
    bidirectional = Module(2)
    bidirectional.is_causal = False
    monkeypatch.setattr(kernels, "_ATTENTION_OPERATORS", [True])
    decode_attention(bidirectional, query, key, value, None)  # not causal
    decode_attention(Module(2), query[..., :8], key[..., :8], value[..., :8], None)  # head size not a multiple of 16
    assert calls == [6, 6, 6]


def test_models_prefill_with_the_operator_and_match_stock(tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole model's prefill from an empty cache takes the operator in every layer (full attention), and its
    logits and the steps after it match the stock model's (float32)."""
    target = make_tiny_model(tokenizer, seed=5, layers=2, hidden=64)
    taken: list[bool] = []
    check = kernels._is_causal_prefill
    monkeypatch.setattr(kernels, "_is_causal_prefill", lambda *args: taken.append(check(*args)) or taken[-1])
    ids = target.encode_prompt(PROMPT, use_chat=False)
    rows = []
    for model in (CachedModel(target, in_place=False), CachedModel(with_kernels(target))):
        logits = [model.forward(ids, logits_to_keep=1), model.forward([5, 6, 7])]
        rows.append(torch.cat([part.reshape(-1, part.shape[-1]) for part in logits]))
    assert taken[:2] == [True, True]  # the prefill's two layers; the step after it has a cache
    torch.testing.assert_close(rows[1], rows[0], atol=1e-4, rtol=1e-4)


def test_growing_layer_matches_dynamic_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes, rollbacks and growth past the capacity (made tiny here) give the stock layer's keys and values."""
    monkeypatch.setattr(GrowingLayer, "INITIAL_CAPACITY", 4)
    torch.manual_seed(0)
    stock, growing = DynamicLayer(), GrowingLayer()
    assert growing.get_seq_length() == 0
    growing.crop(-3)  # before the first write: nothing to do, as for the stock layer
    for size, removed in [(3, 0), (2, 1), (6, 0), (1, 4), (9, 2), (1, 0), (20, 25)]:
        keys, values = torch.randn(1, 2, size, 8), torch.randn(1, 2, size, 8)
        expected = stock.update(keys, values)
        got = growing.update(keys, values)
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)
        if removed:
            stock.crop(-removed)
        growing.crop(-removed)
        assert growing.get_seq_length() == stock.get_seq_length()
        assert torch.equal(growing.keys, stock.keys) and torch.equal(growing.values, stock.values)
    with pytest.raises(ValueError, match="negative"):
        growing.crop(2)
    growing.reset()
    assert growing.get_seq_length() == 0 and not growing.is_initialized


def test_growing_layer_reserve_makes_room_before_the_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """After ``reserve(n)`` a write of n positions stays in the same buffers (a compiled step must not
    grow them), and the buffers always hold more positions than are cached (a view's contiguity then
    never changes); the keys are views, never assigned."""
    monkeypatch.setattr(GrowingLayer, "INITIAL_CAPACITY", 4)
    layer = GrowingLayer()
    layer.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    for size in (1, 1, 5, 2, 9, 1):
        layer.reserve(size)
        buffers = layer._buffers
        assert buffers is not None and buffers[0].shape[-2] > layer.length + size
        keys, values = layer.update(torch.randn(1, 2, size, 8), torch.randn(1, 2, size, 8))
        assert layer._buffers is buffers
        assert keys.data_ptr() == buffers[0].data_ptr() and not keys.is_contiguous()
    assert layer.get_seq_length() == 22
    with pytest.raises(AttributeError, match="view of its buffer"):
        layer.keys = torch.zeros(1, 2, 3, 8)


def test_install_swaps_linears_and_attention(tiny_target: LoadedModel) -> None:
    installed = with_kernels(tiny_target)
    linears = [module for module in installed.model.modules() if isinstance(module, torch.nn.Linear)]
    assert linears == []
    names = {
        name for name, module in installed.model.named_modules() if isinstance(module, PackedLinear | SharedLinear)
    }
    stock = {name for name, module in tiny_target.model.named_modules() if isinstance(module, torch.nn.Linear)}
    assert names == stock and stock
    # attention's query/key/value and the MLP's gate/up share a packed weight per layer
    shared = {
        name.rsplit(".", 1)[-1] for name in names if isinstance(installed.model.get_submodule(name), SharedLinear)
    }
    assert shared == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    assert installed.model.config._attn_implementation == kernels.ATTENTION
    assert tiny_target.model.config._attn_implementation == "sdpa"  # the original is untouched


def test_kernels_apply_only_where_they_can(tiny_target: LoadedModel) -> None:
    model = tiny_target.model
    assert kernels.applicable(model, "auto") is None
    assert "stock" in kernels.applicable(model, "stock")
    half = copy.deepcopy(model).to(torch.float16)
    assert "float16" in kernels.applicable(half, "auto")
    assert not kernels.install(half, "auto")  # left as loaded
    assert any(isinstance(module, torch.nn.Linear) for module in half.modules())
    with pytest.raises(ConfigError, match="unknown kernels 'fast'"):
        kernels.check_kernels("fast")


def test_installing_kernels_keeps_freed_memory_once_applied(
    tiny_target: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(kernels, "keep_freed_memory", lambda: calls.append("kept") or True)
    assert not kernels.install(copy.deepcopy(tiny_target.model).to(torch.float16), "auto")
    assert not kernels.install(copy.deepcopy(tiny_target.model), "stock")
    assert calls == []  # where the kernels do not apply, malloc is left alone
    assert kernels.install(copy.deepcopy(tiny_target.model), "auto")
    assert calls == ["kept"]


class FakeLibc:
    """A C library whose ``mallopt`` records its calls (a function, so ctypes' argtypes can be set on it)."""

    def __init__(self, refuse: int | None = None) -> None:
        self.calls: list[tuple[int, int]] = []

        def mallopt(parameter: int, value: int) -> int:
            self.calls.append((parameter, value))
            return 0 if parameter == refuse else 1

        self.mallopt = mallopt


def test_the_allocator_settings_reach_malloc_and_a_refusal_is_reported() -> None:
    libc = FakeLibc()
    assert allocator._apply(libc)  # type: ignore[arg-type]
    assert libc.calls == list(allocator.SETTINGS.items())
    assert dict(libc.calls)[allocator.M_MMAP_THRESHOLD] == 32 << 20  # glibc's largest
    refusing = FakeLibc(refuse=allocator.M_TOP_PAD)
    assert not allocator._apply(refusing)  # type: ignore[arg-type]
    assert len(refusing.calls) == 3  # the others are still set
    assert not allocator._apply(types.SimpleNamespace())  # type: ignore[arg-type]  # no mallopt at all


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's parameters are glibc's")
def test_glibc_takes_the_allocator_settings() -> None:
    assert allocator.keep_freed_memory() and allocator.keep_freed_memory()  # applied once, then remembered


def test_cached_steps_match_stock_through_rollbacks(tiny_target: LoadedModel) -> None:
    """The in-place cache and the kernels, through prefill, steps of several sizes and rollbacks."""
    stock, fast = CachedModel(tiny_target, in_place=False), CachedModel(with_kernels(tiny_target))
    assert isinstance(fast.cache.layers[0], GrowingLayer) and not isinstance(stock.cache.layers[0], GrowingLayer)
    ids = tiny_target.encode_prompt(PROMPT, use_chat=False)
    for model in (stock, fast):
        model.forward(ids, logits_to_keep=1)
    for step, size in enumerate([1, 4, 1, 7, 2, 16, 3] * 40):  # past the initial capacity of 256
        tokens = [(step * 7 + offset) % 200 + 2 for offset in range(size)]
        torch.testing.assert_close(fast.forward(tokens), stock.forward(tokens), atol=1e-4, rtol=1e-4)
        keep = stock.cached_length - step % 3
        stock.crop_to(keep)
        fast.crop_to(keep)
        assert fast.cached_length == stock.cached_length
    fast.reset()
    assert fast.cached_length == 0


def test_lossless_speculation_with_kernels_matches_plain_and_stock(tiny_target: LoadedModel) -> None:
    config = DecodeConfig(max_new_tokens=40, ignore_eos=True)
    fast = with_kernels(tiny_target)
    stock_plain = PlainDecoder(tiny_target, config).generate(PROMPT, use_chat=False).token_ids
    assert PlainDecoder(fast, config).generate(PROMPT, use_chat=False).token_ids == stock_plain
    for k in (1, 4, 12):
        result = SpeculativeDecoder(
            fast, NgramDrafter(), make_verifier("exact"), config, SpeculationConfig(num_draft_tokens=k)
        ).generate(PROMPT, use_chat=False)
        assert result.token_ids == stock_plain, k
    assert result.stats.num_accepted > 0  # drafts were verified and kept, so rollbacks happened too


def test_sliding_window_model_with_kernels_matches_stock(tokenizer) -> None:
    """Gemma-3-style sliding layers live in the in-place cache too (every position kept); attention gets their
    windowed masks."""
    target = make_tiny_gemma3(tokenizer, layer_types=["sliding_attention", "full_attention"])
    fast = with_kernels(target)
    layers = CachedModel(fast).cache.layers
    assert all(isinstance(layer, GrowingLayer) for layer in layers)
    config_decode = DecodeConfig(max_new_tokens=40, ignore_eos=True)
    expected = PlainDecoder(target, config_decode).generate(PROMPT, use_chat=False).token_ids
    result = SpeculativeDecoder(
        fast, NgramDrafter(), make_verifier("exact"), config_decode, SpeculationConfig(num_draft_tokens=6)
    ).generate(PROMPT, use_chat=False)
    assert result.token_ids == expected


def test_bfloat16_kernels_agree_with_stock(tokenizer) -> None:
    """bf16 rounds differently, so agreement rather than identity: teacher-forced over the same tokens
    (one-token and several-token steps), the kernels' logits stay close to stock and pick the same
    token almost everywhere (independent of how a CPU's bf16 units round)."""
    target = make_tiny_model(tokenizer, seed=3, layers=2, hidden=64)
    target = LoadedModel(model=target.model.to(torch.bfloat16), tokenizer=tokenizer, name="tiny-bf16")
    if kernels.applicable(target.model, "auto") is not None:
        pytest.skip("this CPU has no oneDNN bfloat16 linear")
    ids = target.encode_prompt(PROMPT, use_chat=False)
    steps = [[(7 * index + offset) % 200 + 2 for offset in range(size)] for index, size in enumerate([1, 3, 1, 6] * 5)]
    rows = []
    for model in (CachedModel(target, in_place=False), CachedModel(with_kernels(target))):
        model.forward(ids, logits_to_keep=1)
        rows.append(torch.cat([model.forward(step) for step in steps]))
    stock, fast = rows
    agree = (stock.argmax(-1) == fast.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree
    assert (stock - fast).abs().max() <= 0.05 * stock.abs().max()


def test_load_model_installs_kernels_unless_stock(tiny_model_dir) -> None:
    from flyspec.runtime.loading import load_model

    fast = load_model(str(tiny_model_dir), dtype="float32")
    stock = load_model(str(tiny_model_dir), dtype="float32", kernels="stock")
    assert fast.kernels and not stock.kernels
    assert any(isinstance(module, PackedLinear) for module in fast.model.modules())
    assert not any(isinstance(module, PackedLinear) for module in stock.model.modules())
    ids = [5, 6, 7, 8, 9]
    with torch.inference_mode():
        torch.testing.assert_close(
            fast.model(torch.tensor([ids])).logits, stock.model(torch.tensor([ids])).logits, atol=1e-4, rtol=1e-4
        )
