"""builder.py and trainer.py: the one builder and the one step, under every precision, state policy and method."""

import itertools

import pytest
import torch
from conftest import ITERATION_FILES, LOGGED_ITERATION_FILES, files_per_iteration, train_defaults
from conftest import TINY as TINY_ARGS

import builder
import omgd
import train_config
from trainer import Trainer, get_lr

TINY = dict(
    n_layer=4,
    n_head=2,
    n_embd=32,
    block_size=16,
    vocab_size=64,
    omgd_gamma=2,
    omgd_period=2,
    galore_rank=4,
    learning_rate=1e-2,
)


def batches(seed=0, batch_size=4):
    """Two fixed batches in turn, as (x, y, position): a tiny model learns them within a few steps."""
    g = torch.Generator().manual_seed(seed)
    pool = [torch.randint(64, (batch_size, 17), generator=g) for _ in range(2)]
    for count in itertools.count():
        x = pool[count % 2]
        yield x[:, :-1], x[:, 1:], count


def train(cfg, steps, model=None, opt=None, cycler=None, seed=0):
    """`steps` iterations of train.py's iteration (Trainer: switch, prefetch, step) on a fresh or given build."""
    torch.manual_seed(0)
    if model is None:
        model, opt, cycler = builder.build(cfg, 'cpu')
    losses = []
    trainer = Trainer(
        {**cfg, 'decay_lr': False}, model, opt, cycler, batches(seed), 'cpu'
    )  # at learning_rate throughout
    for it in range(steps):
        loss, _ = trainer.step()
        losses.append(loss.item())
    return model, opt, cycler, losses


PRECISIONS = [('amp', ''), ('bf16', ''), ('bf16_master', ''), ('bf16_master', 'cpu')]


@pytest.mark.parametrize('method', ['full', 'lisa_wor', 'galore'])
@pytest.mark.parametrize('state', omgd.STATE_POLICIES)
@pytest.mark.parametrize('precision, master_device', PRECISIONS)
def test_every_precision_state_and_method_trains(precision, master_device, state, method):
    cfg = train_defaults(
        **TINY,
        precision=precision,
        master_device=master_device,
        omgd_state=state,
        method=method,
        gradient_accumulation_steps=2,
    )
    model, opt, cycler, losses = train(cfg, 5)  # 3 switches under lisa_wor: 0, 2, 4
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    weights = {p.dtype for p in model.parameters()}
    assert weights == {torch.float32 if precision == 'amp' else torch.bfloat16}
    active = {p for i in cycler.active for p in cycler.units[i]} | {
        p for p in model.parameters() if p.requires_grad and not any(p is q for u in cycler.units for q in u)
    }
    for p, state_of_p in opt.state.items():
        moments = [v for k, v in state_of_p.items() if torch.is_tensor(v) and v.dim() > 0 and k != 'projector']
        # fp32 state exactly where a master is kept; bf16 training keeps bf16 moments
        assert {v.dtype for v in moments} == {torch.bfloat16 if precision == 'bf16' else torch.float32}
        assert ('master' in state_of_p) == (precision == 'bf16_master')
    with_state = {p for p in opt.state if any(torch.is_tensor(v) and v.dim() > 0 for v in opt.state[p].values())}
    if state == 'drop':  # exactly the active parameters hold optimizer state
        assert with_state == active
    elif state == 'offload':  # the frozen ones' state is parked, the active ones' is not
        parked = set(cycler.optimizer_state.offloaded)
        assert parked == with_state - active and not parked & active
    else:
        assert active <= with_state


@pytest.mark.parametrize('precision, master_device', PRECISIONS)
def test_offload_trains_bitwise_like_keep(precision, master_device):
    runs = {}
    for state in ('keep', 'offload'):
        cfg = train_defaults(**TINY, precision=precision, master_device=master_device, omgd_state=state)
        model, opt, _, losses = train(cfg, 5)  # switches at 0, 2, 4: the third brings back parked blocks here
        runs[state] = (losses, [p.detach().clone() for p in model.parameters()])
    assert runs['keep'][0] == runs['offload'][0]
    assert all(torch.equal(a, b) for a, b in zip(runs['keep'][1], runs['offload'][1]))


