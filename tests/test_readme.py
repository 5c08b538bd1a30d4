"""The README's code map names files that exist, and docs/training.md's "where to look" names what the code
defines; the commands the README and docs/ show parse, run (after training) as written and give the figures they
document."""

import importlib
import os
import re
import shlex

from conftest import ROOT, run_script, run_train


def readme_section(start, end, path='README.md'):
    text = open(os.path.join(ROOT, path)).read()
    return text[text.index(start) : text.index(end)]


def test_the_code_map_names_files_that_exist():
    rows = [line for line in readme_section('## Code map', 'Beside the code:').splitlines() if line.startswith('| `')]
    files = [name for row in rows for name in re.findall(r'`([\w/.*-]+\.py|[\w-]+/)`', row.split('|')[1])]
    assert len(files) > 20, files
    for name in files:
        if '*' not in name:
            assert os.path.exists(os.path.join(ROOT, name)), name


def test_infra_readme_names_every_file_of_infra_and_no_other():
    rows = [
        line for line in open(os.path.join(ROOT, 'infra', 'README.md')).read().splitlines() if line.startswith('| `')
    ]
    named = [name for row in rows for name in re.findall(r'`(\w+\.py)`', row.split('|')[1])]
    assert sorted(named) == sorted(
        f for f in os.listdir(os.path.join(ROOT, 'infra')) if f.endswith('.py') and f != '__init__.py'
    )


def test_where_to_look_names_what_the_code_defines():
    names = re.findall(
        r'`([a-z_]+(?:\.[A-Za-z_]+)+)(?:/\w+)?`', readme_section('Where to look:', 'One iteration', 'docs/training.md')
    )
    assert len(names) >= 15, names  # the fifteen everyday concerns, at least
    for name in names:
        parts = name.split('.')
        module = parts[0] + '.' + parts[1] if parts[0] == 'infra' else parts[0]  # infra/: a folder of modules
        attributes = parts[len(module.split('.')) :]
        obj = importlib.import_module(module)
        for attribute in attributes:
            assert hasattr(obj, attribute), f"docs/training.md names {name}, which {module}.py does not define"
            obj = getattr(obj, attribute)


def test_after_training_commands_run_on_the_quick_starts_out(tmp_path):
    """The README's "After training" commands for the quick start's out/ run as written, on a tiny run of the same
    dataset in its place (out/ -> a temporary out/): each exits 0, and the export's tokenizer is the characters."""
    block = readme_section('**After training**', '## Methods')
    commands = [
        shlex.split(line.split('  #')[0])
        for line in block.splitlines()
        if line.startswith('python ') and re.search(r'=out( |/|$)', line)
    ]
    assert [c[1] for c in commands] == ['eval.py', 'sample.py', 'export.py', 'eval.py'], commands
    # train.py's default batch_size and eval_iters (TINY's are smaller): the export's val loss must be train.py's
    run_train(
        f'--out_dir={tmp_path / "out"}', '--max_iters=4', '--eval_interval=4', '--batch_size=32', '--eval_iters=20'
    )
    losses = []
    for python, script, *args in commands:
        args = [re.sub(r'^(--\w+=)out(?=/|$)', rf'\g<1>{tmp_path / "out"}', a) for a in args]
        result = run_script(script, args)
        assert result.returncode == 0, (script, args, result.stdout[-2000:], result.stderr[-2000:])
        if script == 'export.py':
            assert 'tokenizer: tokenizer.json, tokenizer_config.json: the ' in result.stdout, result.stdout
        if script == 'eval.py':
            losses.append(re.search(r'^val loss ([\d.]+), perplexity', result.stdout, re.M).group(1))
    assert losses[0] == losses[1], losses  # the checkpoint and its export, read back


def doc_text(name):
    return open(os.path.join(ROOT, name)).read()


def documented_command(text, start):
    """The first command after `start` in a markdown text, its continuation lines joined, split like a shell."""
    text = text[text.index(start) :]
    line = re.search(r'^python .*?(?<!\\)$', text, re.M | re.S).group(0)
    return shlex.split(line.replace('\\\n', ' '))


def test_the_gpt2_xl_fine_tune_memory_table_is_what_the_estimator_prints():
    """docs/models.md's GPT-2 XL table and the README's estimate for the config, against a re-run of the documented
    command (about a minute on one thread: the four rows on the meta device)."""
    import bench_memory
    from configurator import configure

    models = doc_text('docs/models.md')
    python, script, *argv = documented_command(models, '**Memory on one GPU, estimated**')
    assert script == 'bench_memory.py' and argv[0] == 'config/finetune_shakespeare_lisa_wor.py', argv
    table = models[models.index('| method | precision | weights |') :].split('\n\n')[0].splitlines()[2:]
    documented = {
        (cells[0].split()[0], cells[1]): [float(c) for c in cells[2:]]
        for cells in ([c.replace('*', '').strip() for c in row.strip('|').split('|')] for row in table)
    }
    assert len(documented) == 4, table
    # --device=meta: the estimator's rows, also where a GPU would measure them
    result = bench_memory.run(
        configure(bench_memory.DEFAULTS, [os.path.join(ROOT, argv[0]), *argv[1:], '--device=meta'])
    )
    assert result['estimate']
    printed = {
        (r['method'], r['precision']): [
            round(bench_memory.gib(r[k]), 2) for k in ('params', 'grads', 'optimizer', 'others', 'peak')
        ]
        for r in result['rows']
    }
    assert printed == documented
    readme_line = next(
        line for line in doc_text('README.md').splitlines() if 'finetune_shakespeare_lisa_wor.py  ' in line
    )
    estimate = float(re.search(r'~([\d.]+) GiB \(estimate\)', readme_line).group(1))
    assert estimate == round(printed['lisa_wor', 'amp'][-1], 1), readme_line


