import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import bench_memory  # noqa: E402

GIB = 2 ** 30


def config(**overrides):
    cfg = dict(bench_memory.DEFAULTS)
    cfg.update(overrides)
    return cfg


def test_llama_7b_breakdown_matches_paper():
    """The paper's Model/Gradients/Optimizer columns, from the real optimizers' state on meta tensors."""
    cfg = config(model='llama-7b', methods='full,galore,golore,lisa,lisa_wor', batch_size=16, block_size=256,
                 device='meta', micro_batches=0)  # bytes only: no forward/backward, for speed
    result = bench_memory.run(cfg)
    assert result['estimate']
    got = {r['method']: tuple(round(r[k] / GIB, 2) for k in ('params', 'grads', 'optimizer'))
           for r in result['rows']}
    assert got == {'full': (12.55, 12.55, 25.10), 'galore': (12.55, 12.55, 1.73), 'golore': (12.55, 12.55, 1.73),
                   'lisa': (12.55, 1.24, 2.48), 'lisa_wor': (12.55, 1.24, 2.48)}
    galore_row = next(r for r in result['rows'] if r['method'] == 'galore')
    assert galore_row['projectors'] > 0  # counted apart, not as optimizer state


def test_meta_and_cpu_agree_on_exact_bytes():
    common = dict(model='tiny', n_layer=2, n_embd=64, vocab_size=512, block_size=32, batch_size=2, micro_batches=2,
                  galore_rank=8, methods='full,galore,lisa_wor,lisa_wor+master,lisa_wor+offload')
    meta = bench_memory.run(config(device='meta', **common))['rows']
    cpu = bench_memory.run(config(device='cpu', **common))['rows']
    for m, c in zip(meta, cpu):
        for key in ('params', 'grads', 'optimizer', 'cpu_state', 'projectors'):
            assert m[key] == c[key], (m['method'], key)
        assert m['others'] > 0 and c['others'] > 0
    offload = next(r for r in meta if r['method'] == 'lisa_wor+offload')
    plain = next(r for r in meta if r['method'] == 'lisa_wor')
    assert offload['optimizer'] == 0 and offload['cpu_state'] > 0 and offload['peak'] < plain['peak']


def test_cpu_build_keeps_gpt2_head_tied_to_embedding():
    """to_empty gives each module its own tensor; build_model must re-tie GPT-2's head to its embedding
    (untied, --device=cpu counted the 50304 x 768 head twice: 162.5M parameters instead of 123.9M)."""
    cfg = config(model='gpt2', n_layer=2, n_head=4, n_embd=64, vocab_size=512, block_size=32)
    counts = {}
    for device in ('meta', 'cpu'):
        net = bench_memory.build_model(bench_memory.model_config(cfg), torch.device(device), torch.float32, False)
        assert bench_memory.tied_parameters(net) == [['wte.weight', 'lm_head.weight']], device
        counts[device] = sum(p.numel() for p in net.parameters())
    from model import GPT
    assert counts['meta'] == counts['cpu'] == sum(p.numel() for p in GPT(bench_memory.model_config(cfg)).parameters())
    assert abs(net.wte.weight.std().item() - 0.02) < 0.002  # initialised after to_empty, not garbage
    rows = {device: bench_memory.run(config(device=device, methods='full', micro_batches=0, **{
        k: cfg[k] for k in ('model', 'n_layer', 'n_head', 'n_embd', 'vocab_size', 'block_size')}))['rows'][0]
        for device in ('meta', 'cpu')}
    assert all(rows['meta'][k] == rows['cpu'][k] for k in ('params', 'grads', 'optimizer', 'n_params'))


def test_live_bytes_counts_storages_once_and_frees():
    tracker = bench_memory.LiveBytes('meta')
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
    tracker = bench_memory.LiveBytes('meta')
    tracker.add(q)
    with tracker, bench_memory.MetaAsCuda():
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert out.shape == q.shape
    assert tracker.peak < 4 * 1024 * 1024 * 2 / 4  # far below one T x T score matrix per head


