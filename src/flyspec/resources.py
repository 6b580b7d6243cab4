"""What outlives one generation: loaded models, n-gram caches, layer-skip calibrations, step costs.

Sharing them is a decision of whoever creates a :class:`Resources` (a CLI run, the server, a
benchmark, an evaluation) and passes it to :func:`flyspec.api.build_decoder`; the library's default
is a private one per call, so no state leaks between callers or requests through a module global.
A protected-token vocabulary belongs to its loaded model (``LoadedModel.vocabulary``), so it lives
as long as the model does here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from flyspec.config import DEFAULT_DEVICE, DEFAULT_DTYPE, NgramCacheConfig, NgramConfig
from flyspec.drafters.layer_skip import Calibrations
from flyspec.drafters.ngram_cache import NgramCache
from flyspec.models import LoadedModel, load_model
from flyspec.step_cost import SIZES, StepCost, step_cost

ModelRef = str | LoadedModel


class Resources:
    """Models by name (loaded once, in ``dtype`` on ``device``, compiled if asked), n-gram caches,
    calibrations, and each model's step cost t(n) (``step_cost.py``; a property of the machine).

    ``models``: already loaded models, found by their ``name`` (tests, or a caller that loaded them).
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
    ) -> None:
        self.dtype = dtype
        self.device = device  # every model named here loads onto it: draft models sit beside the target
        self.compile = compile  # every model named here compiles its cached steps (compiled_steps.compile_steps)
        self.kernels = kernels  # ... and gets flyspec's CPU kernels where they apply (kernels.py)
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
                self._models[model] = load_model(
                    model, dtype=self.dtype, device=self.device, compile=self.compile, kernels=self.kernels
                )
            return self._models[model]

    def step_cost(self, model: LoadedModel, max_tokens: int) -> StepCost:
        """``model``'s forward cost t(n) for n up to ``max_tokens``: remembered here, else read from the
        on-disk cache or measured (``step_cost.step_cost``). Measured up to the next size of the grid, so
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
        view = Resources(self.dtype, device=self.device, compile=self.compile, kernels=self.kernels)
        view._models, view._lock, view.calibrations = self._models, self._lock, self.calibrations
        view._step_costs = self._step_costs
        return view
