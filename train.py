"""Pre-train a GPT-2 or LLaMA model with OMGD layer cycling (LISA-wor) or a baseline method.

$ python train.py                                  # small LISA-wor model on Shakespeare, CPU, minutes
$ python train.py config/shakespeare_lisa_wor.py --method=lisa --max_iters=500
$ torchrun --standalone --nproc_per_node=4 train.py config/gpt2_lisa_wor.py  # DDP (gloo without CUDA)
$ torchrun --standalone --nproc_per_node=4 train.py config/gpt2_lisa_wor.py --parallel=fsdp  # sharded blocks

--init_from=auto resumes from out_dir when it holds a checkpoint, so a restarted job continues by itself
(several nodes: docs/distributed.md). Every evaluation, logged iteration, switch and save is also a record in
out_dir/metrics.jsonl (infra/metrics.py).
"""

import contextlib
import functools
import math
import os
import signal
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

import builder
import train_config
from configurator import ConfigError, help_text, wants_help
from data.tokenizer import Tokenizer, read_meta
from dataloader import check_vocab, data_dir, dataset_vocab, open_splits, prepare_if_embedded
from infra import ddp_check, distributed, memory_options, multiple_choice
from infra.checkpoint import Checkpointer, CheckpointError
from infra.metrics import LogOutlivesItsReader, Metrics
from memory_estimate import check_fits, estimate_iteration
from model import DTYPES, PRESET_KEYS, TransformerConfig
from trainer import Trainer


class RunError(Exception):
    """A reason to stop the run: main() prints it as one `error:` line and exits 1."""


@contextlib.contextmanager
def refused(*errors, prefix='', then=None):
    """`errors` raised inside are the user's to fix: a RunError, not a traceback; then() adds what the run leaves."""
    try:
        yield
    except errors as e:
        raise RunError(f"{prefix}{e}" + (f"; {then()}" if then else '')) from None


def main(argv):
    # train_config.py holds every key with its default and its rule; config files and --key=value override them
    if wants_help(argv):
        usage = "usage: python train.py [config/FILE.py ...] [--key=value ...]"
        print(help_text(usage, train_config.DEFAULTS, train_config.meanings()))
        return 0
    given_keys = set()  # the keys the command line and config files set: a resume refuses architecture overrides
    try:
        cfg = train_config.load(argv, given=given_keys)
        if cfg['gpu_config'] and cfg['device'] == 'cpu' and not any(a.startswith('--device=') for a in argv):
            raise ValueError(
                f"this is a GPU config (gpu_config=True) and this machine has no CUDA GPU (torch "
                f"{torch.__version__}); run it on a GPU, or pass --device=cpu to run it on the CPU anyway"
            )
    except (ConfigError, ValueError) as e:  # every rank of a node refuses the same config: one line
        return distributed.report_error(e, printed=os.environ.get('LOCAL_RANK', '0') == '0')
    # before CUDA's first allocation, which reads it
    allocator_note = memory_options.cuda_allocator() if cfg['device'].startswith('cuda') else None
    try:  # torchrun sets RANK; before anything is built: ranks given different configs would train apart
        ranks, device = distributed.setup(cfg['backend'], cfg['device'], cfg['dist_timeout_s'])
        distributed.check_same_config(ranks, cfg)
    except ValueError as e:
        if dist.is_initialized():
            dist.destroy_process_group()
        return distributed.report_error(e, printed=os.environ.get('RANK', '0') == '0')
    if allocator_note and ranks.master:
        print(allocator_note, flush=True)
    checkpointer = Checkpointer(cfg['out_dir'], ranks, device, writes=not cfg['eval_only'])  # infra/checkpoint.py
    try:
        status = train(cfg, given_keys, ranks, device, checkpointer)
    except (RunError, CheckpointError, RuntimeError) as e:  # one line; the last good checkpoint stays as it was
        if isinstance(e, RuntimeError):
            if not distributed.lost_rank(e):
                raise  # a bug: its traceback
            e = (
                f"rank {ranks.rank}: a collective with the other ranks failed ({str(e).strip().splitlines()[0][:160]})"
                f": another rank is stuck or dead; the last checkpoint in {cfg['out_dir']} is kept: resume with "
                f"--init_from=auto (raise --dist_timeout_s={cfg['dist_timeout_s']} if a rank is only slow)"
            )
        distributed.report_error(e)
        checkpointer.close(failed=True)  # a background save of a good state ends before the group goes
        if dist.is_initialized():
            dist.destroy_process_group()
        return 1
    except KeyboardInterrupt:  # Ctrl-C outside the loop (the loop's own stop saves): nothing is half-written
        distributed.report_error("interrupted (Ctrl-C); the last checkpoint, if any, is as it was")
        checkpointer.close(failed=True)
        return 128 + signal.SIGINT
    distributed.teardown(ranks)  # a barrier, then destroy_process_group
    checkpointer.close()
    return status


