"""configurator.py: config files then --key=value, strict keys and types."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import train_defaults  # noqa: E402

from configurator import ConfigError, at_least, configure  # noqa: E402

DEFAULTS = dict(learning_rate=6e-4, max_iters=100, compile=True, method='lisa_wor', omgd_gamma=2)


def test_file_then_overrides_in_order(tmp_path):
    cfg = tmp_path / 'c.py'
    cfg.write_text("import math\nmethod = 'lisa'\nomgd_gamma = 3\n_private = 1\nmax_iters = int(math.sqrt(400))\n")
    out = configure(DEFAULTS, [str(cfg), '--omgd_gamma=4'])
    assert out == dict(DEFAULTS, method='lisa', omgd_gamma=4, max_iters=20)


@pytest.mark.parametrize(
    'text, value', [('True', True), ('false', False), ('1', True), ('0', False), ('true', True), ('False', False)]
)
def test_booleans(text, value):
    assert configure(DEFAULTS, [f'--compile={text}'])['compile'] is value


def test_int_for_float_and_strings():
    out = configure(DEFAULTS, ['--learning_rate=1', '--method=full'])
    assert out['learning_rate'] == 1.0 and isinstance(out['learning_rate'], float)
    assert out['method'] == 'full'


@pytest.mark.parametrize(
    'argv, message',
    [
        (['--lerning_rate=1e-3'], "unknown config key 'lerning_rate'; did you mean learning_rate?"),
        (['--omgd_gama=3'], "did you mean omgd_gamma?"),
        (['--max_iters=1e3'], "max_iters=1000.0 has type float, expected int"),
        (['--max_iters=abc'], "max_iters='abc' is not a valid int"),
        (['--compile=yes'], "compile='yes' is not a valid bool"),
        (['--max_iters'], "expected --key=value, got '--max_iters'; give --max_iters=VALUE"),
        (['--compil'], "expected --key=value, got '--compil'; unknown config key 'compil'; did you mean compile?"),
        (['missing_config.py'], "cannot read config file 'missing_config.py'"),
    ],
)
def test_errors_are_one_line_and_helpful(argv, message):
    with pytest.raises(ConfigError) as e:
        configure(DEFAULTS, argv)
    assert message in str(e.value) and '\n' not in str(e.value)


@pytest.mark.parametrize(
    'arg, message',
    [
        ('--max_iters=9223372036854775808', "max_iters=9223372036854775808 does not fit in 64 bits"),
        ('--max_iters=-9223372036854775809', "does not fit in 64 bits (torch's integers, -2**63 .. 2**63-1)"),
        ('--learning_rate=1e400', "learning_rate=inf is not a finite number; give one such as 0.0006"),
        ('--learning_rate=-1e999', "learning_rate=-inf is not a finite number"),
        ('--learning_rate=1' + '0' * 400, "is not a finite number"),  # an int beyond float's range
    ],
)
def test_ints_beyond_64_bits_and_infinite_floats_are_refused(arg, message):
    """torch.manual_seed(2**64) or a size of 10**20 would fail in torch's words, not naming the key."""
    with pytest.raises(ConfigError) as e:
        configure(DEFAULTS, [arg])
    assert message in str(e.value) and '\n' not in str(e.value)
    edge = configure(DEFAULTS, ['--max_iters=9223372036854775807', '--learning_rate=1e308'])
    assert edge['max_iters'] == 2**63 - 1 and edge['learning_rate'] == 1e308


def test_a_bare_switch_of_a_boolean_key_is_true():
    given = set()
    out = configure(DEFAULTS, ['--compile=False', '--compile'], given=given)
    assert out['compile'] is True and given == {'compile'}


@pytest.mark.parametrize(
    'text, message',
    [
        ("method = 'lisa'\nomgd_gama = 10\n", "line 2: unknown config key 'omgd_gama'; did you mean omgd_gamma?"),
        ("max_iters = 1e3\n", "line 1: max_iters=1000.0 has type float, expected int (default 100)"),
        ("max_iters = 5\nif True:\n    max_iters = 'five'\n", "line 3: max_iters='five' is not a valid int"),
    ],
)
def test_a_bad_key_or_value_in_a_config_file_names_the_file_and_line(tmp_path, text, message):
    cfg = tmp_path / 'c.py'
    cfg.write_text(text)
    with pytest.raises(ConfigError) as e:
        configure(DEFAULTS, [str(cfg)])
    assert str(e.value).startswith(f"config file {str(cfg)!r}, {message}"), str(e.value)


