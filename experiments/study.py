"""
When does LISA-wor beat LISA? A paired, resumable study through train.py, and the measurements
that explain what it finds.

Every training run is a `python train.py ...` subprocess (experiments/runner.py); a run's seed s
sets --seed, --data_seed and --omgd_seed, so at one seed every configuration starts from the same
weights, sees the same data order (for the same sampling) and is evaluated on the same fixed
windows: differences are paired by seed (experiments/stats.py). The metric the theory is about is
the training loss; train.py's eval 'train' split draws the same fixed windows of the training set
at every evaluation, so 'train loss' below is the loss on a fixed set of training windows (and
'val loss' the same on val.bin).

Models: GPT, n_embd 32, 2 heads, N_L blocks; 4 blocks: block_size 64, batch 32; 8 and 12 blocks:
block_size 32, batch 8 (DEPTH_ARGS). LISA and LISA-wor train gamma blocks for K iterations; M =
N_L / gamma periods make a LISA-wor cycle.

Regimes (the dataset and the iterations of a run):
- multi: a prefix of data/shakespeare_char/train.bin (written once to RUNS/../data/
  shakespeare_char_<N>k with the full val.bin and meta.pkl): MULTI_TOKENS for 4 blocks (48
  iterations per epoch), M4_MULTI_TOKENS for 8 and 12 (75 iterations per epoch).
- sub: the whole corpus (4.46M tokens), a fraction of one epoch.
- pre: the whole corpus, full AdamW: the model the fine-tuning runs start from (checkpoint kept).
- ft: fine-tuning the 'pre' model on another text in the same characters: CPython's own reference
  documentation (pydoc_data.topics, shipped with Python), characters outside Shakespeare's set
  dropped, written once to RUNS/../data/pydoc_char (FT_TOKENS train, a tenth of that val). Each run
  starts from a checkpoint at iteration 0 (the pre-trained weights, a fresh optimizer, cycler and data
  order for its own config) that train.py resumes (--init_from=resume).

Stages, in the order they run (a stage's runs go seed-major, so a stage stopped part-way still pairs):
  M = 2 (4 blocks, gamma 2, K 10; multi 480 iterations = 10 epochs, sub 240):
  core_multi_adamw, core_multi_sgd, core_sub_adamw, core_sub_sgd: lisa, lisa_wor x keep, drop
         (+ full for AdamW)
  aligned: K = one epoch (every (block group, window) pair once per cycle of M epochs); lisa at the
           same K for pairing (aligned_cycle: K = epoch / M, one cycle per epoch)
  probe: in-process instrumented copies of train.py's loop (seed 0; Adam-state age at reactivation,
         update norms after reactivation, clipping), checked against train.py's log
  offload: lisa_wor with omgd_state=offload, to check it equals keep bitwise (seed 0)
  methods_sgd: lisa_scale, lisa_wor_noscale with SGD (multi): without replacement vs the N_L/gamma scale
  iid: lisa, lisa_wor with i.i.d. sampling (multi)
  methods: lisa_scale, lisa_wor_noscale, tensor_wor, tensor_iid (multi, AdamW)
  sweep: K in {1, 10, 50} x gamma in {1, 2} for lisa vs lisa_wor (multi, AdamW)
  k1_keep: the sweep's K=1, gamma=2 cell under the other state policy
  M = 4 (8 blocks gamma 2, and 12 blocks gamma 3 as the paper's GPT-2; K 3, 600 iterations = 50
  cycles: multi 8 epochs, sub 0.04 epoch):
  m4_multi_adamw: lisa, lisa_wor x keep, drop
  m4_multi_sgd: lisa, lisa_scale, lisa_wor (SGD with momentum)
  m4_pre, m4_ft: 12 blocks pre-trained on Shakespeare (full AdamW, 2,000 iterations, seed 0), fine-tuned
         600 iterations (8 epochs) on pydoc_char: full, lisa, lisa_wor at gamma 3, K 3 (50 cycles)
  m4_sub_adamw: m4_multi_adamw's runs, sub-epoch
  m4_full: full AdamW for m4_multi_adamw's models (the reference)
  m4_probe: the instrumented loop for m4_multi_adamw's runs (seed 0)
  ft_sweep: lisa, lisa_wor fine-tuning at K 1 and 6 (gamma 3), and gamma 1 and 6 (K 3)
  k6_keep: the 12-block keep cells of m4_multi_adamw and m4_sub_adamw at K 6 (lisa, lisa_wor)
  k6_more: K 6, multi-epoch: 8 blocks under keep, 12 blocks under drop (lisa, lisa_wor)
  m8_multi_adamw: M = 8 (8 blocks, gamma 1, K 2, 800 iterations = 50 cycles): lisa, lisa_wor x keep, drop
  Issue 31, "does the period K decide?" (K31_STAGES; 12 blocks, gamma 3, AdamW, lisa and lisa_wor;
  pre-registered in experiments/README.md with seeds 100-109: --first_seed=100 --seeds=10):
  k31_keep: multi, 600 iterations, keep: K in {3, 6, 12, 25}, and K 3 with beta1 0.5 and 0
  k31_k100: the paper's K = 100, keep: 10,000 iterations (25 cycles) on the 'paper' prefix (5.4 epochs)
  k31_drop, k31_k100_drop: the same under drop
  Their report adds NAME_tests.md (the five confirmatory tests, the exploratory contrasts, every cell).
'keep' for the later stages is the policy under which lisa_wor reached the lower mean train loss in
core_multi_adamw (M = 2 stages) or m4_multi_adamw (M = 4 stages) (--policy=auto), or the one named.

    python experiments/study.py --stages=m4_multi_adamw,m4_multi_sgd,m4_pre,m4_ft --name=study_m4 --max_load=5
    python experiments/study.py --stages=m4_multi_sgd --layers=8 --name=study_m4   # the 8-block runs only
    python experiments/study.py --stages=core_multi_adamw,probe --seeds=5 --name=study_m2
    python experiments/study.py --report_only=True --name=study_m4 --report_dir=results
    python experiments/study.py --stages=k31_keep,k31_k100 --first_seed=100 --seeds=10 --jobs=1 \\
        --stop_at=10:42 --name=study_k31

--stop_at=HH:MM (UTC) starts no seed group after that time (a stopped stage keeps complete pairs).

The study in five files: study_plan.py (what runs: specs, train.py's arguments, the stages and issue
31's tests as data), this file (running them, resumable), study_stats.py (the statistics),
study_report.py (tables and plots) and study_probe.py (block schedules and the instrumented runs).

Finished runs are skipped (resume). Writes REPORT_DIR/NAME.json (every run's curves and the paired
statistics), NAME_tables.md, NAME_loss.png and NAME_probe.md (default REPORT_DIR: out/study).
"""

