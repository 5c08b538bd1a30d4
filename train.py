"""
Pre-train a GPT-2 or LLaMA model with OMGD layer cycling (LISA-wor) or a baseline method.

One process (CPU or one GPU):
$ python train.py                                  # small LISA-wor model on Shakespeare, CPU, minutes
$ python train.py config/shakespeare_lisa_wor.py --method=lisa --max_iters=500

DDP on 4 GPUs of one node (gloo instead of nccl when there is no CUDA, or with --backend=gloo):
$ torchrun --standalone --nproc_per_node=4 train.py config/gpt2_lisa_wor.py
FSDP2 (each block sharded over the ranks), for weights that do not fit on one GPU:
$ torchrun --standalone --nproc_per_node=4 train.py config/gpt2_lisa_wor.py --parallel=fsdp
Preemptible clusters: --init_from=auto resumes from out_dir when it holds a checkpoint, so a
restarted job (torchrun --max-restarts, a SLURM requeue) continues by itself.

Several nodes (the same command on every node; HOST is one of them; the rendezvous assigns ranks):
$ torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
      --rdzv-id=gpt2 train.py config/gpt2_lisa_wor.py

Besides the log, every evaluation, logged iteration, switch and save is a record (one JSON object
a line) in out_dir/metrics.jsonl: what the experiments read and what a user plots.
"""
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

import builder
import checkpoint as ckpt_io
import checkpoint_dcp
import ddp_check
import distributed
import memory_options
import multiple_choice
import train_config
from configurator import ConfigError, format_config, help_text, wants_help
from dataloader import check_vocab, data_dir, dataset_vocab, open_splits, prepare_if_embedded
from data.tokenizer import Tokenizer, read_meta
from memory_estimate import check_fits, estimate_iteration
from model import TransformerConfig
from trainer import ParallelModel, Trainer, fsdp_units, get_lr, mfu, peak_bf16_flops


class RunError(Exception):
    """A reason to stop the run: main() prints it as one `error:` line and exits 1."""


class Records:
    """out_dir/metrics.jsonl, written by rank 0: one JSON object a line, each with its `kind`
    ('eval', 'iter', 'switch', 'save', 'end') and `iter`. A resume first drops the records after
    the checkpoint's iteration, so the file always describes the run that continues."""

    def __init__(self, out_dir, enabled, resumed_from=None):
        self.path, self.enabled, self.resumed_from, self.started = (os.path.join(out_dir, 'metrics.jsonl'), enabled,
                                                                    resumed_from, False)

    def _start(self):
        """At the first record, not before: a run refused at start leaves the earlier file as it was."""
        self.started = True
        if os.path.exists(self.path):
            kept = []
            if self.resumed_from is not None:
                with open(self.path) as f:
                    kept = [line for line in f if self._kept(line, self.resumed_from)]
            with open(self.path, 'w') as f:  # a new run in this out_dir (overwrite=True) starts a new file
                f.writelines(kept)

    @staticmethod
    def _kept(line, resumed_from):
        """Records of iterations before the checkpoint's, and its save; not a line cut by a crash."""
        try:
            rec = json.loads(line)
        except ValueError:
            return False
        return rec['iter'] < resumed_from or (rec['iter'] == resumed_from and rec['kind'] == 'save')

    def write(self, kind, **fields):
        if self.enabled:
            if not self.started:
                self._start()
            with open(self.path, 'a') as f:
                f.write(json.dumps({'kind': kind, **fields}) + '\n')