def run_script(*args, timeout=120):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_bench_memory_script_writes_outputs(tmp_path):
    prefix = str(tmp_path / 'mem')
    proc = run_script('bench_memory.py', '--model=llama-60m', '--methods=full,lisa_wor', '--batch_size=4',
                      '--block_size=64', '--device=meta', f'--out={prefix}')
    assert proc.returncode == 0, proc.stderr
    for ext in ('.md', '.json', '.png'):
        assert os.path.getsize(prefix + ext) > 0
    text = open(prefix + '.md').read()
    assert 'ESTIMATE' in text and '| lisa_wor |' in text
    data = json.load(open(prefix + '.json'))
    assert data['estimate'] and [r['method'] for r in data['rows']] == ['full', 'lisa_wor']
    assert data['rows'][1]['grads'] < data['rows'][0]['grads']


def test_bench_memory_rejects_unknown_keys():
    proc = run_script('bench_memory.py', '--batchsize=4')
    assert proc.returncode != 0 and 'unknown config key' in proc.stderr and 'batch_size' in proc.stderr
    with pytest.raises(ValueError, match=r'\+master or \+offload'):
        bench_memory.parse_method('lisa_wor+gpu')
    with pytest.raises(ValueError, match='AdamW methods'):
        bench_memory.parse_method('galore+offload')


def test_bench_script_runs(tmp_path):
    out = str(tmp_path / 'bench.md')
    proc = run_script('bench.py', '--model=tiny', '--n_layer=2', '--n_embd=64', '--vocab_size=512', '--batch_size=2', '--block_size=32', '--steps=2',
                      '--warmup_steps=1', '--methods=full,lisa_wor,galore', '--compile=False', f'--out={out}')
    assert proc.returncode == 0, proc.stderr
    text = open(out).read()
    rows = [line.split('|')[1:-1] for line in text.splitlines() if line.startswith('| ')]
    header = [cell.strip() for cell in rows[0]]
    speeds = {cells[0].strip(): float(cells[header.index('tokens/s')].replace(',', '')) for cells in rows[1:]}
    assert list(speeds) == ['full', 'lisa_wor', 'galore'] and all(v > 0 for v in speeds.values()), speeds
    cfg = config(model='tiny', n_layer=2, n_embd=64, vocab_size=512, block_size=32)
    net = bench_memory.build_model(bench_memory.model_config(cfg), torch.device('meta'), torch.float32, False)
    assert f"{sum(p.numel() for p in net.parameters()) / 1e6:.1f}M parameters" in text


@pytest.mark.parametrize('overrides,message', [
    (dict(dtype='fp16'), 'dtype must be'),
    (dict(batch_size=0), 'batch_size and grad_accum must be'),
    (dict(grad_accum=0), 'batch_size and grad_accum must be'),
    (dict(methods='adam'), 'unknown method'),
    (dict(methods=','), 'methods is empty'),
    (dict(device='tpu'), 'device must be auto'),
    (dict(model='gpt5', micro_batches=0), 'unknown model'),
    (dict(model='tiny', n_embd=100, n_head=3, micro_batches=0), 'model shape:'),
])
def test_bench_memory_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        bench_memory.run(config(**{'device': 'meta', 'methods': 'full', **overrides}))


@pytest.mark.parametrize('argv,message', [
    (['--device=tpu'], 'device must be auto'),
    (['--dtype=fp16'], 'dtype must be auto, float32 or bfloat16'),
    (['--steps=0'], 'steps must be >= 1'),
    (['--methods=lisa_wor+master'], 'has a suffix'),
    (['--methods=adam'], 'unknown method'),
    (['--methods='], 'methods is empty'),
    (['--model=gpt5'], 'unknown model'),
    (['--n_embd=100', '--n_head=3'], 'model shape:'),
    (['--stepz=3'], 'unknown config key'),
])
def test_bench_errors(argv, message):
    import bench
    with pytest.raises(SystemExit, match=message):
        bench.main(['--device=cpu', *argv] if not argv[0].startswith('--device') else argv)


