"""bench_memory.py, bench.py and experiments/compare.py measure train.py's iteration: they build through
builder.build and step through Trainer, whose train_step gets the config's keys."""

import os
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, 'experiments'))
import compare  # noqa: E402

import bench  # noqa: E402
import bench_memory  # noqa: E402
import memory_estimate  # noqa: E402
import train_config  # noqa: E402
from configurator import configure  # noqa: E402
from trainer import Trainer  # noqa: E402

SMALL = [
    '--arch=llama',
    '--n_layer=4',
    '--n_head=4',
    '--n_embd=64',
    '--vocab_size=512',
    '--block_size=32',
    '--batch_size=2',
    '--method=lisa_wor',
    '--omgd_gamma=2',
    '--grad_clip=0.5',
    '--gradient_accumulation_steps=2',
]


@pytest.fixture
def steps(monkeypatch):
    """Every call of Trainer.train_step, by the values it steps with; the step itself still runs."""
    calls, step = [], Trainer.train_step

    def recorded(trainer, model, sync=None, micro_steps=None):
        calls.append(
            dict(
                grad_accum=micro_steps or trainer.grad_accum,
                grad_clip=trainer.cfg['grad_clip'],
                scale_after_clip=trainer.cfg['omgd_scale_after_clip'],
            )
        )
        return step(trainer, model, sync, micro_steps)

    monkeypatch.setattr(Trainer, 'train_step', recorded)
    return calls


def run_bench_memory(scale_after_clip):
    cfg = configure(
        bench_memory.DEFAULTS,
        [*SMALL, '--device=cpu', '--micro_batches=2', f'--omgd_scale_after_clip={scale_after_clip}'],
    )
    device, rows = bench_memory.check(cfg)
    memory_estimate.measure(rows[0], device)


def run_bench(scale_after_clip):
    cfg = configure(
        bench.DEFAULTS, [*SMALL, '--device=cpu', '--compile=False', f'--omgd_scale_after_clip={scale_after_clip}']
    )
    device, rows, _ = bench.check(cfg)
    bench.MethodRun(rows[0], device).step(0, timed=True)


def run_compare(scale_after_clip):
    flags = {name: default for name, _, default in compare.TRAIN_FLAGS}
    flags.update(
        dataset='no_such_dataset', n_layer=4, n_embd=64, block_size=32, batch_size=2, omgd_gamma=2, grad_clip=0.5
    )
    args = SimpleNamespace(
        **flags,
        max_iters=40,
        train_arg=['--gradient_accumulation_steps=2', f'--omgd_scale_after_clip={scale_after_clip}'],
    )
    mem = compare.measure_memory('lisa_wor', args)
    assert 'error' not in mem, mem


@pytest.mark.parametrize('scale_after_clip', [True, False])
@pytest.mark.parametrize('caller', [run_bench_memory, run_bench, run_compare], ids=lambda f: f.__name__[4:])
def test_every_caller_steps_through_the_trainers_train_step(caller, scale_after_clip, steps):
    """Each measured iteration is Trainer.train_step, given the config's accumulation, clipping and
    clip/scale order (test_trainer.py checks what the step does with them)."""
    caller(scale_after_clip)
    assert steps, f"{caller.__name__} trained without Trainer.train_step"
    assert all(c['grad_clip'] == 0.5 and c['scale_after_clip'] is scale_after_clip for c in steps), steps
    assert steps[-1]['grad_accum'] == 2  # the measured / timed iteration accumulates the config's micro-batches


def test_llama7b_config_trains_one_step_on_meta(steps):
    """config/llama7b_lisa_wor.py, as train.py reads it, built by builder.build on the meta
    device and trained one real step by Trainer.train_step; its bytes follow from the shapes."""
    path = os.path.join(ROOT, 'config', 'llama7b_lisa_wor.py')
    train_cfg = train_config.load(
        [path], defaults=train_config.DEFAULTS | train_config.machine_defaults(False)
    )  # a valid train.py config
    train_config.check(train_cfg)
    cfg = configure(bench_memory.DEFAULTS, [path, '--device=meta', '--micro_batches=1'])
    assert {k: cfg[k] for k in train_cfg if k not in ('device', 'dtype', 'compile', 'backend')} == {
        k: train_cfg[k] for k in train_cfg if k not in ('device', 'dtype', 'compile', 'backend')
    }
    device, rows = bench_memory.check(cfg)
    assert len(rows) == 1 and (rows[0]['method'], rows[0]['precision']) == ('lisa_wor', 'bf16')
    row = memory_estimate.measure(rows[0], device)
    # warm-up (iteration 0, one micro-batch) and the measured iteration, with the config's clipping and order
    assert steps == [dict(grad_accum=1, grad_clip=1.0, scale_after_clip=True)] * 2
    V, d, h, L = 50304, 4096, 11008, 32  # the config's vocabulary; llama-7b's width, MLP and depth
    block = 4 * d * d + 3 * d * h + 2 * d  # q, k, v, o; gate, up, down; two RMSNorm weights
    n_params = 2 * V * d + L * block + d  # untied embedding and head, final norm
    trainable = 2 * block + 2 * V * d + d  # 2 active blocks + embedding, head and final norm
    assert row['n_params'] == n_params and len(row['active_blocks']) == 2
    # pure bf16: 2 bytes per weight and per gradient, two bf16 AdamW moments per trainable parameter
    assert (row['params'], row['grads'], row['optimizer']) == (2 * n_params, 2 * trainable, 4 * trainable)
    assert row['cpu_state'] == 0 and row['others'] > 0
    # the config's note: GPT-2's tokenizer adds 2 x 18304 x 4096 bf16 weights (286 MiB) to the paper's 12.55 GiB
    assert row['params'] - 2 * (n_params - 2 * (V - 32000) * d) == 2 * 18304 * 4096 * 2 == 286 * 2**20
    assert round((row['params'] - 286 * 2**20) / 2**30, 2) == 12.55
