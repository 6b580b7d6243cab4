cd /work/main
export PYTHONPATH=/work/main/src:/work/main/integrations/vllm/src VLLM_CPU_OMP_THREADS_BIND=0-1
M=plain,ngram+exact,ngram+fly,ngram+fly+bare,hf-plain,hf-lookup
.venv/bin/flyspec bench --compile --methods $M,vllm-plain --limit 2 --max-new-tokens 128 --vllm-venv /work/venv-vllm --out /work/scratch/b15/A-compiled > /work/scratch/b15/A.log 2>&1
.venv/bin/flyspec bench --methods $M --limit 2 --max-new-tokens 128 --out /work/scratch/b15/B-eager > /work/scratch/b15/B.log 2>&1
