"""
Launch train.py runs and collect what they logged: the one runner of experiments/compare.py and
experiments/study.py.

A run is a `python train.py ARGS` subprocess on the CPU (one OMP thread by default) in its own
folder RUNS/NAME, logging to RUNS/NAME/train.log; its curves are read from the records train.py
writes (RUNS/NAME/metrics.jsonl: evaluations, logged iterations, switches) into RUNS/NAME/result.json.
run_all runs a list of jobs N at a time and skips every job whose result.json exists without an
error, so an interrupted batch resumes where it stopped. SIGTERM or Ctrl-C stops the runs too
(run_child): no train.py outlives the script that started it, to collide with the next attempt.
"""

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# every run: eager CPU float32, no sample, a checkpoint only at the end (removed unless kept)
CPU_ARGS = ('--compile=False', '--sample_tokens=0', '--always_save_checkpoint=False', '--device=cpu', '--dtype=float32')


def read_records(out_dir):
    """Curves and timings of a run from the records train.py wrote (out_dir/metrics.jsonl)."""
    evals, iters, switches = [], [], []
    path = os.path.join(out_dir, 'metrics.jsonl')
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    {'eval': evals, 'iter': iters, 'switch': switches}.get(rec['kind'], []).append(rec)
                except (ValueError, KeyError, TypeError):  # a line cut by a killed run: the others still count
                    warn_once(path, f"{path}: skipped a line that is not a record ({line.strip()[:60]!r})")
    times = [r['ms'] for r in iters if r['iter'] > 0]  # the first logged iteration includes start-up work
    return {
        'eval_iters': [r['iter'] for r in evals],
        'train_loss': [r['train_loss'] for r in evals],
        'val_loss': [r['val_loss'] for r in evals],
        'log_iters': [r['iter'] for r in iters],
        'step_loss': [r['loss'] for r in iters],
        'median_ms_per_iter': statistics.median(times) if times else None,
        'last_logged_epoch': iters[-1]['epoch'] if iters else None,  # fraction of the training set's windows seen
        'switches': len(switches),
        'first_switches': [f"iter {r['iter']}: {r['description']}" for r in switches[:3]],
    }


def train_argv(args, out_dir):
    """train.py's arguments for a run of `args` (a list of '--key=value') in out_dir."""
    return [*CPU_ARGS, *args, f'--out_dir={out_dir}']


def warn_once(key, message):
    """A `warning: ...` line on stderr, once per key (files are read again and again)."""
    if key not in _warned:
        _warned.add(key)
        print(f"warning: {message}", file=sys.stderr, flush=True)


_warned = set()

# -----------------------------------------------------------------------------
# children that never outlive this process


class Stopped(Exception):
    """A run not started, or stopped, because this process got SIGTERM or SIGINT."""


_children = set()  # the running Popen objects of run_child
_stop = threading.Event()  # set by the first SIGTERM/SIGINT: no child starts after it
_stopped = {'signal': None, 'runs': 0, 'timer': None}
GRACE_S = 60  # a stopped train.py saves a checkpoint first; SIGKILL after this


def _signal_children(sig):
    for proc in list(_children):  # a copy: worker threads add and remove
        try:
            os.killpg(proc.pid, sig)  # its own process group: train.py and anything it started
        except (ProcessLookupError, PermissionError):
            pass


def _on_signal(signum, frame):
    if _stop.is_set():  # a second signal: no more waiting
        _signal_children(signal.SIGKILL)
        return
    _stopped.update(
        signal=signum, runs=len(_children), timer=threading.Timer(GRACE_S, _signal_children, (signal.SIGKILL,))
    )
    _stop.set()
    _signal_children(signal.SIGTERM)
    _stopped['timer'].daemon = True
    _stopped['timer'].start()


