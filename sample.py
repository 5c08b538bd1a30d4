"""
Sample text from a trained checkpoint (char-level or GPT-2 BPE, picked from the dataset).

$ python sample.py --out_dir=out --start="ROMEO:" --num_samples=2 --max_new_tokens=200
"""
import os
import pickle
import sys

import torch


def load_codec(data_dir):
    """(encode, decode) for a dataset: its meta.pkl for characters, otherwise GPT-2 BPE."""
    meta_path = os.path.join(data_dir, 'meta.pkl')
    if os.path.exists(meta_path):
        with open(meta_path, 'rb') as f:
            meta = pickle.load(f)
        stoi, itos = meta['stoi'], meta['itos']
        def encode(text):
            unknown = sorted(set(text) - set(stoi))
            if unknown:
                raise ValueError(f"characters {''.join(unknown)!r} are not in the dataset's vocabulary")
            return [stoi[c] for c in text]
        return encode, (lambda ids: ''.join(itos[i] for i in ids))
    from data.gpt2_bpe import gpt2_encoding
    enc = gpt2_encoding()
    return (lambda s: enc.encode(s, allowed_special={'<|endoftext|>'})), enc.decode


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