def train(cfg, given_keys, ranks, device, checkpointer):
    """The run: the setup, then the loop; returns the exit status (0, or 128 + a stop signal's number)."""
    fsdp = ranks.enabled and cfg['parallel'] == 'fsdp'
    # scratch, resume or auto; a resume's config is its checkpoint's with this command's keys on top (run_config)
    with refused(ValueError):
        cfg = checkpointer.start(cfg, functools.partial(train_config.run_config, cfg, given_keys), fsdp)
    resumed_at = checkpointer.iter_num if checkpointer.init_from == 'resume' else None
    with refused(ImportError):  # the log lines, out_dir/metrics.jsonl and wandb (infra/metrics.py)
        metrics = Metrics(cfg, ranks, device, resumed_at)
    torch.manual_seed(cfg['seed'])  # same model init on every rank (DDP broadcasts rank 0's; FSDP needs it)
    if device.startswith('cuda'):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    train_batches, eval_batches, mc = open_data(cfg, ranks)
    raw_model = initial_model(cfg, checkpointer, ranks, device, fsdp)
    model_args = asdict(raw_model.config)  # what was built, after any crop: sample.py and resumes rebuild it
    # the printed and saved config describes the model that trains, whatever init_from built it from
    cfg.update({k: model_args[k] for k in (*PRESET_KEYS, 'block_size') if k in cfg})
    with refused(ValueError):  # every id of the data needs a row of the embedding
        check_vocab(cfg['dataset'], raw_model.config.vocab_size, train_batches, *eval_batches.values())
    tokens_per_iter = cfg['gradient_accumulation_steps'] * cfg['batch_size'] * cfg['block_size']
    metrics.header(raw_model, checkpointer, tokens_per_iter, train_config.warnings(cfg, resumed_at))
    trainer = build_trainer(cfg, raw_model, ranks, device, fsdp, train_batches, checkpointer.iter_num)
    checkpointer.load(trainer.state_objects(), train_batches)  # a resume's optimizer, cycler, scaler, data, RNG
    wandb_id = metrics.start_wandb(checkpointer.wandb_id)

    def save():  # on every rank; never a non-finite state
        values = {
            'data': trainer.data_position,
            'model_args': model_args,
            'iter_num': trainer.iter_num,
            'best_val_loss': best_val_loss,
            'config': cfg,
            'wandb_id': wandb_id,
        }
        metrics.save(trainer.iter_num, checkpointer.save(trainer.state_objects(), values))

    # installed only now: during the setup above, Ctrl-C must stop the run at once, as there is nothing to save
    stop_request = StopRequest()
    with refused(ValueError, then=checkpointer.last_good):  # a token id the model cannot embed, found as read
        trainer.next_batch()  # fetched one ahead (the step fetches each next one right after a forward)
    first_iter, best_val_loss, seconds_per_iter = trainer.iter_num, checkpointer.best_val_loss, None
    metrics.begin(trainer.model, tokens_per_iter, first_iter)
    t0 = time.time()
    while True:
        # a signal may reach only some ranks; one process reads its flag (an iteration reads no distributed.py)
        stop = ranks.any(stop_request.requested) if ranks.enabled else stop_request.requested
        if stop:
            print(f"rank {ranks.rank}: stop requested, stopping at iteration {trainer.iter_num}", flush=True)
            if trainer.iter_num > first_iter:  # else nothing trained since the start or the resume
                save()
            if ranks.enabled:  # rank 0 has written the file before any rank exits non-zero and torchrun stops the rest
                dist.barrier(group=ranks.cpu_group)
            break
        it = trainer.iter_num
        if it % cfg['eval_interval'] == 0 or it >= cfg['max_iters'] or cfg['eval_only']:
            losses = trainer.evaluate(eval_batches, cfg['eval_iters'], ranks, device)  # averaged over ranks
            scores = {}
            if mc is not None:  # every rank alike: the same weights, the same scores
                found = multiple_choice.mc_accuracy(trainer.model, *mc, device, trainer.autocast)
                scores = {'mc_acc': found['acc'], 'mc_acc_norm': found['acc_norm']}
            metrics.evaluation(it, **{f'{split}_loss': loss for split, loss in losses.items()}, **scores)
            check_finite(losses, trainer.iter_num, checkpointer)
            improved = losses['val'] < best_val_loss
            best_val_loss = min(best_val_loss, losses['val'])
            if it > first_iter and (improved or cfg['always_save_checkpoint']):  # all-reduced losses: every rank alike
                save()
            t0 = time.time()  # an iteration's time excludes the evaluation and the save
        if it >= cfg['max_iters'] or cfg['eval_only']:
            break

        with (  # the one iteration (Trainer.step): learning rate, switch, prefetch, DDP rebuild, step
            refused(ValueError, then=checkpointer.last_good),
            refused(ddp_check.CheckFailed, prefix=f"ddp check failed at iteration {it}, not on every rank: "),
        ):
            loss, switched = trainer.step()
        if switched:  # what trains now (omgd.Cycler.report), and the DDP wrapper's rebuild
            description, values = trainer.cycler.report(trainer.model)
            rebuild_ms = trainer.parallel.rebuild_ms if ranks.enabled and not fsdp else None
            metrics.switch(it, description, **values, ddp_rebuild_ms=rebuild_ms)
        if cfg['ddp_check'] and trainer.observer.summary and ranks.master and (switched or it == cfg['max_iters'] - 1):
            print(f"iter {it}: {trainer.observer.summary}")

        t1 = time.time()
        dt, t0 = t1 - t0, t1
        seconds_per_iter = dt if seconds_per_iter is None else 0.9 * seconds_per_iter + 0.1 * dt
        if it % cfg['log_interval'] == 0:
            lossf = ranks.mean(loss.item(), device) if ranks.enabled else loss.item()
            check_finite({'train': lossf}, trainer.iter_num, checkpointer)
            metrics.iteration(it, dt, seconds_per_iter, loss=lossf, **trainer.values(), epoch=train_batches.epochs())
    stop_request.release()  # Ctrl-C during the sample below stops at once
    checkpointer.finish()  # the last background save is on disk, complete, before the run ends
    metrics.end(trainer.iter_num, stop)
    # under FSDP every rank runs the sample's forwards (each all-gathers the weights); rank 0 prints
    if (ranks.master or fsdp) and cfg['sample_tokens'] > 0 and not stop:
        sample(cfg, trainer.model, trainer.autocast, device, ranks.master)
    # 128 + the signal's number, as a process it ended: schedulers do not take a preempted run for a finished one
    return stop_request.exit_status if stop else 0


