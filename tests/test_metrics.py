"""infra/metrics.py as a sink: the one test of the log lines' format, and what a switch reports (omgd.Cycler.report:
every part that trains, found by module)."""

import json
from types import SimpleNamespace

import torch
from conftest import train_defaults

import builder
import omgd
from infra import metrics

TINY = dict(n_layer=4, n_head=2, n_embd=16, block_size=8, vocab_size=32, omgd_gamma=2)


def test_the_log_lines_format(tmp_path, capsys):
    """The one test of the lines' text: each event's line, its fields in order, each by its rule in SHOWN; a value
    no rule names shows as `name value`; the records hold the same values, unrounded."""
    m = metrics.Metrics(
        dict(out_dir=str(tmp_path), eval_only=False, wandb_log=False, max_iters=100),
        SimpleNamespace(master=True, world_size=1),
        'cpu',
    )
    m.begin(None, tokens_per_iter=4096, first_iter=0)
    m.evaluation(10, train_loss=2.123456, val_loss=2.5, mc_acc=0.25, mc_acc_norm=0.3125)
    m.switch(10, 'cycle 2: active blocks [0, 3]; trains embed and blocks [0, 3]', active=[0, 3], ddp_rebuild_ms=3.0)
    m.iteration(10, 0.25, 0.5, loss=2.0, lr=6e-4, epoch=1.5, grad_norm=0.123456, note='x')
    assert capsys.readouterr().out.splitlines() == [
        "step 10: train loss 2.1235, val loss 2.5000, mc acc 0.2500, acc_norm 0.3125",
        "iter 10: cycle 2: active blocks [0, 3]; trains embed and blocks [0, 3], DDP rebuilt in 3.0 ms",
        "iter 10: loss 2.0000, lr 6.00e-04, epoch 1.50, grad_norm 0.1235, note x, time 250.0ms, tok/s 16,384, "
        "11/100, 0m44s left",
    ]
    eval_, switch, iter_ = map(json.loads, open(tmp_path / 'metrics.jsonl'))
    assert eval_ == dict(kind='eval', iter=10, train_loss=2.123456, val_loss=2.5, mc_acc=0.25, mc_acc_norm=0.3125)
    assert switch['active'] == [0, 3] and switch["ddp_rebuild_ms"] == 3.0
    assert iter_ == dict(
        kind='iter', iter=10, loss=2.0, lr=6e-4, epoch=1.5, grad_norm=0.123456, note='x', ms=250.0, tok_per_s=16384.0
    )


def built(**overrides):
    torch.manual_seed(0)
    return builder.build(train_defaults(**TINY, **overrides), 'cpu')


def test_a_switch_names_every_part_that_trains():
    """The switch's line and record name the outer parts that always train (omgd_always) with the cycled blocks;
    found by module (model.outer_modules(), model.blocks' indices), so a block a fork keeps on is named too."""
    model, optimizer, cycler = built()
    assert cycler.step(0)
    line, values = cycler.report(model)
    blocks = cycler.active
    assert values == {'active': blocks, 'trains': {'outer': ['embed', 'pos', 'norm', 'head'], 'blocks': blocks}}
    assert line == f"{cycler.describe()}; trains embed, pos, norm, head and blocks {blocks}"

    model, optimizer, cycler = built(arch='llama', omgd_always='norm')  # llama: an untied head
    cycler.step(0)
    assert cycler.report(model)[1]['trains'] == {'outer': ['norm'], 'blocks': cycler.active}

    # a fork's edit: block 0 always trains, the cycler cycles blocks 1-3 (its unit i is block i + 1)
    model, optimizer, _ = built()
    units = [list(block.parameters()) for block in model.blocks[1:]]
    cycler = omgd.Cycler(units, optimizer, omgd.CyclerConfig(gamma=1, period=2))
    cycler.step(0)
    line, values = cycler.report(model)
    assert values['trains'] == {'outer': ['embed', 'pos', 'norm', 'head'], 'blocks': [0, cycler.active[0] + 1]}
    assert line.endswith(f"; trains embed, pos, norm, head and blocks [0, {cycler.active[0] + 1}]")

    model, optimizer, cycler = built(method='tensor_wor', omgd_ratio=0.5)  # part of a block counts as training
    cycler.step(0)
    trains = cycler.report(model)[1]['trains']
    on = {i for i, block in enumerate(model.blocks) if any(p.requires_grad for p in block.parameters())}
    assert trains['blocks'] == sorted(on) and 0 < len(on)
