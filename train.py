"""
Pre-train a GPT-2 or LLaMA model with OMGD layer cycling (LISA-wor) or a baseline method.

One process (CPU or one GPU):
$ python train.py                                  # small LISA-wor model on Shakespeare, CPU, minutes
$ python train.py config/shakespeare_lisa_wor.py --method=lisa --max_iters=500

DDP on 4 GPUs of one node (gloo instead of nccl when there is no CUDA, or with --backend=gloo):
$ torchrun --standalone --nproc_per_node=4 train.py config/gpt2_lisa_wor.py
FSDP2 (each block sharded over the ranks), for weights that do not fit on one GPU:
$ torchrun --standalone --nproc_per_node=4 train.py config/gpt2_lisa_wor.py --parallel=fsdp

Several nodes (the same command on every node; HOST is one of them; the rendezvous assigns ranks):
$ torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
      --rdzv-id=gpt2 train.py config/gpt2_lisa_wor.py
"""
import math
import os
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from configurator import ConfigError, configure, format_config
import checkpoint as ckpt_io
from dataloader import data_dir, dataset_vocab, open_splits, prepare_if_embedded
import distributed
from model import GPT, GPTConfig
import training

# -----------------------------------------------------------------------------
# default config values: a small GPT on character-level Shakespeare with LISA-wor, minutes on CPU
# I/O
out_dir = 'out'
eval_interval = 100
log_interval = 10
eval_iters = 20
eval_only = False  # evaluate once and exit
always_save_checkpoint = True  # if False, save only when the val loss improves
init_from = 'scratch'  # 'scratch', 'resume' (from out_dir) or a GPT-2 name ('gpt2', 'gpt2-medium', ...)
overwrite = False  # let a run that does not resume replace the checkpoint already in out_dir
sample_tokens = 300  # length of the sample printed at the end (0: none)
# wandb logging (optional, off by default; never needed to run or test)
wandb_log = False
wandb_project = 'omgd'
wandb_run_name = 'run'
# data
dataset = 'shakespeare_char'  # a folder of data/ (or a path) with train.bin and val.bin
sampling = 'rr'  # 'rr': random reshuffling (each window once per epoch), 'iid': nanoGPT's sampling with replacement
data_seed = 1337
gradient_accumulation_steps = 1  # micro-steps per optimizer step, summed over all ranks
batch_size = 32  # micro-batch size per rank
block_size = 64
# model: a preset name ('gpt2', 'gpt2-medium', 'llama-60m', ...) sets the architecture keys below
preset = ''
arch = 'gpt2'  # 'gpt2' or 'llama'
n_layer = 6
n_head = 4
n_kv_head = 0  # llama grouped-query attention; 0 means n_head
n_embd = 128
mlp_hidden = 0  # 0: 4*n_embd for gpt2, LLaMA's rule for llama
dropout = 0.0
bias = False
vocab_size = 0  # 0: from the dataset (meta.pkl), else GPT-2's 50304 (padded 50257)
activation_checkpointing = False  # recompute each block's activations in the backward
checkpoint_sublayers = False  # with activation_checkpointing: recompute attention and MLP apart (lower peak, more saved inputs)
activation_offload = False  # keep the tensors saved for the backward in host memory (model.OffloadActivations)
loss_chunk = 0  # >0: head and cross-entropy this many tokens at a time; the full logits never exist (slower)
# optimizer
optimizer = 'adamw'  # 'adamw' or 'sgd' (with momentum); method='galore'/'golore' use galore.py
learning_rate = 2e-3
max_iters = 1000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.99
momentum = 0.9  # sgd only
grad_clip = 1.0  # 0 disables clipping
# learning rate schedule: linear warm-up, then cosine decay to min_lr
decay_lr = True
warmup_iters = 50
lr_decay_iters = 1000
min_lr = 2e-4
# layer cycling (omgd.py); see the README's table of methods
method = 'lisa_wor'  # full, lisa, lisa_scale, lisa_wor, lisa_wor_noscale, tensor_wor, tensor_iid, galore, golore
omgd_gamma = 2  # active middle blocks per period
omgd_period = 25  # K: iterations between switches
omgd_warmup = 0  # iterations of full training before cycling starts
omgd_ratio = 0.5  # tensor_wor: 1/M, the share of each of the M groups; tensor_iid: each tensor's keep probability
omgd_state = 'drop'  # optimizer state of frozen parameters: 'drop', 'offload' (to CPU) or 'keep'
omgd_seed = 0  # seeds block selection (same on every rank), independent of the data order
omgd_scale_after_clip = True  # the paper's code clips the gradient norm first, then scales
omgd_always = 'embed,pos,norm,head'  # parts trained at every step
# galore / golore (galore.py)
galore_rank = 128
galore_update_proj_gap = 200
galore_scale = 0.25
golore_svd_fraction = 0.0  # golore: fraction of max_iters on SVD (GaLore) projections before random ones; GoLore's scripts use 0.8
# system
device = 'cuda' if torch.cuda.is_available() else 'cpu'
precision = 'amp'  # 'amp' (fp32 weights, autocast), 'bf16' (all bf16) or 'bf16_master' (bf16 + fp32 masters of the active parameters); training.py
master_device = ''  # bf16_master: '' keeps masters and moments on the weights' device, 'cpu' moves them and the AdamW step to the CPU
dtype = 'bfloat16' if torch.cuda.is_available() else 'float32'  # amp's autocast dtype: float32, bfloat16 or float16 (loss-scaled); CPU runs in float32
compile = torch.cuda.is_available()  # torch.compile each block separately (regional compilation)
backend = 'nccl' if torch.cuda.is_available() else 'gloo'
parallel = 'ddp'  # under torchrun: 'ddp' (replicated weights) or 'fsdp' (FSDP2, weights sharded per block)
seed = 1337
ddp_check = False  # assert the DDP or FSDP invariants at every iteration on every rank (tests; hashes all weights)
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
defaults = {k: globals()[k] for k in config_keys}
try:
    config = configure(defaults, sys.argv[1:])
