"""
Prepare OpenWebText (or another Hugging Face text dataset, or local text files)
with the GPT-2 BPE, following nanoGPT's data/openwebtext/prepare.py:
load_dataset(..., num_proc=...), a 0.0005 validation split with seed 2357,
ds.map() to GPT-2 ids + <|endoftext|> per document, then everything is
concatenated into train.bin / val.bin (uint16) and meta.pkl by
data.common.tokenize_dataset. --tokenizer=DIR: a local Hugging Face tokenizer
instead (its end-of-text token per document; uint32 above 65,536 ids).
C4, the paper's LLaMA corpus, has its own script with streaming: data/c4/prepare.py.

    python data/openwebtext/prepare.py [--num_proc 8]
    python data/openwebtext/prepare.py --text_files='corpus/*.txt' --out_dir=data/mycorpus
"""

import glob
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `data.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from configurator import above, one_of
from data.common import TOKENIZER_MEANING, not_utf8, prepare_main, tokenize_dataset
from data.tokenizer import Tokenizer

HERE = Path(__file__).resolve().parent


def load_raw(
    dataset="openwebtext",
    dataset_config=None,
    text_files=None,
    sample_by="document",
    num_proc_load_dataset=None,
    split="train",
    max_docs=None,
    cache_dir=None,
):
    """The raw dataset (a single `datasets.Dataset`) with a `text` column."""
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    files = sorted(glob.glob(text_files, recursive=True)) if text_files else None
    if text_files and not files:
        raise FileNotFoundError(f"no files match --text_files {text_files!r}")
    try:
        if files:
            raw = load_dataset("text", data_files={"train": files}, sample_by=sample_by, cache_dir=cache_dir)["train"]
        else:
            raw = load_dataset(
                dataset, dataset_config, split=split, num_proc=num_proc_load_dataset, cache_dir=cache_dir
            )
    except DatasetGenerationError as e:  # its cause is the reader's error, which names no file
        for path in files or []:
            try:
                with open(path, encoding="utf-8") as f:
                    while f.read(1 << 24):
                        pass
            except UnicodeDecodeError as bad:
                raise ValueError(not_utf8(path, bad)) from None
        source = f"--text_files {text_files!r}" if files else f"dataset {dataset!r}"
        raise ValueError(f"{source} cannot be read: {e.__cause__ or e}") from None
    if max_docs is not None:
        raw = raw.select(range(min(max_docs, len(raw))))
    return raw


def prepare(
    out_dir=None,
    dataset="openwebtext",
    dataset_config=None,
    text_files=None,
    sample_by="document",
    num_proc=None,
    num_proc_load_dataset=None,
    test_size=0.0005,
    seed=2357,
    max_docs=None,
    text_field="text",
    cache_dir=None,
    tokenizer="gpt2",
):
    """Download/load, split and tokenize; writes train.bin, val.bin and meta.pkl into out_dir. Returns stats."""
    t0 = time.time()
    out_dir = Path(out_dir) if out_dir is not None else HERE
    num_proc = num_proc or max(1, (os.cpu_count() or 2) // 2)
    tok = Tokenizer(tokenizer)
    tok.encode("")  # load it once in the parent (workers inherit it on fork)
    raw = load_raw(
        dataset,
        dataset_config,
        text_files,
        sample_by,
        num_proc_load_dataset or num_proc,
        max_docs=max_docs,
        cache_dir=cache_dir,
    )

    # owt by default only contains the 'train' split, so create a test split
    split_dataset = raw.train_test_split(test_size=test_size, seed=seed, shuffle=True)
    split_dataset["val"] = split_dataset.pop("test")  # rename the test split to val
    print(split_dataset)

    # tokenize (gpt2 bpe + <|endoftext|> per document) and write the .bin files and meta.pkl
    counts = tokenize_dataset(split_dataset, tok, out_dir, num_proc=num_proc, text_field=text_field)
    for split, n in counts.items():
        print(f"{split} has {n:,} tokens")
    return {
        "out_dir": str(out_dir),
        **{f"{k}_tokens": v for k, v in counts.items()},
        "seconds": round(time.time() - t0, 3),
    }


KEYS = dict(
    dataset="openwebtext",
    dataset_config="",
    text_files="",
    sample_by="document",
    num_proc=0,
    num_proc_load_dataset=0,
    test_size=0.0005,
    seed=2357,
    max_docs=0,
    text_field="text",
    cache_dir="",
    tokenizer="gpt2",
)
MEANINGS = dict(
    dataset="Hugging Face dataset name (e.g. allenai/c4)",
    dataset_config="dataset config name (e.g. 'en' for allenai/c4)",
    text_files="glob of local text files to use instead of --dataset",
    sample_by="with --text_files: what one document (one <|endoftext|>) is",
    num_proc="workers for the .map() tokenization (0: as nanoGPT, half the CPU cores)",
    num_proc_load_dataset="workers for load_dataset (0: --num_proc)",
    max_docs="only use the first N documents (0: all)",
    cache_dir="Hugging Face datasets cache dir",
    tokenizer=TOKENIZER_MEANING,
)
RULES = dict(sample_by=one_of("document", "paragraph", "line"), test_size=above(0, upper=1))


def main(argv=None):
    return prepare_main(
        prepare, "OpenWebText (or another text dataset) -> GPT-2 train.bin/val.bin", HERE, argv, KEYS, MEANINGS, RULES
    )


if __name__ == "__main__":
    sys.exit(main())
