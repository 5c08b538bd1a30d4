"""
Sample text from a trained checkpoint (char-level or GPT-2 BPE, picked from the dataset).

$ python sample.py --out_dir=out --start="ROMEO:" --num_samples=2 --max_new_tokens=200
"""
import os
import sys

import torch


def load_codec(data_dir):
    """(encode, decode) with the tokenizer the dataset's meta.pkl records (data/tokenizer.py): GPT-2
    BPE, characters or a local Hugging Face tokenizer; a one-line error when it cannot be loaded."""
    from data.tokenizer import Tokenizer, read_meta
    try:
        tok = Tokenizer.from_meta(read_meta(data_dir))
    except ValueError as e:
        sys.exit(f"error: {e}")
    return (lambda text: tok.encode(text, special=True)), tok.decode


def main(argv):
    from checkpoint import CheckpointError, read as read_checkpoint
    from configurator import ConfigError, configure
    from model import GPT, GPTConfig
    defaults = dict(out_dir='out', start='\n', num_samples=1, max_new_tokens=300, temperature=0.8,
                    top_k=200, seed=1337, device='cuda' if torch.cuda.is_available() else 'cpu')
    try:
        cfg = configure(defaults, argv)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    try:
        checkpoint = read_checkpoint(os.path.join(cfg['out_dir'], 'ckpt.pt'), map_location=cfg['device'])
    except CheckpointError as e:
        sys.exit(f"error: {e}")
    model = GPT(GPTConfig(**checkpoint['model_args']))
    model.load_state_dict(checkpoint['model'])
    model.eval().to(cfg['device'])
    data_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', checkpoint['config']['dataset'])
    encode, decode = load_codec(data_dir)
    torch.manual_seed(cfg['seed'])
    start = cfg['start']
    if start.startswith('FILE:'):
        try:
            with open(start[5:], encoding='utf-8') as f:
                start = f.read()
        except (OSError, UnicodeDecodeError) as e:
            sys.exit(f"error: --start=FILE:{start[5:]}: cannot read it ({e.strerror or e}); give an existing "
                     f"UTF-8 text file")
    try:
        x = torch.tensor([encode(start)], dtype=torch.long, device=cfg['device'])
    except ValueError as e:
        sys.exit(f"error: --start: {e}")
    for _ in range(cfg['num_samples']):
        y = model.generate(x, cfg['max_new_tokens'], temperature=cfg['temperature'], top_k=cfg['top_k'])
        print(decode(y[0].tolist()))
        print('---------------')


if __name__ == '__main__':
    main(sys.argv[1:])
