import json
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from conftest import run_script  # noqa: E402

import bench_memory  # noqa: E402
import memory_estimate  # noqa: E402

GIB = 2**30


def config(*argv, **overrides):
    """bench_memory's config for `argv` (config files, --key=value), then overrides."""
    from configurator import configure

    return {**configure(bench_memory.DEFAULTS, list(argv)), **overrides}


LLAMA_7B = os.path.join(ROOT, 'config', 'llama7b_lisa_wor.py')
SMALL = dict(
    preset='',
    arch='llama',
    n_layer=4,
    n_head=4,
    n_embd=64,
    vocab_size=512,
    block_size=32,
    batch_size=2,
    micro_batches=2,
    galore_rank=8,
)


def test_llama_7b_breakdown_matches_paper():
    """The paper's Model/Gradients/Optimizer columns, from the real optimizers' state on meta tensors, for
    config/llama7b_lisa_wor.py with LLaMA's vocabulary: the training config is the paper's setting."""
    cfg = config(
        LLAMA_7B,
        '--vocab_size=32000',
        '--methods=full,galore,golore,lisa,lisa_wor',
        '--device=meta',
        '--micro_batches=1',
    )
    result = bench_memory.run(cfg)
    assert result['estimate'] and result['precisions'] == [('bf16', '')]
    got = {r['method']: tuple(round(r[k] / GIB, 2) for k in ('params', 'grads', 'optimizer')) for r in result['rows']}
    assert got == {
        'full': (12.55, 12.55, 25.10),
        'galore': (12.55, 12.55, 1.73),
        'golore': (12.55, 12.55, 1.73),
        'lisa': (12.55, 1.24, 2.48),
        'lisa_wor': (12.55, 1.24, 2.48),
    }
    galore_row = next(r for r in result['rows'] if r['method'] == 'galore')
    assert galore_row['projectors'] > 0  # counted apart, not as optimizer state
    text = bench_memory.markdown(result)
    assert 'precision bf16, omgd_state drop' in text and "The paper's table" in text


def test_meta_and_cpu_agree_on_exact_bytes():
    """Every precision on both devices; the CPU masters of bf16_master:cpu are host memory on both."""
    common = dict(SMALL, methods='full,galore,lisa_wor', precisions='bf16,bf16_master,bf16_master:cpu')
    meta = bench_memory.run(config(device='meta', **common))['rows']
    cpu = bench_memory.run(config(device='cpu', **common))['rows']
    assert [(r['method'], r['precision'], r['master_device']) for r in meta] == [
        (m, p, d)
        for p, d in (('bf16', ''), ('bf16_master', ''), ('bf16_master', 'cpu'))
        for m in ('full', 'galore', 'lisa_wor')
    ]
    for m, c in zip(meta, cpu):
        for key in ('params', 'grads', 'optimizer', 'cpu_state', 'projectors'):
            assert m[key] == c[key], (m['method'], m['precision'], key)
        assert m['others'] > 0 and c['others'] > 0
    rows = {(r['method'], memory_estimate.precision_label(r['precision'], r['master_device'])): r for r in meta}
    plain, master, offload = (rows['lisa_wor', p] for p in ('bf16', 'bf16_master', 'bf16_master:cpu'))
    assert plain['grads'] < rows['full', 'bf16']['grads']
    # fp32 master + 2 fp32 moments (12 bytes) instead of 2 bf16 moments (4 bytes) per trainable parameter
    assert master['optimizer'] == 3 * plain['optimizer'] and offload['optimizer'] == 0
    assert offload['cpu_state'] == master['optimizer'] and offload['peak'] < plain['peak'] < master['peak']


def test_cpu_build_keeps_gpt2_head_tied_to_embedding():
    """GPT-2 ties its head to its embedding: built on meta or on the CPU, it is counted once."""
    from model import Transformer

    cfg = config(**dict(SMALL, arch='gpt2', methods='full', micro_batches=1))
    rows = {device: bench_memory.run(config(**{**cfg, 'device': device}))['rows'][0] for device in ('meta', 'cpu')}
    n_params = sum(p.numel() for p in Transformer(memory_estimate.model_config(cfg)).parameters())
    assert rows['meta']['n_params'] == rows['cpu']['n_params'] == n_params
    assert all(rows['meta'][k] == rows['cpu'][k] for k in ('params', 'grads', 'optimizer'))