DOCS = [
    'README.md',
    *sorted(os.path.join('docs', f) for f in os.listdir(os.path.join(ROOT, 'docs'))),
    'results/precision_bisect.md',
]


def documented_commands():
    """(file, argv) of every `python SCRIPT.py ...` and `torchrun ... train.py ...` the docs show: in code blocks (a
    line, its continuations joined, the comment cut) and inline (`python ...`); argv from the script on."""
    found = []
    for name in DOCS:
        text = doc_text(name)
        blocks = re.findall(r'^```\w*\n(.*?)^```', text, re.M | re.S)
        prose = re.sub(r'^```\w*\n.*?^```', '', text, flags=re.M | re.S)
        lines = [line for block in blocks for line in block.replace('\\\n', ' ').splitlines()]
        lines += [span.replace('\n', ' ') for span in re.findall(r'`((?:OMP_NUM_THREADS=\d+ )?python [^`]+)`', prose)]
        for line in lines:
            words = [w.strip('[]') for w in shlex.split(line.split('|')[0], comments=True)]  # [--optional=X]
            while words and re.match(r'^[A-Z_]+=', words[0]):  # OMP_NUM_THREADS=1 and such
                words = words[1:]
            if words[:1] == ['torchrun']:
                words = words[next(i for i, w in enumerate(words) if w.endswith('.py')) :]
            elif words[:1] == ['python'] and len(words) > 1 and words[1].endswith('.py'):
                words = words[1:]
            else:
                continue
            found.append((name, words))
    return found


def script_keys(script):
    """{key: default} of a script, read from its --help (every script's configurator.command_line)."""
    import ast

    result = run_script(script, ['--help'])
    assert result.returncode == 0, (script, result.stderr[-500:])
    keys = {}
    for line in result.stdout.splitlines():
        if match := re.match(r'^  --(\w+)=(\S+)', line):
            keys[match.group(1)] = ast.literal_eval(match.group(2))
    assert keys, (script, result.stdout[-500:])
    return keys


def test_every_documented_command_parses():
    """Each command the README and docs/ show names a script that exists and gives only its keys, as --key=value
    (placeholders such as DIR are strings), with config files that exist, values of each key's type."""
    from configurator import configure

    commands = documented_commands()
    scripts = sorted({argv[0] for _, argv in commands})
    assert {'train.py', 'eval.py', 'sample.py', 'export.py', 'bench_memory.py'} <= set(scripts), scripts
    keys = {script: script_keys(script) for script in scripts}
    cwd = os.getcwd()
    os.chdir(ROOT)  # config files are named from the checkout's root
    try:
        for name, (script, *args) in commands:
            if args in (['--help'], ['-h']):
                continue
            for arg in args:
                assert not arg.startswith('--') or '=' in arg, f"{name}: {arg} is not --key=value"
                assert arg.startswith('--') or os.path.isfile(arg), f"{name}: no config file {arg}"
            placeholders = [a for a in args if re.match(r'^--\w+=[A-Z]+$', a)]  # --num_proc=N: any value of its type
            assert all(a[2:].split('=')[0] in keys[script] for a in placeholders), (name, placeholders)
            configure(
                keys[script], [a for a in args if a not in placeholders]
            )  # an unknown key or a value of the wrong type raises here
    finally:
        os.chdir(cwd)


def test_documented_training_commands_do_not_write_into_the_quick_starts_out():
    """After the quick start filled out/, a train.py command with the default out_dir is refused: every documented
    training command other than the quick start itself names its own --out_dir (itself or by its config file)."""
    import train_config
    from configurator import configure

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        into_out = [
            (name, ' '.join(argv))
            for name, argv in documented_commands()
            if argv[0] == 'train.py'
            and not name.startswith('results/')  # a record of what ran (in fresh worktrees), not advice
            and argv[1:] not in ([], ['--help'])
            and configure(train_config.DEFAULTS, argv[1:])['out_dir'] == 'out'
        ]
    finally:
        os.chdir(cwd)
    assert into_out == []


def test_ci_runs_the_readmes_test_command():
    """.ci/run's suite line is the README's first test command (with CI's environment variables in front)."""
    readme = open(os.path.join(ROOT, 'README.md')).read()
    command = re.search(r'^(python -m pytest [^#\n]*?)\s*# all', readme, re.M).group(1)
    run = open(os.path.join(ROOT, '.ci', 'run')).read()
    suite = [line for line in run.splitlines() if 'python -m pytest' in line and not line.startswith('#')]
    assert len(suite) == 1 and suite[0].endswith(' ' + command), (suite, command)
