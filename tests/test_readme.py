"""The README's code map names files that exist, and its "where to look" names what the code defines."""

import importlib
import os
import re
import shlex

from conftest import ROOT, run_script, run_train


def readme_section(start, end):
    text = open(os.path.join(ROOT, 'README.md')).read()
    return text[text.index(start) : text.index(end)]


def test_the_code_map_names_files_that_exist():
    rows = [line for line in readme_section('## Code map', 'Where to look:').splitlines() if line.startswith('| `')]
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
    names = re.findall(r'`([a-z_]+(?:\.[A-Za-z_]+)+)(?:/\w+)?`', readme_section('Where to look:', 'One iteration'))
    assert len(names) >= 15, names  # the fifteen everyday concerns, at least
    for name in names:
        parts = name.split('.')
        module = parts[0] + '.' + parts[1] if parts[0] == 'infra' else parts[0]  # infra/: a folder of modules
        attributes = parts[len(module.split('.')) :]
        obj = importlib.import_module(module)
        for attribute in attributes:
            assert hasattr(obj, attribute), f"README names {name}, which {module}.py does not define"
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
    run_train(f'--out_dir={tmp_path / "out"}', '--max_iters=4', '--eval_interval=4')
    for python, script, *args in commands:
        args = [re.sub(r'^(--\w+=)out(?=/|$)', rf'\g<1>{tmp_path / "out"}', a) for a in args]
        result = run_script(script, args)
        assert result.returncode == 0, (script, args, result.stdout[-2000:], result.stderr[-2000:])
        if script == 'export.py':
            assert 'tokenizer: tokenizer.json, tokenizer_config.json: the ' in result.stdout, result.stdout
        if script == 'eval.py':
            assert re.search(r'^val loss [\d.]+, perplexity', result.stdout, re.M), result.stdout