@pytest.mark.parametrize('scale_after_clip', [True, False])
def test_step_order_of_clip_and_scale(scale_after_clip):
    """One step by hand: clip the gradient norm, then scale the active blocks (or the other way)."""
    cfg = train_defaults(
        **TINY, grad_clip=0.05, optimizer='sgd', weight_decay=0.0, omgd_scale_after_clip=scale_after_clip
    )
    torch.manual_seed(0)
    model, opt, cycler = builder.build(cfg, 'cpu')
    cycler.step(0)
    X, Y, _ = next(batches())
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(X, Y)[1].backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    active = {n for n, p in model.named_parameters() if any(p is q for i in cycler.active for q in cycler.units[i])}
    scale = torch.tensor(cycler.scaling())

    def norm(g):
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(v) for v in g.values()]))

    if not scale_after_clip:
        grads = {n: g * scale if n in active else g for n, g in grads.items()}
    clip = torch.clamp(0.05 / (norm(grads) + 1e-6), max=1.0)
    grads = {n: g * clip for n, g in grads.items()}
    if scale_after_clip:
        grads = {n: g * scale if n in active else g for n, g in grads.items()}
    step_cfg = {**cfg, 'grad_clip': 0.05, 'omgd_scale_after_clip': scale_after_clip, 'gradient_accumulation_steps': 1}
    Trainer(step_cfg, model, opt, cycler, batches(), 'cpu').train_step(model)
    for n, p in model.named_parameters():
        expected = reference[n] - cfg['learning_rate'] * grads[n] if n in grads else reference[n]
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-7)


def test_memory_options_train_the_same():
    base = train_defaults(**TINY)
    _, _, _, reference = train(base, 5)
    for option in (
        dict(loss_chunk=24),
        dict(activation_offload=True),
        dict(activation_checkpointing=True),
        dict(activation_checkpointing=True, checkpoint_sublayers=True),
    ):
        model, _, _, losses = train({**base, **option}, 5)
        options = model.memory_options  # memory_options.apply's record of what it applied
        assert (
            options['loss_chunk'],
            options['activation_offload'],
            options['activation_checkpointing'],
            options['checkpoint_sublayers'],
        ) == (
            option.get('loss_chunk', 0),
            option.get('activation_offload', False),
            option.get('activation_checkpointing', False),
            option.get('checkpoint_sublayers', False),
        )
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    'cfg, message',
    [
        (dict(loss_chunk=-1), "loss_chunk must be >= 0 tokens"),
        (dict(precision='fp8'), "unknown precision 'fp8'; choose one of amp, bf16, bf16_master"),
        (dict(master_device='cuda'), "master_device must be '' (the weights' device) or 'cpu', got 'cuda'"),
        (
            dict(master_device='cpu'),
            "master_device='cpu' places fp32 master weights, which only "
            "precision='bf16_master' has; add --precision=bf16_master",
        ),
        (dict(precision='bf16', dtype='float16'), "dtype='float16' is the autocast dtype of precision='amp'"),
        (dict(precision='bf16_master', optimizer='sgd'), "precision='bf16_master' keeps AdamW's fp32 master weights"),
        (dict(method='lisa_wr'), f"unknown method 'lisa_wr'; choose one of {', '.join(train_config.METHOD_NAMES)}"),
    ],
)
def test_impossible_combinations_are_refused(cfg, message):
    with pytest.raises(ValueError) as e:
        train_config.check(train_defaults(**cfg))
    assert str(e.value).startswith(message) and '\n' not in str(e.value)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    'arch_args',
    [dict(arch='gpt2', bias=True), dict(arch='llama', n_head=4, n_kv_head=2), dict(arch='gpt2', tie_embeddings=False)],
    ids=['gpt2', 'llama-gqa', 'untied'],
)
def test_new_model_has_the_weights_of_a_cpu_fp32_build(arch_args, dtype):
    """builder.new_model builds on meta and fills the tensors where they live, in their dtype;
    the weights, buffers and the RNG state after it are those of Transformer(config) on the CPU, cast."""
    from model import Transformer, TransformerConfig

    config = TransformerConfig(**{**dict(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=50), **arch_args})
    torch.manual_seed(3)
    reference = Transformer(config).to(dtype)
    rng_after_reference = torch.get_rng_state()
    torch.manual_seed(3)
    model = builder.new_model(config, 'cpu', dtype)
    assert torch.equal(torch.get_rng_state(), rng_after_reference)
    a, b = reference.state_dict(), model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert all(torch.equal(x, y) for x, y in zip(reference.buffers(), model.buffers()))
    assert (model.wte.weight is model.lm_head.weight) == config.tie_embeddings
    meta = builder.new_model(config, 'meta', dtype)  # shapes only
    assert {p.device.type for p in meta.parameters()} == {'meta'}