import json
import os
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runner  # noqa: E402
import study_plan  # noqa: E402
from study_plan import ft_dataset, multi_dataset, run_name, stage_specs, train_args  # noqa: E402
from study_probe import probe  # noqa: E402
from study_report import report, runs_from_report  # noqa: E402
from study_stats import resolve_policy  # noqa: E402

from configurator import at_least, command_line, one_of  # noqa: E402

# -----------------------------------------------------------------------------
# the data of the regimes, written once into RUNS/../data


def shakespeare_char():
    from dataloader import data_dir, prepare_if_embedded

    prepare_if_embedded('shakespeare_char')
    return data_dir('shakespeare_char')


def make_multi_dataset(runs_dir, n_tokens=None):
    """The multi-epoch split: the first n_tokens tokens of train.bin, the full val.bin, the same meta.pkl."""
    import numpy as np

    dst = multi_dataset(runs_dir, n_tokens)
    if os.path.exists(os.path.join(dst, 'meta.pkl')):
        return dst
    source = shakespeare_char()
    os.makedirs(dst, exist_ok=True)
    train = np.memmap(os.path.join(source, 'train.bin'), dtype=np.uint16, mode='r')
    np.array(train[: n_tokens or study_plan.MULTI_TOKENS]).tofile(os.path.join(dst, 'train.bin'))
    shutil.copyfile(os.path.join(source, 'val.bin'), os.path.join(dst, 'val.bin'))
    shutil.copyfile(os.path.join(source, 'meta.pkl'), os.path.join(dst, 'meta.pkl'))  # last: marks it complete
    return dst


