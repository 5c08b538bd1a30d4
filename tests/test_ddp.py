"""train.py under DDP: two gloo ranks on CPU, launched the way the README says (torchrun).

What is checked, and how:
- `--ddp_check=True` makes every rank, after every optimizer step, report its active set, a
  SHA-256 of all its weights, whether the previous DDP wrapper is gone (freed by reference
  counting), whether its frozen parameters are bitwise unchanged since the switch, whether it holds
  gradients exactly for the active parameters, and which parameters and how many elements the DDP
  reducer's buckets hold; every rank compares all reports and the run fails on any mismatch.
  It also counts the bucket all-reduces of each step (one per bucket: only the last micro-step syncs).
- 2 ranks x 2 micro-steps x 2 windows against 1 rank x 2 micro-steps x 4 windows (the same
  windows, dataloader.py) with SGD and no clipping, which are linear in the gradient: a gradient
  summed instead of averaged would be off by 0.34 (measured as a doubled learning rate), where the
  reduction order alone costs 2.4e-7.
- Exact resume under two ranks through a normal end, a SIGTERM sent to a single worker and a
  SIGTERM sent to torchrun (which forwards it to every worker): both ranks stop at the same
  iteration, and the last resumed run ends bit for bit where a straight run ends.
- Resuming on another number of ranks: accepted when the data position allows, else one line.

torchrun's agent runs in the pytest process and forks its workers from a process that imported train.py
(conftest.forked_torchrun); the SIGTERM for torchrun itself goes to the command. One launch runs train.py several
times (this file's __main__): the checked run, the method sweep, the config's run, the straight run and the first
part of the resumed one; the one-rank runs run in the pytest process.
"""

import json
import os
import re
import shutil
import sys
import weakref
from functools import partial

import pytest
import torch
from conftest import (
    DDP_TINY as TINY,
)
from conftest import (
    ITERATION_FILES,
    LINEAR,
    ONE_RANK,
    ROOT,
    TWO_RANKS,  # noqa: F401
    assert_same_state,
    copy_checkpoint,
    files_per_iteration,
    forked_torchrun,
    load,
    records,
)
from conftest import (
    stop_with_sigterm as _stop_with_sigterm,
)
from conftest import (
    torchrun_train as train,
)

import omgd  # noqa: E402
from infra import ddp_check  # noqa: E402
from infra.distributed import Ranks  # noqa: E402
from model import Transformer, TransformerConfig  # noqa: E402

pytestmark = pytest.mark.torchrun  # launches torchrun (deselect with -m "not torchrun")


def lisa_active_elements(ckpt, trained_blocks=2):
    """Elements that train under LISA with the default omgd_always (every outer part): the whole
    model but the frozen blocks, counted on a GPT built from the checkpoint's model_args."""
    ref = Transformer(TransformerConfig(**ckpt['model_args']))
    total = sum(p.numel() for p in ref.parameters())  # parameters() dedupes the tied head
    return total, total - (len(ref.blocks) - trained_blocks) * sum(p.numel() for p in ref.blocks[0].parameters())


def test_two_ranks_stay_in_sync_and_match_one_rank(many_runs, tmp_path):
    root, logs = many_runs
    out, log = root / 'checked', logs['checked']
    switches = records(out, 'switch')
    assert [s['iter'] for s in switches] == list(range(0, 40, 3))
    assert all(s['ddp_rebuild_ms'] is not None and len(s['active']) == 2 for s in switches)
    # a ddp check line per switch and at the last iteration (checks run at every step; any
    # failure exits non-zero on every rank)
    checks = re.findall(
        r'iter (\d+): ddp check: 2 ranks agree on active \[(\d), (\d)\] and weights sha256 '
        r'[0-9a-f]{16}; (\d+) active elements, DDP buckets (\d+); one all-reduce per bucket; '
        r'frozen untouched, '
        r'no frozen gradients, old wrapper freed',
        log,
    )
    assert [int(c[0]) for c in checks] == list(range(0, 40, 3))  # 39, the last iteration, is a switch
    # ddp_check already fails the run unless the buckets hold exactly the parameters that require
    # grad; this checks that those are 2 blocks plus the outer parts, at every switch
    assert {int(c[3]) for c in checks} == {lisa_active_elements(load(out))[1]}
    assert [[int(a) for a in c[1:3]] for c in checks] == [s['active'] for s in switches]
    assert len(records(out, 'save')) == 1 and 'tokens per iteration: 256 (2 ranks)' in log

    one = tmp_path / 'one_rank'
    train(f'--out_dir={one}', '--max_iters=40', *LINEAR, *ONE_RANK, ranks=1)
    a, b = load(out), load(one)
    assert a['cycler']['active'] == b['cycler']['active'] and a['data'] == b['data']
    # Not bitwise: each rank averages 2 micro-steps of 2 windows and gloo averages the 2 ranks,
    # where one rank averages 2 micro-steps of 4 windows, so float32 rounding differs (observed
    # 2.4e-7, ~2 ulp at the weights' magnitude ~1.4). A gradient summed instead of averaged is 0.34.
    worst = max((a['model'][k] - b['model'][k]).abs().max().item() for k in a['model'])
    assert worst < 1e-5, worst
    losses = [[r['loss'] for r in records(d, 'iter')] for d in (out, one)]
    assert len(losses[0]) == 40 and losses[0] == pytest.approx(losses[1], abs=1e-5)  # the mean over ranks


