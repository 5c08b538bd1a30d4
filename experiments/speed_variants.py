"""
What else keeps full AdamW's GPU speed down (issue 40, item 2): bench.py's row of one method, timed
under variants that train.py does not choose by itself, each on a fresh model, one after the other.

    python experiments/speed_variants.py [bench.py's keys] [--variants=NAME,...]

Variants (all: the default):
  batch=B       the micro-batch of B sequences (per-block compile)
  whole         the whole model compiled as one graph (torch.compile of the model), not block by block:
                what nothing switching (method full) would allow
  outer         the blocks compiled one by one as train.py does, and the embeddings and the final norm (they
                train under every method) as regions of their own
  sdpa=NAME     attention through one SDPA kernel only (flash, cudnn, efficient, math), the blocks compiled under it
Prints a table of ms/iter (median), tokens/s and MFU, and writes it to --out when given.
"""

import os
import sys
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's modules
import bench  # noqa: E402
import train_config  # noqa: E402
from configurator import command_line  # noqa: E402
from infra.metrics import peak_bf16_flops  # noqa: E402

VARIANTS = 'batch=12,outer,batch=16,batch=24,batch=32,whole,sdpa=flash,sdpa=cudnn,sdpa=efficient'
DEFAULTS = {**bench.DEFAULTS, 'methods': 'full', 'variants': VARIANTS}
SDPA = ('flash', 'cudnn', 'efficient', 'math')


def known_variant(variant):
    name, _, value = variant.partition('=')
    return (
        (name == 'batch' and value.isdigit() and int(value) > 0)
        or variant in ('whole', 'outer')
        or (name == 'sdpa' and value in SDPA)
    )


RULES = {
    **bench.RULES,
    'variants': (
        (lambda v: bool(v) and all(known_variant(x) for x in v.split(','))),
        f"a comma list of batch=N, whole, outer, sdpa={'|'.join(SDPA)}",
    ),
}


def sdpa_context(name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {
        'flash': SDPBackend.FLASH_ATTENTION,
        'cudnn': SDPBackend.CUDNN_ATTENTION,
        'efficient': SDPBackend.EFFICIENT_ATTENTION,
        'math': SDPBackend.MATH,
    }[name]
    return sdpa_kernel(backend)


def run_variant(cfg, device, variant):
    """One row of bench.py under `variant`; None when the variant cannot run here (said on stderr)."""
    name, _, value = variant.partition('=')
    row_cfg = {**cfg, 'method': cfg['methods'].split(',')[0]}
    if name == 'batch':
        row_cfg['batch_size'] = int(value)
    if name == 'whole':
        row_cfg['compile'] = False  # compiled below, as one graph
    context = sdpa_context(value) if name == 'sdpa' else nullcontext()
    try:
        with context:
            run = bench.MethodRun(row_cfg, device)
            if name == 'whole':
                run.net.compile()  # in place: the Trainer steps the same module
                run.net.compile_loss()
            if name == 'outer':
                for module in run.net.outer_modules().values():
                    if module is not run.net.lm_head:  # the head's product runs inside the loss
                        module.compile()
            total = cfg['warmup_steps'] + cfg['steps']
            for it in range(total):
                run.step(it, timed=it >= cfg['warmup_steps'])
        return run.row(peak_bf16_flops(device), with_memory=device.type == 'cuda')
    except (RuntimeError, ValueError) as e:  # e.g. no kernel of that SDPA backend for this GPU or dtype
        print(f"variant {variant}: cannot run ({str(e).strip().splitlines()[0][:200]})", file=sys.stderr)
        return None
    finally:
        if device.type == 'cuda':
            torch.cuda.empty_cache()


def main(argv):
    given = set()
    cfg = command_line(argv, DEFAULTS, RULES, __doc__, train_config.meanings(), given)
    device = bench.setup(cfg, given)[0]
    lines = [
        f"Machine: {bench.describe_machine(device)}; method {cfg['methods'].split(',')[0]}, "
        f"{cfg['steps']} timed iterations after {cfg['warmup_steps']}",
        f"Command: `python experiments/speed_variants.py {' '.join(argv)}`",
        '',
        '| variant | ms/iter | tokens/s | MFU | peak alloc GiB |',
        '|---|---|---|---|---|',
    ]
    for variant in cfg['variants'].split(','):
        row = run_variant(cfg, device, variant)
        if row is None:
            lines.append(f"| {variant} | – | – | – | – |")
            continue
        mfu = '–' if row['mfu'] is None else f"{100 * row['mfu']:.1f}%"
        peak = '–' if row['peak_gib'] is None else f"{row['peak_gib']:.2f}"
        lines.append(f"| {variant} | {row['ms']:.1f} | {row['tokens_per_s']:,.0f} | {mfu} | {peak} |")
        print(lines[-1], flush=True)
    text = '\n'.join(lines) + '\n'
    print(text, end='')
    if cfg['out']:
        with open(cfg['out'], 'w') as f:
            f.write(text)


if __name__ == '__main__':
    main(sys.argv[1:])
