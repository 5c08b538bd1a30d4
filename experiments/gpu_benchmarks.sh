#!/usr/bin/env bash
# The GPU half of the README's Memory and Speed sections, in one command, on one CUDA GPU:
#
#   bash experiments/gpu_benchmarks.sh            # writes results/*_<GPU name>.{md,json,png}
#
# The same commands without a GPU give the meta-device estimates already in results/; this script
# refuses to run without CUDA so that it never writes an estimate under a GPU's name.
# llama-7b needs about 53 GiB for full AdamW (the meta estimate): an 80 GiB GPU is enough.
set -euo pipefail
cd "$(dirname "$0")/.."

gpu=$(python -c "
import sys, torch
if not torch.cuda.is_available():
    sys.exit('error: no CUDA device; run bench_memory.py --device=meta for the estimates')
print(torch.cuda.get_device_name().replace(' ', '_'))")
log=results/gpu_benchmarks_$gpu.log
mkdir -p results
echo "GPU: $gpu, torch $(python -c 'import torch; print(torch.__version__)'), log: $log"

run() {  # run one command, echoing it into the log first
    echo "\$ $*" | tee -a "$log"
    "$@" 2>&1 | tee -a "$log"
}

# the paper's LLaMA-7B table: pure bf16, micro-batch 16 x 256, activation checkpointing
run python bench_memory.py --model=llama-7b --methods=full,galore,golore,lisa,lisa_wor \
    --batch_size=16 --block_size=256 --out="results/memory_llama-7b_$gpu"
# LISA-wor with an fp32 master copy of the active blocks only: on the GPU (+master, above the paper's
# 19.56 GiB) or on the CPU with the AdamW step there (+offload, the row below it)
run python bench_memory.py --model=llama-7b --methods=lisa_wor,lisa_wor+master,lisa_wor+offload \
    --batch_size=16 --block_size=256 --out="results/memory_llama-7b_lisa_wor_variants_$gpu"
# GPT-2 124M at config/gpt2_lisa_wor.py's micro-batch, nanoGPT's precision (fp32 weights, bf16 autocast)
run python bench_memory.py --model=gpt2 --methods=full,galore,golore,lisa,lisa_wor,lisa_wor+master \
    --batch_size=60 --block_size=1024 --gamma=3 --dtype=bf16_autocast --activation_checkpointing=False \
    --vocab_size=50304 --grad_accum=8 --out="results/memory_gpt2_$gpu"
# speed: full AdamW, LISA, LISA-wor and GaLore on GPT-2 124M, compiled per block, one run
run python bench.py --model=gpt2 --vocab_size=50304 --batch_size=12 --block_size=1024 --gamma=3 --out="results/bench_gpt2_$gpu.md"
