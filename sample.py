"""
Sample text from a trained checkpoint, with the tokenizer its dataset's meta.pkl records (data/tokenizer.py).

$ python sample.py --out_dir=out --start="ROMEO:" --num_samples=2 --max_new_tokens=200
"""

import os
import sys

import torch

from builder import trained_model
from configurator import above, at_least, command_line
from data.tokenizer import Tokenizer, read_meta
from dataloader import data_dir
from train_config import check_device


def load_codec(directory, model_vocab=None):
    """(encode, decode) of the dataset's tokenizer; one error line if it cannot load or has over model_vocab ids."""
    try:
        tok = Tokenizer.from_meta(read_meta(directory))
    except ValueError as e:
        sys.exit(f"error: {e}")
    if model_vocab is not None and tok.vocab_size > model_vocab:
        meta = os.path.join(directory, 'meta.pkl')
        what = f"GPT-2's BPE, since there is no {meta}" if not os.path.exists(meta) else f"{tok.name}, from {meta}"
        sys.exit(
            f"error: the checkpoint's vocab_size is {model_vocab} but the tokenizer of its dataset ({what}) has "
            f"{tok.vocab_size} ids: not the tokenizer the model trained on; restore that meta.pkl, or prepare "
            f"the dataset again as it was prepared for this run"
        )
    return (lambda text: tok.encode(text, special=True)), tok.decode


# keys (--key=value): (default, meaning); configurator.py checks them by RULES, as for train.py
KEYS = dict(
    out_dir=('out', 'the run whose checkpoint (ckpt.pt or newest step folder) to sample from'),
    start=('\n', "the prompt, or FILE:path to read it from a file"),
    num_samples=(1, 'how many samples'),
    max_new_tokens=(300, 'tokens generated per sample'),
    temperature=(0.8, '> 0; lower is more predictable'),
    top_k=(200, 'sample among the k likeliest tokens (0: all)'),
    seed=(1337, 'seeds the sampling'),
    device=('cuda' if torch.cuda.is_available() else 'cpu', "'cpu', 'cuda' or 'cuda:N'"),
)
DEFAULTS = {k: default for k, (default, _) in KEYS.items()}
HELP = {k: meaning for k, (_, meaning) in KEYS.items()}
RULES = dict(
    out_dir=at_least(1, 'a non-empty path', len),
    start=at_least(1, 'a non-empty prompt', len),
    num_samples=at_least(1),
    max_new_tokens=at_least(1),
    temperature=above(0),
    top_k=at_least(0),
)


def main(argv):
    cfg = command_line(argv, DEFAULTS, RULES, "usage: python sample.py [--key=value ...]", HELP)
    try:
        check_device(cfg['device'])
        model, checkpoint, _ = trained_model(cfg['out_dir'])
    except ValueError as e:  # CheckpointError too
        sys.exit(f"error: {e}")
    model.eval().to(cfg['device'])
    encode, decode = load_codec(data_dir(checkpoint['config']['dataset']), model.config.vocab_size)
    torch.manual_seed(cfg['seed'])
    start = cfg['start']
    if start.startswith('FILE:'):
        try:
            with open(start[5:], encoding='utf-8') as f:
                start = f.read()
        except (OSError, UnicodeDecodeError) as e:
            reason = 'not UTF-8 text' if isinstance(e, UnicodeDecodeError) else e.strerror
            sys.exit(f"error: --start=FILE:{start[5:]}: cannot read it ({reason}); give an existing UTF-8 text file")
    try:
        ids = encode(start)
    except ValueError as e:
        sys.exit(f"error: --start: {e}")
    if not ids:
        sys.exit("error: --start encodes to no tokens; give a non-empty prompt")
    x = torch.tensor([ids], dtype=torch.long, device=cfg['device'])
    for _ in range(cfg['num_samples']):
        y = model.generate(x, cfg['max_new_tokens'], temperature=cfg['temperature'], top_k=cfg['top_k'] or None)
        print(decode(y[0].tolist()))
        print('---------------')


if __name__ == '__main__':
    main(sys.argv[1:])
