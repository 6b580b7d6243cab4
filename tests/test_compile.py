"""The compiled step forward (``--compile``, ``compiled_steps.compile_steps``): same tokens, same KV invariant.

One tiny model is compiled once for the module (compiling takes tens of seconds on 2 cores).
"""

from __future__ import annotations

import dataclasses
import types
from types import SimpleNamespace

import pytest
import torch
from torch._inductor.codecache import CppWrapperCodeCache

import flyspec.runtime.kernels as kernels
from conftest import make_tiny_gemma3, make_tiny_model
from flyspec.api import build_decoder
from flyspec.config import DecodeConfig, DraftLengthConfig, SpeculationConfig
from flyspec.decoding.plain import PlainDecoder
from flyspec.resources import Resources
from flyspec.runtime.cached_model import CachedModel
from flyspec.runtime.compiled_steps import compile_options, compile_steps
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.loading import cpu_isa
from flyspec.runtime.packed_linears import PackedLinear, SharedLinear
from test_reference import naive_greedy

PROMPT = [5, 9, 12, 7, 5, 9, 12, 7, 5, 9]  # repeats, so n-gram drafts have something to copy


@pytest.fixture(scope="module", params=["stock", "kernels"])
def models(tokenizer, request) -> tuple[LoadedModel, LoadedModel]:
    """An eager model and its compiled twin: transformers' modules (inductor freezing packs the
    weights), or flyspec's kernels (packed linears as opaque operators, the decode attention)."""
    eager = make_tiny_model(tokenizer, seed=11, name="compile-me")
    if request.param == "kernels":
        assert kernels.install(eager.model, "auto")
        eager = dataclasses.replace(eager, kernels=True)
    loaded: list[object] = []  # the C++ wrappers inductor builds or loads from its cache, one per graph
    original = CppWrapperCodeCache.load_pybinding_async.__func__

    def spy(cls, *args, **kwargs):
        loaded.append(args)
        return original(cls, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CppWrapperCodeCache, "load_pybinding_async", classmethod(spy))
        compiled = compile_steps(eager)
    CPP_WRAPPERS[request.param] = len(loaded)
    return eager, compiled


CPP_WRAPPERS: dict[str, int] = {}  # per engine: the C++ wrappers its compile loaded


def test_compile_steps_wraps_the_forward_and_keeps_the_model(models) -> None:
    eager, compiled = models
    assert eager.step_forward is None
    assert compiled.step_forward is not None and compiled.prefill_forward is not None
    assert eager.prefill_forward is None
    assert compiled.model is eager.model  # the weights are shared, not copied
    assert compiled.kernels == eager.kernels


def test_on_the_cpu_every_graph_runs_from_a_cpp_wrapper(models, request) -> None:
    # the prefill's graph and the steps' two (one token; several): each called from C++, not Python (issue 53)
    assert CPP_WRAPPERS[request.node.callspec.params["models"]] >= 3
    assert compile_options(models[0])["cpp_wrapper"] is True


def test_the_compiled_graphs_call_the_packed_linears_c_operator(models, request) -> None:
    """With flyspec's kernels, every compiled graph (the prefill's and both steps') calls the packed linears through
    ``flyspec_cpp::packed_linear`` (C++), never the Python-bodied ``flyspec::packed_linear`` (issue 53)."""
    if request.node.callspec.params["models"] == "stock":
        pytest.skip("transformers' modules have no packed linears: inductor's freezing packs their weights")
    _, compiled = models
    cached = CachedModel(compiled)
    with torch.profiler.profile() as trace:
        cached.forward(list(range(3, 12)), logits_to_keep=1)  # the prefill's graph
        cached.forward([5])  # one token
        cached.forward([5, 6, 7])  # several
    calls = {event.name for event in trace.events()}
    assert "flyspec_cpp::packed_linear" in calls
    assert "flyspec::packed_linear" not in calls
    if cpu_isa() in {"AVX512", "AVX512-BF16", "AMX"} and compiled.dtype == torch.float32:
        # and the operator reads a step's rows out of every packed weight itself (packed_linear.cpp)
        linears = [module for module in compiled.model.modules() if isinstance(module, PackedLinear)]
        shared = [module.group.linear for module in compiled.model.modules() if isinstance(module, SharedLinear)]
        assert linears and shared  # fused siblings (query/key/value, gate/up) hold theirs in their group
        assert all(torch.ops.flyspec_cpp.streamed(linear.handle) for linear in linears + shared)