def test_train_py_memory_keys_reach_the_measurement():
    """Keys that builder.build applies change the estimate with no code here: loss_chunk, and
    activation_offload, whose host copies the meta device emulates (and the emulation is undone)."""
    from infra import memory_options

    others = {
        name: bench_memory.run(config(**SMALL, device='meta', methods='lisa_wor', **kw))['rows'][0]['others']
        for name, kw in dict(plain={}, offload=dict(activation_offload=True), chunk=dict(loss_chunk=8)).items()
    }
    assert others['offload'] < others['plain'] and others['chunk'] < others['plain'], others
    assert memory_options.OFFLOAD_COPIES == {}  # the meta copies are set only while a row is measured


def test_vocabulary_as_train_py_reads_it(tmp_path):
    """vocab_size, else the dataset's meta.pkl (train.py's rule), else the preset's / GPT-2's."""
    import pickle

    from model import Transformer

    with open(tmp_path / 'meta.pkl', 'wb') as f:
        pickle.dump({'vocab_size': 77}, f)
    prepared = {**SMALL, 'dataset': str(tmp_path), 'vocab_size': 0}
    vocab = lambda **kw: memory_estimate.model_config(config(**kw)).vocab_size  # noqa: E731
    assert vocab(**prepared) == 77 and vocab(**{**prepared, 'vocab_size': 512}) == 512
    assert vocab(dataset='no_such_dataset') == 50304 and vocab(dataset='no_such_dataset', preset='llama-60m') == 32000
    row = bench_memory.run(config(**prepared, device='meta', methods='full'))['rows'][0]
    assert row['n_params'] == sum(
        p.numel() for p in Transformer(memory_estimate.model_config(config(**prepared))).parameters()
    )


def test_defaults_are_train_py_keys():
    """bench_memory.py and bench.py read train.py's keys, whatever train.py adds: every key, with
    train.py's value (the device-dependent ones as on a GPU machine for bench_memory)."""
    from conftest import train_defaults

    import bench

    train = {k: v for k, v in train_defaults().items() if isinstance(v, (int, float, bool, str))}  # its key rule
    own = {'device', 'dtype', 'compile', 'backend'}  # train_defaults() sets these for CPU tests
    for defaults in (bench_memory.DEFAULTS, bench.DEFAULTS):
        assert set(train) <= set(defaults)
        assert {k: defaults[k] for k in train if k not in own} == {k: train[k] for k in train if k not in own}
    assert (bench_memory.DEFAULTS['dtype'], bench_memory.DEFAULTS['compile']) == ('bfloat16', True)
    assert bench_memory.DEFAULTS['device'] == bench.DEFAULTS['device'] == 'auto'


def test_live_bytes_counts_storages_once_and_frees():
    tracker = memory_estimate.LiveBytes('meta')
    with tracker:
        a = torch.empty(1000, device='meta')  # 4000 bytes
        view = a[:10]
        b = a * 2
        with tracker.host():
            h = torch.empty(500, device='meta')
        assert tracker.current == 8000 and tracker.is_host(h) and not tracker.is_host(view)
        del b
        assert tracker.current == 4000
    assert tracker.peak == 8000


def test_attention_saves_no_t_by_t_matrix():
    q = torch.empty(1, 4, 1024, 16, device='meta', dtype=torch.bfloat16, requires_grad=True)
    tracker = memory_estimate.LiveBytes('meta')
    tracker.add(q)
    with tracker, memory_estimate.MetaAsCuda():
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert out.shape == q.shape
    assert tracker.peak < 4 * 1024 * 1024 * 2 / 4  # far below one T x T score matrix per head


def test_bench_memory_script_writes_outputs(tmp_path):
    prefix = str(tmp_path / 'mem')
    proc = run_script(
        'bench_memory.py',
        [
            '--preset=llama-60m',
            '--methods=full,lisa_wor',
            '--batch_size=4',
            '--block_size=64',
            '--device=meta',
            f'--out={prefix}',
        ],
    )
    assert proc.returncode == 0, proc.stderr
    for ext in ('.md', '.json', '.png'):
        assert os.path.getsize(prefix + ext) > 0
    text = open(prefix + '.md').read()
    assert 'ESTIMATE' in text and '| lisa_wor | amp |' in text and 'precision amp, omgd_state drop' in text
    data = json.load(open(prefix + '.json'))
    assert data['estimate'] and [r['method'] for r in data['rows']] == ['full', 'lisa_wor']
    assert data['rows'][1]['grads'] < data['rows'][0]['grads']


