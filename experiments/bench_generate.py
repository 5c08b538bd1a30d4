"""
Generation speed with and without the KV cache (model.py's KVCache): tokens/s of Transformer.generate for the
same greedy completion both ways, and their ratio, in one run.

$ OMP_NUM_THREADS=1 python experiments/bench_generate.py                              # GPT-2 124M, random weights, CPU
$ python experiments/bench_generate.py --preset=llama-130m --block_size=1024 --device=cuda
$ python experiments/bench_generate.py --out_dir=out                                  # a train.py checkpoint

The weights do not change the time (random ones unless out_dir is given); each way is timed after a
short warm-up, on the same prompt of random ids. docs/evaluation.md records measured figures.
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's modules

DEFAULTS = dict(
    preset='gpt2',
    block_size=0,
    out_dir='',
    prompt_tokens=16,
    new_tokens=256,
    batch_size=1,
    device='cuda' if torch.cuda.is_available() else 'cpu',
    dtype='float32',
    seed=1337,
)
HELP = dict(
    preset="a model.py preset (random weights)",
    block_size="override the preset's (0: keep it)",
    out_dir="a train.py run to time instead of a preset",
    prompt_tokens="tokens of the random prompt",
    new_tokens="tokens generated",
    batch_size="sequences generated at once",
    device="'cpu', 'cuda' or 'cuda:N'",
    dtype="'float32', or autocast in 'bfloat16' or 'float16'",
    seed="seeds the weights and the prompt",
)
from model import DTYPES  # noqa: E402


def rules():
    from configurator import at_least, one_of

    return dict(
        block_size=at_least(0),
        prompt_tokens=at_least(1),
        new_tokens=at_least(1),
        batch_size=at_least(1),
        dtype=one_of(*DTYPES, label='dtype'),
    )


def build(cfg):
    from model import Transformer, TransformerConfig, config_from_preset

    if cfg['out_dir']:
        from infra.checkpoint import read_any

        checkpoint, path = read_any(cfg['out_dir'], map_location='cpu', mmap=True, optimizer=False)
        model = Transformer(TransformerConfig(**checkpoint['model_args']))
        model.load_state_dict(checkpoint['model'])
        return model, path
    overrides = {'block_size': cfg['block_size']} if cfg['block_size'] else {}
    return Transformer(config_from_preset(cfg['preset'], **overrides)), f"preset {cfg['preset']} (random weights)"


def timed(model, idx, new_tokens, use_cache, device, autocast):
    """(tokens, seconds) of a greedy completion."""
    if device.startswith('cuda'):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with autocast:
        out = model.generate(idx, new_tokens, top_k=1, use_cache=use_cache)
    if device.startswith('cuda'):
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main(argv):
    from contextlib import nullcontext

    from configurator import command_line
    from infra.checkpoint import CheckpointError
    from train_config import check_device

    cfg = command_line(argv, DEFAULTS, rules(), "usage: python experiments/bench_generate.py [--key=value ...]", HELP)
    try:
        check_device(cfg['device'])
        torch.manual_seed(cfg['seed'])
        model, what = build(cfg)
    except (CheckpointError, ValueError) as e:
        sys.exit(f"error: {e}")
    device = cfg['device']
    model.eval().to(device)
    autocast = (
        nullcontext()
        if cfg['dtype'] == 'float32'
        else torch.amp.autocast(device_type=device.split(':')[0], dtype=DTYPES[cfg['dtype']])
    )
    idx = torch.randint(0, model.config.vocab_size, (cfg['batch_size'], cfg['prompt_tokens']), device=device)
    end = cfg['prompt_tokens'] + cfg['new_tokens']
    print(
        f"{what}: {model.get_num_params(False) / 1e6:.1f}M parameters, block_size {model.config.block_size}; "
        f"{cfg['batch_size']} x ({cfg['prompt_tokens']} prompt + {cfg['new_tokens']} new tokens), greedy; "
        f"{device}, {cfg['dtype']}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)"
    )
    if end > model.config.block_size + 1:
        print(f"note: beyond {model.config.block_size} tokens both ways run the cropped window afresh each step")
    for use_cache in (True, False):  # warm-up
        timed(model, idx, 4, use_cache, device, autocast)
    results = {}
    for use_cache in (False, True):
        out, seconds = timed(model, idx, cfg['new_tokens'], use_cache, device, autocast)
        results[use_cache] = (out, seconds)
        rate = cfg['batch_size'] * cfg['new_tokens'] / seconds
        print(f"{'cached' if use_cache else 'uncached'}: {seconds:.2f} s, {rate:.1f} tokens/s")
    same = torch.equal(results[True][0], results[False][0])
    print(
        f"speed-up (cached / uncached tokens/s): {results[False][1] / results[True][1]:.2f}x; "
        f"same tokens: {'yes' if same else 'no (near-ties of the random weights, rounded differently)'}"
    )


if __name__ == '__main__':
    main(sys.argv[1:])