def test_a_rule_names_the_config_file_only_when_the_file_set_the_value(tmp_path):
    cfg = tmp_path / 'c.py'
    cfg.write_text("method = 'lisa'\nmax_iters = 0\n")
    rules = {'max_iters': at_least(1)}
    with pytest.raises(ConfigError) as e:
        configure(DEFAULTS, [str(cfg)], rules)
    assert str(e.value) == f"config file {str(cfg)!r}, line 2: max_iters must be >= 1, got 0"
    with pytest.raises(ConfigError) as e:
        configure(DEFAULTS, [str(cfg), '--max_iters=-1'], rules)
    assert str(e.value) == "max_iters must be >= 1, got -1"


@pytest.mark.parametrize(
    'text, message',
    [
        ("max_iters = (\n", "line 1: SyntaxError: '(' was never closed"),
        ("method = 'lisa'\nmax_iters = steps * 2\n", "line 2: NameError: name 'steps' is not defined"),
    ],
)
def test_mistake_inside_config_file_names_file_and_line(tmp_path, text, message):
    cfg = tmp_path / 'c.py'
    cfg.write_text(text)
    with pytest.raises(ConfigError) as e:
        configure(DEFAULTS, [str(cfg)])
    assert str(e.value) == f"config file {str(cfg)!r}, {message}"


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shipped_config(name):
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return configure(train_defaults(), [os.path.join('config', name)])
    finally:
        os.chdir(cwd)


def test_every_shipped_config_file_is_valid():
    configs = sorted(f for f in os.listdir(os.path.join(ROOT, 'config')) if f.endswith('.py'))
    assert 'gpt2_lisa_wor.py' in configs and 'shakespeare_lisa_wor.py' in configs
    for name in configs:
        shipped_config(name)


def test_gpt2_configs_hold_the_papers_settings():
    # appendix "Experimental Details", GPT-2 pre-training; the paper describes no cycling warm-up
    paper = dict(
        preset='gpt2',
        block_size=1024,
        max_iters=100000,
        lr_decay_iters=100000,
        learning_rate=6e-4,
        min_lr=6e-5,
        warmup_iters=2000,
        weight_decay=0.1,
        beta1=0.9,
        beta2=0.95,
        omgd_gamma=3,
        omgd_period=100,
        omgd_warmup=0,
        dataset='openwebtext',
    )
    for name, method in (('gpt2_lisa_wor.py', 'lisa_wor'), ('gpt2_lisa.py', 'lisa'), ('gpt2_full.py', 'full')):
        cfg = shipped_config(name)
        assert {k: cfg[k] for k in paper} == paper and cfg['method'] == method
        assert cfg['batch_size'] * cfg['block_size'] * cfg['gradient_accumulation_steps'] == 60 * 1024 * 8


def test_help_lists_every_key_with_its_default_and_meaning():
    from conftest import run_script

    import train_config

    result = run_script('train.py', ['--help'])
    assert result.returncode == 0 and result.stderr == ''
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.startswith('  --')}
    assert sorted(lines) == sorted(f'--{k}={v!r}' for k, v in train_config.DEFAULTS.items())
    assert all(len(line.split(None, 1)) == 2 for line in lines.values())  # each with its comment
    sample = run_script('sample.py', ['-h'])
    assert sample.returncode == 0 and '--temperature=0.8' in sample.stdout


def test_defaults_are_data_importable_without_running_a_script():
    import train_config

    assert train_config.DEFAULTS['method'] == 'lisa_wor' and train_config.DEFAULTS['omgd_gamma'] == 2
    gpu_machine = train_config.machine_defaults(cuda=True)
    assert gpu_machine['dtype'] == 'bfloat16' and gpu_machine['compile'] is True


@pytest.mark.parametrize(
    'key, value, library_call',
    [
        ('sampling', 'seq', lambda path: __import__('dataloader').TokenBatches(path, 8, 2, sampling='seq')),
        (
            'loss_chunk',
            -1,
            lambda path: __import__('infra.memory_options', fromlist=['apply']).apply(tiny_model(), loss_chunk=-1),
        ),
        ('omgd_period', 0, lambda path: cycler_of(period=0)),
        ('omgd_ratio', 1.5, lambda path: cycler_of(method='tensor_iid', ratio=1.5)),
        ('omgd_state', 'free', lambda path: cycler_of(state='free')),
        ('omgd_always', 'embed,tail', lambda path: cycler_of(always=('embed', 'tail'))),
        ('preset', 'gpt5', lambda path: __import__('model').config_from_preset('gpt5')),
    ],
)
def test_a_library_key_has_one_rule_that_the_config_and_the_library_both_apply(tmp_path, key, value, library_call):
    """train_config checks a whole config with the rules the libraries own and apply themselves: the
    same one-line message from `--key=value` and from the library call."""
    import numpy as np

    import train_config

    path = tmp_path / 'train.bin'
    np.arange(200, dtype=np.uint16).tofile(path)
    with pytest.raises(ValueError) as from_config:
        train_config.load([f'--{key}={value}', '--device=cpu'])
    with pytest.raises(ValueError) as from_library:
        library_call(str(path))
    assert str(from_config.value) == str(from_library.value)