# -----------------------------------------------------------------------------
# the setup's steps, in the order train() calls them


def open_data(cfg, ranks):
    """(training batches, {split: evaluation batches}, the multiple-choice benchmark (examples, encode) or None)."""
    if ranks.master:
        prepare_if_embedded(cfg['dataset'])
    if ranks.enabled:
        dist.barrier()
    keys = ('dataset', 'block_size', 'batch_size', 'sampling', 'data_seed')
    with refused(FileNotFoundError, ValueError):
        train_batches, eval_batches = open_splits(*(cfg[key] for key in keys), ranks.rank, ranks.world_size)
    mc = None
    if cfg['eval_mc_path']:
        with refused(ValueError, RuntimeError, OSError, prefix='eval_mc_path: '):
            encode = Tokenizer.from_meta(read_meta(data_dir(cfg['dataset']))).encode
            mc = multiple_choice.read_mc(cfg['eval_mc_path'], cfg['eval_mc_limit'], encode), encode
    return train_batches, eval_batches, mc


def initial_model(cfg, checkpointer, ranks, device, fsdp):
    """The run's first model: out_dir's checkpoint's, a new one or a pretrained one (hf.py), cropped to block_size."""
    vocab_size = cfg['vocab_size']
    if not vocab_size:
        vocab_size = dataset_vocab(cfg['dataset'])
        if vocab_size and ranks.master:
            print(f"found vocab_size = {vocab_size} (inside {data_dir(cfg['dataset'])}/meta.pkl)")
    with refused(RuntimeError, ValueError):
        if checkpointer.init_from == 'resume':  # on the device; a step folder's weights come when sharded
            model = builder.resumed_model(checkpointer.saved, cfg, device, checkpointer.path)
        elif checkpointer.init_from == 'scratch':
            model_config = TransformerConfig(**builder.transformer_kwargs(cfg, vocab_size))
            dtype = builder.weight_dtype(cfg['precision'])
            # before it is allocated: a one-line refusal, not the OOM killer (FSDP checks one rank's share)
            estimate = functools.partial(estimate_iteration, cfg, vocab_size)
            check_fits(model_config, device, dtype.itemsize, estimate, ranks.world_size, fsdp)
            model = builder.new_model(model_config, device, dtype)  # on the device, in its dtype
        else:  # a GPT-2 name or a local Hugging Face model directory
            import hf

            model = hf.from_pretrained(cfg['init_from'], cfg['dropout'], cfg['block_size'])
    if cfg['block_size'] < model.config.block_size:
        model.crop_block_size(cfg['block_size'])
    return model


