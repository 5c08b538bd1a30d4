"""
Where a training script's loop spends its time on a GPU: runs SCRIPT (this repository's train.py, or nanoGPT's) in
this process with its own arguments, times --timed iterations after --warmup (a synchronize at each end, none
between), then profiles --profiled more with torch.profiler and CUDA's sync detection. An iteration is counted at
each optimizer step (a global post-step hook), so any script with one optimizer step an iteration can be measured
alike, unedited.

    python experiments/profile_loop.py --out=DIR --name=NAME [--warmup=10 --timed=20 --profiled=8] SCRIPT ARGS...

Writes DIR/NAME.txt (ms/iter; the GPU's busy and idle time in the profiled iterations and its largest gaps; every
synchronizing call by where the script made it; the ops by host and by GPU time) and DIR/NAME_trace.json.gz
(chrome://tracing, Perfetto). The script's --max_iters must leave room for warmup + timed + profiled steps.
"""

import argparse
import collections
import gzip
import json
import os
import runpy
import sys
import tempfile
import time
import traceback
import warnings

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

TORCH_DIR = os.path.dirname(torch.__file__)
CUDA = torch.cuda.is_available()  # on a CPU (a dry run of this script) no synchronize and no sync detection


def synchronize():
    if CUDA:
        torch.cuda.synchronize()


class LoopProbe:
    """The optimizer's post-step hook: starts the clock, then the profiler, then writes the report."""

    def __init__(self, out, name, warmup, timed, profiled):
        self.out, self.name, self.steps = out, name, 0
        self.start_timing, self.start_profile, self.end = warmup, warmup + timed, warmup + timed + profiled
        self.lines, self.syncs, self.profiler = [], collections.Counter(), None

    def __call__(self, optimizer, args, kwargs):
        self.steps += 1
        if self.steps == self.start_timing:
            synchronize()
            self.t0 = time.perf_counter()
        elif self.steps == self.start_profile:
            synchronize()
            ms = (time.perf_counter() - self.t0) * 1e3 / (self.start_profile - self.start_timing)
            self.lines.append(f"{self.name}: {ms:.2f} ms/iter (steps {self.start_timing}-{self.start_profile})")
            print(self.lines[-1], flush=True)
            self.profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            )
            self.profiler.__enter__()
            self.filters = warnings.filters[:]
            warnings.simplefilter('always')
            self.show_warning, warnings.showwarning = warnings.showwarning, self.record_sync
            if CUDA:
                torch.cuda.set_sync_debug_mode('warn')
        elif self.steps == self.end:
            synchronize()
            self.end_profile()
            self.write()

    def end_profile(self):
        """The profiler stopped; sync detection and warnings as they were."""
        if CUDA:
            torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning, warnings.filters[:] = self.show_warning, self.filters
        self.profiler.__exit__(None, None, None)

    def stop(self):
        """After the script: ends a profile it left unfinished (it ended inside the profiled iterations)."""
        if self.profiler is not None and self.steps < self.end:
            self.end_profile()

    def record_sync(self, message, category, filename, lineno, file=None, line=None):
        if 'called a synchronizing' not in str(message):  # the script's own warnings, and the mode's prototype one
            return self.show_warning(message, category, filename, lineno, file, line)
        stack = traceback.extract_stack()[:-1]
        frames = [f for f in stack if not f.filename.startswith(TORCH_DIR) and f.filename != warnings.__file__][-3:]
        where = ' <- '.join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))
        self.syncs[(str(message).split('\n')[0][:70], where)] += 1

    def write(self):
        os.makedirs(self.out, exist_ok=True)
        fd, scratch = tempfile.mkstemp(dir=self.out, suffix='.json')  # a new file: the only one this removes
        os.close(fd)
        try:
            self.profiler.export_chrome_trace(scratch)
            with open(scratch, 'rb') as f:
                trace = f.read()
        finally:
            os.remove(scratch)
        with gzip.open(os.path.join(self.out, f"{self.name}_trace.json.gz"), 'wb') as g:
            g.write(trace)
        events = json.loads(trace)['traceEvents']
        n = self.end - self.start_profile
        gpu = sorted(
            (e['ts'], e['ts'] + e['dur'], e['name'])
            for e in events
            if e.get('cat') in ('kernel', 'gpu_memcpy', 'gpu_memset') and 'dur' in e
        ) or [(0.0, 0.0, 'none')]
        busy, gaps, until, last = 0.0, [], gpu[0][0], gpu[0][2]
        for start, end, name in gpu:  # the union of the GPU's intervals, and the idle gaps between them
            if start > until:
                gaps.append((start - until, last, name))
            busy += max(0.0, end - max(start, until))
            if end > until:
                until, last = end, name
        window = until - gpu[0][0]
        self.lines += [
            f"profiled {n} iterations: GPU busy {busy / n / 1e3:.2f} ms/iter, idle {(window - busy) / n / 1e3:.2f} "
            f"ms/iter ({len(gpu)} GPU activities, {len(gaps)} gaps)",
            "largest idle gaps (us, after -> before):",
            *(f"  {d:9.1f}  {a[:60]} -> {b[:60]}" for d, a, b in sorted(gaps, reverse=True)[:12]),
            f"synchronizing calls in the profiled iterations ({sum(self.syncs.values())}):",
            *(f"  {count:4d}  {message} at {where}" for (message, where), count in self.syncs.most_common()),
            "ops by host time:",
            self.profiler.key_averages().table(sort_by='self_cpu_time_total', row_limit=25, max_name_column_width=60),
            "ops by GPU time:",
            self.profiler.key_averages().table(sort_by='self_cuda_time_total', row_limit=25, max_name_column_width=60),
        ]
        with open(os.path.join(self.out, f"{self.name}.txt"), 'w') as f:
            f.write('\n'.join(self.lines) + '\n')
        print('\n'.join(self.lines[:3]), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], allow_abbrev=False)
    parser.add_argument('--out', required=True)
    parser.add_argument('--name', required=True)
    parser.add_argument('--warmup', type=int, default=10)
    parser.add_argument('--timed', type=int, default=20)
    parser.add_argument('--profiled', type=int, default=8)
    parser.add_argument('script')
    parser.add_argument('script_args', nargs=argparse.REMAINDER)  # the script's own, even where named like ours
    args = parser.parse_args()
    probe = LoopProbe(os.path.abspath(args.out), args.name, args.warmup, args.timed, args.profiled)
    hook = register_optimizer_step_post_hook(probe)
    sys.argv = [args.script, *args.script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))  # as `python SCRIPT` would
    try:
        runpy.run_path(args.script, run_name='__main__')
    except SystemExit as e:
        if e.code:  # the script failed: its own status
            raise
    finally:
        hook.remove()
        probe.stop()
    if probe.steps < probe.end:
        sys.exit(
            f"error: {args.script} made {probe.steps} optimizer steps, fewer than the {probe.end} to measure; "
            f"raise its --max_iters"
        )


if __name__ == '__main__':
    main()