def test_resume_on_another_number_of_ranks(many_runs, tmp_path):
    out = many_runs[0] / 'checked'
    first = load(out)
    assert first['world_size'] == 2 and first['data']['windows_per_step'] == 4
    # batch_size x ranks unchanged (4 x 1 for 2 x 2): same windows, the run goes on
    copy_checkpoint(out, tmp_path)  # the 2-rank run's sharded step folder, resharded to 1 rank
    run = train(f'--out_dir={tmp_path}', '--max_iters=43', '--init_from=resume', *LINEAR, *ONE_RANK, ranks=1)
    assert 'resuming a 2-rank checkpoint on 1 rank: same data position' in run.out
    after = load(tmp_path)
    assert after['iter_num'] == 43
    assert after['data']['windows_consumed'] == first['data']['windows_consumed'] + 3 * 8
    # another global batch (3 windows a micro-step): the next windows of the same order, none skipped
    run = train(f'--out_dir={tmp_path}', '--max_iters=45', '--init_from=resume', *LINEAR, '--batch_size=3', ranks=1)
    again = load(tmp_path)
    assert again['iter_num'] == 45 and again['data']['epoch'] == after['data']['epoch']
    assert again['data']['windows_consumed'] == after['data']['windows_consumed'] + 2 * 2 * 3


METHODS = ['full', 'lisa', 'lisa_scale', 'lisa_wor_noscale', 'tensor_wor', 'tensor_iid'] + (
    ['galore', 'golore'] if os.path.exists(os.path.join(ROOT, 'galore.py')) else []
)
RESUME = ['--dropout=0.1', '--omgd_period=4', *TWO_RANKS]  # AdamW; dropout: per-rank RNG streams
STRAIGHT = 40  # iterations of the straight run that the resumed runs must reproduce
CONFIG = 'config/shakespeare_lisa_wor.py'
SHORT = [  # its run shortened
    '--max_iters=2',
    '--eval_interval=2',
    '--eval_iters=1',
    '--n_layer=2',
    '--omgd_gamma=1',
    '--block_size=32',
    '--sample_tokens=0',
    '--compile=False',
    '--device=cpu',  # two ranks on a one-GPU machine too
]


@pytest.fixture(scope='module')
def many_runs(tmp_path_factory):
    """One torchrun launch: train.py run once per method, the checked run (LISA-wor, 40 iterations = 14
    switches, every invariant checked), config/shakespeare_lisa_wor.py shortened, the straight run of the
    resume test and its first part (a normal end at 10), and the run whose files are traced."""
    root = tmp_path_factory.mktemp('many')
    runs = [
        ('checked', [f'--out_dir={root / "checked"}', '--max_iters=40', '--ddp_check=True', *LINEAR, *TWO_RANKS]),
        ('config', [CONFIG, f'--out_dir={root / "config"}', *SHORT]),
    ]
    runs += [
        (
            m,
            [
                f'--out_dir={root / m}',
                f'--method={m}',
                '--max_iters=5',
                '--omgd_period=2',
                '--ddp_check=True',
                '--galore_rank=8',
                '--galore_update_proj_gap=2',
                *TWO_RANKS,
            ],
        )
        for m in METHODS
    ]
    runs.append(('straight', [f'--out_dir={root / "straight"}', f'--max_iters={STRAIGHT}', *RESUME]))
    runs.append(('first', [f'--out_dir={root / "first"}', '--max_iters=10', *RESUME]))
    # switches at 0 and 3; the save after the last step is traced too (not counted): ckpt.pt's costs less to trace
    runs.append(('files', [f'--out_dir={root / "files"}', '--max_iters=4', '--checkpoint_format=file', *TWO_RANKS]))
    run = forked_torchrun('tests/test_ddp.py', env={'DDP_TEST_RUNS': json.dumps(runs)})
    assert run.proc.returncode == 0, run.out[-3000:]
    logs = dict(re.findall(r'=== (\w+)\n(.*?)(?==== |\Z)', run.out, flags=re.S))
    return root, logs


