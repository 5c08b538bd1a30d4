"""The torch versions the code supports (requirements.txt: the tested range, torch 2.9.1 to 2.14; .ci/run
runs the suite on every minor release of it): the APIs it relies on exist, and where the API changed inside
the range, the code picks what the installed torch has. Fake torch classes stand in for the versions
that are not installed."""

import importlib
import inspect
import os
import re

import pytest
import torch
import torch.distributed as dist

from infra import ddp_check, distributed
from infra.distributed import Ranks, no_buffer_sync, wrap_ddp


class DDP211:
    """torch 2.11's DistributedDataParallel signature (no forward_sync_buffers); records its arguments."""

    def __init__(
        self,
        module,
        device_ids=None,
        output_device=None,
        dim=0,
        broadcast_buffers=True,
        init_sync=True,
        process_group=None,
        bucket_cap_mb=None,
        find_unused_parameters=False,
        check_reduction=False,
        gradient_as_bucket_view=False,
        static_graph=False,
        delay_all_reduce_named_params=None,
        param_to_hook_all_reduce=None,
        mixed_precision=None,
        device_mesh=None,
        skip_all_reduce_unused_params=False,
    ):
        self.kwargs = dict(
            device_ids=device_ids,
            broadcast_buffers=broadcast_buffers,
            init_sync=init_sync,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )


class DDP213(DDP211):
    """torch 2.13's: forward_sync_buffers added, broadcast_buffers deprecated (a FutureWarning when given)."""

    def __init__(
        self,
        module,
        device_ids=None,
        broadcast_buffers=None,
        init_sync=True,
        gradient_as_bucket_view=False,
        forward_sync_buffers=None,
    ):
        if broadcast_buffers is not None:
            raise AssertionError('broadcast_buffers is deprecated in torch 2.13')
        self.kwargs = dict(
            device_ids=device_ids,
            forward_sync_buffers=forward_sync_buffers,
            init_sync=init_sync,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )


@pytest.mark.parametrize(
    'ddp, sync_off', [(DDP211, {'broadcast_buffers': False}), (DDP213, {'forward_sync_buffers': False})]
)
def test_ddp_is_built_with_the_arguments_of_the_installed_torch(ddp, sync_off, monkeypatch):
    """forward_sync_buffers is new in torch 2.13 (torch 2.9 to 2.12 raise TypeError on it: every DDP run
    crashed); broadcast_buffers=False says the same before, and is deprecated from 2.13."""
    monkeypatch.setattr(torch.nn.parallel, 'DistributedDataParallel', ddp)
    wrapper = wrap_ddp(torch.nn.Linear(2, 2), Ranks(enabled=True, world_size=2), 'cpu', init_sync=False)
    assert wrapper.kwargs == {'device_ids': None, 'init_sync': False, 'gradient_as_bucket_view': True, **sync_off}


def test_the_installed_ddp_takes_what_wrap_ddp_passes():
    accepted = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    assert {'init_sync', 'gradient_as_bucket_view', *no_buffer_sync(torch.nn.parallel.DistributedDataParallel)} <= set(
        accepted
    )


def test_counted_reduce_scatter_calls_the_collective_the_installed_torch_has(monkeypatch):
    """FSDP2's reduce-scatter, counted by ddp_check: dist.reduce_scatter_single from torch 2.13, which
    torch 2.9 to 2.12 do not have (every --ddp_check FSDP run crashed there): reduce_scatter_tensor there."""
    calls = []
    monkeypatch.delattr(dist, 'reduce_scatter_single', raising=False)  # as in torch 2.9 to 2.12
    monkeypatch.setattr(
        dist,
        'reduce_scatter_tensor',
        lambda output, input, op, group, async_op: calls.append(('tensor', output, input, op, group, async_op)),
        raising=False,
    )
    counter = {'calls': 0, 'elements': 0}
    comm = ddp_check.CountedReduceScatter(counter)
    out, inp = torch.zeros(2), torch.ones(4)
    comm(out, inp, 'group', 'sum', async_op=True)
    assert calls == [('tensor', out, inp, 'sum', 'group', True)] and counter == {'calls': 1, 'elements': 4}
    monkeypatch.setattr(
        dist,
        'reduce_scatter_single',
        lambda output, input, op, group, async_op: calls.append(('single', output, input, op, group, async_op)),
        raising=False,
    )  # torch 2.13
    comm(out, inp, 'group', 'sum')
    assert calls[-1] == ('single', out, inp, 'sum', 'group', False) and counter == {'calls': 2, 'elements': 8}


def test_a_single_rank_gloo_reduce_scatter_through_the_counted_collective():
    """The real collective of the installed torch, on a one-rank gloo group: the shard is the input."""
    if dist.is_initialized():
        pytest.skip('a process group exists already')
    dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)
    try:
        counter = {'calls': 0, 'elements': 0}
        out = torch.zeros(3)
        ddp_check.CountedReduceScatter(counter)(out, torch.arange(3.0), dist.group.WORLD, dist.ReduceOp.SUM)
        assert torch.equal(out, torch.arange(3.0)) and counter == {'calls': 1, 'elements': 3}
    finally:
        dist.destroy_process_group()


