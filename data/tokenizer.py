"""The tokenizer of a prepared dataset, as its meta.pkl records it: the one reader of meta.pkl for
train.py (through dataloader.py), sample.py, export.py and the prepare scripts.

meta.pkl, written by every data/*/prepare.py next to train.bin and val.bin:
    tokenizer   'gpt2' (GPT-2 BPE), 'char' (with stoi and itos), or the absolute path of a local
                Hugging Face tokenizer directory (its tokenizer.json, read offline with `tokenizers`)
    vocab_size  every id in train.bin and val.bin is below it
    dtype       the width of the ids: 'uint16' while they fit (vocab_size <= 65,536), else 'uint32'
    stoi, itos  'char' only: character -> id, id -> character
    n_ids       {'train': ids in train.bin, 'val': ...}: a .bin of another width or length is refused
Datasets prepared before these keys existed still read: a meta.pkl with vocab_size, stoi and itos
only is 'char', a folder without meta.pkl is GPT-2 BPE; both are uint16. A meta.pkl with only a
vocab_size gives the vocabulary (tokenizer None) but nothing to decode with.

Importing this module imports neither numpy nor a tokenizer library; each is loaded on first use.
"""

import json
import os
import pickle

GPT2_VOCAB, GPT2_EOT = 50257, 50256
DTYPES = {'uint16': 1 << 16, 'uint32': 1 << 32}  # dtype -> number of ids it can hold
# the end-of-text token of a Hugging Face tokenizer whose tokenizer_config.json names no eos_token
EOT_NAMES = ('<|endoftext|>', '<|end_of_text|>', '</s>', '<eos>')


REPLACEMENT = '\ufffd'  # what decode() writes for an id the tokenizer lacks


def token_dtype(vocab_size):
    """The narrowest dtype of train.bin / val.bin that holds ids up to vocab_size - 1."""
    return 'uint16' if vocab_size <= DTYPES['uint16'] else 'uint32'


