"""
Launch train.py runs and collect what they logged: the one runner of experiments/compare.py and
experiments/study.py.

A run is a `python train.py ARGS` subprocess on the CPU (one OMP thread by default) in its own
folder RUNS/NAME, logging to RUNS/NAME/train.log; its curves are read from the records train.py
writes (RUNS/NAME/metrics.jsonl: evaluations, logged iterations, switches) into RUNS/NAME/result.json.
run_all runs a list of jobs N at a time and skips every job whose result.json exists without an
error, so an interrupted batch resumes where it stopped.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# every run: eager CPU float32, no sample, a checkpoint only at the end (removed unless kept)
CPU_ARGS = ('--compile=False', '--sample_tokens=0', '--always_save_checkpoint=False', '--device=cpu',
            '--dtype=float32')


def read_records(out_dir):
    """Curves and timings of a run from the records train.py wrote (out_dir/metrics.jsonl)."""
    evals, iters, switches = [], [], []
    path = os.path.join(out_dir, 'metrics.jsonl')
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                {'eval': evals, 'iter': iters, 'switch': switches}.get(rec['kind'], []).append(rec)
    times = [r['ms'] for r in iters if r['iter'] > 0]  # the first logged iteration includes start-up work
    return {
        'eval_iters': [r['iter'] for r in evals], 'train_loss': [r['train_loss'] for r in evals],
        'val_loss': [r['val_loss'] for r in evals],
        'log_iters': [r['iter'] for r in iters], 'step_loss': [r['loss'] for r in iters],
        'median_ms_per_iter': statistics.median(times) if times else None,
        'last_logged_epoch': iters[-1]['epoch'] if iters else None,  # fraction of the training set's windows seen
        'switches': len(switches), 'first_switches': [f"iter {r['iter']}: {r['description']}" for r in switches[:3]],
    }


def train_argv(args, out_dir):
    """train.py's arguments for a run of `args` (a list of '--key=value') in out_dir."""
    return [*CPU_ARGS, *args, f'--out_dir={out_dir}']


def run_train(args, out_dir, max_iters, threads=1, keep_checkpoints=False):
    """One train.py run in out_dir (train.log there); returns the parsed log with returncode,
    wall_s, command and, when it failed or did not evaluate at max_iters, 'error'."""
    os.makedirs(out_dir, exist_ok=True)
    cmd = [sys.executable, 'train.py', *train_argv(args, out_dir)]
    env = dict(os.environ)
    if threads:
        env['OMP_NUM_THREADS'] = str(threads)
    t0 = time.time()
    with open(os.path.join(out_dir, 'train.log'), 'w') as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.PIPE, text=True, env=env)
    wall = time.time() - t0
    result = {'returncode': proc.returncode, 'wall_s': round(wall, 1), 'command': ' '.join(cmd[1:]),
              **read_records(out_dir)}
    if proc.returncode != 0:
        lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
        result['error'] = lines[-1][:300] if lines else f'exit code {proc.returncode}'
        with open(os.path.join(out_dir, 'stderr.log'), 'w') as f:
            f.write(proc.stderr)
    elif not result['val_loss'] or result['eval_iters'][-1] != max_iters:
        result['error'] = 'no final evaluation in the records'
    if not keep_checkpoints:
        for name in ('ckpt.pt', 'ckpt.pt.tmp'):
            if os.path.exists(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
    status = f"error: {result['error']}" if 'error' in result else f"final val {result['val_loss'][-1]:.4f}"
    print(f"[{time.strftime('%H:%M:%S')}] {os.path.basename(out_dir)}: {status} ({wall:.0f} s)", flush=True)
    return result


# -----------------------------------------------------------------------------
# many runs, resumable


def result_path(runs_dir, name):
    return os.path.join(runs_dir, name, 'result.json')


def read_result(runs_dir, name):
    """A run's saved result (finished or failed), or None."""
    path = result_path(runs_dir, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


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
        while True:
            with lock:
                if running[0] == 0 or max_load is None or os.getloadavg()[0] < max_load:
                    running[0] += 1
                    break
            time.sleep(5)
        try:
            out_dir = os.path.join(runs_dir, job['name'])
            r = {**launch(job, out_dir), **job}
        finally:
            with lock:
                running[0] -= 1
        path = result_path(runs_dir, job['name'])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + '.tmp', 'w') as f:
            json.dump(r, f)
        os.replace(path + '.tmp', path)
        return r

    if todo:
        with ThreadPoolExecutor(max_workers=max(1, n_jobs)) as pool:
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


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the repository's one-line `error: ...` (argparse prints its usage first)."""

    def error(self, message):
        sys.exit(f"error: {message} (see --help)")
