"""The model runtime: everything that runs a model, and nothing about speculation.

- ``loaded_model.py``   LoadedModel: a causal LM with its tokenizer; weight and tokenizer fingerprints
- ``loading.py``        load_model from a packaged name, a .gguf file, a directory or a hub id; devices, dtypes
- ``cached_model.py``   CachedModel: incremental forwards on a KV cache that can be cropped (rollback)
- ``target.py``         Target: prefill, score a draft in one forward (``[k + 1, vocab]``), roll back
- ``compiled_steps.py`` the cached steps through ``torch.compile`` (``--compile``)
- ``kernels.py``        flyspec's CPU kernels (``--kernels auto``): decode attention, in-place KV cache
- ``packed_linears.py`` oneDNN-prepacked linears for the kernels
- ``step_cost.py``      the target's measured forward cost t(n), cached on disk
- ``memory_floor.py``   the memory floor of a one-token step: its weights' bytes ÷ the device's read bandwidth
- ``clock.py``          clock reads that wait for the device first (GPU kernels run asynchronously)

Nothing here imports the rest of flyspec except the torch-free declarations every layer shares
(``config/speculation.py`` with ``config/mapping.py``, ``config/names.py``): ``tests/test_layout.py`` checks it. The
drafters, verifiers and decoders are built on top of this package; it knows none of them.
"""
