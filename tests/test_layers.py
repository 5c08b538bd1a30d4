"""The layers import one way (README, code map): base (infra/, configurator.py) < model and method (model, omgd,
optim, galore, dataloader, data/) < run (train_config, builder, trainer, hf, memory_estimate) < scripts. Every
import of a project module is read from the source (ast), those inside functions too."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = {
    'base': ('infra', 'configurator'),
    'model and method': ('model', 'omgd', 'optim', 'galore', 'dataloader', 'data'),
    'run': ('train_config', 'builder', 'trainer', 'hf', 'memory_estimate'),
    'scripts': ('train', 'sample', 'eval', 'export', 'bench', 'bench_memory', 'experiments'),
}
ORDER = list(LAYERS)


def layer_of(module):
    """The layer of a dotted module name ('infra.checkpoint', 'data.tokenizer'), or None: not the project's."""
    top = module.split('.')[0]
    return next((name for name, tops in LAYERS.items() if top in tops), None)


def modules(root):
    """{dotted name: path} of every .py file of the project under root (tests and config files are no modules)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith('.') and d not in ('tests', 'config', '__pycache__')]
        for f in files:
            if f.endswith('.py'):
                rel = os.path.relpath(os.path.join(folder, f), root)[:-3]
                found[rel.replace(os.sep, '.').removesuffix('.__init__')] = os.path.join(folder, f)
    return found


def upward_imports(root):
    """['path:line imports name (layer)'] of every import of a module in a higher layer than the importer's."""
    bad = []
    for name, path in modules(root).items():
        own = layer_of(name)
        assert own is not None, f"{path} is in no layer: add it to LAYERS (and to the README's code map)"
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module]
            else:
                continue
            for target in targets:
                layer = layer_of(target)
                if layer is not None and ORDER.index(layer) > ORDER.index(own):
                    bad.append(f"{os.path.relpath(path, root)}:{node.lineno} imports {target} ({layer})")
    return bad


def test_no_module_imports_a_layer_above_its_own():
    assert upward_imports(ROOT) == []


@pytest.mark.parametrize(
    'path, source',
    [
        ('infra/store.py', 'import os\n\n\ndef f():\n    from model import Transformer\n'),  # lazily, in a function
        ('configurator.py', 'import train_config\n'),
        ('omgd.py', 'from builder import build\n'),
        ('data/prep.py', 'import trainer\n'),
    ],
)
def test_the_check_finds_a_planted_upward_import(tmp_path, path, source):
    """The check on a tree with one upward import: it names that import and nothing else."""
    for name, text in {'model.py': 'import torch\n', 'infra/__init__.py': '', path: source}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    bad = upward_imports(str(tmp_path))
    assert len(bad) == 1 and bad[0].startswith(f"{path}:"), bad
