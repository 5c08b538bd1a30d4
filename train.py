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

import checkpoint as ckpt_io
import distributed
import train_config
import training
from configurator import ConfigError, format_config, wants_help
from dataloader import check_vocab, data_dir, dataset_vocab, open_splits, prepare_if_embedded
from memory_tools import check_fits
from model import GPT, GPTConfig

# the config: train_config.py holds every key with its default and its rule; config files and
# --key=value override them, in order, all checked before anything is built
if wants_help(sys.argv[1:]):
    print(f"usage: python train.py [config/FILE.py ...] [--key=value ...]\n\nkeys (default, meaning):\n"
          f"{train_config.help_text()}")
    sys.exit(0)
given_keys = set()  # the keys the command line and config files set: a resume refuses architecture overrides
try:
    cfg = train_config.load(sys.argv[1:], given=given_keys)
except (ConfigError, ValueError) as e:
    sys.exit(f"error: {e}")
# -----------------------------------------------------------------------------

def estimate_peak(config, vocab_size):
    """Peak bytes of an iteration of this config, estimated on the meta device (bench_memory.py)."""
    import bench_memory
    row = bench_memory.measure({**config, 'vocab_size': vocab_size, 'micro_batches': 0, 'compile': False},
                               torch.device('meta'))
    return row['peak']