def test_new_model_drawn_on_the_device_is_initialised_like_a_cpu_build():
    """cpu_draws=False (the benchmarks) draws where the weights live, in their dtype: the same init
    (on a GPU other values; on the CPU bf16 draws happen to equal fp32 draws cast)."""
    from model import TransformerConfig

    config = TransformerConfig(n_layer=2, n_head=2, n_embd=64, block_size=16, vocab_size=64)
    torch.manual_seed(3)
    reference = builder.new_model(config, 'cpu', torch.bfloat16)
    torch.manual_seed(3)
    model = builder.new_model(config, 'cpu', torch.bfloat16, cpu_draws=False)
    assert model.wte.weight is model.lm_head.weight
    a, b = reference.state_dict(), model.state_dict()
    for k in a:  # zeros stay zeros, ones ones, and the random ones have the same spread
        assert b[k].dtype == torch.bfloat16 and torch.isfinite(b[k].float()).all(), k
        assert (
            abs(a[k].float().std().nan_to_num() - b[k].float().std().nan_to_num())
            < 0.2 * a[k].float().std().nan_to_num() + 1e-6
        ), k


@pytest.mark.once  # the code map's claim, pure Python (sys.setprofile); the loop is tested above on every torch
def test_one_iteration_reads_five_files(tmp_path):
    """The loop's iterations, switches and dropped optimizer state included, call into five of the
    project's files (train, trainer, omgd, model, dataloader), as the README says, and an iteration
    that logs or records (its log line, a switch's) into infra/metrics.py besides; torchrun's iteration:
    test_ddp.py::test_a_torchrun_iteration_reads_the_five_files_and_distributed_py."""
    status, files = files_per_iteration([*TINY_ARGS, f'--out_dir={tmp_path}', '--max_iters=8', '--omgd_state=drop'])
    assert status == 0
    assert files == LOGGED_ITERATION_FILES  # log_interval=1: every iteration logs
    # iterations 8 and 9 of the resumed run neither log (log_interval=100), nor switch (at 6, then 9: after the
    # last traced step), nor evaluate: the five files, and nothing else
    status, files = files_per_iteration(
        [
            *TINY_ARGS,
            f'--out_dir={tmp_path}',
            '--max_iters=10',
            '--init_from=resume',
            '--log_interval=100',
            '--omgd_state=drop',
        ]
    )
    assert status == 0
    assert files == ITERATION_FILES


def test_step_runs_the_iteration_it_is_given_with_the_micro_steps_it_is_given():
    """step(iter_num, micro_steps), as the benchmarks jump to a switch: that iteration's learning
    rate and switch, that many micro-batches; the next plain step() continues from there."""
    cfg = train_defaults(**{**TINY, "omgd_period": 3}, warmup_iters=2, lr_decay_iters=20)
    torch.manual_seed(0)
    model, opt, cycler = builder.build(cfg, 'cpu')
    trainer = Trainer(cfg, model, opt, cycler, batches(), 'cpu', grad_accum=2)
    _, switched = trainer.step(6, micro_steps=3)
    assert switched and cycler.last_switch == 6 and trainer.iter_num == 7
    assert opt.param_groups[0]['lr'] == get_lr(6, cfg)
    assert trainer.data_position == 3  # batches 0-2 trained, batch 3 fetched ahead
    _, switched = trainer.step()
    assert not switched and trainer.iter_num == 8 and opt.param_groups[0]['lr'] == get_lr(7, cfg)
    assert trainer.data_position == 5  # grad_accum=2 micro-batches


def test_values_report_the_rate_each_group_applied():
    """The logged learning rate is read from the optimizer's groups, as applied: one `lr` when they agree (the
    schedule's rate), else one per group, named by its index (a group's lr_scale scales the schedule)."""
    cfg = train_defaults(**TINY, warmup_iters=2, lr_decay_iters=20)
    torch.manual_seed(0)
    model, opt, cycler = builder.build(cfg, 'cpu')
    trainer = Trainer(cfg, model, opt, cycler, batches(), 'cpu')
    for it in range(3):
        trainer.step()
        assert trainer.values() == {'lr': get_lr(it, cfg)}
    opt.param_groups[1]['lr_scale'] = 0.5
    trainer.step()
    assert trainer.values() == {'lr_g0': get_lr(3, cfg), 'lr_g1': get_lr(3, cfg) * 0.5}
    assert [g['lr'] for g in opt.param_groups] == list(trainer.values().values())