def test_bench_memory_rejects_unknown_keys():
    proc = run_script('bench_memory.py', ['--batchsize=4'])
    assert proc.returncode != 0 and 'unknown config key' in proc.stderr and 'batch_size' in proc.stderr
    proc = run_script('bench_memory.py', ['--methods=lisa_wor+master'])  # the old suffixes are gone
    from train_config import METHOD_NAMES  # a fork's new method joins the list

    assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [
        f"error: unknown method 'lisa_wor+master'; choose one of {', '.join(METHOD_NAMES)}"
    ]
    assert METHOD_NAMES[:4] == ('full', 'lisa', 'lisa_scale', 'lisa_wor') and 'golore' in METHOD_NAMES


def test_bench_script_runs(tmp_path):
    out = str(tmp_path / 'bench.md')
    proc = run_script(
        'bench.py',
        [
            '--arch=llama',
            '--n_layer=2',
            '--n_embd=64',
            '--vocab_size=512',
            '--batch_size=2',
            '--block_size=32',
            '--steps=2',
            '--warmup_steps=1',
            '--methods=full,lisa_wor,galore',
            '--precisions=amp,bf16_master:cpu',
            '--compile=False',
            f'--out={out}',
        ],
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r'timing: 100%.* 18/18 ', proc.stderr), proc.stderr  # the bar: 6 rows x 3 iterations
    assert re.search(r'^galore \(bf16_master:cpu\): [\d.]+ ms/iter', proc.stdout, re.M), proc.stdout
    text = open(out).read()
    rows = [line.split('|')[1:-1] for line in text.splitlines() if line.startswith('| ')]
    header = [cell.strip() for cell in rows[0]]
    speeds = {
        (cells[0].strip(), cells[1].strip()): float(cells[header.index('tokens/s')].replace(',', ''))
        for cells in rows[1:]
    }
    assert list(speeds) == [(m, p) for p in ('amp', 'bf16_master:cpu') for m in ('full', 'lisa_wor', 'galore')]
    assert all(v > 0 for v in speeds.values()), speeds
    from model import Transformer

    cfg = config(arch='llama', n_layer=2, n_embd=64, vocab_size=512)
    n_params = sum(p.numel() for p in Transformer(memory_estimate.model_config(cfg)).parameters())
    assert f"{n_params / 1e6:.1f}M parameters" in text


@pytest.mark.parametrize(
    'overrides,message',
    [
        (dict(dtype='fp16'), "unknown dtype 'fp16'"),
        (dict(batch_size=0), 'batch_size must be >= 1, got 0'),
        (dict(micro_batches=-1), 'micro_batches must be >= 0, got -1'),
        (dict(gradient_accumulation_steps=0), 'gradient_accumulation_steps must be >= 1'),
        (dict(methods='adam'), "unknown method 'adam'"),
        (dict(methods=','), 'methods lists no method'),
        (dict(precisions='fp8'), "unknown precision 'fp8'"),
        (dict(precisions='bf16_master:gpu'), "master_device must be '' (the weights' device) or 'cpu', got 'gpu'"),
        (dict(precisions='bf16:cpu'), "master_device='cpu' places fp32 master weights"),
        (dict(device='tpu'), 'device must be auto, cuda, meta, cpu'),
        (dict(preset='gpt5'), "unknown preset 'gpt5'"),
        (dict(preset='gpt2', n_layer=2), "preset='gpt2' sets the architecture, so n_layer=2 would be ignored"),
        (dict(n_embd=100, n_head=3), 'model shape:'),
    ],
)
def test_bench_memory_errors(overrides, message):
    with pytest.raises(ValueError) as e:
        bench_memory.run(config(**{'device': 'meta', 'methods': 'full', **overrides}))
    assert message in str(e.value) and '\n' not in str(e.value)


@pytest.mark.parametrize(
    'argv,message',
    [
        (['--device=meta'], 'device must be auto, cuda, cpu'),
        (['--dtype=fp16'], "unknown dtype 'fp16'"),
        (['--steps=0'], 'steps must be >= 1'),
        (['--methods=lisa_wor+master'], "unknown method 'lisa_wor+master'"),
        (['--precisions=bf16_master:gpu'], "master_device must be ''"),
        (['--methods=,'], 'methods lists no method'),
        (['--preset=gpt5'], "unknown preset 'gpt5'"),
        (['--n_embd=100', '--n_head=3'], 'model shape:'),
        (['--stepz=3'], 'unknown config key'),
    ],
)
def test_bench_errors(argv, message):
    import bench

    with pytest.raises(SystemExit) as e:
        bench.main(['--device=cpu', *argv] if not argv[0].startswith('--device') else argv)
    assert str(e.value).startswith('error: ') and message in str(e.value) and '\n' not in str(e.value)