# every torch API of the code whose presence depends on the version, by where it is used
APIS = [
    ('torch.distributed.fsdp', 'fully_shard'),  # distributed.shard_fsdp (public from torch 2.6)
    ('torch.distributed.fsdp', 'MixedPrecisionPolicy'),
    ('torch.distributed.fsdp', 'FSDPModule.set_custom_reduce_scatter'),  # ddp_check
    ('torch.distributed.fsdp', 'FSDPModule.set_requires_gradient_sync'),  # distributed.ParallelModel.sync
    ('torch.distributed.fsdp', 'FSDPModule.reshard'),  # distributed.reshard_fsdp
    ('torch.distributed.fsdp', 'FSDPModule._get_fsdp_state'),  # distributed.shard_fsdp's early lazy init
    ('torch.distributed.fsdp._fully_shard._fsdp_state', 'FSDPState._lazy_init'),
    ('torch.distributed.fsdp._fully_shard._fsdp_api', 'ReduceScatter'),  # ddp_check.CountedReduceScatter
    ('torch.distributed.device_mesh', 'init_device_mesh'),
    ('torch.distributed.checkpoint.state_dict', 'get_model_state_dict'),  # distributed.full_state_dicts
    ('torch.distributed.checkpoint.state_dict', 'get_optimizer_state_dict'),
    ('torch.distributed.checkpoint.state_dict', 'set_optimizer_state_dict'),
    ('torch.distributed.checkpoint.state_dict', 'StateDictOptions'),
    ('torch.distributed.algorithms.ddp_comm_hooks.default_hooks', 'allreduce_hook'),  # ddp_check
    ('torch.compiler', 'disable'),  # memory_options.compile_blocks
    ('torch.amp', 'is_autocast_available'),  # model.AUTOCAST_DEVICE_TYPES, memory_options.ChunkedLinearCE
    ('torch', 'get_autocast_dtype'),
    ('torch.nn', 'RMSNorm'),  # model.py (LLaMA)
    ('torch.nn.functional', 'rms_norm'),  # memory_estimate.MetaAsCuda
    ('torch.nn.Module', 'compile'),  # memory_options.compile_blocks
    ('torch.autograd.graph', '_engine_run_backward'),  # memory_estimate.MetaAsCuda.backward
    ('torch.autograd.graph', 'saved_tensors_hooks'),  # memory_options.OffloadActivations
    ('torch.utils._python_dispatch', 'TorchDispatchMode'),  # memory_estimate.LiveBytes, builder.RandomOnCPU
    ('torch.overrides', 'TorchFunctionMode'),  # memory_estimate.MetaAsCuda
    ('torch._dynamo.config', 'recompile_limit'),  # tests/test_compile.py
    ('torch._dynamo.config', 'fail_on_recompile_limit_hit'),
]


@pytest.mark.parametrize('module, name', APIS)
def test_the_installed_torch_has_every_api_the_code_uses(module, name):
    obj = importlib.import_module(module) if not module.endswith('.Module') else torch.nn.Module
    for part in name.split('.'):
        assert hasattr(obj, part), f"torch {torch.__version__} has no {module}.{name}"
        obj = getattr(obj, part)


def test_keyword_arguments_the_code_passes():
    """Keyword arguments that older torch versions lack."""
    assert 'mmap' in inspect.signature(torch.load).parameters  # checkpoint.read
    q, kv = torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 2, 8)  # model.py's grouped-query attention
    assert torch.nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True).shape == q.shape
    assert 'init_sync' in inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    assert 'recursive' in inspect.signature(torch.compiler.disable).parameters


def test_fsdp_optimizer_state_loads_with_parameters_that_have_none():
    """A checkpoint of layer cycling under omgd_state='drop' holds no state for the frozen blocks. train.py
    loads the optimizer before the cycler, while every parameter still requires grad: torch 2.9's
    set_optimizer_state_dict then raised KeyError for the first such parameter (2.10 skips it).
    On a one-rank gloo group, in this process."""
    import itertools

    from conftest import train_defaults

    import builder
    from trainer import Trainer

    if dist.is_initialized():
        pytest.skip('a process group exists already')
    dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)
    try:
        ranks = Ranks(True, 0, 0, 1, dist.group.WORLD)
        cfg = train_defaults(
            n_layer=4, n_head=2, n_embd=16, block_size=8, vocab_size=32, omgd_gamma=2, omgd_period=1, omgd_state='drop'
        )

        def build():
            torch.manual_seed(0)
            return builder.build(cfg, 'cpu', shard=lambda m: distributed.shard_fsdp(m, ranks, 'cpu', None))

        model, opt, cycler = build()
        x = torch.randint(32, (2, 8))
        trainer = Trainer(cfg, model, opt, cycler, itertools.repeat((x, x, None)), 'cpu')
        for _ in range(2):
            trainer.step()
        _, saved = distributed.full_state_dicts(model, opt)
        n_params = sum(len(g['params']) for g in saved['param_groups'])
        assert 0 < len(saved['state']) < n_params  # the frozen blocks have none
        fresh, fresh_opt, _ = build()
        assert all(p.requires_grad for p in fresh.parameters())
        distributed.load_optimizer_state(fresh, fresh_opt, saved)
        assert all(p.requires_grad for p in fresh.parameters())  # as they were
        _, loaded = distributed.full_state_dicts(fresh, fresh_opt)
        assert loaded['state'].keys() == saved['state'].keys()
        for i, state in saved['state'].items():
            for key, value in state.items():
                assert torch.equal(torch.as_tensor(loaded['state'][i][key]), torch.as_tensor(value)), (i, key)
    finally:
        dist.destroy_process_group()


