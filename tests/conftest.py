"""Helpers shared by several test files (no test file imports another)."""

import contextlib
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Datasets are prepared in a temporary folder (dataloader.DATA_ROOT), never in the checkout's data/:
# a user's data/shakespeare prepared from their own text must survive the tests. Set before any
# project module is imported; subprocesses (torchrun, signals) inherit it.
# A torchrun worker that imports this file keeps the folder of the pytest process that started it; each
# pytest-xdist worker (tests -n 2) makes its own, as two workers preparing one dataset at once would collide.
_OWNER = os.environ.get('PYTEST_XDIST_WORKER', 'pytest')
_INHERITED = os.environ.get('OMGD_TEST_DATA_OWNER', _OWNER) == _OWNER and os.environ.get('OMGD_TEST_DATA_ROOT')
TEST_DATA_ROOT = _INHERITED or tempfile.mkdtemp(prefix='omgd-test-data-')
os.environ['OMGD_DATA_ROOT'] = os.environ['OMGD_TEST_DATA_ROOT'] = TEST_DATA_ROOT
os.environ['OMGD_TEST_DATA_OWNER'] = _OWNER


def data_files():
    """{path: (size, mtime)} of what the prepare scripts write into the checkout's data/."""
    found = {}
    for folder, _, names in os.walk(os.path.join(ROOT, 'data')):
        for name in names:
            if name.endswith(('.bin', '.pkl')):
                path = os.path.join(folder, name)
                found[path] = (os.path.getsize(path), os.path.getmtime(path))
    return found


_DATA_BEFORE = data_files()


def pytest_sessionfinish(session, exitstatus):
    """Fail the run when a test wrote into the checkout's data/ (then remove the temporary data this process made:
    a pytest a test starts, tests/test_compat.py's, leaves its parent's)."""
    if not _INHERITED:
        shutil.rmtree(TEST_DATA_ROOT, ignore_errors=True)
    changed = sorted(set(data_files().items()) ^ set(_DATA_BEFORE.items()))
    if changed:
        print(f"\nerror: the tests changed the checkout's data/: {sorted({p for p, _ in changed})}", file=sys.stderr)
        session.exitstatus = 1