@pytest.mark.parametrize('method', METHODS)
def test_every_method_under_two_ranks(many_runs, method):
    root, logs = many_runs
    log = logs[method]
    checks = re.findall(r'iter (\d+): ddp check: 2 ranks agree .* (\d+) active elements, DDP buckets (\d+);', log)
    assert checks, log
    # what trains (ddp_check has already matched the buckets to it): everything, 2 of 4 blocks
    # plus the outer parts, or some of the tensors
    total, lisa = lisa_active_elements(load(root / method))
    active = {int(c[1]) for c in checks}
    if method in ('full', 'galore', 'golore'):
        assert active == {total}
    elif method.startswith('lisa'):
        assert active == {lisa}
    else:
        assert max(active) < total
    if method in ('full', 'galore', 'golore'):  # never switch: one wrapper for the whole run
        assert [c[0] for c in checks] == ['4'] and records(root / method, 'switch') == []
    else:
        assert [c[0] for c in checks] == ['0', '2', '4'], log
        assert [s['iter'] for s in records(root / method, 'switch') if s['ddp_rebuild_ms'] is not None] == [0, 2, 4]
    assert load(root / method)['iter_num'] == 5


def test_a_torchrun_iteration_reads_the_five_files_and_distributed_py(many_runs):
    """Under DDP (a new wrapper at each switch, gradient sync, the stop agreement and the mean loss over
    ranks), every rank's iterations call into the five files of one process, and infra/distributed.py, where
    all of torchrun's work lives."""
    root, _ = many_runs
    assert [s['iter'] for s in records(root / 'files', 'switch')] == [0, 3]
    for rank in (0, 1):
        with open(root / 'files' / f'files_rank{rank}.json') as f:  # log_interval=1: each iteration logs
            assert json.load(f) == sorted([*ITERATION_FILES, 'infra/metrics.py', 'infra/distributed.py']), rank