class StopRequest:
    """Preemption (SIGTERM from a cluster or from torchrun, which forwards its own SIGTERM/SIGINT to
    every worker; Ctrl-C): finish the current iteration, then all ranks save and stop together.
    A signal may reach only some ranks, so every iteration starts with `agreed()`, an
    all_reduce(MAX) of the flag: all ranks then leave the loop at the same iteration. torchrun
    kills the workers 30 s after forwarding a signal (--shutdown-timeout), so a stop saves at
    once and skips the evaluation."""

    def __init__(self):
        self.requested = False
        self.exit_status = 128 + signal.SIGTERM  # also on ranks that stop only because another rank was asked
        self.previous = {sig: signal.signal(sig, self._request) for sig in (signal.SIGTERM, signal.SIGINT)}

    def release(self):
        """Put back the handlers there were before: after the loop a signal stops the process at once."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _request(self, signum, frame):
        self.requested = True
        self.exit_status = 128 + signum

    def agreed(self, ranks):
        return ranks.any(self.requested)


def format_duration(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def main(argv):
    # the config: train_config.py holds every key with its default and its rule; config files and
    # --key=value override them, in order, all checked before anything is built
    if wants_help(argv):
        print(f"usage: python train.py [config/FILE.py ...] [--key=value ...]\n\nkeys (default, meaning):\n"
              f"{help_text(train_config.DEFAULTS, train_config.meanings())}")
        return 0
    given_keys = set()  # the keys the command line and config files set: a resume refuses architecture overrides
    try:
        cfg = train_config.load(argv, given=given_keys)
        if cfg['gpu_config'] and cfg['device'] == 'cpu' and not any(a.startswith('--device=') for a in argv):
            raise ValueError(f"this is a GPU config (gpu_config=True) and this machine has no CUDA GPU (torch "
                             f"{torch.__version__}); run it on a GPU, or pass --device=cpu to run it on the CPU anyway")
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    # before CUDA's first allocation, which reads it
    allocator_note = memory_options.cuda_allocator() if cfg['device'].startswith('cuda') else None
    # distributed setup (distributed.py): torchrun sets RANK; every rank runs this same script
    ranks, device = distributed.setup(cfg['backend'], cfg['device'], cfg['dist_timeout_s'])
    if allocator_note and ranks.master:
        print(allocator_note, flush=True)
    created_out_dir = ranks.master and not os.path.exists(cfg['out_dir'])
    # one writer per out_dir (rank 0 holds the lock until it exits); --eval_only writes nothing
    lock = ckpt_io.OutDirLock(cfg['out_dir'])
    try:
        if ranks.master and not cfg['eval_only']:
            try:
                lock.acquire()
            except ckpt_io.CheckpointError as e:
                created_out_dir = False  # held by the other run
                raise RunError(e) from None
        status = train(cfg, given_keys, ranks, device)
    except (RunError, RuntimeError) as e:  # one line; the last good checkpoint, if any, stays as it was
        if not isinstance(e, RunError) and not distributed.lost_rank(e):
            raise  # a bug: its traceback
        if not isinstance(e, RunError):
            e = (f"rank {ranks.rank}: a collective with the other ranks failed ({str(e).strip().splitlines()[0][:160]}): "
                 f"another rank is stuck or dead; the last checkpoint in {cfg['out_dir']} is kept: resume with "
                 f"--init_from=auto (raise --dist_timeout_s={cfg['dist_timeout_s']} if a rank is only slow)")
        print(f"error: {e}", file=sys.stderr, flush=True)
        checkpoint_dcp.abandon_all()  # a background save of a good state ends before the group goes
        out_dir = cfg['out_dir']
        left_empty = created_out_dir and os.path.isdir(out_dir) and set(os.listdir(out_dir)) <= {'.lock'}
        lock.release(remove=left_empty)
        if left_empty:
            os.rmdir(out_dir)  # a run that saved nothing leaves no empty out_dir behind
        if dist.is_initialized():
            dist.destroy_process_group()
        return 1
    distributed.teardown(ranks)  # a barrier, then destroy_process_group (distributed.py: why)
    lock.release()
    return status


def train(cfg, given_keys, ranks, device):
    """The run, top to bottom; returns the exit status (0, or 128 + a stop signal's number)."""
    master, world_size = ranks.master, ranks.world_size
    fsdp = ranks.enabled and cfg['parallel'] == 'fsdp'
    try:
        train_config.check_parallel(cfg, world_size, fsdp)
    except ValueError as e:
        raise RunError(e) from None
    out_dir = cfg['out_dir']
    ckpt_path = os.path.join(out_dir, 'ckpt.pt')
    # the checkpoint a resume continues: ckpt.pt or the newest complete step folder, whichever holds
    # the later iteration (checkpoint_dcp.find)
    found = checkpoint_dcp.find(out_dir)
    resume_format = found[0] if found else 'file'
    if found:
        ckpt_path = found[1]
    init_from = cfg['init_from']
    if init_from == 'auto':  # a restarted job resumes; the first launch starts from scratch
        init_from = 'resume' if found else 'scratch'
    if init_from == 'resume' and found:  # the checkpoint's config, the command's keys on top
        try:
            saved = (ckpt_io.read(ckpt_path, mmap=True) if resume_format == 'file' else
                     checkpoint_dcp.read_values(ckpt_path))
            cfg = train_config.resume_config(saved['config'], saved['model_args'], cfg, given_keys)
        except (ckpt_io.CheckpointError, ValueError) as e:
            raise RunError(e) from None
        except (KeyError, TypeError) as e:
            raise RunError(f"cannot resume from {ckpt_path}: it holds no config or model_args ({e}); it is not a "
                           f"checkpoint of train.py: restore a backup or train from scratch") from None
    replaced = []  # an earlier run's checkpoints, removed once this run has saved one (overwrite=True)
    if init_from != 'resume' and not cfg['eval_only'] and found:
        # a new run saves over out_dir/ckpt.pt; losing a long run to a re-typed command must be asked for
        earlier = (ckpt_io.earlier_run(ckpt_path) if resume_format == 'file' else
                   f"iteration {found[2]} of an earlier run")
        replaced = checkpoint_dcp.all_checkpoints(out_dir)
        if not cfg['overwrite']:
            raise RunError(f"{ckpt_path} holds {earlier}; continue it with --init_from=resume, choose "
                           f"another --out_dir, or pass --overwrite=True to replace it (--init_from=auto resumes when there is one)")
        if master:
            print(f"{ckpt_path} holds {earlier}; this run's first save replaces it (overwrite=True)")
    if master and not cfg['eval_only']:  # the writer (it holds the lock): an unusable out_dir is found now
        try:
            ckpt_io.check_out_dir(out_dir)
            removed = checkpoint_dcp.remove_incomplete(out_dir)  # what a crash in the middle of a save left
        except ckpt_io.CheckpointError as e:
            raise RunError(e) from None
        if removed:
            print(f"removed {', '.join(removed)} from {out_dir}: checkpoint(s) left incomplete by an interrupted save")
    checkpoint_format = cfg['checkpoint_format']
    if checkpoint_format == 'auto':  # one file in one process; sharded folders on several ranks
        checkpoint_format = 'dcp' if world_size > 1 else 'file'

    wandb = None
    if cfg['wandb_log'] and master:
        try:
            import wandb
        except ImportError:
            raise RunError("wandb_log=True needs the wandb package: pip install wandb, or drop --wandb_log") from None

    device_type = 'cuda' if device.startswith('cuda') else 'cpu'
    torch.manual_seed(cfg['seed'])  # same model init on every rank (DDP broadcasts rank 0's; FSDP needs it)
    if device_type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    # data: the embedded Shakespeare corpora are prepared on first use, anything else must exist
    if master:
        prepare_if_embedded(cfg['dataset'])
    if ranks.enabled:
        dist.barrier()
    try:
        train_batches, eval_batches = open_splits(cfg['dataset'], cfg['block_size'], cfg['batch_size'],
                                                  cfg['sampling'], cfg['data_seed'], ranks.rank, world_size)
    except (FileNotFoundError, ValueError) as e:
        raise RunError(e) from None
    mc_examples = mc_encode = None  # eval_mc_path: the multiple-choice benchmark of every evaluation
    if cfg['eval_mc_path']:
        try:
            mc_examples = multiple_choice.read_mc(cfg['eval_mc_path'], cfg['eval_mc_limit'])
            mc_encode = Tokenizer.from_meta(read_meta(data_dir(cfg['dataset']))).encode
            for number, ex in enumerate(mc_examples, 1):  # text the tokenizer cannot encode: now, not at an evaluation
                try:
                    for text in (ex['query'], *ex['choices']):
                        mc_encode(text)
                except ValueError as e:
                    raise ValueError(f"{cfg['eval_mc_path']}, example {number}: {e}") from None
        except (ValueError, RuntimeError, OSError) as e:
            raise RunError(f"eval_mc_path: {e}") from None
    vocab_size = cfg['vocab_size']
    if not vocab_size:
        vocab_size = dataset_vocab(cfg['dataset'])
        if vocab_size and master:
            print(f"found vocab_size = {vocab_size} (inside {data_dir(cfg['dataset'])}/meta.pkl)")

    # model: from scratch, from out_dir's checkpoint, or a pretrained GPT-2 / Hugging Face directory
    iter_num, best_val_loss, checkpoint, saved_iter, wandb_id = 0, 1e9, None, None, None
    try:
        if init_from == 'scratch':
            model_config = TransformerConfig(**builder.transformer_kwargs(cfg, vocab_size))
            dtype = builder.weight_dtype(cfg['precision'])
            # before it is allocated: a one-line refusal, not the OOM killer
            check_fits(model_config, device, dtype.itemsize, world_size=world_size, fsdp=fsdp,
                       estimate_peak=lambda: estimate_iteration(cfg, vocab_size)['peak'])
            raw_model = builder.new_model(model_config, device, dtype)  # on the device, in its dtype
        elif init_from == 'resume' and resume_format == 'dcp':  # weights loaded once sharded (below)
            checkpoint, raw_model = checkpoint_dcp.resume(ckpt_path, device, cfg, given_keys)
            iter_num = saved_iter = checkpoint['iter_num']
            best_val_loss, wandb_id = checkpoint['best_val_loss'], checkpoint.get('wandb_id')
        elif init_from == 'resume':  # the checks that the config can continue it included (checkpoint.py)
            checkpoint, raw_model = ckpt_io.resume(ckpt_path, device, cfg, given_keys)
            iter_num = saved_iter = checkpoint['iter_num']
            best_val_loss, wandb_id = checkpoint['best_val_loss'], checkpoint.get('wandb_id')
        else:  # a GPT-2 name or a local Hugging Face model directory (hf.py)
            import hf
            raw_model = hf.from_pretrained(init_from, cfg['dropout'], cfg['block_size'])
    except (RuntimeError, ValueError) as e:
        raise RunError(e) from None
    if cfg['block_size'] < raw_model.config.block_size:
        raw_model.crop_block_size(cfg['block_size'])
    model_args = asdict(raw_model.config)  # what was built, after any crop: sample.py and resumes rebuild it
    # the printed and saved config describes the model that trains, whatever init_from built it from
    cfg.update({k: model_args[k] for k in (*builder.ARCH_KEYS, 'block_size') if k in cfg})
    try:  # every id of the data needs a row of the embedding
        check_vocab(cfg['dataset'], raw_model.config.vocab_size, train_batches, *eval_batches.values())
    except ValueError as e:
        raise RunError(e) from None
    tokens_per_iter = cfg['gradient_accumulation_steps'] * cfg['batch_size'] * cfg['block_size']
    if master:
        for line in train_config.warnings(cfg):
            print(f"warning: {line}", file=sys.stderr, flush=True)
        if init_from == 'resume' and iter_num >= cfg['max_iters'] and not cfg['eval_only']:
            print(f"warning: the checkpoint is at iteration {iter_num} and max_iters={cfg['max_iters']}: this run "
                  f"evaluates and trains nothing; raise --max_iters to train on", file=sys.stderr, flush=True)
        print(f"config:\n{format_config(cfg)}")
        print(f"model: {cfg['arch']}, {cfg['n_layer']} blocks, {raw_model.get_num_params() / 1e6:.2f}M parameters "
              f"(from {'a checkpoint' if init_from == 'resume' else init_from})")
        print(f"tokens per iteration: {tokens_per_iter:,} ({world_size} rank{'s' * (world_size > 1)})")
        if init_from == 'resume':
            print(f"resuming from iteration {iter_num} of {ckpt_path}")

    def shard(model):  # FSDP2, before the optimizer and the cycler (they must see the sharded parameters)
        amp_dtype = train_config.PTDTYPES[cfg['dtype']]
        distributed.shard_fsdp(model, ranks, device_type, amp_dtype if device_type == 'cuda' and
                               cfg['precision'] == 'amp' and amp_dtype != torch.float32 else None)

    try:  # the one builder (builder.py): memory options, precision, device, optimizer over ALL parameters, cycler
        raw_model, optimizer, cycler = builder.build(cfg, device, model=raw_model, shard=shard if fsdp else None)
    except ValueError as e:
        raise RunError(e) from None
    if master and cycler.cycle_note():
        print(cycler.cycle_note())
    torch.manual_seed(cfg['seed'] + ranks.rank)  # from here on (dropout) each rank draws its own random numbers
    if cfg['compile']:
        # Regional compilation (memory_options.py): one graph per block, which sees two requires_grad patterns
        # (trainable or frozen); a whole-model compile recompiles for every pattern and gives up after 8
        memory_options.compile_blocks(raw_model, cfg['method'])

    # under torchrun the DDP wrapper is rebuilt over the active parameters after every switch
    # (trainer.ParallelModel), FSDP reshards; one process trains the model as it is
    parallel = ParallelModel(raw_model, ranks, device_type, fsdp) if ranks.enabled or cfg['ddp_check'] else None
    observer = ddp_check.RankCheck(parallel, fsdp_units(raw_model) if fsdp else None) \
        if cfg['ddp_check'] else None
    trainer = Trainer(cfg, raw_model, optimizer, cycler, train_batches.iterate(device), device_type,
                      cfg['gradient_accumulation_steps'] // world_size, parallel, observer=observer, iter_num=iter_num)
    if checkpoint is not None:
        try:
            objects = {**trainer.state_objects(), 'data': train_batches}
            if resume_format == 'dcp':  # each rank reads its shards, whatever the ranks that wrote them
                checkpoint_dcp.load(ckpt_path, checkpoint, raw_model, optimizer, ranks.cpu_group)
                objects = {k: v for k, v in objects.items() if k not in ('model', 'optimizer')}
            ckpt_io.load_state(checkpoint, objects, fsdp)
        except (ValueError, KeyError) as e:
            raise RunError(f"cannot resume from {ckpt_path}: {e}") from None
        if ranks.any(not ckpt_io.all_finite(raw_model, optimizer)):
            raise RunError(f"{ckpt_path} holds weights or optimizer state that are not finite (iteration {iter_num}): "
                           f"it cannot be resumed; restore a backup of it, or start again with --init_from=scratch "
                           f"--overwrite=True")
        saved_tokens = checkpoint['data'].get('n_tokens')
        if saved_tokens is not None and saved_tokens != train_batches.n_tokens and master:
            print(f"warning: {train_batches.path} has {train_batches.n_tokens:,} tokens, the checkpoint's data had "
                  f"{saved_tokens:,}: the file changed, and the saved position now points into another order of "
                  f"windows", file=sys.stderr, flush=True)
        if not ckpt_io.restore_rng(checkpoint, ranks, device_type, cfg['seed'], iter_num) and master:
            print(f"resuming a {checkpoint.get('world_size', 1)}-rank checkpoint on {world_size} "
                  f"rank{'s' * (world_size > 1)}: same data position, not bitwise the run it would have been")
        checkpoint = None  # free memory
    records = Records(out_dir, master and not cfg['eval_only'],
                      resumed_from=iter_num if init_from == 'resume' else None)

    def last_good():
        return (f"kept the last good checkpoint {ckpt_path} (iteration {saved_iter})" if saved_iter is not None
                else "this run saved no checkpoint")

    def check_finite(losses):  # the values are all-reduced, so every rank stops here alike
        for split, value in losses.items():
            if not math.isfinite(value):
                raise RunError(f"{split} loss is {value} at iteration {trainer.iter_num}; {last_good()}; lower "
                               f"learning_rate or raise warmup_iters")

    # 'file': rank 0 writes out_dir/ckpt.pt; 'dcp': every rank writes its shards of a step folder
    # (checkpoint_dcp.py), in the background on a GPU (checkpoint_async)
    saver = checkpoint_dcp.Saver(out_dir, ranks, cfg['keep_last'], checkpoint_dcp.background(
        cfg['checkpoint_async'], device_type)) if checkpoint_format == 'dcp' else None
    if saver is not None and master:
        saver.replaces = replaced

    def save_checkpoint():  # on every rank; never a non-finite state
        nonlocal ckpt_path, replaced
        values = {'data': trainer.data_position, 'model_args': model_args, 'iter_num': trainer.iter_num,
                  'best_val_loss': best_val_loss, 'config': cfg, 'wandb_id': wandb_id}
        try:
            if saver is not None:
                path, wrote = saver.save(trainer.state_objects(), values, device_type), master
            else:
                path = os.path.join(out_dir, 'ckpt.pt')
                wrote = ckpt_io.save(path, ranks, trainer.state_objects(), values, fsdp, device_type)
        except ckpt_io.NonFiniteState:
            raise RunError(f"the weights or optimizer state are not finite at iteration {trainer.iter_num}; "
                           f"{last_good()}; lower learning_rate or raise warmup_iters") from None
        except ckpt_io.CheckpointError as e:
            raise RunError(e) from None
        ckpt_path = path
        if wrote:
            if saver is None:  # an earlier run's step folders (overwrite=True) go with the first save
                checkpoint_dcp.remove_checkpoints([p for p in replaced if p != path])
                replaced = []
            background = saver is not None and saver.use_async
            note = ' (copied to host memory, written to disk in the background)' if background else ''
            print(f"saved checkpoint to {path}{note}")
            records.write('save', iter=trainer.iter_num, path=path)
        return trainer.iter_num

    if wandb is not None:  # a resumed run continues the wandb run of its checkpoint, restarts included
        wandb_id = wandb_id or wandb.util.generate_id()
        wandb.init(project=cfg['wandb_project'], name=cfg['wandb_run_name'], config=cfg, id=wandb_id, resume='allow')

    def record(kind, **fields):  # the metrics file, wandb, and (by the caller) the log line
        records.write(kind, **fields)
        if wandb is not None and kind in ('eval', 'iter'):
            wandb.log({f'{kind}/{k}': v for k, v in fields.items() if isinstance(v, (int, float))}, step=fields['iter'])

    max_iters, eval_interval, log_interval = cfg['max_iters'], cfg['eval_interval'], cfg['log_interval']
    peak_flops = peak_bf16_flops(device)
    # SIGTERM/SIGINT: all ranks finish the iteration, save and stop together (StopRequest). Installed
    # only now: during the setup above, Ctrl-C must stop the run at once, as there is nothing to save.
    stop_request = StopRequest()
    try:
        trainer.next_batch()  # fetched one ahead (the step fetches each next one right after a forward)
    except ValueError as e:  # a token id the model cannot embed, found as a large file is read
        raise RunError(f"{e}; {last_good()}") from None
    run_start = t0 = time.time()
    first_iter, running_mfu, seconds_per_iter = iter_num, -1.0, None
    while True:
        stop = stop_request.agreed(ranks)
        if stop:
            print(f"rank {ranks.rank}: stop requested, stopping at iteration {trainer.iter_num}", flush=True)
            if trainer.iter_num > first_iter:  # else nothing trained since the start or the resume
                saved_iter = save_checkpoint()
            if ranks.enabled:  # rank 0 has written the file before any rank exits non-zero, when torchrun stops the rest
                dist.barrier(group=ranks.cpu_group)
            break
        it = trainer.iter_num
        if it % eval_interval == 0 or it >= max_iters or cfg['eval_only']:
            losses = trainer.evaluate(eval_batches, cfg['eval_iters'], ranks, device)
            mc = {}
            if mc_examples is not None:  # every rank alike: the same weights, the same scores
                scores = multiple_choice.mc_accuracy(raw_model, mc_examples, mc_encode, device, trainer.autocast)
                mc = {'mc_acc': scores['acc'], 'mc_acc_norm': scores['acc_norm']}
            if master:
                shown = f", mc acc {mc['mc_acc']:.4f}, acc_norm {mc['mc_acc_norm']:.4f}" if mc else ''
                print(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}{shown}")
                record('eval', iter=it, train_loss=losses['train'], val_loss=losses['val'],
                       lr=get_lr(it, cfg), **mc)
            check_finite(losses)
            improved = losses['val'] < best_val_loss
            best_val_loss = min(best_val_loss, losses['val'])
            # every rank decides alike: the losses are all-reduced, so identical on every rank
            if it > first_iter and (improved or cfg['always_save_checkpoint']):
                saved_iter = save_checkpoint()
            t0 = time.time()  # an iteration's time excludes the evaluation and the save
        if it >= max_iters or cfg['eval_only']:
            break

        try:  # the one iteration (Trainer): learning rate, switch, prefetch, DDP rebuild, step
            loss, switched = trainer.step()
        except ValueError as e:  # a token id the model cannot embed, found as a large file is read
            raise RunError(f"{e}; {last_good()}") from None
        except ddp_check.CheckFailed as e:
            raise RunError(f"ddp check failed at iteration {it}, not on every rank: {e}") from None
        if switched and master:
            rebuild = f", DDP rebuilt in {parallel.rebuild_ms:.1f} ms" if ranks.enabled and not fsdp else ""
            print(f"iter {it}: {cycler.describe()}{rebuild}")
            record('switch', iter=it, active=list(cycler.active), description=cycler.describe(),
                   ddp_rebuild_ms=parallel.rebuild_ms if ranks.enabled and not fsdp else None)
        if observer is not None and observer.summary and master and (switched or it == max_iters - 1):
            print(f"iter {it}: {observer.summary}")

        t1 = time.time()
        dt, t0 = t1 - t0, t1
        seconds_per_iter = dt if seconds_per_iter is None else 0.9 * seconds_per_iter + 0.1 * dt
        if it % log_interval == 0:
            lossf = ranks.mean(loss.item(), device)
            check_finite({'train': lossf})
            if master:
                fields = dict(iter=it, loss=lossf, ms=dt * 1000, tok_per_s=tokens_per_iter / dt,
                              epoch=train_batches.epochs(), lr=get_lr(it, cfg))
                line = (f"iter {it}: loss {lossf:.4f}, time {dt * 1000:.1f}ms, tok/s {tokens_per_iter / dt:,.0f}, "
                        f"epoch {fields['epoch']:.2f}")
                if peak_flops and it - first_iter >= 5:
                    iter_mfu = mfu(raw_model.estimate_flops_per_token(), tokens_per_iter, dt, peak_flops, world_size)
                    running_mfu = iter_mfu if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * iter_mfu
                    fields['mfu'] = running_mfu
                    line += f", mfu {running_mfu * 100:.2f}%"
                if device_type == 'cuda':
                    fields.update(mem_alloc_gib=torch.cuda.max_memory_allocated() / 2**30,
                                  mem_reserved_gib=torch.cuda.max_memory_reserved() / 2**30)
                    line += f", mem {fields['mem_alloc_gib']:.2f}/{fields['mem_reserved_gib']:.2f} GiB alloc/reserved"
                line += (f", {it + 1}/{max_iters}, "
                         f"{format_duration(seconds_per_iter * (max_iters - it - 1))} left")
                print(line, flush=True)
                record('iter', **fields)
    stop_request.release()  # Ctrl-C during the sample below stops at once
    if saver is not None:  # the last background save is on disk, complete, before the run ends
        try:
            saver.finish()
        except ckpt_io.CheckpointError as e:
            raise RunError(e) from None
    if master:
        elapsed = time.time() - run_start
        print(f"{'stopped' if stop else 'done'}: iterations {first_iter} to {trainer.iter_num} in "
              f"{format_duration(elapsed)}")
        records.write('end', iter=trainer.iter_num, seconds=elapsed, stopped=bool(stop))

    # under FSDP every rank runs the sample's forwards (each all-gathers the weights); rank 0 prints
    if (master or fsdp) and cfg['sample_tokens'] > 0 and not stop:
        try:
            tokenizer = Tokenizer.from_meta(read_meta(data_dir(cfg['dataset'])))
        except ValueError as e:
            raise RunError(e) from None
        start = torch.tensor([tokenizer.encode('\n', special=True)], dtype=torch.long, device=device)
        raw_model.eval()  # no dropout while generating (evaluate left it in training mode)
        with trainer.autocast:
            y = raw_model.generate(start, cfg['sample_tokens'], temperature=0.8, top_k=200)
        if master:
            print(f"sample:\n{tokenizer.decode(y[0].tolist())}")
    # a stopped run exits as a process the signal ended would (128 + its number), so that schedulers
    # and requeue scripts do not take a preempted run for a finished one (README)
    return stop_request.exit_status if stop else 0


class LogOutlivesItsReader:
    """stdout that survives its reader: after `python train.py | head`, the rest of the log goes to
    /dev/null and the run trains on, instead of dying of BrokenPipeError at its next print."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())  # also for the flush at exit
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())

    def __getattr__(self, name):
        return getattr(self.stream, name)


if __name__ == '__main__':
    if not isinstance(sys.stdout, LogOutlivesItsReader) and hasattr(sys.stdout, 'fileno'):
        try:
            sys.stdout.fileno()
            sys.stdout = LogOutlivesItsReader(sys.stdout)
        except (OSError, ValueError):  # not a real file (a test's StringIO): nothing can break
            pass
    sys.exit(main(sys.argv[1:]))