@pytest.mark.skipif(
    open('/proc/sys/vm/overcommit_memory').read().strip() == '1',
    reason='this kernel grants any allocation (overcommit_memory=1): the batch would be filled, not refused',
)
def test_a_batch_too_large_for_memory_is_one_line():
    """--batch_size=1000000000: the row's 512 GB batch is refused by the allocator; one line, not its traceback."""
    import bench

    with pytest.raises(SystemExit) as e:
        bench.main(
            [
                '--device=cpu',
                '--batch_size=1000000000',
                '--n_layer=1',
                '--n_embd=16',
                '--n_head=2',
                '--block_size=64',
                '--steps=1',
                '--warmup_steps=0',
                '--methods=full',
                '--compile=False',
            ]
        )
    assert re.fullmatch(
        r"error: a row does not fit in the memory of cpu \(.*can't allocate memory.*\); lower "
        r"--batch_size or --block_size, or choose a smaller model",
        str(e.value),
    ), str(e.value)


def test_a_runtime_error_that_is_not_out_of_memory_keeps_its_traceback(monkeypatch):
    """Only running out of memory becomes the one-line advice to lower the batch: any other RuntimeError
    (a bug, a kernel's failure) goes on as it was, its message and traceback intact."""
    import bench

    def failing(row_cfgs, device):
        raise RuntimeError('mat1 and mat2 shapes cannot be multiplied (8x16 and 32x16)')

    monkeypatch.setattr(bench, 'bench', failing)
    with pytest.raises(RuntimeError, match='shapes cannot be multiplied'):
        bench.main(
            [
                '--device=cpu',
                '--n_layer=1',
                '--n_embd=16',
                '--n_head=2',
                '--block_size=64',
                '--steps=1',
                '--warmup_steps=0',
                '--methods=full',
                '--compile=False',
            ]
        )


def gpu_script_commands():
    """(script, [arguments]) of every `run python SCRIPT.py ...` command of experiments/gpu_benchmarks.sh."""
    import shlex

    text = open(os.path.join(ROOT, 'experiments', 'gpu_benchmarks.sh')).read().replace('\\\n', ' ')
    commands = []
    for line in text.splitlines():
        if line.split()[:2] == ['run', 'python']:
            words = shlex.split(line.replace('$gpu', 'GPU'))
            commands.append((words[2], words[3:]))
    return commands


def test_gpu_script_uses_only_valid_keys():
    """A mistyped key or an impossible combination would only show on the GPU, after minutes of other
    benchmarks: every command's config (files included) must parse and pass the scripts' checks."""
    import bench
    from configurator import configure

    scripts = {'bench_memory.py': bench_memory, 'bench.py': bench}
    commands = gpu_script_commands()
    assert [script for script, _ in commands] == ['bench_memory.py'] * 3 + ['bench.py']
    for script, argv in commands:
        argv = [os.path.join(ROOT, a) if not a.startswith('--') else a for a in argv]
        cfg = configure(scripts[script].DEFAULTS, argv)
        scripts[script].check(cfg)
        assert cfg['methods'] and cfg['out'].startswith('results/')  # results/ is written only when named


def under(path, folder):
    """Whether `path` (relative paths from the repository root, where the commands run) lies in `folder`."""
    path, folder = (os.path.realpath(os.path.join(ROOT, p)) for p in (path, folder))
    return os.path.commonpath([path, folder]) == folder


def git_ignored(path):
    """Whether the top folder of `path` matches a folder pattern of .gitignore (as out*/ does)."""
    import fnmatch

    top = os.path.relpath(os.path.realpath(os.path.join(ROOT, path)), ROOT).split(os.sep)[0]
    patterns = [
        line.strip().strip('/') for line in open(os.path.join(ROOT, '.gitignore')) if line.strip().endswith('/')
    ]
    return any(fnmatch.fnmatch(top, p) for p in patterns)


def test_default_outputs_stay_out_of_results():
    """Run as documented without --out, a benchmark must not overwrite the committed results/ files."""
    import bench
    from configurator import configure

    for argv in ([], ['--preset=gpt2'], [LLAMA_7B]):
        prefix = bench_memory.output_prefix(configure(bench_memory.DEFAULTS, argv))
        assert not under(prefix, 'results') and git_ignored(prefix), prefix
    assert bench_memory.output_prefix(configure(bench_memory.DEFAULTS, ['--out=results/x'])) == 'results/x'
    assert configure(bench.DEFAULTS, [])['out'] == ''  # bench.py writes a file only when --out names one


