"""Helpers shared by several test files."""
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def train_defaults(**overrides):
    """train.py's module-level literal defaults (its config keys), on CPU, with overrides."""
    defaults = {}
    for node in ast.parse(open(os.path.join(ROOT, 'train.py')).read()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                defaults[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    defaults.update(device='cpu', dtype='float32', compile=False, backend='gloo')
    return {**defaults, **overrides}


def assert_same_state(a, b):
    """Two train.py checkpoints hold bitwise the same model, optimizer, schedule and data position."""
    import torch
    assert a['iter_num'] == b['iter_num']
    for k in a['model']:
        assert torch.equal(a['model'][k], b['model'][k]), k
    assert a['optimizer']['state'].keys() == b['optimizer']['state'].keys()
    for index, s1 in a['optimizer']['state'].items():  # by parameter index: insertion orders may differ
        s2 = b['optimizer']['state'][index]
        assert s1.keys() == s2.keys()
        assert all(torch.equal(s1[k], s2[k]) if torch.is_tensor(s1[k]) else s1[k] == s2[k] for k in s1)
    ca, cb = a['cycler'], b['cycler']
    assert (ca['active'], ca['last_switch'], ca['schedule']['pending']) == \
        (cb['active'], cb['last_switch'], cb['schedule']['pending'])
    assert torch.equal(ca['schedule']['rng'], cb['schedule']['rng'])
    assert a['data'] == b['data']