def test_ci_runs_the_suite_on_every_torch_of_the_supported_range():
    """The supported range (requirements.txt) is the tested range: .ci/run's versions are the lower
    bound and one release of every minor version up to the upper bound."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    low, high = re.search(
        r'^torch>=([\d.]+),<([\d.]+)', open(os.path.join(root, 'requirements.txt')).read(), re.M
    ).groups()
    run = open(os.path.join(root, '.ci', 'run')).read()
    versions = [
        re.search(r'^NEWEST=([\d.]+)', run, re.M).group(1),
        *re.search(r'^OTHERS="([\d. ]+)"', run, re.M).group(1).split(),
    ]
    minor = lambda v: tuple(int(part) for part in v.split('.')[:2])
    (major, first), (_, last) = minor(low), minor(high)
    assert sorted(minor(v) for v in versions) == [(major, m) for m in range(first, last)], versions
    assert low in versions  # the bound itself, not another release of its minor


def test_every_test_file_runs_on_every_torch_or_once_by_the_rule():
    """CI's rule (tests/conftest.py): every test file is in EVERY_TORCH or in ONCE, not both; a file that launches
    torchrun, uses torch.distributed or compiles is version-sensitive, so never in ONCE; .ci/torch deselects the
    ONCE files on the other versions and .ci/run runs the whole suite on NEWEST."""
    import conftest

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = {n for n in os.listdir(os.path.join(root, 'tests')) if n.startswith('test_') and n.endswith('.py')}
    assert not conftest.EVERY_TORCH & conftest.ONCE
    assert conftest.EVERY_TORCH | conftest.ONCE == files, sorted(files ^ (conftest.EVERY_TORCH | conftest.ONCE))
    sensitive = re.compile(r'\bTORCHRUN\b|torchrun_train|mark\.torchrun|torch\.distributed|\bdist\.|torch\.compile\(')
    for name in conftest.ONCE:
        found = sensitive.search(open(os.path.join(root, 'tests', name)).read())
        assert not found, f"{name} uses {found.group()}: version-sensitive, it belongs in EVERY_TORCH"
    torch_ci = open(os.path.join(root, '.ci', 'torch')).read()
    assert re.search(r"^[^#]*python -m pytest .*-m 'not once'", torch_ci, re.M), 'the other versions run all but once'
    newest = [
        line.split('python -m pytest')[1]
        for line in open(os.path.join(root, '.ci', 'run'))
        if 'python -m pytest' in line
    ]
    assert newest and all(' -m ' not in args and ' -k ' not in args for args in newest), newest


@pytest.mark.once  # pytest's marker selection, pure Python: two pytest processes (16 s) that no torch version changes
def test_not_once_deselects_the_files_of_once_and_only_those():
    """What .ci/torch runs on the other versions, collected for one file of each set: pytest -m 'not once' keeps
    this file's tests and drops test_defaults.py's (ONCE); -m once the other way round."""
    import subprocess
    import sys

    import conftest

    assert 'test_defaults.py' in conftest.ONCE and 'test_compat.py' in conftest.EVERY_TORCH
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = ['tests/test_defaults.py', 'tests/test_compat.py']
    this = 'tests/test_compat.py::test_not_once_deselects_the_files_of_once_and_only_those'
    collected = {}
    for expr in ('not once', 'once'):
        out = subprocess.run(
            [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '--collect-only', '-m', expr, *files],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout
        ids = {line.strip() for line in out.splitlines() if '::' in line}
        collected[expr] = {i if i == this else i.split('::')[0] for i in ids}
    # this test is marked once itself (it checks pytest's markers): -m once collects it beside test_defaults.py
    assert collected == {'not once': {'tests/test_compat.py'}, 'once': {'tests/test_defaults.py', this}}, collected
    assert os.path.isdir(conftest.TEST_DATA_ROOT)  # a pytest started here leaves this one's prepared datasets