def build_trainer(cfg, model, ranks, device, fsdp, train_batches, iter_num):
    """The run's Trainer: builder.build's model, optimizer (over ALL parameters) and cycler, wrapped for torchrun."""
    device_type = 'cuda' if device.startswith('cuda') else 'cpu'
    # FSDP2, before the optimizer and the cycler (they must see the sharded parameters); gathered in amp's dtype
    amp_dtype = DTYPES[cfg['dtype']] if cfg['precision'] == 'amp' else torch.float32
    param_dtype = amp_dtype if device_type == 'cuda' and amp_dtype != torch.float32 else None
    shard = functools.partial(distributed.shard_fsdp, ranks=ranks, device_type=device_type, param_dtype=param_dtype)
    with refused(ValueError):
        model, optimizer, cycler = builder.build(cfg, device, model=model, shard=shard if fsdp else None)
    if ranks.master and cycler.cycle_note():
        print(cycler.cycle_note())
    torch.manual_seed(cfg['seed'] + ranks.rank)  # from here on (dropout) each rank draws its own random numbers
    if cfg['compile']:  # per block: a whole-model compile recompiles at every requires_grad pattern
        builder.compile_blocks(model, cfg['method'])
    # under torchrun a DDP wrapper over the active parameters, rebuilt at every switch, or FSDP resharded
    parallel = observer = None
    if ranks.enabled or cfg['ddp_check']:
        parallel = distributed.ParallelModel(model, ranks, device_type, fsdp)
    if cfg['ddp_check']:
        observer = ddp_check.Checker(ranks, model, distributed.fsdp_units(model) if fsdp else None, parallel)
    batches, grad_accum = train_batches.iterate(device), cfg['gradient_accumulation_steps'] // ranks.world_size
    return Trainer(
        cfg, model, optimizer, cycler, batches, device_type, grad_accum, parallel, observer=observer, iter_num=iter_num
    )


def check_finite(losses, iter_num, checkpointer):
    """Stop at a loss that is not finite (all-reduced values: every rank stops here alike)."""
    for split, value in losses.items():
        if not math.isfinite(value):
            raise RunError(
                f"{split} loss is {value} at iteration {iter_num}; {checkpointer.last_good()}; lower "
                f"learning_rate or raise warmup_iters"
            )


def sample(cfg, raw_model, autocast, device, master):
    """A sample of the trained model (rank 0 prints it)."""
    with refused(ValueError):
        tokenizer = Tokenizer.from_meta(read_meta(data_dir(cfg['dataset'])))
    start = torch.tensor([tokenizer.encode('\n', special=True)], dtype=torch.long, device=device)
    raw_model.eval()  # no dropout while generating (evaluate left it in training mode)
    with autocast:
        y = raw_model.generate(start, cfg['sample_tokens'], temperature=0.8, top_k=200)
    if master:
        print(f"sample:\n{tokenizer.decode(y[0].tolist())}")


class StopRequest:
    """SIGTERM (a cluster, or torchrun forwarding its own), Ctrl-C, SIGHUP: finish the iteration, then all ranks save
    and stop together (every iteration starts with ranks.any of the flag), at once: torchrun kills them 30 s after."""

    def __init__(self):
        self.requested = False
        self.exit_status = 128 + signal.SIGTERM  # also on ranks that stop only because another rank was asked
        self.previous = {  # SIGHUP too: a closed terminal or ssh session would otherwise end the run with no save
            sig: signal.signal(sig, self._request) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        }

    def release(self):  # the previous handlers: after the loop a signal stops the process at once
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _request(self, signum, frame):
        self.requested = True
        self.exit_status = 128 + signum


if __name__ == '__main__':
    LogOutlivesItsReader.install()  # `python train.py | head`: the run trains on (infra/metrics.py)
    sys.exit(main(sys.argv[1:]))
