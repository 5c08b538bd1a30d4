"""The seams of a fork's everyday edits (README "Code map"): a model field reaches the model through its
train.py key alone, a cycler field through its omgd_ key alone, and an optimizer group scales the learning-rate
schedule by its own lr_scale. Each is what a fork tried and found missing (issue 43, item 6)."""

import dataclasses
import itertools

import torch
from conftest import train_defaults

import builder
import omgd
from trainer import Trainer, get_lr

TINY = dict(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32)


def test_a_new_model_field_reaches_the_model_through_its_key_alone(monkeypatch):
    """qk_norm added to TransformerConfig and as a train.py key: builder passes it, with no list to join
    (a list of shape keys left it out, and --qk_norm=True built a model without it, silently)."""
    forked = dataclasses.make_dataclass('ForkedConfig', [('qk_norm', bool, False)], bases=(builder.TransformerConfig,))
    monkeypatch.setattr(builder, 'TransformerConfig', forked)
    cfg = {**train_defaults(**TINY), 'qk_norm': True}
    args = builder.transformer_kwargs(cfg)
    assert args['qk_norm'] is True and forked(**args).qk_norm is True
    assert {k: v for k, v in args.items() if k != 'qk_norm'} == {
        f.name: cfg[f.name] for f in dataclasses.fields(forked) if f.name in cfg and f.name != 'qk_norm'
    }


def test_a_new_cycler_field_comes_from_its_omgd_key_alone(monkeypatch):
    """A sampler's new field (block probabilities) is read from omgd_<field> by CyclerConfig.from_config,
    which builder.build_cycler calls: no field-by-field call to extend."""
    forked = dataclasses.make_dataclass(
        'ForkedCyclerConfig', [('block_probs', str, '')], bases=(omgd.CyclerConfig,), frozen=True
    )
    cfg = {**train_defaults(**TINY), 'omgd_block_probs': '1,1,2', 'omgd_always': 'embed,head', 'omgd_gamma': 2}
    config = forked.from_config(cfg)
    assert (config.block_probs, config.always, config.gamma, config.method) == (
        '1,1,2',
        ('embed', 'head'),
        2,
        cfg['method'],
    )
    assert omgd.CyclerConfig.from_config(cfg, 'full').method == 'full'
    seen = []
    monkeypatch.setattr(omgd, 'build_cycler', lambda model, optimizer, config: seen.append(config))
    monkeypatch.setattr(omgd, 'CyclerConfig', forked)  # the fork's omgd.py
    builder.build_cycler(None, None, cfg)
    assert seen == [config] and seen[0].block_probs == '1,1,2'


def test_a_group_scales_the_schedule_by_its_own_lr_scale():
    """Trainer.step writes the schedule's rate into every group, so a group's own rate was overwritten at the
    first step; a group with lr_scale gets the rate times it, the others the rate itself, bitwise."""
    cfg = train_defaults(**TINY, warmup_iters=2, lr_decay_iters=20, method='full')
    torch.manual_seed(0)
    model, optimizer, cycler = builder.build(cfg, 'cpu')
    optimizer.param_groups[1]['lr_scale'] = 0.1
    x = torch.randint(32, (2, 8))
    trainer = Trainer(cfg, model, optimizer, cycler, itertools.repeat((x, x, None)), 'cpu')
    for it in range(4):
        trainer.step()
        assert optimizer.param_groups[0]['lr'] == get_lr(it, cfg)
        assert optimizer.param_groups[1]['lr'] == get_lr(it, cfg) * 0.1


def test_a_key_newer_than_the_checkpoint_is_held_to_its_default_on_resume(monkeypatch):
    """A fork adds a key a resume cannot change (here: its optimizer) after a checkpoint was saved: that run
    trained as the key's default does, so giving another value on resume is refused in one line (it was let
    through, to end in torch's 'different number of parameter groups')."""
    import pytest

    import train_config

    cfg = train_defaults(**TINY)
    saved = {k: v for k, v in cfg.items() if k != 'optimizer'}  # the checkpoint's config, from before the key
    model_args = builder.transformer_kwargs(cfg)
    with pytest.raises(
        ValueError,
        match=r"^optimizer='sgd' differs from the checkpoint's 'adamw' \(its optimizer "
        r"state is that optimizer's\); resume with --optimizer=adamw$",
    ):
        train_config.check_resume(saved, model_args, {**cfg, 'optimizer': 'sgd'}, {'optimizer'})
    assert train_config.check_resume(saved, model_args, cfg, {'optimizer'})['optimizer'] == 'adamw'


def test_a_new_figure_reaches_the_log_line_and_the_record_through_the_trainer_alone(tmp_path, monkeypatch):
    """A fork puts the gradient norm on the log line: the norm train_step clips with, reported by Trainer.values
    (trainer.py's edit, here patched in). train.py hands the values to infra/metrics.py, which shows and records
    any value it is handed: no edit in infra/ (the norm used to need one in metrics.py)."""
    from conftest import records, run_train

    import trainer

    norms, clip, values = [], torch.nn.utils.clip_grad_norm_, trainer.Trainer.values
    monkeypatch.setattr(torch.nn.utils, 'clip_grad_norm_', lambda *a, **k: norms.append(clip(*a, **k).item()))
    monkeypatch.setattr(trainer.Trainer, 'values', lambda self: {**values(self), 'grad_norm': norms[-1]})
    out = run_train(f'--out_dir={tmp_path}', '--max_iters=3', '--eval_interval=3').stdout
    assert len(norms) == 3 and [r['grad_norm'] for r in records(tmp_path, 'iter')] == norms
    for it, norm in enumerate(norms):
        assert f"grad_norm {norm:.4g}, " in next(
            line for line in out.splitlines() if line.startswith(f'iter {it}: loss')
        )