def test_readme_commands_leave_results_alone():
    """A command copied from the README or docs/ writes to out/, never over the committed results/ files;
    each results/memory_*.md records the command that wrote it, naming its own prefix."""
    import glob
    import re

    writes_results = re.compile(r'--(out|out_dir|report_dir)[= ]results\b')
    scripts = ('bench_memory.py', 'bench.py', 'experiments/compare.py', 'experiments/linreg.py', 'experiments/study.py')
    shown = set()
    for path in [os.path.join(ROOT, 'README.md')] + sorted(glob.glob(os.path.join(ROOT, 'docs', '*.md'))):
        for line in open(path):
            for script in scripts:
                if f'python {script}' in line:
                    shown.add(script)
                    assert not writes_results.search(line), (path, line)
    assert 'bench_memory.py' in shown  # the README shows the memory command
    for md in glob.glob(os.path.join(ROOT, 'results', 'memory_*.md')):
        prefix = os.path.relpath(md, ROOT)[: -len('.md')]
        command = next(line for line in open(md) if line.startswith('Command: `python bench_memory.py'))
        assert re.search(rf'--out={re.escape(prefix)}[` ]', command), (md, command)


@pytest.mark.skipif(torch.cuda.is_available(), reason='on a GPU the script would run the benchmarks')
def test_gpu_script_refuses_without_cuda():
    before = sorted(os.listdir(os.path.join(ROOT, 'results')))
    proc = subprocess.run(
        ['bash', os.path.join(ROOT, 'experiments', 'gpu_benchmarks.sh')], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and 'error: no CUDA device' in proc.stderr
    assert sorted(os.listdir(os.path.join(ROOT, 'results'))) == before


def test_meta_estimate_of_the_peak_within_one_percent_of_cpu_for_gpt2():
    """The estimate's total (Others included) against LiveBytes on real CPU tensors, GPT-2 layout. amp is
    left out: CPU runs it in fp32 without autocast, while meta emulates CUDA's bf16 autocast."""
    common = dict(SMALL, arch='gpt2', bias=True, methods='full,lisa_wor', precisions='bf16,bf16_master')
    meta = bench_memory.run(config(device='meta', **common))['rows']
    cpu = bench_memory.run(config(device='cpu', **common))['rows']
    for m, c in zip(meta, cpu):
        assert (m['method'], m['precision']) == (c['method'], c['precision'])
        assert abs(m['peak'] / c['peak'] - 1) < 0.01, (m['method'], m['precision'], m['peak'], c['peak'])


def test_sublayer_checkpointing_lowers_the_peak_with_offload():
    """Attention and MLP recomputed apart hold half a block's activations in the backward; with the
    block inputs offloaded, the extra saved inputs cost the device nothing."""
    common = dict(
        SMALL,
        methods='lisa_wor',
        precisions='bf16',
        activation_checkpointing=True,
        activation_offload=True,
        loss_chunk=16,
        batch_size=8,
    )
    whole = bench_memory.run(config(device='meta', **common))['rows'][0]
    halves = bench_memory.run(config(device='meta', checkpoint_sublayers=True, **common))['rows'][0]
    assert halves['others'] < whole['others'], (halves['others'], whole['others'])


def test_the_memory_benchmark_says_how_far_along_it_is(tmp_path):
    result = run_script(
        'bench_memory.py',
        [
            "--preset=",
            '--arch=llama',
            '--n_layer=2',
            '--n_head=2',
            '--n_embd=32',
            '--vocab_size=64',
            '--block_size=16',
            '--batch_size=2',
            '--methods=full,lisa_wor',
            '--device=meta',
            f'--out={tmp_path}/r',
        ],
    )
    assert result.returncode == 0, result.stderr[-2000:]
    progress = [line for line in result.stderr.splitlines() if line.startswith('measured ')]
    assert [p.split(' in ')[0] for p in progress] == [
        'measured 1/2 rows (full, amp)',
        'measured 2/2 rows (lisa_wor, amp)',
    ]
    assert progress[-1].endswith('about 0 s left')


EXPERIMENT_ARGS = [
    '--preset=',
    '--n_layer=4',
    '--n_head=2',
    '--n_embd=32',
    '--vocab_size=256',
    '--block_size=32',
    '--batch_size=2',
    '--device=cpu',
    '--compile=False',
]


def test_bench_profiles_one_more_iteration_by_host_time(tmp_path):
    """bench.py --profile: the iteration after the timed ones (a switch here: 2 + 3 = 5, period 5) under the
    profiler, its operators by host time (on CUDA by GPU time first) in PREFIX_METHOD_PRECISION.txt."""
    prefix = tmp_path / 'prof'
    proc = run_script(
        'bench.py',
        [
            *EXPERIMENT_ARGS,
            '--steps=3',
            '--warmup_steps=2',
            '--methods=lisa_wor',
            '--omgd_period=5',
            f'--profile={prefix}',
        ],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = (tmp_path / 'prof_lisa_wor_amp.txt').read_text()
    assert text.startswith('iteration 5, by host time\n') and 'Optimizer.step#AdamW.step' in text
    assert 'by GPU time' not in text  # the CPU has no device table


def test_speed_variants_times_each_variant(tmp_path):
    """experiments/speed_variants.py: one row per variant, in order, the report written where --out says; a
    variant it does not know is refused in one line before anything runs."""
    out = tmp_path / 'variants.md'
    proc = run_script(
        'experiments/speed_variants.py',
        [*EXPERIMENT_ARGS, '--steps=2', '--warmup_steps=1', '--variants=batch=2,outer,sdpa=math', f'--out={out}'],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [
        line.split(' | ') for line in out.read_text().splitlines() if line.startswith(('| batch=', '| outer', '| sdpa'))
    ]
    assert [r[0] for r in rows] == ['| batch=2', '| outer', '| sdpa=math']
    assert all(float(r[2].replace(',', '')) > 0 for r in rows)  # tokens/s
    proc = run_script('experiments/speed_variants.py', [*EXPERIMENT_ARGS, '--variants=batch=2,sdpa=fast'])
    assert proc.returncode == 1 and 'Traceback' not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: variants must be a comma list of batch=N")


def test_profile_loop_times_then_profiles_a_training_script_unedited(tmp_path):
    """experiments/profile_loop.py over train.py: its report and gzipped trace, the script's own --out_dir passed
    through, a file already named like its trace kept; a run too short to measure is one error line, exit 1; the
    optimizer hook and the warning filters do not outlive the run."""
    import gzip
    import warnings

    from conftest import TINY
    from torch.optim.optimizer import _global_optimizer_post_hooks

    always = ('always', None, Warning, None, 0)  # the filter profile_loop adds while it profiles
    hooks, filters = len(_global_optimizer_post_hooks), warnings.filters.count(always)
    (tmp_path / 'probe_trace.json').write_text('not this run')
    probe = ['experiments/profile_loop.py', f'--out={tmp_path}', '--name=probe', '--warmup=2', '--timed=3']
    train = ['train.py', *TINY, f'--out_dir={tmp_path / "run"}', '--eval_interval=100']
    proc = run_script(probe[0], [*probe[1:], '--profiled=2', *train, '--max_iters=8'])
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = (tmp_path / 'probe.txt').read_text()
    assert re.match(r'probe: \d+\.\d+ ms/iter \(steps 2-5\)\nprofiled 2 iterations: ', report), report[:300]
    assert json.loads(gzip.decompress((tmp_path / 'probe_trace.json.gz').read_bytes()))['traceEvents']
    assert (tmp_path / 'probe_trace.json').read_text() == 'not this run'
    assert (tmp_path / 'run' / 'ckpt.pt').exists()  # train.py's own --out_dir, not taken for profile_loop's --out
    proc = run_script(probe[0], [*probe[1:], '--profiled=20', *train, '--max_iters=8', '--overwrite=True'])
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
        'error: train.py made 8 optimizer steps, fewer than the 25 to measure; raise its --max_iters'
    ), proc.stderr[-2000:]
    assert len(_global_optimizer_post_hooks) == hooks and warnings.filters.count(always) == filters


def test_switch_timing_splits_switch_iterations(tmp_path):
    """experiments/switch_timing.py: every iteration shown once, the switches marked where the cycler switched
    (a switch every 2 iterations), per policy."""
    proc = run_script(
        'experiments/switch_timing.py',
        [*EXPERIMENT_ARGS, '--omgd_gamma=1', '--omgd_period=2', '--iters=8', '--shown=4', '--policies=keep,offload'],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for policy in ('keep', 'offload'):
        section = proc.stdout.split(f'omgd_state={policy}:')[1].splitlines()[1:5]
        assert [line.split()[0] for line in section] == ['4', '5', '6', '7']
        assert [line.split()[1] == 'S' for line in section] == [True, False, True, False]