def fail(message):
    """One line on stderr and a non-zero exit; the last good checkpoint, if any, stays as it was."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    if created_out_dir and os.path.isdir(cfg['out_dir']) and not os.listdir(cfg['out_dir']):
        os.rmdir(cfg['out_dir'])  # a run that saved nothing leaves no empty out_dir behind
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(1)


# distributed setup (distributed.py): torchrun sets RANK; every rank runs this same script.
# `distributed_run`: launched by torchrun, whichever `parallel` (DDP or FSDP2) it then uses.
created_out_dir = False
ranks, device = distributed.setup(cfg['backend'], cfg['device'])
distributed_run, ddp_rank, ddp_world_size, master_process = ranks.enabled, ranks.rank, ranks.world_size, ranks.master
fsdp = distributed_run and cfg['parallel'] == 'fsdp'
try:
    train_config.check_parallel(cfg, ddp_world_size, fsdp)
except ValueError as e:
    fail(e)
grad_accum = cfg['gradient_accumulation_steps'] // ddp_world_size
out_dir = cfg['out_dir']
ckpt_path = os.path.join(out_dir, 'ckpt.pt')
if cfg['init_from'] != 'resume' and not cfg['eval_only'] and os.path.exists(ckpt_path):
    # a new run saves over out_dir/ckpt.pt; losing a long run to a re-typed command must be asked for
    earlier = ckpt_io.earlier_run(ckpt_path)
    if not cfg['overwrite']:
        fail(f"{ckpt_path} holds {earlier}; continue it with --init_from=resume, choose another --out_dir, "
             f"or pass --overwrite=True to replace it")
    if master_process:
        print(f"{ckpt_path} holds {earlier}; this run's first save replaces it (overwrite=True)")
if master_process:  # the writer: an unusable out_dir is found now, not at the first save after hours of training
    created_out_dir = not os.path.exists(out_dir)
    try:
        ckpt_io.check_out_dir(out_dir)
    except ckpt_io.CheckpointError as e:
        fail(e)

tokens_per_iter = cfg['gradient_accumulation_steps'] * cfg['batch_size'] * cfg['block_size']
if master_process:
    print(f"config:\n{format_config(cfg)}")
    print(f"tokens per iteration: {tokens_per_iter:,} ({ddp_world_size} ranks)")
device_type = 'cuda' if device.startswith('cuda') else 'cpu'
torch.manual_seed(cfg['seed'])  # same model init on every rank (DDP broadcasts rank 0's; FSDP needs it); data has its own seed
if device_type == 'cuda':
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

# data: the embedded Shakespeare corpora are prepared on first use, anything else must exist
if master_process:
    prepare_if_embedded(cfg['dataset'])
if distributed_run:
    dist.barrier()
try:
    train_batches, eval_batches = open_splits(cfg['dataset'], cfg['block_size'], cfg['batch_size'], cfg['sampling'],
                                              cfg['data_seed'], ddp_rank, ddp_world_size)
except (FileNotFoundError, ValueError) as e:
    fail(e)
vocab_size = cfg['vocab_size']
if not vocab_size:
    vocab_size = dataset_vocab(cfg['dataset'])
    if vocab_size and master_process:
        print(f"found vocab_size = {vocab_size} (inside {data_dir(cfg['dataset'])}/meta.pkl)")

# model: from scratch, from out_dir's checkpoint, or a pretrained GPT-2
iter_num, best_val_loss, checkpoint = 0, 1e9, None
saved_iter = None  # the iteration of the checkpoint in out_dir that belongs to this run
try:
    if cfg['init_from'] == 'scratch':
        model_config = GPTConfig(**training.model_args(cfg, vocab_size))
        dtype = training.weight_dtype(cfg['precision'])
        # before it is allocated: a one-line refusal, not the OOM killer
        check_fits(model_config, device, dtype.itemsize, estimate_peak=lambda: estimate_peak(cfg, vocab_size))
        raw_model = training.new_model(model_config, device, dtype)  # on the device, in its dtype: no fp32 host copy
    elif cfg['init_from'] == 'resume':  # the checks that the config can continue it included (checkpoint.py)
        checkpoint, raw_model = ckpt_io.resume(ckpt_path, device, cfg, given_keys)
        iter_num, best_val_loss = checkpoint['iter_num'], checkpoint['best_val_loss']
        saved_iter = iter_num
        if master_process:
            print(f"resuming from iteration {iter_num} of {ckpt_path}")
    else:  # a GPT-2 name or a local Hugging Face model directory (hf.py)
        import hf
        raw_model = hf.from_pretrained(cfg['init_from'], cfg['dropout'], cfg['block_size'])
except (RuntimeError, ValueError) as e:
    fail(e)
if cfg['block_size'] < raw_model.config.block_size:
    raw_model.crop_block_size(cfg['block_size'])
model_args = asdict(raw_model.config)  # what was built, after any crop: sample.py and resumes rebuild it
try:  # every id of the data needs a row of the embedding
    check_vocab(cfg['dataset'], raw_model.config.vocab_size, train_batches, *eval_batches.values())
except ValueError as e:
    fail(e)


def shard(model):  # FSDP2, before the optimizer and the cycler (they must see the sharded parameters)
    amp_dtype = train_config.PTDTYPES[cfg['dtype']]
    distributed.shard_fsdp(model, ranks, device_type, amp_dtype if device_type == 'cuda' and cfg['precision'] == 'amp'
                           and amp_dtype != torch.float32 else None)


try:  # the one builder (training.py): memory options, precision, device, optimizer over ALL parameters, cycler
    raw_model, opt, cycler = training.build(cfg, device, model=raw_model, shard=shard if fsdp else None)
except ValueError as e:
    fail(e)
if master_process and cycler.cycle_note():
    print(cycler.cycle_note())
torch.manual_seed(cfg['seed'] + ddp_rank)  # from here on (dropout) each rank draws its own random numbers

if cfg['compile']:
    # Regional compilation: one compiled graph per block. A whole-model compile recompiles for
    # every new requires_grad pattern and gives up after 8; a block only ever sees two patterns
    # (trainable or frozen). nn.Module.compile keeps parameter names free of '_orig_mod.'.
    for block in raw_model.blocks:
        block.compile()

# replicas.model, what the loop trains: the DDP wrapper, rebuilt over the active parameters at the
# first iteration and after every switch (distributed.Replicas); FSDP and one process: raw_model
replicas = distributed.Replicas(raw_model, ranks, device_type, fsdp, cfg['ddp_check'])
trainer = training.Trainer(cfg, raw_model, opt, cycler, device_type, grad_accum, replicas)
# what a checkpoint holds the state_dict() of (checkpoint.py); the data position is saved as a value
train_state = {'model': raw_model, 'optimizer': opt, 'cycler': cycler, 'scaler': trainer.scaler}
if checkpoint is not None:
    try:
        ckpt_io.load_state(checkpoint, {**train_state, 'data': train_batches}, fsdp)
    except (ValueError, KeyError) as e:
        fail(f"cannot resume from {ckpt_path}: {e}")
    if not ckpt_io.restore_rng(checkpoint, ranks, device_type, cfg['seed'], iter_num) and master_process:
        print(f"resuming a {checkpoint.get('world_size', 1)}-rank checkpoint on {ddp_world_size} "
              f"rank{'s' * (ddp_world_size > 1)}: same data position, not bitwise the run it would have been")
    checkpoint = None  # free memory


@torch.no_grad()
def estimate_loss():
    out = {}
    raw_model.eval()
    for split, batches in eval_batches.items():
        batches.load_state_dict(batches.start)  # the same windows at every evaluation
        losses = torch.zeros(cfg['eval_iters'], device=device)  # on the device: one sync per split, not per batch
        for k in range(cfg['eval_iters']):
            X, Y = batches.next_batch(device)
            with trainer.autocast:
                _, loss = raw_model(X, Y)
            losses[k] = loss
        out[split] = ranks.mean(losses.mean().item(), device)
    raw_model.train()
    return out


def last_good():
    return (f"kept the last good checkpoint {ckpt_path} (iteration {saved_iter})" if saved_iter is not None
            else "this run saved no checkpoint")


def save_checkpoint():
    """Called on every rank; rank 0 writes (checkpoint.py). Never saves a non-finite state."""
    global saved_iter
    values = {'data': data_position, 'model_args': model_args, 'iter_num': iter_num, 'best_val_loss': best_val_loss,
              'config': cfg}
    try:
        wrote = ckpt_io.save(ckpt_path, ranks, train_state, values, fsdp, device_type)
    except ckpt_io.NonFiniteState:
        fail(f"the weights or optimizer state are not finite at iteration {iter_num}; {last_good()}; lower "
             f"learning_rate or raise warmup_iters")
    except ckpt_io.CheckpointError as e:
        fail(e)
    if wrote:
        print(f"saved checkpoint to {ckpt_path}")
    saved_iter = iter_num


if cfg['wandb_log'] and master_process:
    try:
        import wandb
    except ImportError:
        fail("wandb_log=True needs the wandb package: pip install wandb, or drop --wandb_log")
    wandb.init(project=cfg['wandb_project'], name=cfg['wandb_run_name'], config=cfg)


def check_finite(losses):
    """Stop at a non-finite loss; the values are all-reduced, so every rank stops here alike."""
    for split, value in losses.items():
        if not math.isfinite(value):
            fail(f"{split} loss is {value} at iteration {iter_num}; {last_good()}; lower learning_rate or raise "
                 f"warmup_iters")


def next_batch():
    """The next training micro-batch; remembers the data position of the batch it fetched, which
    is what a checkpoint must store, since the loop prefetches one micro-batch ahead."""
    global data_position
    data_position = train_batches.state_dict()
    try:
        return train_batches.next_batch(device)
    except ValueError as e:  # a token id the model cannot embed, found as a large file is read
        fail(f"{e}; {last_good()}")


ddp_summary = None


def check_ranks():
    """--ddp_check: every rank's invariants after the optimizer step, gradients still there."""
    global ddp_summary
    problems, ddp_summary = replicas.check(opt, cycler, cfg['omgd_state'])
    if problems:
        fail(f"ddp check failed at iteration {iter_num}, not on every rank: {'; '.join(problems)}")