except ConfigError as e:
    sys.exit(f"error: {e}")
globals().update(config)
# -----------------------------------------------------------------------------

def fail(message):
    """One line on stderr and a non-zero exit; nothing has been saved by this run yet."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(1)


# values that need nothing built to check: refuse them before data, model and process group cost time
try:
    training.check_config(config)
except ValueError as e:
    fail(e)

# distributed setup (distributed.py): torchrun sets RANK; every rank runs this same script.
# `distributed_run`: launched by torchrun, whichever `parallel` (DDP or FSDP2) it then uses.
ranks, device = distributed.setup(backend, device)
distributed_run, ddp_rank, ddp_world_size, master_process = ranks.enabled, ranks.rank, ranks.world_size, ranks.master
fsdp = distributed_run and parallel == 'fsdp'
try:
    training.check_parallel(config, ddp_world_size, fsdp)
except ValueError as e:
    fail(e)
grad_accum = gradient_accumulation_steps // ddp_world_size
ckpt_path = os.path.join(out_dir, 'ckpt.pt')
if init_from != 'resume' and not eval_only and os.path.exists(ckpt_path):
    # a new run saves over out_dir/ckpt.pt; losing a long run to a re-typed command must be asked for
    earlier = ckpt_io.earlier_run(ckpt_path)
    if not overwrite:
        fail(f"{ckpt_path} holds {earlier}; continue it with --init_from=resume, choose another --out_dir, "
             f"or pass --overwrite=True to replace it")
    if master_process:
        print(f"{ckpt_path} holds {earlier}; this run's first save replaces it (overwrite=True)")

tokens_per_iter = gradient_accumulation_steps * batch_size * block_size
if master_process:
    print(f"config:\n{format_config(config)}")
    print(f"tokens per iteration: {tokens_per_iter:,} ({ddp_world_size} ranks)")
    os.makedirs(out_dir, exist_ok=True)
device_type = 'cuda' if device.startswith('cuda') else 'cpu'
torch.manual_seed(seed)  # same model init on every rank (DDP broadcasts rank 0's; FSDP needs it); data has its own seed
if device_type == 'cuda':
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
ptdtype = training.PTDTYPES[dtype]
autocast = training.autocast(config, device_type)
scaler = training.grad_scaler(config, device_type)  # float16 gradients underflow without loss scaling

# data: the embedded Shakespeare corpora are prepared on first use, anything else must exist
if master_process:
    prepare_if_embedded(dataset)
if distributed_run:
    dist.barrier()
try:
    train_batches, eval_batches = open_splits(dataset, block_size, batch_size, sampling, data_seed, ddp_rank,
                                              ddp_world_size)
except (FileNotFoundError, ValueError) as e:
    fail(e)
if not vocab_size:
    vocab_size = dataset_vocab(dataset)
    if vocab_size and master_process:
        print(f"found vocab_size = {vocab_size} (inside {data_dir(dataset)}/meta.pkl)")

# model
model_args = training.model_args(config, vocab_size)
iter_num, best_val_loss, checkpoint = 0, 1e9, None
saved_iter = None  # the iteration of the checkpoint in out_dir that belongs to this run
if init_from == 'scratch':
    try:
        raw_model = GPT(GPTConfig(**model_args))
    except ValueError as e:
        fail(e)
elif init_from == 'resume':
    try:  # the checks that the config can continue it included (checkpoint.py)
        checkpoint, raw_model = ckpt_io.resume(ckpt_path, device, config, defaults)
    except ValueError as e:
        fail(e)
    iter_num, best_val_loss = checkpoint['iter_num'], checkpoint['best_val_loss']
    saved_iter = iter_num
    if master_process:
        print(f"resuming from iteration {iter_num} of {ckpt_path}")
else:  # a GPT-2 name
    try:
        raw_model = GPT.from_pretrained(init_from, dict(dropout=dropout))
    except (RuntimeError, ValueError) as e:
        fail(e)
if block_size < raw_model.config.block_size:
    raw_model.crop_block_size(block_size)
model_args = asdict(raw_model.config)  # what was built, after any crop: sample.py and resumes rebuild it
training.configure_memory(raw_model, config)
training.cast_model(raw_model, precision).to(device)
if fsdp:
    # before the optimizer and the cycler (they must see the sharded parameters) and the compile
    distributed.shard_fsdp(raw_model, ranks, device_type, ptdtype if device_type == 'cuda' and precision == 'amp'
                           and ptdtype != torch.float32 else None)

opt = training.build_optimizer(raw_model, config, device_type)  # over ALL parameters
try:
    cycler = training.build_cycler(raw_model, opt, config)
except ValueError as e:
    fail(e)
if master_process and cycler.cycle_note():
    print(cycler.cycle_note())
torch.manual_seed(seed + ddp_rank)  # from here on (dropout) each rank draws its own random numbers
if checkpoint is not None:
    try:
        ckpt_io.load_state(checkpoint, raw_model, opt, cycler, train_batches, scaler, fsdp)
    except (ValueError, KeyError) as e:
        fail(f"cannot resume from {ckpt_path}: {e}")
    if not ckpt_io.restore_rng(checkpoint, ranks, device_type, seed, iter_num) and master_process:
        print(f"resuming a {checkpoint.get('world_size', 1)}-rank checkpoint on {ddp_world_size} "
              f"rank{'s' * (ddp_world_size > 1)}: same data position, not bitwise the run it would have been")
    checkpoint = None  # free memory

if compile:
    # Regional compilation: one compiled graph per block. A whole-model compile recompiles for
    # every new requires_grad pattern and gives up after 8; a block only ever sees two patterns
    # (trainable or frozen). nn.Module.compile keeps parameter names free of '_orig_mod.'.
    for block in raw_model.blocks:
        block.compile()

# replicas.model, what the loop trains: the DDP wrapper, rebuilt over the active parameters at the
# first iteration and after every switch (distributed.Replicas); FSDP and one process: raw_model
replicas = distributed.Replicas(raw_model, ranks, device_type, fsdp, ddp_check)


def get_lr(it):
    if not decay_lr:
        return learning_rate
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (learning_rate - min_lr)


@torch.no_grad()
def estimate_loss():
    out = {}
    raw_model.eval()
    for split, batches in eval_batches.items():
        batches.load_state_dict(batches.start)  # the same windows at every evaluation
        losses = torch.zeros(eval_iters, device=device)  # on the device: one sync per split, not per batch
        for k in range(eval_iters):
            X, Y = batches.next_batch(device)
            with autocast:
                _, loss = raw_model(X, Y)
            losses[k] = loss
        out[split] = ranks.mean(losses.mean().item(), device)
    raw_model.train()
    return out


def save_checkpoint():
    """Called on every rank; rank 0 writes (checkpoint.py)."""
    global saved_iter
    if ckpt_io.save(ckpt_path, ranks, raw_model, opt, cycler, data_position, model_args, iter_num, best_val_loss,
                    config, scaler, fsdp, device_type):
        print(f"saved checkpoint to {ckpt_path}")
        saved_iter = iter_num


if wandb_log and master_process:
    import wandb
    wandb.init(project=wandb_project, name=wandb_run_name, config=config)


def check_finite(losses):
    """Stop at a non-finite loss; the values are all-reduced, so every rank stops here alike."""
    for split, value in losses.items():
        if not math.isfinite(value):
            kept = (f"kept the last good checkpoint {ckpt_path} (iteration {saved_iter})" if saved_iter is not None
                    else "this run saved no checkpoint")
            fail(f"{split} loss is {value} at iteration {iter_num}; {kept}; lower learning_rate or raise warmup_iters")


def next_batch():
    """The next training micro-batch; remembers the data position of the batch it fetched, which
    is what a checkpoint must store, since the loop prefetches one micro-batch ahead."""
    global data_position
    data_position = train_batches.state_dict()
    return train_batches.next_batch(device)


def check_ranks():
    """--ddp_check: every rank's invariants after the optimizer step, gradients still there."""
    problems, summary = replicas.check(opt, cycler, omgd_state)
    if problems:
        fail(f"ddp check failed at iteration {iter_num}, not on every rank: {'; '.join(problems)}")
    if master_process and (switched or iter_num == max_iters - 1):
        print(f"iter {iter_num}: {summary}")