def make_ft_dataset(runs_dir, n_tokens=None):
    """The fine-tuning text: CPython's reference documentation (pydoc_data.topics, in key order) in
    shakespeare_char's characters (others dropped): n_tokens train, n_tokens // 10 val, same meta.pkl."""
    from pydoc_data.topics import topics

    import numpy as np

    from data.tokenizer import read_meta  # data only: a meta.pkl never runs code

    dst = ft_dataset(runs_dir)
    if os.path.exists(os.path.join(dst, 'meta.pkl')):
        return dst
    source = shakespeare_char()
    stoi = read_meta(source)['stoi']
    n_tokens = n_tokens or study_plan.FT_TOKENS
    ids = [stoi[c] for c in ''.join(topics[k] for k in sorted(topics)) if c in stoi]
    n_val = n_tokens // 10
    if len(ids) < n_tokens + n_val:
        raise ValueError(f"pydoc_data.topics has {len(ids)} usable characters, fewer than {n_tokens + n_val}")
    os.makedirs(dst, exist_ok=True)
    np.array(ids[:n_tokens], dtype=np.uint16).tofile(os.path.join(dst, 'train.bin'))
    np.array(ids[n_tokens : n_tokens + n_val], dtype=np.uint16).tofile(os.path.join(dst, 'val.bin'))
    shutil.copyfile(os.path.join(source, 'meta.pkl'), os.path.join(dst, 'meta.pkl'))  # last: marks it complete
    return dst


# -----------------------------------------------------------------------------
# running, resumable (runner.run_all: a run with a result.json and no error is skipped)


def finetune_start(s, out_dir, runs_dir):
    """RUN/ckpt.pt at iteration 0 for fine-tuning run s: the pre-trained weights, and the
    optimizer, cycler, data position and RNG a fresh run of s's own config starts with, in
    train.py's checkpoint format (resumed with --init_from=resume)."""
    import torch

    import builder
    from infra import checkpoint
    from infra.distributed import Ranks
    from trainer import grad_scaler

    pre = os.path.join(runs_dir, run_name(stage_specs('m4_pre', [])[0]), 'ckpt.pt')  # the pre-training run
    if not os.path.exists(pre):
        raise FileNotFoundError(f"{pre} not found: the pre-training run must finish first")
    pretrained = checkpoint.read(pre)  # weights_only, as every checkpoint read
    cfg = runner.config_of(train_args(s, runs_dir), out_dir)
    torch.manual_seed(cfg['seed'])
    model, opt, cycler = builder.build(cfg, 'cpu', pretrained['model_args']['vocab_size'])
    model.load_state_dict(pretrained['model'])
    from dataloader import open_splits

    train_batches, _ = open_splits(
        cfg['dataset'], cfg['block_size'], cfg['batch_size'], cfg['sampling'], cfg['data_seed']
    )
    os.makedirs(out_dir, exist_ok=True)
    objects = {'model': model, 'optimizer': opt, 'cycler': cycler, 'scaler': grad_scaler(cfg, 'cpu')}
    values = {
        'data': train_batches.state_dict(),
        'model_args': pretrained['model_args'],
        'iter_num': 0,
        'best_val_loss': 1e9,
        'config': cfg,
        'wandb_id': None,
    }
    checkpoint.save(os.path.join(out_dir, 'ckpt.pt'), Ranks(), objects, values)  # train.py's writer


def train_launch(s, out_dir, runs_dir):
    if s['regime'] == 'ft':
        try:
            finetune_start(s, out_dir, runs_dir)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            return {'error': f'fine-tuning start: {type(e).__name__}: {str(e)[:200]}'}
    return runner.run_train(train_args(s, runs_dir), out_dir, s['iters'], keep_checkpoints=s['regime'] == 'pre')


def probe_launch(s, out_dir, runs_dir):
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS='1')
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), f'--probe_spec={json.dumps(s)}', f'--runs_dir={runs_dir}'],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
    )
    r = {'returncode': proc.returncode, 'wall_s': round(time.time() - t0, 1)}
    if proc.returncode == 0:
        with open(os.path.join(out_dir, 'probe.json')) as f:
            r.update(json.load(f))
    else:
        r['error'] = (proc.stderr.strip().splitlines() or ['exit code %d' % proc.returncode])[-1][:300]
    print(f"[{time.strftime('%H:%M:%S')}] {run_name(s)}: {r.get('error', 'ok')} ({r['wall_s']:.0f} s)", flush=True)
    return r