def test_the_models_floats_are_constants_of_its_graphs_not_inputs(models) -> None:
    """Every norm's epsilon and attention's scaling is baked into the compiled graphs: the code dynamo runs before each
    graph reads none of the model's float attributes (each one read was a float64 tensor made at every call; issue 53,
    benchmarks/2026-11-28-constant-floats)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    _, compiled = models
    modules = compiled.model.modules()
    floats = {name for module in modules for name, value in vars(module).items() if type(value) is float}
    assert {"variance_epsilon", "attention_scaling"} <= floats
    for forward in (compiled.step_forward, compiled.prefill_forward):
        entries = _debug_get_cache_entry_list(forward.func._torchdynamo_orig_callable.__code__)
        assert entries  # the warm-up compiled it
        for entry in entries:
            names = set(entry.code.co_names).union(
                *(const.co_names for const in entry.code.co_consts if isinstance(const, types.CodeType))
            )
            assert not names & floats, f"read at every call: {sorted(names & floats)}"


def test_a_gpu_model_keeps_the_python_wrapper() -> None:
    for kernels_installed in (False, True):
        options = compile_options(SimpleNamespace(kernels=kernels_installed, device=torch.device("cuda")))
        assert "cpp_wrapper" not in options and options.get("freezing", False) is not kernels_installed
    options = compile_options(SimpleNamespace(kernels=False, device=torch.device("cpu")))
    assert options["cpp_wrapper"] and options["cpp_wrapper_build_separate"] and options["freezing"]


def test_compiled_steps_score_like_eager_ones(models) -> None:
    eager, compiled = models
    rows = []
    for loaded in models:
        cached = CachedModel(loaded)
        cached.forward(PROMPT[:-1], logits_to_keep=1)  # prefill: compiled (a graph of its own) and eager
        first = cached.forward(PROMPT[-1:])  # one token
        second = cached.forward([3, 4, 5, 6, 7])  # a draft's worth, another shape: the same dynamic graph
        cached.crop_to(len(PROMPT) + 1)  # roll back as a verifier would
        third = cached.forward([8, 9])
        rows.append(torch.cat([first, second, third]))
        assert cached.cached_length == len(PROMPT) + 3
    torch.testing.assert_close(rows[0], rows[1], atol=1e-4, rtol=1e-4)  # float32: rounding only
    assert torch.equal(rows[0].argmax(-1), rows[1].argmax(-1))


def test_compiled_greedy_decoding_matches_the_independent_reference(models) -> None:
    eager, compiled = models
    expected = naive_greedy(eager.model, PROMPT, 24)
    decode = DecodeConfig(max_new_tokens=24, ignore_eos=True)
    resources = Resources(models=(compiled,))
    plain = PlainDecoder(compiled, decode).generate(PROMPT)
    spec = SpeculationConfig(drafter="ngram", verifier="exact", num_draft_tokens=6)
    speculative = build_decoder(compiled, spec, decode, resources=resources).generate(PROMPT)
    assert plain.token_ids == expected
    assert speculative.token_ids == expected
    assert speculative.stats.num_target_forwards < plain.stats.num_target_forwards  # drafts were kept


def test_compiling_happens_at_load_not_during_generation(models) -> None:
    from torch._dynamo.utils import counters

    _, compiled = models
    before = sum(counters["stats"].values()), dict(counters["frames"])
    cached = CachedModel(compiled)
    cached.forward(list(range(3, 40)), logits_to_keep=1)  # a longer prefill than the warm-up's
    # every draft length, each rolled back by a verifier's verdict (none, one or several tokens
    # rejected): a cropped cache is a view with other strides, which must not need a new graph
    for size, rejected in ((1, 0), (16, 9), (7, 1), (1, 0), (2, 1), (5, 0), (9, 3), (1, 0), (3, 2)):
        cached.forward(list(range(size)))
        cached.crop_to(cached.cached_length - rejected)
    assert (sum(counters["stats"].values()), dict(counters["frames"])) == before


def test_a_prefill_of_any_length_runs_the_one_prefill_graph_compiled_at_load(models) -> None:
    """A prefill from an empty cache runs its own compiled graph (dynamic in the prompt's length), compiled by the
    warm-up: prompts shorter and longer than the decode attention's query limit and the cache's first capacity
    compile nothing new, score like eager prefills (the last row), and the steps after them reuse their graphs."""
    from torch._dynamo.utils import counters

    eager, compiled = models
    before = sum(counters["stats"].values()), dict(counters["frames"])
    with torch._dynamo.config.patch(error_on_recompile=True):
        for length in (2, 3, kernels.MAX_DECODE_QUERIES + 1, kernels.GrowingLayer.INITIAL_CAPACITY + 44):
            prompt = [(7 * index) % 250 + 3 for index in range(length)]
            rows = []
            for loaded in (compiled, eager):
                cached = CachedModel(loaded)
                assert cached._forward_for(length, 1) is (loaded.prefill_forward or loaded.model)
                rows.append(torch.cat([cached.forward(prompt, logits_to_keep=1), cached.forward([5]),
                                       cached.forward([5, 6, 7])]))  # fmt: skip
            torch.testing.assert_close(rows[0], rows[1], atol=1e-4, rtol=1e-4)  # float32: rounding only
    assert (sum(counters["stats"].values()), dict(counters["frames"])) == before
    cached = CachedModel(compiled)  # a 1-token prompt (a size torch specialises) and a continued prefill: eager
    assert cached._forward_for(1, 1) is compiled.model
    cached.forward([3, 4], logits_to_keep=1)
    assert cached._forward_for(5, 1) is compiled.model


def test_the_in_place_cache_grows_under_compile_without_a_new_graph(models, monkeypatch) -> None:
    """Compiled steps write into GrowingLayer's buffers (with or without the kernels: the in-place cache is
    every device's): steps and rollbacks past several doublings of a (here tiny) capacity score like eager
    steps on transformers' concatenating cache and compile nothing new, because the buffers grow outside
    the graph, and a rollback copies nothing (only the length changes)."""
    eager, compiled = models
    monkeypatch.setattr(kernels.GrowingLayer, "INITIAL_CAPACITY", 8)
    fast, reference = CachedModel(compiled), CachedModel(dataclasses.replace(eager, kernels=False), in_place=False)
    assert isinstance(fast.cache.layers[0], kernels.GrowingLayer)
    rows: list[list[torch.Tensor]] = [[], []]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for index, cached in enumerate((fast, reference)):
            cached.forward(PROMPT[:5], logits_to_keep=1)
            for size, rejected in ((1, 0), (6, 2), (1, 0), (9, 3), (16, 4), (2, 0), (16, 0), (1, 1)):
                rows[index].append(cached.forward(list(range(size))))
                cached.crop_to(cached.cached_length - rejected)
    assert fast.cached_length == reference.cached_length == 5 + 52 - 10
    torch.testing.assert_close(torch.cat(rows[0]), torch.cat(rows[1]), atol=1e-4, rtol=1e-4)
    assert fast.cache.layers[0]._buffers[0].shape[-2] > 32  # grew through 8, 16 and 32


def test_two_compiled_models_of_one_class_keep_their_own_weights(models, tokenizer) -> None:
    """Each compiled model's graphs live on a code object of its own, so dropping the guards on its
    modules cannot hand one model's graph (with the other's packed or frozen weights) to the other."""
    eager, compiled = models
    other = make_tiny_model(tokenizer, seed=12, name="compile-me-too")
    if eager.kernels:
        assert kernels.install(other.model, "auto")
        other = dataclasses.replace(other, kernels=True)
    other_compiled = compile_steps(other)
    for pair in ((eager, compiled), (other, other_compiled), (eager, compiled)):
        logits = []
        for loaded in pair:
            cached = CachedModel(loaded)
            cached.forward(PROMPT[:-1], logits_to_keep=1)
            logits.append(cached.forward(PROMPT[-1:]))
        torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


def test_a_speculative_generation_compiles_nothing_after_load(models) -> None:
    """The real loop — drafts made by the drafter outside inference mode, rollbacks after partial
    rejections, plain steps — runs on the graphs compiled at load: any recompile is an error."""
    _, compiled = models
    decode = DecodeConfig(max_new_tokens=40, ignore_eos=True)
    resources = Resources(models=(compiled,))
    for policy in ("fixed", "cost"):
        spec = SpeculationConfig(num_draft_tokens=8, draft_length=DraftLengthConfig(policy=policy))
        decoder = build_decoder(compiled, spec, decode, resources=resources)
        with torch._dynamo.config.patch(error_on_recompile=True):
            result = decoder.generate(PROMPT + [3, 1, 4, 1, 5, 9, 2, 6])
            PlainDecoder(compiled, decode).generate(PROMPT)
        assert result.stats.num_accepted > 0 and result.stats.num_proposed > result.stats.num_accepted


def test_compile_reaches_the_models_resources_load() -> None:
    assert Resources(compile=True).compile is True
    assert Resources().compile is False


@pytest.mark.heavy(40)
@pytest.mark.parametrize("window", [8, 40])
def test_sliding_window_layers_compile_once_and_decode_exactly_past_the_window(tokenizer, window: int) -> None:
    """Gemma-3's sliding-window layers under ``--compile``: generation far past the window, plain and speculative with
    rollbacks, runs on the graphs compiled at load (transformers' sliding layers recompiled at every new stride, issue
    79; and the mask's guard on the window, where the window lies beyond what a short warm-up reaches: 40 here, 512
    in Gemma-3-270M) and keeps naive greedy decoding's tokens."""
    layers = ["sliding_attention", "sliding_attention", "full_attention"]
    eager = make_tiny_gemma3(tokenizer, layers, seed=4, window=window)
    assert kernels.install(eager.model, "auto")
    eager = dataclasses.replace(eager, kernels=True)
    compiled = compile_steps(eager)
    decode = DecodeConfig(max_new_tokens=3 * window + 24, ignore_eos=True)
    expected = naive_greedy(eager.model, PROMPT, decode.max_new_tokens)
    spec = SpeculationConfig(drafter="ngram", verifier="exact", num_draft_tokens=6)
    with torch._dynamo.config.patch(error_on_recompile=True):
        plain = PlainDecoder(compiled, decode).generate(PROMPT)
        speculative = build_decoder(compiled, spec, decode, resources=Resources(models=(compiled,))).generate(PROMPT)
    assert plain.token_ids == expected
    assert speculative.token_ids == expected
    assert speculative.stats.num_proposed > speculative.stats.num_accepted  # some drafts were rolled back