peak_flops = training.peak_bf16_flops(device)
# SIGTERM/SIGINT: all ranks finish the iteration, save and stop together (distributed.py). Installed
# only now: during the setup above, Ctrl-C must stop the run at once, as there is nothing to save.
stop_request = distributed.StopRequest()
X, Y = next_batch()
t0 = time.time()
local_iter_num, running_mfu = 0, -1.0
while True:
    lr = get_lr(iter_num)
    for group in opt.param_groups:
        group['lr'] = lr
    stop = stop_request.agreed(ranks)
    if stop:
        print(f"rank {ddp_rank}: stop requested, stopping at iteration {iter_num}", flush=True)
        if local_iter_num > 0:  # else nothing trained since the start or the resume
            save_checkpoint()
        if distributed_run:  # rank 0 has written the file before any rank exits non-zero, when torchrun stops the rest
            dist.barrier(group=ranks.cpu_group)
        break
    if iter_num % eval_interval == 0 or iter_num >= max_iters or eval_only:
        losses = estimate_loss()
        if master_process:
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        check_finite(losses)
        if wandb_log and master_process:
            wandb.log({'iter': iter_num, 'train/loss': losses['train'], 'val/loss': losses['val'], 'lr': lr})
        improved = losses['val'] < best_val_loss
        best_val_loss = min(best_val_loss, losses['val'])
        # every rank decides alike: the losses are all-reduced, so identical on every rank
        if local_iter_num > 0 and (improved or always_save_checkpoint):
            save_checkpoint()
    if iter_num >= max_iters or eval_only:
        break

    switched = cycler.step(iter_num)
    cycler.prefetch(iter_num)  # on a period's last iteration: draw the next group, start copying back its offloaded state
    if switched or replicas.model is None:
        replicas.on_switch()
    if switched and master_process:
        print(f"iter {iter_num}: {cycler.describe()}" +
              (f", DDP rebuilt in {replicas.rebuild_ms:.1f} ms" if distributed_run and not fsdp else ""))

    loss, (X, Y) = training.train_step(replicas.model, opt, cycler, (X, Y), next_batch, grad_accum, grad_clip,
                                       omgd_scale_after_clip, autocast, scaler,
                                       replicas.sync if distributed_run else None,
                                       before_zero_grad=check_ranks if ddp_check else None)

    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num % log_interval == 0:
        lossf = ranks.mean(loss.item(), device)
        check_finite({'train': lossf})
        if master_process:
            epoch = train_batches.epochs()
            line = (f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.1f}ms, "
                    f"tok/s {tokens_per_iter / dt:,.0f}, epoch {epoch:.2f}")
            if peak_flops and local_iter_num >= 5:
                mfu = training.mfu(raw_model.estimate_flops_per_token(), tokens_per_iter, dt, peak_flops,
                                   ddp_world_size)
                running_mfu = mfu if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * mfu
                line += f", mfu {running_mfu * 100:.2f}%"
            if device_type == 'cuda':
                line += (f", mem {torch.cuda.max_memory_allocated() / 2**30:.2f}/"
                         f"{torch.cuda.max_memory_reserved() / 2**30:.2f} GiB alloc/reserved")
            print(line, flush=True)
            if wandb_log:
                wandb.log({'iter': iter_num, 'train/loss_step': lossf, 'epoch': epoch})
    iter_num += 1
    local_iter_num += 1
stop_request.release()  # Ctrl-C during the sample below stops at once

# under FSDP every rank runs the sample's forwards (each all-gathers the weights); rank 0 prints
if (master_process or fsdp) and sample_tokens > 0 and not stop:
    from sample import load_codec
    encode, decode = load_codec(data_dir(dataset))
    start = torch.tensor([encode('\n')], dtype=torch.long, device=device)
    raw_model.eval()  # no dropout while generating (estimate_loss left it in training mode)
    with autocast:
        y = raw_model.generate(start, sample_tokens, temperature=0.8, top_k=200)
    if master_process:
        print(f"sample:\n{decode(y[0].tolist())}")
distributed.teardown(ranks)  # a barrier, then destroy_process_group (distributed.py: why)
if stop:
    # the run did not finish: exit as a process the signal ended would (128 + its number), so that
    # schedulers and requeue scripts do not take a preempted run for a finished one (README)
    sys.exit(stop_request.exit_status)