# What runs on every torch of .ci/run's range, what once (on NEWEST): a file whose tests exercise torch APIs that
# changed across the range (torch.distributed, DCP, FSDP2, DDP, torch.compile, torch.load's weights_only and mmap,
# the optimizers' arithmetic, SDPA, autocast, the offload, the memory tools, train.py's exact resume) runs on every
# version; one of pure-Python logic (configs, docs, reports, experiments' statistics, data preparation, error
# lines of the scripts' own checks) is marked `once`, and .ci/torch deselects it with -m 'not once'. A test of such
# logic in an EVERY_TORCH file carries @pytest.mark.once itself.
# tests/test_compat.py checks that every test file is in exactly one of the two.
EVERY_TORCH = {
    'test_bad_inputs.py',  # damaged and foreign checkpoints through torch.load(weights_only=True)
    'test_bench.py',
    'test_bench_shared_step.py',
    'test_checkpoint.py',
    'test_compat.py',
    'test_compile.py',
    'test_dcp.py',
    'test_dcp_untrusted.py',
    'test_ddp.py',
    'test_forked_launch.py',
    'test_fsdp.py',
    'test_fsdp_one_rank.py',
    'test_galore.py',
    'test_generate.py',
    'test_gpu.py',
    'test_hang.py',
    'test_hf.py',
    'test_loss.py',
    'test_memory.py',
    'test_model.py',
    'test_omgd.py',
    'test_optim.py',
    'test_optimizer_offload.py',
    'test_rank_agreement.py',
    'test_restart.py',
    'test_resume.py',
    'test_train.py',
    'test_trainer.py',
}
ONCE = {
    'test_compare.py',
    'test_configurator.py',
    'test_data_prepare.py',
    'test_dataloader.py',
    'test_defaults.py',
    'test_eval.py',
    'test_faults.py',
    'test_foreign_files.py',
    'test_fork_edits.py',
    'test_layers.py',
    'test_linreg.py',
    'test_metrics.py',
    'test_mfu.py',
    'test_precision.py',
    'test_readme.py',
    'test_replication.py',
    'test_sample.py',
    'test_study.py',
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in ONCE:
            item.add_marker(pytest.mark.once)
    # .ci runs two workers a file at a time in this order (--no-loadscope-reorder): the files that launch torchrun
    # first, then by their number of tests, so that the end is small files on both workers, not test_fsdp.py on one
    weight = {}
    for item in items:
        launches, tests = weight.get(item.path, (0, 0))
        weight[item.path] = (launches + bool(item.get_closest_marker('torchrun')), tests + 1)
    items.sort(key=lambda item: tuple(-n for n in weight[item.path]))


# -----------------------------------------------------------------------------
# train.py in one process (tests/test_train.py, tests/test_sample.py)

TINY = [
    '--n_layer=4',
    '--n_head=2',
    '--n_embd=32',
    '--block_size=32',
    '--batch_size=8',
    '--eval_iters=2',
    '--log_interval=1',
    '--sample_tokens=0',
    '--compile=False',
    '--omgd_gamma=2',
    '--omgd_period=3',
    '--warmup_iters=2',
    '--lr_decay_iters=100',
    '--device=cpu',  # a CPU test on a GPU machine too (the CUDA tests say --device=cuda)
]


def run_script(script, argv):
    """Run a script of the repository in this process, as `python script *argv` would, and return
    a CompletedProcess (exit status, stdout, stderr). In-process saves starting Python and torch
    for each run; where the process itself is under test (signals, torchrun), tests start one."""
    import runpy

    out, err, code = io.StringIO(), io.StringIO(), 0
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    saved_argv, cwd = sys.argv, os.getcwd()
    sys.argv = [script, *argv]
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(os.path.join(ROOT, script), run_name='__main__')
            except SystemExit as e:  # what the interpreter would print and return
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                traceback.print_exc()  # a traceback, as the process would print it: tests assert there is none
                code = 1
    finally:
        sys.argv = saved_argv
        os.chdir(cwd)
        for s, handler in handlers.items():
            signal.signal(s, handler)
    return subprocess.CompletedProcess([script, *argv], code, out.getvalue(), err.getvalue())


def run_train(*args, expect_ok=True):
    """train.py with TINY and args, in this process (run_script)."""
    result = run_script('train.py', [*TINY, *args])
    if expect_ok:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result


def files_per_iteration(argv, run=None):
    """The project files whose functions train.py calls from the first Trainer.step to the end of
    the last one (the loop's work between steps included: stop agreement, logging, records),
    found with sys.setprofile while train.main(argv) runs in this process. Generators count when
    resumed (the data iterator). Returns (exit status, sorted paths relative to the checkout)."""
    import train
    from trainer import Trainer

    step, root = Trainer.step.__code__, os.path.realpath(ROOT) + os.sep
    calls, marks = [], []  # the file of every project call; where each step began and ended

    def profile(frame, event, arg):
        if event == 'call':
            path = frame.f_code.co_filename  # '<frozen abc>', '<string>': not a file
            path = os.path.realpath(path) if os.path.isabs(path) else ''
            if path.startswith(root) and not path.startswith(os.path.join(root, 'tests')):
                calls.append(path[len(root) :])
        if frame.f_code is step and event in ('call', 'return'):
            marks.append(len(calls) - (event == 'call'))

    def traced(*args, **kwargs):  # the profile starts at the first step: the set-up before it is not traced (time)
        if sys.getprofile() is None:
            sys.setprofile(profile)
        return step_function(*args, **kwargs)

    step_function, Trainer.step = Trainer.step, traced
    try:
        status = (run or train.main)(argv)
    finally:
        sys.setprofile(None)
        Trainer.step = step_function
    assert len(marks) >= 2, "Trainer.step never ran"
    return status, sorted(set(calls[marks[0] : marks[-1]]))


# README "Code map": the files an iteration calls into (train.py's loop, Trainer.step, the cycler, the forward
# and backward, the next batch). An iteration that logs or writes a record (its log line, a switch's line: the
# records of out_dir/metrics.jsonl) calls infra/metrics.py too, on every rank (rank 0 prints and writes), so a run
# that logs every iteration (log_interval=1) calls into LOGGED_ITERATION_FILES.
ITERATION_FILES = ['dataloader.py', 'model.py', 'omgd.py', 'train.py', 'trainer.py']
LOGGED_ITERATION_FILES = sorted([*ITERATION_FILES, 'infra/metrics.py'])


def assert_one_line_error(result, pattern):
    assert result.returncode != 0
    assert 'Traceback' not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith('error: ') and re.search(pattern, last), last


def load(out_dir):
    """The checkpoint train.py wrote in out_dir, in ckpt.pt's format whatever was written: ckpt.pt, or
    the newest step folder (checkpoint_format='dcp', the default under torchrun) consolidated."""
    from infra import checkpoint

    return checkpoint.read_any(str(out_dir))[0]


def records(out_dir, kind):
    """train.py's records of one kind ('eval', 'iter', 'switch', 'save', 'end') in out_dir/metrics.jsonl:
    what a test reads of a run's numbers, rather than its printed log."""
    import json

    with open(os.path.join(out_dir, 'metrics.jsonl')) as f:
        return [r for r in map(json.loads, f) if r['kind'] == kind]


def copy_checkpoint(src, dst):
    """Copy out_dir `src`'s newest checkpoint (ckpt.pt or step folder) into out_dir `dst`."""
    from infra import checkpoint

    fmt, path, _ = checkpoint.find(str(src))
    os.makedirs(dst, exist_ok=True)
    if fmt == 'file':
        shutil.copyfile(path, os.path.join(dst, 'ckpt.pt'))
    else:
        shutil.copytree(path, os.path.join(dst, os.path.basename(path)))


def train_defaults(**overrides):
    """train.py's defaults (train_config.py), on CPU, with overrides."""
    import train_config

    return {**train_config.DEFAULTS, **train_config.machine_defaults(cuda=False), **overrides}


def cpu_checkpoint_after_one_step(cfg, path):
    """A checkpoint at `path` of cfg's model after one step on the CPU (optimizer state exists);
    returns (model, optimizer) as saved (tests/test_checkpoint.py, tests/test_gpu.py)."""
    import itertools

    import torch

    import builder
    from infra import checkpoint
    from infra.distributed import Ranks
    from trainer import Trainer

    torch.manual_seed(0)
    model, optimizer, cycler = builder.build(cfg, 'cpu')
    x = torch.randint(cfg['vocab_size'], (2, cfg['block_size']))
    Trainer(cfg, model, optimizer, cycler, itertools.repeat((x, x, None)), 'cpu').step()
    checkpoint.save(
        path,
        Ranks(),
        {'model': model, 'optimizer': optimizer, 'cycler': cycler},
        {'iter_num': 1, 'config': cfg, 'data': {}, 'model_args': builder.transformer_kwargs(cfg, cfg['vocab_size'])},
    )
    return model, optimizer


def tiny_model_config(arch, **kw):
    """A TransformerConfig of a tiny model of `arch` (tests/test_model.py, tests/test_memory.py); GPT-2 with biases."""
    from model import TransformerConfig

    return TransformerConfig(
        **{**dict(arch=arch, block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32, bias=True), **kw}
    )


TINY_MODELS = {
    'gpt2': lambda: tiny_model_config('gpt2'),
    'llama': lambda: tiny_model_config('llama', n_kv_head=2),  # grouped-query attention
}


def random_batch(cfg, b=2, t=None, seed=0):
    """(x, y) of random token ids for a model config."""
    import torch

    g = torch.Generator().manual_seed(seed)
    t = t or cfg.block_size
    x = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    y = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    return x, y


def assert_same_state(a, b):
    """Two train.py checkpoints hold bitwise the same model, optimizer, schedule and data position."""
    import torch

    assert a['iter_num'] == b['iter_num']
    for k in a['model']:
        assert torch.equal(a['model'][k], b['model'][k]), k
    assert a['optimizer']['state'].keys() == b['optimizer']['state'].keys()
    for index, s1 in a['optimizer']['state'].items():  # by parameter index: insertion orders may differ
        s2 = b['optimizer']['state'][index]
        assert s1.keys() == s2.keys()
        assert all(torch.equal(s1[k], s2[k]) if torch.is_tensor(s1[k]) else s1[k] == s2[k] for k in s1)
    ca, cb = a['cycler'], b['cycler']
    assert (ca['active'], ca['last_switch'], ca['schedule']['pending']) == (
        cb['active'],
        cb['last_switch'],
        cb['schedule']['pending'],
    )
    assert torch.equal(ca['schedule']['rng'], cb['schedule']['rng'])
    assert a['data'] == b['data']


# -----------------------------------------------------------------------------
# train.py under torchrun, two gloo ranks on CPU (tests/test_ddp.py, tests/test_fsdp.py)

DDP_TINY = [
    '--n_layer=4',
    '--n_head=2',
    '--n_embd=32',
    '--block_size=32',
    '--eval_iters=2',
    '--log_interval=1',
    '--sample_tokens=0',
    '--compile=False',
    '--omgd_gamma=2',
    '--omgd_period=3',
    '--warmup_iters=2',
    '--lr_decay_iters=100',
    '--eval_interval=1000',
    '--backend=gloo',
    '--device=cpu',  # else every rank takes cuda:LOCAL_RANK, and a forked worker cannot initialize CUDA at all
]
# 8 windows per iteration either way: 2 ranks x 2 micro-steps x 2 windows, or 1 rank x 2 x 4 (the
# same windows, dataloader.py); under 2 ranks each rank accumulates 2 micro-steps before syncing
TWO_RANKS = ['--batch_size=2', '--gradient_accumulation_steps=4']
ONE_RANK = ['--batch_size=4', '--gradient_accumulation_steps=2']
LINEAR = ['--optimizer=sgd', '--learning_rate=0.1', '--grad_clip=0']  # updates linear in the gradient
TORCHRUN = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2']
TIMEOUT = 300  # per launch; a hang fails the test instead of blocking CI (loaded machines: 150 s was seen to run out)


def descendants(pid):
    """Pids of all processes below `pid` (torchrun starts its workers in their own sessions)."""
    parent = {}
    for entry in os.listdir('/proc'):
        if entry.isdigit():
            try:
                with open(f'/proc/{entry}/stat') as f:
                    parent[int(entry)] = int(f.read().rsplit(')', 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        found += kids
        frontier = kids
    return found


def kill_tree(proc):
    for pid in descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()


class Watched:
    """wait_for() on a launch's live output: .out, running() and stop() are the launch's."""

    def wait_for(self, pattern, timeout=TIMEOUT):
        deadline = time.time() + timeout
        while time.time() < deadline:
            match = re.search(pattern, self.out)
            if match:
                return match
            if not self.running():
                break
            time.sleep(0.02)
        self.stop()
        pytest.fail(f"never printed {pattern!r}:\n{self.out[-3000:]}")


class Launch(Watched):
    """A subprocess whose merged output is collected by a thread, so a test can watch it live."""

    def __init__(self, cmd, env=None):
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    @property
    def out(self):
        return ''.join(self.lines)

    def wait(self, timeout=TIMEOUT):
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            self.proc.wait()
            pytest.fail(f"timed out after {timeout} s (hang?):\n{self.out[-3000:]}")
        self.reader.join(timeout=10)
        return self

    def running(self):
        return self.proc.poll() is None

    def stop(self):
        kill_tree(self.proc)


def torchrun_train(*args, ranks=2, expect_ok=True):
    """train.py with DDP_TINY: under torchrun on `ranks` ranks, or in this process (ranks=1, run_script: no
    start-up). Returns what has .out (the merged output) and .proc.returncode."""
    if ranks == 1:
        result = run_script('train.py', [*DDP_TINY, *args])
        run = types.SimpleNamespace(out=result.stdout + result.stderr, proc=result)
    else:
        run = forked_torchrun('train.py', *DDP_TINY, *args, ranks=ranks)
    if expect_ok:
        assert run.proc.returncode == 0, run.out[-3000:]
    return run


def forked_torchrun(script, *args, ranks=2, env=None, timeout=TIMEOUT, torchrun_args=(), during=None):
    """`torchrun --standalone --nproc_per_node=ranks *torchrun_args script *args` in this process: torchrun's own
    arguments, agent and rendezvous, its workers forked from a forkserver that imported train.py once. The command
    starts a Python and imports torch for the agent and each worker: 12 s (18 s of CPU) for 1 iteration on the 2-core
    machine, quiet; this 2.5 s for 2 iterations, after a pytest process's first launch. during(launch), if given,
    runs in a thread while the workers run (the agent keeps this one: its signal handlers). A signal sent to torchrun
    itself is tested on the command (Launch). Workers run on the CPU (DDP_TINY); the forkserver asks NVML, not CUDA,
    whether there is a GPU: a child forked after CUDA's initialization cannot use it, and AdamW asks CUDA even of
    CPU parameters (its graph-capture check). Returns the ForkedLaunch."""
    import multiprocessing

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    multiprocessing.set_forkserver_preload(['conftest', 'train'])
    saved_env = dict(os.environ)  # the agent sets variables and signal handlers in its process: this one's
    os.environ['PYTORCH_NVML_BASED_CUDA_CHECK'] = '1'  # for the forkserver this launch may start
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    launch = ForkedLaunch(ranks)
    # --standalone, as torchrun's run() spells it out before config_from_args
    rendezvous = ['--rdzv_backend=c10d', '--rdzv_endpoint=localhost:0', f'--rdzv_id={uuid.uuid4()}']
    argv = [*rendezvous, f'--nproc_per_node={ranks}', '--start_method=forkserver', *torchrun_args, script, *args]
    watchdog = threading.Timer(timeout, launch.time_out, args=(timeout,))
    watchdog.start()
    if during:
        launch.watched.clear()
        threading.Thread(target=launch.watch, args=(during,), daemon=True).start()
    try:
        config, _, _ = config_from_args(parse_args(argv))
        elastic_launch(config, forked_worker)(script, list(args), env or {}, launch.path)
        launch.proc.returncode = 0
    except ChildFailedError as e:  # the command prints it and exits 1
        launch.proc.returncode, launch.summary = 1, f"{type(e).__name__}: {e}"
    finally:
        launch.ended.set()
        watchdog.cancel()
        os.environ.clear()
        os.environ.update(saved_env)
        for s, handler in handlers.items():
            signal.signal(s, handler)
    launch.watched.wait()
    launch.close()
    if launch.failure:
        raise launch.failure
    return launch


def forked_worker(script, argv, env, out):
    """A worker of forked_torchrun: `python script *argv`, its output appended to `out`, which the ranks share as
    the command's workers share its stdout (line-buffered: a test waits for lines); its pid in out.rankN."""
    os.environ.update(env)
    with open(f"{out}.rank{os.environ['RANK']}", 'w') as f:
        f.write(str(os.getpid()))
    fd = os.open(out, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    sys.argv = [script, *argv]
    import runpy

    try:
        runpy.run_path(os.path.join(ROOT, script), run_name='__main__')
    except Exception:  # as the interpreter ends on one: sys.excepthook (torch.distributed's prints '[rankN]: ')
        sys.excepthook(*sys.exc_info())
        sys.exit(1)


class ForkedLaunch(Watched):
    """A forked_torchrun launch, as a test sees a Launch (.out, .proc.returncode, wait_for()), and worker_pids()."""

    def __init__(self, ranks):
        fd, self.path = tempfile.mkstemp(prefix='omgd-torchrun-', suffix='.log')
        os.close(fd)
        self.ranks, self.text, self.summary, self.failure = ranks, None, '', None
        self.proc = types.SimpleNamespace(returncode=None)
        self.ended, self.watched = threading.Event(), threading.Event()
        self.watched.set()

    @property
    def out(self):
        if self.text is None:  # running
            with open(self.path) as f:
                return f.read() + self.summary
        return self.text + self.summary

    def worker_pids(self):
        pids = {}
        for rank in range(self.ranks):
            with contextlib.suppress(OSError, ValueError), open(f'{self.path}.rank{rank}') as f:
                pids[rank] = int(f.read())
        return pids

    def running(self):
        return not self.ended.is_set()

    def watch(self, during):
        try:
            during(self)
        except BaseException as e:  # raised in the test's thread once the agent returns
            self.failure = e
            self.stop()
        finally:
            self.watched.set()

    def time_out(self, timeout):
        self.failure = pytest.fail.Exception(f"timed out after {timeout} s (hang?):\n{self.out[-3000:]}")
        self.stop()

    def stop(self):
        """Kill the workers (before they started: every process below this one): the agent returns."""
        workers = list(self.worker_pids().values())
        for pid in [*workers, *(p for w in workers for p in descendants(w))] or descendants(os.getpid()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def close(self):
        with open(self.path) as f:
            self.text = f.read()
        for path in [self.path, *(f'{self.path}.rank{r}' for r in range(self.ranks))]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


def stop_with_sigterm(out_dir, after, target, args, max_iters):
    """Resume in out_dir, send SIGTERM to `target` ('rank1' or 'torchrun', the command) once iteration `after`
    is logged; check that both ranks stopped at the same iteration and saved it. Returns it."""
    argv = ['train.py', *DDP_TINY, f'--out_dir={out_dir}', f'--max_iters={max_iters}', '--init_from=resume', *args]

    def stop(run):
        run.wait_for(rf'iter {after}: loss')
        os.kill(run.worker_pids()[1] if target == 'rank1' else run.proc.pid, signal.SIGTERM)

    if target == 'rank1':
        run = forked_torchrun(*argv, during=stop)
    else:
        run = Launch(TORCHRUN + argv)
        stop(run)
        run.wait()
    # the workers exit 143 (a preempted run is not a finished one, README); torchrun then exits 1
    assert run.proc.returncode == 1, run.out[-3000:]
    if target == 'rank1':  # the first worker to exit reports 143; torchrun may stop the other before it exits
        assert re.search(r'exitcode\s*: 143', run.out), run.out[-3000:]
    stops = re.findall(r'rank (\d): stop requested, stopping at iteration (\d+)', run.out)
    assert sorted(s[0] for s in stops) == ['0', '1'] and stops[0][1] == stops[1][1], run.out[-3000:]
    stopped = int(stops[0][1])
    assert after < stopped < max_iters, run.out[-3000:]
    assert re.search(rf'iter {stopped - 1}: loss', run.out) and not re.search(rf'iter {stopped}: loss', run.out)
    ckpt = load(out_dir)
    assert ckpt['iter_num'] == stopped and ckpt['world_size'] == 2
    return stopped
