#!/usr/bin/env bash
# The GPU half of the README's Memory and Speed sections, in one command, on one CUDA GPU:
#
#   bash experiments/gpu_benchmarks.sh            # writes results/*_<GPU name>.{md,json,png}
#
# It starts with .ci/gpu, the checks of every CUDA-only branch (docs/gpu.md).
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

# first the checks of every CUDA-only branch (docs/gpu.md; about 10 minutes): benchmarks of code whose
# GPU paths fail would be worth nothing. GPU_CHECKS=0 skips them.
if [ "${GPU_CHECKS:-1}" != 0 ]; then
    run bash .ci/gpu
fi

# the paper's LLaMA-7B table: config/llama7b_lisa_wor.py (pure bf16, micro-batch 16 x 256, activation
# checkpointing, 2 of 32 blocks) with LLaMA's vocabulary instead of the config's GPT-2 one
run python bench_memory.py config/llama7b_lisa_wor.py --vocab_size=32000 --methods=full,galore,golore,lisa,lisa_wor \
    --out="results/memory_llama-7b_$gpu"
# LISA-wor with an fp32 master copy of the active blocks only: on the GPU (bf16_master, above the paper's
# 19.56 GiB) or on the CPU with the AdamW step there (bf16_master:cpu), next to pure bf16
run python bench_memory.py config/llama7b_lisa_wor.py --vocab_size=32000 --methods=lisa_wor \
    --precisions=bf16,bf16_master,bf16_master:cpu --out="results/memory_llama-7b_lisa_wor_variants_$gpu"
# GPT-2 124M as config/gpt2_lisa_wor.py trains it (precision amp: fp32 weights, bf16 autocast; micro-batch
# 60 x 1024; omgd_state keep), and under bf16_master
run python bench_memory.py config/gpt2_lisa_wor.py --methods=full,galore,golore,lisa,lisa_wor \
    --precisions=amp,bf16_master --out="results/memory_gpt2_$gpu"
# speed: full AdamW, LISA, LISA-wor and GaLore on GPT-2 124M, compiled per block, one run
run python bench.py --methods=full,lisa,lisa_wor,galore --preset=gpt2 --vocab_size=50304 --batch_size=12 \
    --block_size=1024 --omgd_gamma=3 --out="results/bench_gpt2_$gpu.md"