class DataOnlyUnpickler(pickle.Unpickler):
    """meta.pkl holds plain data (dicts, strings, numbers, lists), which unpickles without naming
    any class; a file that names one (a crafted meta.pkl calling os.system) is refused, so a data
    folder from elsewhere can never run code."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it names {module}.{name}, and a meta.pkl holds only plain data")


def read_meta(data_dir):
    """The meta.pkl of a prepared dataset with every key above; a one-line ValueError when it
    cannot be read or does not describe a dataset."""
    path = os.path.join(data_dir, 'meta.pkl')
    if not os.path.exists(path):
        return {'tokenizer': 'gpt2', 'vocab_size': GPT2_VOCAB, 'dtype': 'uint16'}
    try:
        with open(path, 'rb') as f:
            meta = DataOnlyUnpickler(f).load()
    except Exception as e:  # truncated, not a pickle, or pickled objects: never loaded
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e}); prepare the dataset again") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path} holds a {type(meta).__name__}, not a dict; prepare the dataset again")
    meta = {'tokenizer': 'char' if 'stoi' in meta else None, 'dtype': 'uint16', **meta}
    problem = _meta_problem(meta)
    if problem:
        raise ValueError(f"{path}: {problem}; prepare the dataset again")
    return meta


def _meta_problem(meta):
    vocab, dtype, name = meta.get('vocab_size'), meta['dtype'], meta['tokenizer']
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab <= 0:
        return f"vocab_size={vocab!r} is not a positive integer"
    if dtype not in DTYPES:
        return f"dtype={dtype!r} is not one of {', '.join(DTYPES)}"
    if vocab > DTYPES[dtype]:
        return f"vocab_size={vocab} does not fit dtype={dtype}"
    if name is not None and (not isinstance(name, str) or not name):  # None: a bare vocabulary, no tokenizer
        return f"tokenizer={name!r} names no tokenizer ('gpt2', 'char' or a directory)"
    counts = meta.get('n_ids', {})
    if not isinstance(counts, dict) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts.values()
    ):
        return f"n_ids={counts!r} is not a dict of id counts"
    if name == 'char' and not (isinstance(meta.get('stoi'), dict) and isinstance(meta.get('itos'), dict)):
        return "tokenizer='char' without its stoi and itos"
    return None


class Tokenizer:
    """Text <-> ids with GPT-2 BPE, a character set, or a local Hugging Face tokenizer directory.

    vocab_size, eot (the id after each document; None for characters) and dtype describe it;
    record() is what meta.pkl stores. Picklable: prepare workers load the library on first use.
    """

    def __init__(self, name='gpt2', itos=None):
        if name == 'char':
            if itos is None:
                raise ValueError(
                    "--tokenizer=char: characters are read from the text by "
                    "data/shakespeare_char/prepare.py; give 'gpt2' or a Hugging Face tokenizer directory"
                )
            self.itos, self.stoi = dict(itos), {c: i for i, c in itos.items()}
            self.vocab_size, self.eot = len(itos), None
        elif name == 'gpt2':
            self.vocab_size, self.eot = GPT2_VOCAB, GPT2_EOT
        else:
            name = os.path.abspath(name)
            self.name = name
            vocab = self._backend.get_vocab(with_added_tokens=True)
            self.vocab_size = max(vocab.values()) + 1  # ids need not be contiguous: the largest bounds them
            self.eot = _hf_eot(name, self._backend)
        self.name = name
        self.dtype = token_dtype(self.vocab_size)

    @classmethod
    def from_meta(cls, meta):
        """The tokenizer a read_meta() dict records; ValueError when it is gone or has changed."""
        name = meta['tokenizer']
        if name is None:
            raise ValueError(
                "the dataset's meta.pkl records a vocab_size but no tokenizer to decode with; prepare the dataset again"
            )
        if name not in ('char', 'gpt2') and not os.path.isfile(os.path.join(name, 'tokenizer.json')):
            raise ValueError(
                f"the dataset's tokenizer {name} (recorded in its meta.pkl) has no tokenizer.json any "
                f"more; restore that directory or prepare the dataset again"
            )
        tok = cls(name, meta.get('itos'))
        if tok.vocab_size > meta['vocab_size']:
            raise ValueError(
                f"the tokenizer {tok.name} has {tok.vocab_size} ids, the dataset was prepared with "
                f"{meta['vocab_size']}: it is not the tokenizer of this dataset; restore it or prepare "
                f"the dataset again"
            )
        return tok

    def record(self):
        """meta.pkl's keys for this tokenizer."""
        meta = {'tokenizer': self.name, 'vocab_size': self.vocab_size, 'dtype': self.dtype}
        if self.name == 'char':
            meta.update(stoi=self.stoi, itos=self.itos)
        return meta

    @property
    def _backend(self):
        if getattr(self, '_loaded', None) is None:
            if self.name == 'gpt2':
                from data.gpt2_bpe import gpt2_encoding

                self._loaded = gpt2_encoding()
            else:
                self._loaded = _hf_load(self.name)
        return self._loaded

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != '_loaded'}

    def encode(self, text, special=False):
        """Ids of text; with special=True, GPT-2's '<|endoftext|>' in the text is its id (sample.py's
        prompt), else plain text (data preparation, as nanoGPT)."""
        if self.name == 'char':
            unknown = sorted(set(text) - set(self.stoi))
            if unknown:
                raise ValueError(f"characters {''.join(unknown)!r} are not in the dataset's vocabulary")
            return [self.stoi[c] for c in text]
        if self.name == 'gpt2':
            enc = self._backend
            return enc.encode(text, allowed_special={'<|endoftext|>'}) if special else enc.encode_ordinary(text)
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts):
        """[encode(t) for t in texts], the Hugging Face tokenizer's batch call where there is one."""
        if self.name in ('char', 'gpt2'):
            return [self.encode(t) for t in texts]
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids):
        """The text of ids; an id the tokenizer lacks is REPLACEMENT: a padded vocabulary (GPT-2's 50257 ids
        padded to 50304) gives the model ids no tokenizer decodes, and an untrained model samples them."""
        known = self._known()
        text, run = [], []
        for i in ids:
            if known(i):
                run.append(i)
            else:
                text += [self._decode(run), REPLACEMENT]
                run = []
        return ''.join(text) + self._decode(run)

    def _known(self):
        """Whether the tokenizer has an id."""
        if self.name == 'char':
            return self.itos.__contains__
        return lambda i: 0 <= i < self.vocab_size

    def _decode(self, ids):
        if self.name == 'char':
            return ''.join(self.itos[i] for i in ids)
        if self.name == 'gpt2':
            return self._backend.decode(ids)
        return self._backend.decode(ids, skip_special_tokens=False)


def _hf_load(directory):
    path = os.path.join(directory, 'tokenizer.json')
    if not os.path.isfile(path):
        raise ValueError(
            f"tokenizer {directory}: no tokenizer.json there; give a local Hugging Face tokenizer "
            f"directory (one with tokenizer.json), or 'gpt2'"
        )
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise ValueError(f"tokenizer {directory} needs the `tokenizers` package: pip install tokenizers") from None
    try:
        return HFTokenizer.from_file(path)
    except Exception as e:  # the Rust side raises a plain Exception for a malformed file
        raise ValueError(
            f"{path} is not a Hugging Face tokenizer ({type(e).__name__}: {e}); give a directory whose "
            f"tokenizer.json the tokenizer's save_pretrained wrote, or 'gpt2'"
        ) from None


def _hf_eot(directory, tok):
    """The end-of-text id: tokenizer_config.json's eos_token, else the first of EOT_NAMES it has."""
    names = list(EOT_NAMES)
    config = os.path.join(directory, 'tokenizer_config.json')
    if os.path.isfile(config):
        try:
            with open(config, encoding='utf-8') as f:
                eos = json.load(f).get('eos_token')
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(f"{config} cannot be read ({type(e).__name__}: {e})") from None
        if isinstance(eos, dict):  # the AddedToken form {"content": "</s>", ...}
            eos = eos.get('content')
        if isinstance(eos, str):
            names = [eos]
    for name in names:
        if tok.token_to_id(name) is not None:
            return tok.token_to_id(name)
    raise ValueError(
        f"tokenizer {directory} has no end-of-text token to put between documents (none of "
        f"{', '.join(names)}); name it as eos_token in its tokenizer_config.json"
    )