@contextlib.contextmanager
def children_stop_with_us():
    """While inside: SIGTERM or SIGINT to this process sends SIGTERM to every child of run_child (and
    SIGKILL after GRACE_S, or at a second signal) and lets no new one start (Stopped); once the block
    is left, one `error:` line and exit status 128 + the signal. A no-op off the main thread (signal
    handlers live there) or inside another such block."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is _on_signal:
        yield
        return
    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    except Stopped:  # a run cut short by the signal: the line below says so
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signum, runs = _stopped['signal'], _stopped['runs']
        if _stopped['timer'] is not None:
            _stopped['timer'].cancel()
        _stopped.update(signal=None, runs=0, timer=None)
        _stop.clear()
    if signum is not None:
        print(
            f"error: stopped by {signal.Signals(signum).name}: {runs} run(s) in progress stopped, none started "
            f"after it; run the same command again to resume (with the same runs folder, finished runs are "
            f"not run again)",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(128 + signum)


def run_child(cmd, **popen_kwargs):
    """subprocess.run(cmd, **popen_kwargs) for a child that must not outlive this process: in its own
    process group (a terminal's Ctrl-C reaches us, and we forward it once), stopped with us
    (children_stop_with_us). Raises Stopped when that has begun."""
    with children_stop_with_us():
        if _stop.is_set():
            raise Stopped(' '.join(cmd[:2]))
        proc = subprocess.Popen(cmd, start_new_session=True, **popen_kwargs)
        _children.add(proc)
        try:
            if _stop.is_set():  # the signal came as it started: the handler may have missed it
                _signal_children(signal.SIGTERM)
            out, err = proc.communicate()
        except BaseException:  # this thread is leaving (an exception): the child must not stay behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            _children.discard(proc)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def stopping():
    """Whether a SIGTERM/SIGINT is stopping this process's runs (a result now is not a run's own)."""
    return _stop.is_set()


def run_train(args, out_dir, max_iters, threads=1, keep_checkpoints=False):
    """One train.py run in out_dir (train.log there); returns the parsed log with returncode,
    wall_s, command and, when it failed or did not evaluate at max_iters, 'error'. Raises Stopped
    when a signal stops this process (children_stop_with_us)."""
    os.makedirs(out_dir, exist_ok=True)
    cmd = [sys.executable, 'train.py', *train_argv(args, out_dir)]
    env = dict(os.environ)
    if threads:
        env['OMP_NUM_THREADS'] = str(threads)
    t0 = time.time()
    with children_stop_with_us():
        with open(os.path.join(out_dir, 'train.log'), 'w') as log:
            proc = run_child(cmd, cwd=ROOT, stdout=log, stderr=subprocess.PIPE, text=True, env=env)
        if stopping():  # not the run's own end: its checkpoint would block the re-run, which starts afresh
            remove_checkpoints(out_dir)
            raise Stopped(out_dir)
    wall = time.time() - t0
    result = {
        'returncode': proc.returncode,
        'wall_s': round(wall, 1),
        'command': ' '.join(cmd[1:]),
        **read_records(out_dir),
    }
    if proc.returncode != 0:
        lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
        result['error'] = lines[-1][:300] if lines else f'exit code {proc.returncode}'
        with open(os.path.join(out_dir, 'stderr.log'), 'w') as f:
            f.write(proc.stderr)
    elif not result['val_loss'] or result['eval_iters'][-1] != max_iters:
        result['error'] = 'no final evaluation in the records'
    if not keep_checkpoints:
        remove_checkpoints(out_dir)
    status = f"error: {result['error']}" if 'error' in result else f"final val {result['val_loss'][-1]:.4f}"
    print(f"[{time.strftime('%H:%M:%S')}] {os.path.basename(out_dir)}: {status} ({wall:.0f} s)", flush=True)
    return result


def remove_checkpoints(out_dir):
    for name in ('ckpt.pt', 'ckpt.pt.tmp'):
        if os.path.exists(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))


# -----------------------------------------------------------------------------
# many runs, resumable


def result_path(runs_dir, name):
    return os.path.join(runs_dir, name, 'result.json')


def read_result(runs_dir, name):
    """A run's saved result (finished or failed), or None: not run, or a result.json that cannot be
    read (then run again, with a warning naming it)."""
    path = result_path(runs_dir, name)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            result = json.load(f)
        if isinstance(result, dict):
            return result
        problem = f"holds a JSON {type(result).__name__}, not a run's result"
    except (OSError, ValueError) as e:  # truncated by a full disk or a copy cut short
        problem = f"cannot be read ({type(e).__name__}: {str(e)[:100]})"
    warn_once(path, f"{path} {problem}; the run counts as not run and runs again")
    return None


def load_result(runs_dir, name):
    """A finished run's result, or None (not run, or failed)."""
    r = read_result(runs_dir, name)
    return None if r is None or 'error' in r else r


def run_all(jobs, runs_dir, launch, n_jobs=2, max_load=None):
    """Run every job (a dict with a unique 'name') that has no finished result yet, n_jobs at a
    time: launch(job, out_dir) returns the run's result, saved with the job's fields as
    RUNS/NAME/result.json (atomically; an error is saved too and retried next time). Returns
    {name: result} for every job with a saved result (failed ones included), in job order.
    max_load: a run starts beside another of these only while the machine's 1-minute load
    average is below it (on a shared machine, one run at a time when it is busy)."""
    todo = [j for j in jobs if load_result(runs_dir, j['name']) is None]
    running = [0]
    lock = threading.Lock()

    def one(job):
        while not stopping():
            with lock:
                if running[0] == 0 or max_load is None or os.getloadavg()[0] < max_load:
                    running[0] += 1
                    break
            time.sleep(5)
        else:
            return None  # stopped by a signal before it started
        try:
            out_dir = os.path.join(runs_dir, job['name'])
            r = {**launch(job, out_dir), **job}
        except Stopped:
            return None  # not a result: the run was cut short, and runs again next time
        finally:
            with lock:
                running[0] -= 1
        if stopping() and 'error' in r:  # failed as it was stopped (a launch of its own): not recorded either
            return None
        path = result_path(runs_dir, job['name'])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + '.tmp', 'w') as f:
            json.dump(r, f)
        os.replace(path + '.tmp', path)
        return r

    if todo:
        with children_stop_with_us(), ThreadPoolExecutor(max_workers=max(1, n_jobs)) as pool:
            list(pool.map(one, todo))
    return {j['name']: r for j in jobs if (r := read_result(runs_dir, j['name'])) is not None}


def all_results(runs_dir):
    """Every finished result under runs_dir, by folder name."""
    out = []
    if os.path.isdir(runs_dir):
        for name in sorted(os.listdir(runs_dir)):
            r = load_result(runs_dir, name)
            if r is not None:
                out.append(r)
    return out


def machine():
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        with open('/proc/cpuinfo') as f:
            names = [l.split(':', 1)[1].strip() for l in f if l.startswith('model name')]
        if names:
            cpu = names[0]
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores (shared), {platform.system()} {platform.release()}"


def config_of(args, out_dir='out'):
    """The config train.py runs with for `args` (train_argv's arguments, read and checked as
    train.py reads them); a bad key or value raises a one-line ValueError."""
    import train_config

    return train_config.load(train_argv(args, out_dir))
