"""Each default once: a dataclass that mirrors train.py's keys (omgd.CyclerConfig: method and the omgd_* keys;
model.TransformerConfig: the model's keys) holds their defaults, and train_config reads them from it instead of
stating them again."""

import ast
import os
from dataclasses import fields

import builder
import omgd
import train_config
from model import TransformerConfig


def cycler_keys():
    """{CyclerConfig field: its train.py key} for every field that has one."""
    keys = {f.name: 'method' if f.name == 'method' else f'omgd_{f.name}' for f in fields(omgd.CyclerConfig)}
    return {name: key for name, key in keys.items() if key in train_config.DEFAULTS}


def model_keys():
    """The TransformerConfig fields that are train.py keys of the same name. vocab_size is not mirrored: its key's
    0 means 'the dataset's', and TransformerConfig's default is what a dataset without a vocabulary gets."""
    return {f.name for f in fields(TransformerConfig) if f.name in train_config.DEFAULTS} - {'vocab_size'}


def test_the_cycler_defaults_are_the_keys_defaults():
    assert len(cycler_keys()) >= 7
    assert omgd.CyclerConfig.from_config(train_config.DEFAULTS) == omgd.CyclerConfig()


def test_the_model_defaults_are_the_keys_defaults():
    keys = model_keys()
    assert {'block_size', 'arch', 'n_layer', 'n_head', 'n_embd', 'bias', 'dropout'} <= keys
    assert {k: train_config.DEFAULTS[k] for k in keys} == {k: getattr(TransformerConfig, k) for k in keys}
    # the model train.py builds by default is TransformerConfig() (a GPT-2 BPE dataset: no vocabulary of its own)
    assert TransformerConfig(**builder.transformer_kwargs(train_config.DEFAULTS)) == TransformerConfig()


def test_train_config_states_no_mirrored_default_again():
    """A literal for a mirrored key would be a second statement of its default (and could contradict it)."""
    with open(os.path.join(os.path.dirname(train_config.__file__), 'train_config.py')) as f:
        tree = ast.parse(f.read())
    keys = set(cycler_keys().values()) | model_keys()
    restated = [
        n.targets[0].id
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and n.targets[0].id in keys
        if isinstance(n.value, ast.Constant)
    ]
    assert restated == []