def tiny_model():
    from model import Transformer, TransformerConfig

    return Transformer(TransformerConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32))


def cycler_of(**fields):
    import torch

    import omgd

    model = tiny_model()
    return omgd.build_cycler(
        model, torch.optim.AdamW(model.parameters()), omgd.CyclerConfig(**{'method': 'lisa_wor', 'gamma': 1, **fields})
    )


SCRIPTS = (
    'train.py',
    'sample.py',
    'eval.py',
    'export.py',
    'bench.py',
    'bench_memory.py',
    'experiments/bench_checkpoint.py',
    'experiments/bench_generate.py',
    'experiments/bench_ddp_switch.py',
    'experiments/study.py',
    'experiments/compare.py',
    'experiments/precision.py',
    'experiments/linreg.py',
)


@pytest.mark.parametrize('script', SCRIPTS)
def test_every_script_has_the_one_command_line(script):
    """configurator's --key=value for every script: --help lists each key with its default and exits 0;
    a key the script does not have, or a bare word of argparse's style, is one `error:` line."""
    from conftest import run_script

    result = run_script(script, ['--help'])
    assert result.returncode == 0 and result.stderr == '', result.stderr[-500:]
    assert 'keys (default, meaning):' in result.stdout
    assert any(line.startswith('  --') and '=' in line for line in result.stdout.splitlines())
    for bad, message in (
        (['--no_such_key=1'], "unknown config key 'no_such_key'"),
        (['--seeds', '3'], 'expected --key=value'),
    ):
        result = run_script(script, bad)
        assert result.returncode == 1 and 'Traceback' not in result.stderr, result.stderr[-800:]
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith('error: ') and message in lines[0], result.stderr[-800:]


@pytest.mark.parametrize(
    'key, value, library_call',
    [
        ('galore_rank', 0, lambda: galore_of(rank=0)),
        ('galore_update_proj_gap', 0, lambda: galore_of(update_proj_gap=0)),
        ('galore_scale', 0.0, lambda: galore_of(scale=0.0)),
        ('arch', 'mamba', lambda: __import__('model').TransformerConfig(arch='mamba')),
    ],
)
def test_galore_and_model_keys_have_one_rule_too(key, value, library_call):
    import train_config

    with pytest.raises(ValueError) as from_config:
        train_config.load([f'--{key}={value}', '--device=cpu'])
    with pytest.raises(ValueError) as from_library:
        library_call()
    assert str(from_config.value) == str(from_library.value)


def galore_of(**kwargs):
    import galore

    return galore.build_optimizer(tiny_model(), 0.1, 1e-3, (0.9, 0.99), **kwargs)


def test_the_device_given_decides_the_defaults_that_depend_on_it(monkeypatch):
    """--device=cpu on a GPU machine (its defaults: bf16, compile, nccl) trains as a CPU machine would, unless
    those keys are given too; with no --device the machine's defaults stay."""
    import train_config

    gpu_machine = {**train_config.DEFAULTS, **train_config.machine_defaults(cuda=True)}
    cpu = train_config.machine_defaults(cuda=False)
    cfg = train_config.load(['--device=cpu'], defaults=gpu_machine)
    assert {k: cfg[k] for k in cpu} == cpu
    cfg = train_config.load(['--device=cpu', '--compile=True', '--dtype=bfloat16'], defaults=gpu_machine)
    assert (cfg['compile'], cfg['dtype'], cfg['backend']) == (True, 'bfloat16', 'gloo')
    monkeypatch.setattr(train_config, 'check_device', lambda device: None)  # 'cuda' on this CPU machine
    cfg = train_config.load(['--max_iters=5'], defaults=gpu_machine)
    assert (cfg['device'], cfg['compile'], cfg['backend']) == ('cuda', True, 'nccl')
    # bench.py and the benchmarks of experiments/ (bench.setup), whose device may also be 'auto'
    import torch

    import bench

    monkeypatch.setattr(bench, 'check', lambda cfg: (torch.device('cpu'), [cfg], None))
    for argv, compiled in (
        (['--device=cpu'], False),
        (['--device=auto'], True),
        (['--device=cpu', '--compile=True'], True),
    ):
        given = set()
        cfg = configure({**bench.DEFAULTS, **gpu_machine, 'device': 'auto'}, argv, given=given)
        assert bench.setup(cfg, given)[1][0]['compile'] is compiled, argv