max_iters, eval_interval, log_interval = cfg['max_iters'], cfg['eval_interval'], cfg['log_interval']
peak_flops = training.peak_bf16_flops(device)
# SIGTERM/SIGINT: all ranks finish the iteration, save and stop together (distributed.py). Installed
# only now: during the setup above, Ctrl-C must stop the run at once, as there is nothing to save.
stop_request = distributed.StopRequest()
X, Y = next_batch()
t0 = time.time()
local_iter_num, running_mfu = 0, -1.0
while True:
    stop = stop_request.agreed(ranks)
    if stop:
        print(f"rank {ddp_rank}: stop requested, stopping at iteration {iter_num}", flush=True)
        if local_iter_num > 0:  # else nothing trained since the start or the resume
            save_checkpoint()
        if distributed_run:  # rank 0 has written the file before any rank exits non-zero, when torchrun stops the rest
            dist.barrier(group=ranks.cpu_group)
        break
    if iter_num % eval_interval == 0 or iter_num >= max_iters or cfg['eval_only']:
        losses = estimate_loss()
        if master_process:
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        check_finite(losses)
        if cfg['wandb_log'] and master_process:
            wandb.log({'iter': iter_num, 'train/loss': losses['train'], 'val/loss': losses['val'],
                       'lr': training.get_lr(iter_num, cfg)})
        improved = losses['val'] < best_val_loss
        best_val_loss = min(best_val_loss, losses['val'])
        # every rank decides alike: the losses are all-reduced, so identical on every rank
        if local_iter_num > 0 and (improved or cfg['always_save_checkpoint']):
            save_checkpoint()
    if iter_num >= max_iters or cfg['eval_only']:
        break

    # the one iteration (training.Trainer): learning rate, switch, prefetch, DDP rebuild, step
    loss, (X, Y), switched = trainer.step(iter_num, (X, Y), next_batch,
                                          before_zero_grad=check_ranks if cfg['ddp_check'] else None)
    if switched and master_process:
        print(f"iter {iter_num}: {cycler.describe()}" +
              (f", DDP rebuilt in {replicas.rebuild_ms:.1f} ms" if distributed_run and not fsdp else ""))
    if ddp_summary and master_process and (switched or iter_num == max_iters - 1):
        print(f"iter {iter_num}: {ddp_summary}")

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
            if cfg['wandb_log']:
                wandb.log({'iter': iter_num, 'train/loss_step': lossf, 'epoch': epoch})
    iter_num += 1
    local_iter_num += 1
stop_request.release()  # Ctrl-C during the sample below stops at once

# under FSDP every rank runs the sample's forwards (each all-gathers the weights); rank 0 prints
if (master_process or fsdp) and cfg['sample_tokens'] > 0 and not stop:
    from sample import load_codec
    encode, decode = load_codec(data_dir(cfg['dataset']))
    start = torch.tensor([encode('\n')], dtype=torch.long, device=device)
    raw_model.eval()  # no dropout while generating (estimate_loss left it in training mode)
    with trainer.autocast:
        y = raw_model.generate(start, cfg['sample_tokens'], temperature=0.8, top_k=200)
    if master_process:
        print(f"sample:\n{decode(y[0].tolist())}")
distributed.teardown(ranks)  # a barrier, then destroy_process_group (distributed.py: why)
if stop:
    # the run did not finish: exit as a process the signal ended would (128 + its number), so that
    # schedulers and requeue scripts do not take a preempted run for a finished one (README)
    sys.exit(stop_request.exit_status)