def default_launch(s, out_dir, runs_dir):
    return probe_launch(s, out_dir, runs_dir) if s['kind'] == 'probe' else train_launch(s, out_dir, runs_dir)


def run_specs(specs, runs_dir, jobs=2, launch=default_launch, max_load=None):
    """Run the specs not finished yet, `jobs` at a time (runner.run_all); {run_name: result} for
    every saved result."""
    return runner.run_all(
        [{**s, 'name': run_name(s)} for s in specs],
        runs_dir,
        lambda job, out_dir: launch(job, out_dir, runs_dir),
        jobs,
        max_load,
    )


def result_path(runs_dir, s):
    return runner.result_path(runs_dir, run_name(s))


def seed_groups(specs):
    """specs split into consecutive runs of one seed (a seed-major stage: one group per seed)."""
    out = []
    for s in specs:
        if out and out[-1][0]['seed'] == s['seed']:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def stop_time(hhmm, now=None):
    """The epoch time of the next HH:MM UTC at or after `now` (today's, or tomorrow's once it has passed
    by more than 12 hours: a deadline set just after midnight for the evening before is past)."""
    import datetime

    h, m = (int(x) for x in hhmm.split(':'))
    if not (0 <= h < 24 and 0 <= m < 60):
        raise ValueError(hhmm)
    now = datetime.datetime.now(datetime.timezone.utc) if now is None else now
    t = now.replace(hour=h, minute=m, second=0, microsecond=0)
    if (now - t).total_seconds() > 12 * 3600:
        t += datetime.timedelta(days=1)
    return t.timestamp()


DEFAULTS = dict(
    stages=','.join(study_plan.STAGES),
    seeds=5,
    first_seed=0,
    stop_at='',
    jobs=2,
    max_load=0.0,
    layers='',
    policy='auto',
    runs_dir=os.path.join(ROOT, 'out', 'study', 'runs'),
    report_dir=os.path.join(ROOT, 'out', 'study'),
    name='study',
    report_only=False,
    runs_from='',
    earlier='',
    probe_spec='',
)
MEANINGS = dict(
    stages='comma-separated, in order',
    seeds='how many seeds: FIRST_SEED..FIRST_SEED+N-1',
    first_seed='the first seed (the k31 stages: 100)',
    stop_at='HH:MM (UTC): start no seed group after it (the runs that started finish; the rest are '
    'reported as not run, and a rerun resumes them)',
    jobs='runs at a time (each OMP_NUM_THREADS=1)',
    max_load='>0: start a second run beside the first only while the 1-minute load average is below it',
    layers='only the runs of models with these numbers of blocks, e.g. 8,12',
    policy='state policy of the later stages: keep, drop or auto',
    name='report file stem: NAME.json, ...',
    report_only='write the reports from the runs there, run nothing',
    runs_from="write the reports from the runs an earlier NAME.json keeps (a fresh checkout has no runs "
    "folder); with report_only=True",
    earlier='an earlier NAME.json of the same runs: NAME_tests.md compares them run by run',
    probe_spec='(internal) one probe run',
)
RULES = {'seeds': at_least(1), 'jobs': at_least(1), 'max_load': at_least(0), 'policy': one_of('auto', 'keep', 'drop')}


