"""
Prepare the English C4 (allenai/c4, config 'en'), the corpus the paper pre-trains LLaMA on:
each document tokenized (GPT-2 BPE, or --tokenizer=DIR, a local Hugging Face tokenizer) with an
end-of-text token after it, concatenated into train.bin and val.bin (C4's own train and validation
splits) and meta.pkl (data/tokenizer.py: uint16 ids, uint32 above 65,536).

    python data/c4/prepare.py --max_tokens=1000000000 --max_val_tokens=10000000   # a slice, streamed
    python data/c4/prepare.py --streaming=False --num_proc=16                      # all of C4-en
    python data/c4/prepare.py --tokenizer=/models/llama-2-7b --max_tokens=1000000000
    python data/c4/prepare.py --json_files='c4/en/c4-*.json.gz'                    # local shards, offline

Documents are read through Hugging Face `datasets`: streamed by default, so a slice downloads only
the shards it reads; --streaming=False downloads the whole split into the datasets cache first
(resumable, and reused by a later run). --json_files reads local C4-format shards instead (one JSON
object with "text" per line, gzip-compressed or not); files named *validation* form the validation
split, the others the training split. The caps end a split after that many documents or ids (the
last document cut at the id cap). Tokenization runs in --num_proc processes, in order, so the files
do not depend on it. The .bin files and meta.pkl replace the old ones together at the end.
"""