def test_check_names_every_broken_invariant_on_any_rank():
    """ddp_check's Checker in one process, each invariant broken in turn, then a second rank's
    report faked: the problems name what failed, on whichever rank, and ranks that disagree."""
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(n_layer=4, n_head=2, n_embd=16, block_size=8, vocab_size=32, bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    cycler = omgd.build_cycler(model, opt, omgd.CyclerConfig('lisa_wor', gamma=2, period=3))
    cycler.step(0)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    checker = ddp_check.Checker(Ranks(), model)
    checker.on_switch(None)  # snapshots the frozen weights
    assert [p for p, _ in checker.frozen_snapshot] == frozen
    x = torch.randint(0, 32, (2, 8))
    model(x, x)[1].backward()
    opt.step()

    def problems(ranks=Ranks(), old_wrapper=None, kept_by_cycle=False):
        checker.ranks, checker.old_wrapper, checker.wrapper_in_gc_cycle = ranks, old_wrapper, kept_by_cycle
        return checker.check(None, opt, cycler, 'drop')[0]

    assert problems() == []
    alive = torch.nn.Module()
    assert problems(old_wrapper=weakref.ref(alive), kept_by_cycle=True) == [
        'the previous DDP wrapper is freed',
        'by reference counting, without gc.collect()',
    ]
    frozen[0].grad = torch.zeros_like(frozen[0])
    opt.state[frozen[0]] = {'step': torch.tensor(1.0)}
    assert problems() == [
        'gradients exist exactly for the active parameters',
        'optimizer state exists only for the active parameters',
    ]
    frozen[0].grad = None
    del opt.state[frozen[0]]
    with torch.no_grad():
        frozen[0].add_(1.0)
    assert problems() == ['frozen parameters are untouched']
    with torch.no_grad():
        frozen[0].sub_(1.0)
    assert problems() == []

    other_blocks = [i for i in range(4) if i not in cycler.active]

    class TwoRanks(Ranks):  # rank 1 reports other blocks, other weights and a failure
        def gather(self, obj):
            return [obj, {**obj, 'active': other_blocks, 'weights': '0' * 64, 'frozen parameters are untouched': False}]

    assert problems(TwoRanks(world_size=2)) == [
        'frozen parameters are untouched',
        'ranks differ in active',
        'ranks differ in weights',
    ]


stop_with_sigterm = partial(_stop_with_sigterm, args=RESUME, max_iters=STRAIGHT)


def test_resume_and_sigterm_continue_exactly(many_runs, tmp_path):
    root, _ = many_runs
    tmp_path = tmp_path / 'run'
    shutil.copytree(root / 'first', tmp_path)  # a normal end at 10 (many_runs), then resume
    assert load(tmp_path)['iter_num'] == 10
    first = stop_with_sigterm(tmp_path, after=12, target='rank1')  # one worker only, the other follows
    stop_with_sigterm(tmp_path, after=first + 2, target='torchrun')  # a preempted node: torchrun gets it
    # the resumed run ends where the straight run ends, bit for bit
    train(f'--out_dir={tmp_path}', f'--max_iters={STRAIGHT}', '--init_from=resume', *RESUME)
    assert_same_state(load(root / 'straight'), load(tmp_path))


if __name__ == '__main__':
    # torchrun worker of the `many_runs` fixture: run train.py once per (name, args) in
    # $DDP_TEST_RUNS, in this same process. Re-creating the process group between runs races
    # (a rank that finishes first would join the next group on stale rendezvous keys), so the
    # runs share one group, created here; train.py's own init and destroy become no-ops.
    import torch.distributed as dist

    sys.path.insert(0, ROOT)
    import train as train_script

    dist.init_process_group(backend='gloo')
    dist.init_process_group = dist.destroy_process_group = lambda *args, **kwargs: None
    for name, args in json.loads(os.environ['DDP_TEST_RUNS']):
        if os.environ.get('RANK') == '0':  # one write: under PYTHONUNBUFFERED, print's two let another rank's
            sys.stdout.flush()  # output in between ('=== fsdp[Gloo] Rank 3 ...'), and the run's log went unfound
            os.write(sys.stdout.fileno(), f"=== {name}\n".encode())
        argv = args if args[0].endswith('.py') else [*TINY, *args]  # a config file's run: as it is written
        if name == 'files':  # the files each rank's iterations call into
            status, files = files_per_iteration(argv)
            with open(os.path.join(args[0].split('=', 1)[1], f"files_rank{os.environ['RANK']}.json"), 'w') as out:
                json.dump(files, out)
        else:
            status = train_script.main(argv)
        if status:
            sys.exit(status)


def test_the_small_config_runs_on_two_ranks(many_runs):
    """config/shakespeare_lisa_wor.py runs under the torchrun command of its comment (its gradient_accumulation_steps
    is a multiple of 2 ranks), shortened here (in many_runs' launch)."""
    root, logs = many_runs
    assert (
        '# $ torchrun --standalone --nproc_per_node=2 train.py config/shakespeare_lisa_wor.py'
        in open(os.path.join(ROOT, CONFIG)).read()
    )
    # 2 micro-steps x 16 x 32
    assert re.search(r'tokens per iteration: 1,024 \(2 ranks', logs['config']), logs['config'][-3000:]
    assert load(root / 'config')['iter_num'] == 2


# once: check_parallel's refusal is pure Python (tests/test_train.py), and torchrun's summary of a one-line
# refusal (the error file) is checked on every torch by tests/test_rank_agreement.py
@pytest.mark.once
def test_a_refusal_under_two_ranks_is_one_line(tmp_path):
    """What 2 ranks cannot train is refused by one `error:` line, not one per rank (torchrun's own report of the
    failed workers follows it)."""
    refused = forked_torchrun('train.py', CONFIG, f'--out_dir={tmp_path}', *SHORT, '--gradient_accumulation_steps=3')
    errors = [line for line in refused.out.splitlines() if line.startswith('error: ')]
    assert refused.proc.returncode != 0 and len(errors) == 1, refused.out[-3000:]
    assert errors[0].startswith(
        "error: gradient_accumulation_steps=3 counts micro-steps summed over all ranks and "
        "must be a multiple of the 2 ranks, e.g. --gradient_accumulation_steps=4"
    ), errors
    # torchrun's failure summary that follows names the line as its root cause, not a link to its docs
    root_cause = refused.out[refused.out.rindex('Root Cause') :]
    assert f'traceback : {errors[0]}' in root_cause and 'To enable traceback' not in refused.out, root_cause
