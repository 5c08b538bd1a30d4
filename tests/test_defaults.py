"""Each default once: a dataclass that mirrors train.py's keys (omgd.CyclerConfig: method and the omgd_* keys)
holds their defaults, and train_config reads them from it instead of stating them again."""

import ast
import os
from dataclasses import fields

import omgd
import train_config


def mirrored_keys():
    """{CyclerConfig field: its train.py key} for every field that has one."""
    keys = {f.name: 'method' if f.name == 'method' else f'omgd_{f.name}' for f in fields(omgd.CyclerConfig)}
    return {name: key for name, key in keys.items() if key in train_config.DEFAULTS}


def test_the_cycler_defaults_are_the_keys_defaults():
    assert len(mirrored_keys()) >= 7
    assert omgd.CyclerConfig.from_config(train_config.DEFAULTS) == omgd.CyclerConfig()


def test_train_config_states_no_cycler_default_again():
    """A literal for a mirrored key would be a second statement of its default (and could contradict it)."""
    with open(os.path.join(os.path.dirname(train_config.__file__), 'train_config.py')) as f:
        tree = ast.parse(f.read())
    keys = set(mirrored_keys().values())
    restated = [
        n.targets[0].id
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and n.targets[0].id in keys
        if isinstance(n.value, ast.Constant)
    ]
    assert restated == []