import collections
import glob
import gzip
import itertools
import os
import sys
import time
import zlib
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `data.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
from tqdm.auto import tqdm

from data.common import TOKENIZER_MEANING, prepare_main, write_dataset
from data.tokenizer import Tokenizer

HERE = Path(__file__).resolve().parent
SPLITS = {"train": "train", "val": "validation"}  # our file -> C4's split


def json_splits(json_files):
    """{C4 split: sorted files} of a comma-separated list of globs."""
    files = sorted({f for pattern in json_files.split(",") for f in glob.glob(os.path.expanduser(pattern.strip()))})
    if not files:
        raise FileNotFoundError(f"no files match --json_files={json_files!r}")
    for f in files:
        check_gzip_header(f)
    splits = {"validation": [f for f in files if "validation" in Path(f).name]}
    splits["train"] = [f for f in files if f not in splits["validation"]]
    for split, chosen in splits.items():
        if not chosen:
            raise ValueError(
                f"--json_files={json_files!r}: no {split} shard among its {len(files)} files (C4 names "
                f"them c4-{split}.*.json.gz); add one"
            )
    return splits


def check_gzip_header(path):
    """A one-line ValueError for a *.gz shard that does not start as gzip does (a download cut at its
    start, an error page saved under the shard's name): datasets would not name it."""
    if not path.endswith(".gz") or not os.path.isfile(path):
        return
    with open(path, "rb") as f:
        head = f.read(2)
    if head != b"\x1f\x8b":
        raise ValueError(
            f"{path} is not a gzip file (it starts with {head!r}); download that shard again, or leave it "
            f"out of --json_files"
        )


def damaged_gzip(files):
    """(path, error) of the first *.gz file that does not decompress to its end, else None (read only
    after a shard failed: datasets does not say which)."""
    for path in files:
        if path.endswith(".gz"):
            try:
                with gzip.open(path) as f:
                    while f.read(1 << 24):
                        pass
            except (EOFError, OSError, zlib.error) as e:
                return path, e
    return None


def documents(split, json_files=None, streaming=True, cache_dir=None, num_proc=None):
    """The texts of one C4 split, in the dataset's order; a one-line ValueError for a shard that
    is not C4's format."""
    source = f"the {split} shards of --json_files" if json_files is not None else f"allenai/c4 en {split}"
    for i, row in enumerate(_rows(source, split, json_files, streaming, cache_dir, num_proc)):
        if not isinstance(row.get("text"), str):
            raise ValueError(
                f"{source}: document {i} has no \"text\" string; C4-format shards hold one JSON "
                f"object with \"text\" per line"
            )
        yield row["text"]


def _rows(source, split, json_files, streaming, cache_dir, num_proc):
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    try:
        if json_files is not None:
            ds = load_dataset(
                "json",
                data_files=json_splits(json_files)[split],
                split="train",
                streaming=streaming,
                cache_dir=cache_dir,
            )
        else:
            ds = load_dataset(
                "allenai/c4",
                "en",
                split=split,
                streaming=streaming,
                cache_dir=cache_dir,
                **({} if streaming else {"num_proc": num_proc}),
            )
        yield from ds
    except StopIteration:  # the json reader's way of saying that a shard is empty
        raise ValueError(f"{source} cannot be read: a shard is empty") from None
    except (DatasetGenerationError, ValueError, EOFError, OSError, zlib.error) as e:
        cause = e.__cause__ or e  # a generation error's cause is the reader's error
        damaged = json_files is not None and isinstance(cause, (EOFError, OSError, zlib.error))
        damaged = damaged and damaged_gzip(json_splits(json_files)[split])
        if damaged:
            raise ValueError(
                f"{damaged[0]} is a damaged gzip file ({damaged[1]}); download that shard again, or leave it "
                f"out of --json_files"
            ) from None
        raise ValueError(f"{source} cannot be read: {cause}") from None


_worker_tokenizer = None


def _init_worker(tokenizer):
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def encode_docs(texts, tokenizer=None):
    """The ids of texts, each followed by the end-of-text id, as one array of the tokenizer's dtype."""
    tok = tokenizer or _worker_tokenizer
    ids = tok.encode_batch(texts)
    return np.fromiter(itertools.chain.from_iterable(d + [tok.eot] for d in ids), dtype=tok.dtype)


def in_order(pool, batches, ahead):
    """encode_docs of each batch, in order, at most `ahead` batches in the workers at a time
    (Pool.imap would read the whole stream ahead of the workers)."""
    pending = collections.deque()
    for batch in batches:
        pending.append(pool.apply_async(encode_docs, (batch,)))
        if len(pending) >= ahead:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def tokenized(split, texts, tok, pool, num_proc, batch_docs, max_tokens, verbose):
    """Arrays of ids of consecutive batches of texts, cut at max_tokens (0: no cap), with a progress bar."""
    batches = iter(lambda: list(itertools.islice(texts, batch_docs)), [])
    arrays = in_order(pool, batches, 4 * num_proc) if pool else (encode_docs(b, tok) for b in batches)
    n = 0
    with tqdm(
        total=max_tokens or None, unit="tok", unit_scale=True, desc=f"tokenizing {split}", disable=not verbose
    ) as bar:
        for a in arrays:
            if max_tokens and n + len(a) >= max_tokens:
                a = a[: max_tokens - n]
            n += len(a)
            bar.update(len(a))
            yield a
            if max_tokens and n >= max_tokens:
                return
    if n == 0:
        raise ValueError(f"the {split} split has no documents; give shards with some")


def prepare(
    out_dir=None,
    json_files=None,
    tokenizer="gpt2",
    streaming=True,
    num_proc=None,
    max_docs=0,
    max_tokens=0,
    max_val_docs=0,
    max_val_tokens=0,
    batch_docs=1000,
    cache_dir=None,
    verbose=True,
):
    """Write train.bin, val.bin and meta.pkl of C4-en (or of --json_files) into out_dir. Returns stats."""
    t0 = time.time()
    out_dir = Path(out_dir) if out_dir is not None else HERE
    for key, value in dict(
        max_docs=max_docs, max_tokens=max_tokens, max_val_docs=max_val_docs, max_val_tokens=max_val_tokens
    ).items():
        if value < 0:
            raise ValueError(f"--{key}={value}: give a number of at least 0 (0: no cap)")
    if batch_docs < 1 or (num_proc is not None and num_proc < 1):
        raise ValueError(f"--batch_docs={batch_docs} --num_proc={num_proc}: give numbers of at least 1")
    num_proc = num_proc or max(1, (os.cpu_count() or 2) // 2)
    tok = Tokenizer(tokenizer)
    if json_files is not None:
        json_splits(json_files)  # a missing file fails before anything is read
    tok.encode("")  # load it in the parent: a forked worker inherits it
    caps = {"train": (max_docs, max_tokens), "val": (max_val_docs, max_val_tokens)}
    pool = None
    if num_proc > 1:
        import multiprocessing

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # parallel in processes, not also in threads
        pool = multiprocessing.Pool(num_proc, initializer=_init_worker, initargs=(tok,))
    splits = {}
    try:
        for ours, c4_split in SPLITS.items():
            n_docs, n_tokens = caps[ours]
            texts = documents(c4_split, json_files, streaming, cache_dir, num_proc)
            if n_docs:
                texts = itertools.islice(texts, n_docs)
            splits[ours] = tokenized(c4_split, texts, tok, pool, num_proc, batch_docs, n_tokens, verbose)
        # the splits are read one after the other as write_dataset writes them
        counts = write_dataset(out_dir, splits, tok.record(), progress=False)
    finally:
        if pool is not None:
            pool.terminate()
    if verbose:
        for split, n in counts.items():
            print(f"{split}.bin: {n:,} tokens ({tok.dtype}, {n * np.dtype(tok.dtype).itemsize / 2**20:,.1f} MiB)")
    return {
        "out_dir": str(out_dir),
        **{f"{k}_tokens": v for k, v in counts.items()},
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
        "dtype": tok.dtype,
        "seconds": round(time.time() - t0, 3),
    }


KEYS = dict(
    json_files="",
    tokenizer="gpt2",
    streaming=True,
    num_proc=0,
    max_docs=0,
    max_tokens=0,
    max_val_docs=0,
    max_val_tokens=0,
    batch_docs=1000,
    cache_dir="",
)
MEANINGS = dict(
    json_files="comma-separated globs of local C4-format shards (*.json.gz) instead of the download",
    tokenizer=TOKENIZER_MEANING,
    streaming="True: read the shards as they download; False: download the split first",
    num_proc="tokenizing processes (0: as nanoGPT, half the CPU cores); also download workers",
    max_docs="cap on training documents (0: all)",
    max_tokens="cap on training ids (0: all)",
    max_val_docs="cap on validation documents (0: all)",
    max_val_tokens="cap on validation ids (0: all)",
    batch_docs="documents per tokenizing task",
    cache_dir="Hugging Face datasets cache dir",
)


def main(argv=None):
    return prepare_main(prepare, "C4-en (or local C4 shards) -> train.bin/val.bin/meta.pkl", HERE, argv, KEYS, MEANINGS)


if __name__ == "__main__":
    sys.exit(main())
