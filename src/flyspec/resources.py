"""What outlives one generation: loaded models, n-gram caches, layer-skip calibrations, step costs.

Sharing them is a decision of whoever creates a :class:`Resources` (a CLI run, the server, a
benchmark, an evaluation) and passes it to :func:`flyspec.api.build_decoder`. A library call given
none (``flyspec.generate``, ``generate_plain``, ``build_decoder``) gets a fresh one of its own
(:func:`default_resources`), so no n-gram cache, calibration or other state that a prompt or an
output reaches passes between callers. Only its *models* come from the one process-wide cache,
:data:`DEFAULT_MODELS` (at most 2, the least recently used dropped; :func:`set_max_cached_models`),
so a loop of ``flyspec.generate(prompt, "model-name")`` loads the model once. The server, the CLI,
bench and eval always pass their own :class:`Resources` and never touch it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

import torch

from flyspec.config import DEFAULT_DEVICE, DEFAULT_DTYPE, ConfigError, NgramCacheConfig, NgramConfig
from flyspec.drafters.layer_skip import Calibrations
from flyspec.drafters.ngram_cache import NgramCache
from flyspec.runtime.loaded_model import LoadedModel
from flyspec.runtime.loading import load_model
from flyspec.runtime.step_cost import SIZES, StepCost, step_cost

ModelRef = str | LoadedModel


class Resources:
    """Models by name (loaded once, in ``dtype`` on ``device``, compiled if asked), n-gram caches,
    calibrations, and each model's step cost t(n) (``runtime/step_cost.py``; a property of the machine).

    ``models``: already loaded models, found by their ``name`` (tests, or a caller that loaded them).
    ``model_cache``: where a name is loaded from the first time (default: loaded here, kept as long as this is).
    :meth:`isolated` gives a view that shares the models, calibrations and step costs but has its own
    n-gram caches: the server gives one to each tenant, a benchmark one to each method.
    """

    def __init__(
        self,
        dtype: str | torch.dtype = DEFAULT_DTYPE,
        models: Iterable[LoadedModel] = (),
        device: str | torch.device = DEFAULT_DEVICE,
        compile: bool = False,
        kernels: str = "auto",
        model_cache: ModelCache | None = None,
    ) -> None:
        self.dtype = dtype
        self.device = device  # every model named here loads onto it: draft models sit beside the target
        self.compile = compile  # every model named here compiles its cached steps (runtime/compiled_steps.py)
        self.kernels = kernels  # ... and gets flyspec's CPU kernels where they apply (runtime/kernels.py)
        self.model_cache = model_cache  # names load through it (DEFAULT_MODELS for library calls), else here
        self._models: dict[str, LoadedModel] = {model.name: model for model in models}
        self._ngram_caches: dict[str, NgramCache] = {}
        self.calibrations = Calibrations()
        self._step_costs: dict[str, StepCost] = {}
        self._lock = threading.Lock()

    def model(self, model: ModelRef) -> LoadedModel:
        """A loaded model as is (and remembered under its name if the name is new), or a name loaded on first use.

        A loaded model is returned itself even when another was remembered under its name first
        (``custom_generate`` passes one per call, with that call's EOS ids).
        """
        with self._lock:
            if isinstance(model, LoadedModel):
                self._models.setdefault(model.name, model)
                return model
            if model not in self._models:
                load = load_model if self.model_cache is None else self.model_cache.load
                self._models[model] = load(
                    model, dtype=self.dtype, device=self.device, compile=self.compile, kernels=self.kernels
                )
            return self._models[model]

    def step_cost(self, model: LoadedModel, max_tokens: int) -> StepCost:
        """``model``'s forward cost t(n) for n up to ``max_tokens``: remembered here, else read from the
        on-disk cache or measured (``runtime/step_cost.step_cost``). Measured up to the next size of the grid, so
        requests asking for ever longer drafts (a server's, say) make at most a few measurements."""
        wanted = next((size for size in SIZES if size >= max_tokens), max_tokens)
        with self._lock:
            cost = self._step_costs.get(model.name)
            if cost is None or cost.max_tokens < max_tokens:
                cost = self._step_costs[model.name] = step_cost(model, wanted)
            return cost

    def ngram_cache(self, vocabulary: str, config: NgramCacheConfig, ngram: NgramConfig) -> NgramCache:
        """The cache of n-grams in ``vocabulary``'s token ids (the model above the n-gram level), made on first use.

        The first configuration is kept: a cache other generations use is never resized.
        """
        with self._lock:
            cache = self._ngram_caches.get(vocabulary)
            if cache is None:
                cache = self._ngram_caches[vocabulary] = NgramCache(config, ngram)
            return cache

    def ngram_caches(self) -> list[NgramCache]:
        with self._lock:
            return list(self._ngram_caches.values())

    def ngram_caches_by_vocabulary(self) -> dict[str, NgramCache]:
        """Each n-gram cache under the name of the model whose token ids it holds (for saving them)."""
        with self._lock:
            return dict(self._ngram_caches)

    def isolated(self) -> Resources:
        """The same models and calibrations, with n-gram caches of its own."""
        view = Resources(
            self.dtype, device=self.device, compile=self.compile, kernels=self.kernels, model_cache=self.model_cache
        )
        view._models, view._lock, view.calibrations = self._models, self._lock, self.calibrations
        view._step_costs = self._step_costs
        return view


class ModelCache:
    """Loaded models by name and load options (dtype, device, compile, kernels): at most ``max_models``,
    the least recently used dropped first (0 keeps none).

    Models only, by design: weights and tokenizers, which no prompt or output changes. Whatever a
    generation learns or measures (n-gram caches, calibrations, step costs) stays in the
    :class:`Resources` of its call.
    """

    def __init__(self, max_models: int = 2) -> None:
        self._models: OrderedDict[tuple[str, str, str, bool, str], LoadedModel] = OrderedDict()
        self._lock = threading.Lock()
        self.resize(max_models)

    def load(
        self,
        name: str,
        dtype: str | torch.dtype = DEFAULT_DTYPE,
        device: str | torch.device = DEFAULT_DEVICE,
        compile: bool = False,
        kernels: str = "auto",
    ) -> LoadedModel:
        """``name`` loaded with these options (as ``load_model``): the kept one, else loaded now."""
        key = (name, str(dtype), str(device), compile, kernels)
        with self._lock:  # one load at a time: two callers asking for one model load it once
            model = self._models.pop(key, None)
            if model is None:
                model = load_model(name, dtype=dtype, device=device, compile=compile, kernels=kernels)
            self._models[key] = model  # the most recently used last
            self._evict()
            return model

    def resize(self, max_models: int) -> None:
        """Keep at most ``max_models`` from now on (dropping the least recently used beyond that)."""
        if isinstance(max_models, bool) or not isinstance(max_models, int) or max_models < 0:
            raise ConfigError(f"max_models must be an integer >= 0 (got {max_models!r}); 0 keeps no model loaded")
        with self._lock:
            self.max_models = max_models
            self._evict()

    def names(self) -> list[str]:
        """The names of the models kept, least recently used first."""
        with self._lock:
            return [key[0] for key in self._models]

    def _evict(self) -> None:
        while len(self._models) > self.max_models:
            self._models.popitem(last=False)


# The one process-wide cache: the models of library calls given no Resources (module docstring).
DEFAULT_MODELS = ModelCache(max_models=2)


def default_resources(
    dtype: str | torch.dtype = DEFAULT_DTYPE, device: str | torch.device = DEFAULT_DEVICE
) -> Resources:
    """The resources of one library call given none: its own n-gram caches, calibrations and step costs,
    its models from :data:`DEFAULT_MODELS`."""
    return Resources(dtype, device=device, model_cache=DEFAULT_MODELS)


def set_max_cached_models(max_models: int) -> None:
    """How many models ``flyspec.generate`` (and any library call given no resources) keeps loaded between
    calls: default 2, the least recently used dropped first; 0 frees them and loads on every call."""
    DEFAULT_MODELS.resize(max_models)
