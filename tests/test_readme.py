"""The README's code map names files that exist, and its "where to look" names what the code defines."""
import importlib
import os
import re

from conftest import ROOT


def readme_section(start, end):
    text = open(os.path.join(ROOT, 'README.md')).read()
    return text[text.index(start):text.index(end)]


def test_the_code_map_names_files_that_exist():
    rows = [line for line in readme_section('## Code map', 'Where to look:').splitlines() if line.startswith('| `')]
    files = [name for row in rows for name in re.findall(r'`([\w/.*-]+\.py|[\w-]+/)`', row.split('|')[1])]
    assert len(files) > 20, files
    for name in files:
        if '*' not in name:
            assert os.path.exists(os.path.join(ROOT, name)), name


def test_where_to_look_names_what_the_code_defines():
    names = re.findall(r'`([a-z_]+(?:\.[A-Za-z_]+)+)(?:/\w+)?`', readme_section('Where to look:', 'One iteration'))
    assert len(names) >= 15, names  # the fifteen everyday concerns, at least
    for name in names:
        module, *attributes = name.split('.')
        obj = importlib.import_module(module)
        for attribute in attributes:
            assert hasattr(obj, attribute), f"README names {name}, which {module}.py does not define"
            obj = getattr(obj, attribute)