def test_master_variants_build_optim_master_adamw():
    """+master/+offload use optim.MasterAdamW (tested in test_optim.py); off CUDA, +offload keeps the
    state on the one device and marks it as host memory for LiveBytes."""
    import contextlib
    import optim
    cfg = config(model='tiny', n_layer=2, n_embd=64, vocab_size=512, block_size=32)
    net = bench_memory.build_model(bench_memory.model_config(cfg), torch.device('meta'), torch.bfloat16, False)
    tracker = bench_memory.LiveBytes('meta')
    master = bench_memory.build_optimizer(net, 'lisa_wor', 'master', cfg, torch.device('meta'), tracker)
    offload = bench_memory.build_optimizer(net, 'lisa_wor', 'offload', cfg, torch.device('meta'), tracker)
    assert type(master) is type(offload) is optim.MasterAdamW
    assert master.master_device is None and offload.master_device is None
    assert offload.host_scope == tracker.host and master.host_scope is contextlib.nullcontext
    assert [g['weight_decay'] for g in master.param_groups] == [cfg['weight_decay'], 0.0]


def gpu_script_commands():
    """The (script, [keys]) of every `run python SCRIPT.py --key=...` command of experiments/gpu_benchmarks.sh."""
    text = open(os.path.join(ROOT, 'experiments', 'gpu_benchmarks.sh')).read().replace('\\\n', ' ')
    commands = []
    for line in text.splitlines():
        words = line.split()
        if words[:2] == ['run', 'python']:
            commands.append((words[2], [w[2:].split('=')[0] for w in words[3:] if w.startswith('--')]))
    return commands


def test_gpu_script_uses_only_valid_keys():
    """A mistyped key would only show on the GPU, after minutes of other benchmarks."""
    import bench
    defaults = {'bench_memory.py': bench_memory.DEFAULTS, 'bench.py': bench.DEFAULTS}
    commands = gpu_script_commands()
    assert [script for script, _ in commands] == ['bench_memory.py'] * 3 + ['bench.py']
    for script, keys in commands:
        assert keys and all(key in defaults[script] for key in keys), (script, keys)
    assert all('out' in keys for _, keys in commands)  # results/ is written only when named


def under(path, folder):
    """Whether `path` (relative paths from the repository root, where the commands run) lies in `folder`."""
    path, folder = (os.path.realpath(os.path.join(ROOT, p)) for p in (path, folder))
    return os.path.commonpath([path, folder]) == folder


def git_ignored(path):
    """Whether the top folder of `path` matches a folder pattern of .gitignore (as out*/ does)."""
    import fnmatch
    top = os.path.relpath(os.path.realpath(os.path.join(ROOT, path)), ROOT).split(os.sep)[0]
    patterns = [line.strip().strip('/') for line in open(os.path.join(ROOT, '.gitignore')) if line.strip().endswith('/')]
    return any(fnmatch.fnmatch(top, p) for p in patterns)


def test_default_outputs_stay_out_of_results():
    """Run as documented without --out, a benchmark must not overwrite the committed results/ files."""
    import bench
    from configurator import configure
    for model in ('llama-7b', 'gpt2'):
        prefix = bench_memory.output_prefix(configure(bench_memory.DEFAULTS, [f'--model={model}']))
        assert not under(prefix, 'results') and git_ignored(prefix), prefix
    assert bench_memory.output_prefix(configure(bench_memory.DEFAULTS, ['--out=results/x'])) == 'results/x'
    assert configure(bench.DEFAULTS, [])['out'] == ''  # bench.py writes a file only when --out names one


def test_readme_commands_that_write_results_name_their_output():
    """The README's commands behind the committed results/ files say where they write."""
    flags = {'bench_memory.py': '--out=results/', 'experiments/compare.py': '--out_dir=results',
             'experiments/linreg.py': '--out_dir=results'}
    found = set()
    for line in open(os.path.join(ROOT, 'README.md')):
        for script, flag in flags.items():
            if f'python {script}' in line:
                found.add(script)
                assert flag in line, line
    assert found == set(flags)


@pytest.mark.skipif(torch.cuda.is_available(), reason='on a GPU the script would run the benchmarks')
def test_gpu_script_refuses_without_cuda():
    before = sorted(os.listdir(os.path.join(ROOT, 'results')))
    proc = subprocess.run(['bash', os.path.join(ROOT, 'experiments', 'gpu_benchmarks.sh')],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and 'error: no CUDA device' in proc.stderr
    assert sorted(os.listdir(os.path.join(ROOT, 'results'))) == before