def main(argv=None):
    args = SimpleNamespace(**command_line(sys.argv[1:] if argv is None else argv, DEFAULTS, RULES, __doc__, MEANINGS))
    runs_dir = os.path.abspath(args.runs_dir)
    if args.probe_spec:
        probe(json.loads(args.probe_spec), runs_dir)
        return 0
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    label = runs_dir if os.path.relpath(runs_dir, ROOT).startswith('..') else os.path.relpath(runs_dir, ROOT)
    if args.runs_from and not args.report_only:
        sys.exit("error: --runs_from writes reports from a NAME.json and runs nothing: add --report_only=True")
    try:
        deadline = stop_time(args.stop_at) if args.stop_at else None
    except ValueError:
        sys.exit(f'error: --stop_at={args.stop_at!r}: give a UTC time as HH:MM, e.g. --stop_at=10:42')
    command = ' '.join(['python experiments/study.py'] + (sys.argv[1:] if argv is None else list(argv)))
    stages = [s.strip() for s in args.stages.split(',') if s.strip()]
    try:
        layers = {int(n) for n in args.layers.split(',') if n.strip()}
    except ValueError:
        sys.exit(f'error: --layers={args.layers!r}: give numbers of blocks, e.g. --layers=8,12')
    unknown = [s for s in stages if s not in study_plan.STAGES]
    if unknown:
        sys.exit(f'error: unknown stage {unknown[0]!r}; choose from {", ".join(study_plan.STAGES)}')

    def policy_of(stage):  # 'auto' follows the runs finished so far, so it reads them; a named policy reads nothing
        return resolve_policy(args.policy, runner.all_results(runs_dir) if args.policy == 'auto' else [], stage)

    if not args.report_only:
        # every run's train.py config checked before the first run starts (a bad one fails now, in one line)
        for stage in stages:
            for s in stage_specs(stage, seeds, policy_of(stage)):
                try:
                    runner.config_of(train_args(s, runs_dir))
                except ValueError as e:
                    sys.exit(f"error: stage {stage}, run {run_name(s)}: {e}")
        failed = []
        needed = {study_plan.dataset(s, runs_dir) for stage in stages for s in stage_specs(stage, seeds)}
        for n_tokens in (study_plan.MULTI_TOKENS, study_plan.M4_MULTI_TOKENS, study_plan.PAPER_TOKENS):
            if multi_dataset(runs_dir, n_tokens) in needed:
                make_multi_dataset(runs_dir, n_tokens)
        if ft_dataset(runs_dir) in needed:
            make_ft_dataset(runs_dir)
        not_started = 0
        for stage in stages:
            specs = stage_specs(stage, seeds, policy_of(stage))
            specs = [s for s in specs if not layers or s['n_layer'] in layers]
            t0 = time.time()
            print(f"[{time.strftime('%H:%M:%S')}] stage {stage}: {len(specs)} runs", flush=True)
            results, started = {}, sum(runner.load_result(runs_dir, run_name(s)) is None for s in specs)
            for group in seed_groups(specs) if deadline else [specs]:  # a seed's runs: complete pairs
                if (
                    deadline
                    and time.time() >= deadline
                    and any(runner.load_result(runs_dir, run_name(s)) is None for s in group)
                ):
                    not_started += sum(runner.load_result(runs_dir, run_name(s)) is None for s in group)
                    continue
                results.update(run_specs(group, runs_dir, args.jobs, max_load=args.max_load or None))
            failed += [name for name, r in results.items() if 'error' in r]
            print(f"[{time.strftime('%H:%M:%S')}] stage {stage} done in {time.time() - t0:.0f} s", flush=True)
            if not failed and started and (not deadline or time.time() < deadline):  # the last one: below
                report(runner.all_results(runs_dir), label, args.report_dir, seeds, command, args.name, args.jobs)
        if failed:  # earlier reports stay as they were; finished runs are kept, and rerun failures resume
            print(
                f"error: {len(failed)} runs failed (first: {failed[0]}: see {runs_dir}/{failed[0]}); reports "
                f"not rewritten; run the same command again to retry them",
                file=sys.stderr,
            )
            return 1
        if not_started:
            print(
                f"[{time.strftime('%H:%M:%S')}] --stop_at={args.stop_at}: {not_started} runs not started "
                f"(the same command resumes them)",
                flush=True,
            )
    try:
        results = runs_from_report(args.runs_from) if args.runs_from else runner.all_results(runs_dir)
        report(
            results,
            args.runs_from or label,
            args.report_dir,
            seeds,
            command,
            args.name,
            args.jobs,
            args.earlier or None,
        )
    except (OSError, ValueError, KeyError) as e:  # a missing or foreign NAME.json
        sys.exit(f"error: cannot write the reports: {type(e).__name__}: {e}")
    print(
        f"wrote {args.name}.json, {args.name}_tables.md, {args.name}_probe.md, {args.name}_loss.png "
        f"in {args.report_dir}"
    )
    return 0


if __name__ == '__main__':
    sys.exit(main())
