r"""
GPU memory of train.py's iteration, split like the OMGD paper's LLaMA-7B table: model weights, gradients, optimizer
state, and "others" (activations, temporaries, workspaces) = the peak minus those three. Each row is
memory_estimate.measure of train.py's iteration, after a warm-up that creates the optimizer state (docs/memory.md).

$ python bench_memory.py config/llama7b_lisa_wor.py --vocab_size=32000 \
      --methods=full,galore,golore,lisa,lisa_wor                     # the paper's table (LLaMA's vocabulary)
$ python bench_memory.py config/llama7b_lisa_wor.py                  # the config you will train
$ python bench_memory.py config/gpt2_lisa_wor.py --methods=full,lisa_wor --precisions=amp,bf16_master

Every key of train.py is accepted with its meaning there; the defaults are train.py's on a GPU
machine (dtype bfloat16, compile True). Keys of this script:
  methods       comma-separated methods, one row each ('': the config's `method`)
  precisions    comma-separated PRECISION or PRECISION:MASTER_DEVICE (e.g. bf16,bf16_master,bf16_master:cpu):
                the rows of every method under each ('': the config's precision and master_device)
  micro_batches micro-batches the measured iteration runs (0: all; from the third on, they allocate nothing new)
  device        auto (cuda if available, else meta), cuda (measured: max_memory_allocated/reserved),
                meta (an ESTIMATE on shapes, memory_estimate.py) or cpu (run for real, fp32 compute)
  out           output prefix for .md/.json/.png; '' -> out/memory_<preset> (git-ignored)
"""

import json
import os
import sys
import textwrap
import time

import torch

import train_config
from configurator import at_least, check_rule, command_line
from infra import memory_options
from memory_estimate import check_rows, measure, model_config, model_name, precision_label

# keys of this script only (train.py has none of these names); `device` has its own values here
OWN_KEYS = dict(methods='', precisions='', micro_batches=2, out='')
assert not set(OWN_KEYS) & set(train_config.DEFAULTS)
DEFAULTS = {**train_config.DEFAULTS, **train_config.machine_defaults(cuda=True), 'device': 'auto', **OWN_KEYS}
RULES = {**train_config.RULES, 'micro_batches': at_least(0)}

BYTE_KEYS = ('params', 'grads', 'optimizer', 'others', 'peak', 'reserved', 'projectors', 'cpu_state', 'tracked_peak')
# the paper's Table (GiB), for comparison when the preset is llama-7b
PAPER_LLAMA_7B = {
    'full': (12.55, 12.55, 25.10, 14.66, 64.86),
    **dict.fromkeys(('galore', 'golore'), (12.55, 12.55, 1.73, 4.40, 31.23)),
    **dict.fromkeys(('lisa', 'lisa_wor'), (12.55, 1.24, 2.48, 3.29, 19.56)),
}
PRECISION_NOTES = {
    'amp': "fp32 weights, gradients and AdamW state, forward under {dtype} autocast (nanoGPT's setting)",
    'bf16': "bf16 weights, gradients and AdamW state, no fp32 master (the paper's table)",
    'bf16_master': "bf16 weights and gradients, fp32 master copy and fp32 moments of the trainable parameters "
    "on the GPU (Optimizer column)",
    'bf16_master:cpu': "bf16 weights and gradients on the GPU; fp32 master copy, fp32 moments and the AdamW step "
    "on the CPU (CPU state column, not GPU memory)",
}


def gib(n):
    return None if n is None else n / 2**30


def notes_for(cfg, device, estimate, row, precisions):
    if estimate:
        how = "attention as FlashAttention/memory-efficient kernels, CUDA autocast emulated"
        if device.type == 'cpu':
            how = "the CPU's own kernels, fp32 compute as train.py on a CPU"
        how_measured = (
            f"ESTIMATE on the {device.type} device, not a GPU measurement. Weights, gradients and optimizer state are "
            "exact tensor bytes; Others = the peak of live tensor bytes counted op by op (memory_estimate.LiveBytes; "
            f"{how}) minus those three. Allocator rounding/fragmentation, cuBLAS workspaces and the CUDA context are "
            "not included; no reserved figure."
        )
    else:
        how_measured = (
            "Measured on the GPU: Total = torch.cuda.max_memory_allocated over the measured iteration, "
            "Reserved = max_memory_reserved; Others = Total - Model - Gradients - Optimizer."
        )
    config, gas = model_config(cfg), cfg['gradient_accumulation_steps']
    labels = [precision_label(p, d) for p, d in precisions]
    return [
        how_measured,
        f"Model {model_name(cfg)}: {config.arch}, {config.n_layer} blocks, n_embd {config.n_embd}, MLP "
        f"{config.mlp_hidden}, vocab {config.vocab_size}, {row['n_params']:,} parameters.",
        *(f"precision={label}: {PRECISION_NOTES[label].format(dtype=cfg['dtype'])}." for label in labels),
        f"Micro-batch {cfg['batch_size']} x {cfg['block_size']} tokens (of {gas} accumulation steps; the measured "
        f"iteration runs {row['micro_batches']}); activation checkpointing "
        f"{'on' if cfg['activation_checkpointing'] else 'off'}; "
        f"{'compiled per block' if cfg['compile'] and device.type == 'cuda' else 'eager'}; grad_clip "
        f"{cfg['grad_clip']:g}, OMGD scale {'after' if cfg['omgd_scale_after_clip'] else 'before'} clipping.",
        f"State policy omgd_state='{cfg['omgd_state']}'. LISA methods: {cfg['omgd_gamma']} active blocks plus "
        f"{cfg['omgd_always']}. GaLore/GoLore: rank {cfg['galore_rank']} on every attention and MLP matrix, projected "
        "on the smaller side; embeddings, head and norms have full AdamW state. Projection matrices are not counted "
        "as optimizer state (they are inside Others).",
        "Measured iteration = train.py's (Trainer.step), the second of a switching period (optimizer state already "
        "exists); the peak is over forward/backward of every micro-batch, clipping, scaling and the step.",
    ]


def title(result, what='Memory breakdown (GiB)'):
    """One line naming everything that sets the bars: model, micro-batch, precisions, state policy, memory options."""
    cfg = result['config']
    where = 'one device' if result['estimate'] else f"one {result['device']}"
    precisions = ', '.join(precision_label(p, d) for p, d in result['precisions'])
    names = ('activation_checkpointing', 'checkpoint_sublayers', 'loss_chunk', 'activation_offload')
    # .get: checkpoint_sublayers is absent from older results/*.json
    options = [f"{name}={cfg[name]}" if name == 'loss_chunk' else name for name in names if cfg.get(name)]
    return (
        f"{what}, {model_name(cfg)}, {where}, micro-batch {cfg['batch_size']} x {cfg['block_size']}, precision "
        f"{precisions}, omgd_state {cfg['omgd_state']}, " + (' + '.join(options) if options else 'no memory options')
    )


def markdown(result):
    cfg, rows, estimate = result['config'], result['rows'], result['estimate']
    out = [f"# {title(result)}" + (f" — ESTIMATE ({result['device']} device, no GPU)" if estimate else ''), '']
    out += [f"- {line}" for line in result['notes']]
    out += ['', f"Command: `{result['command']}`", '']
    extra = [('projectors', 'GaLore proj. (in Others)'), ('cpu_state', 'CPU state')]
    extra = [(k, h) for k, h in extra if any(r[k] for r in rows)]
    total = 'Total (est.)' if estimate else 'Total'
    head = ['Method', 'Precision', 'Model', 'Gradients', 'Optimizer', 'Others', total, 'Reserved']
    head += [h for _, h in extra]
    out += ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
    for r in rows:
        cells = [r['method'], precision_label(r['precision'], r['master_device'])]
        cells += [f"{gib(r[k]):.2f}" for k in ('params', 'grads', 'optimizer', 'others', 'peak')]
        cells.append('–' if r['reserved'] is None else f"{gib(r['reserved']):.2f}")
        cells += [f"{gib(r[k]):.2f}" for k, _ in extra]
        out.append('| ' + ' | '.join(cells) + ' |')
    if cfg['preset'] == 'llama-7b' and model_config(cfg).vocab_size == 32000:
        out += [
            '',
            "The paper's table (GiB, pure bf16, vocab 32000), for comparison. Its Others/Total were measured on an RTX "
            "PRO 6000 with its own code; a commented-out passage of the paper's source says the full-parameter row was "
            "estimated from proportions after running out of memory.",
            '',
            '| Method | Model | Gradients | Optimizer | Others | Total |',
            '|---|---|---|---|---|---|',
        ]
        for name, values in PAPER_LLAMA_7B.items():
            out.append(f"| {name} | " + ' | '.join(f"{v:.2f}" for v in values) + ' |')
    return '\n'.join(out) + '\n'


def plot(result, path):
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure to close

    rows = result['rows']
    parts = [('params', 'Model'), ('grads', 'Gradients'), ('optimizer', 'Optimizer'), ('others', 'Others')]
    colors = ['#4c72b0', '#dd8452', '#55a868', '#c44e52']
    width = 1.3 * len(rows) + 4.0  # room for the legend right of the bars
    fig = Figure(figsize=(width, 5.0))
    ax = fig.subplots()
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for (key, label), color in zip(parts, colors):
        values = [max(0.0, gib(r[key])) for r in rows]
        ax.bar(x, values, bottom=bottom, label=label, color=color, width=0.6)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, r in enumerate(rows):
        ax.text(i, bottom[i], f"{gib(r['peak']):.2f}", ha='center', va='bottom', fontsize=9)
    several = len(result['precisions']) > 1  # then each bar names its precision too
    labels = [f"{r['method']} ({precision_label(r['precision'], r['master_device'])})" for r in rows]
    ax.set_xticks(list(x), labels if several else [r['method'] for r in rows], rotation=20)
    ax.set_ylabel('GiB')
    text = title(result, 'GPU memory') + (f" (ESTIMATE, {result['device']} device)" if result['estimate'] else '')
    # wrapped to the figure's width (about 14 characters an inch at 9 pt), so that no title is clipped
    ax.set_title(textwrap.fill(text, width=int(13 * width), break_on_hyphens=False), fontsize=9)
    ax.set_ylim(0, max(bottom) * 1.12)
    ax.legend(loc='upper left', bbox_to_anchor=(1.01, 1.0), fontsize=8)  # outside: never over a bar's total
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def check(cfg):
    """One-line ValueErrors for what no row can run with; returns (device, row configs)."""
    check_rule('micro_batches', cfg['micro_batches'], RULES['micro_batches'])  # run() takes cfgs made elsewhere
    return check_rows(cfg)[:2]


def run(cfg, argv=()):
    """Measure every row of cfg (methods x precisions); return the result dict (nothing written)."""
    device, row_cfgs = check(cfg)
    rows, t0 = [], time.time()
    for i, row in enumerate(row_cfgs, 1):  # a 7B row takes a minute or more: say how far along it is
        rows.append(measure(row, device))
        spent, label = time.time() - t0, precision_label(row['precision'], row['master_device'])
        print(
            f"measured {i}/{len(row_cfgs)} rows ({row['method']}, {label}) in {spent:.0f} s, "
            f"about {spent / i * (len(row_cfgs) - i):.0f} s left",
            file=sys.stderr,
            flush=True,
        )
    estimate = device.type != 'cuda'
    precisions = list(dict.fromkeys((r['precision'], r['master_device']) for r in rows))
    return dict(
        estimate=estimate,
        device=device.type if estimate else torch.cuda.get_device_name(device),
        torch=torch.__version__,
        config=cfg,
        precisions=precisions,
        command=' '.join(['python bench_memory.py', *argv]),
        notes=notes_for(cfg, device, estimate, rows[0], precisions),
        rows=rows,
    )


def output_prefix(cfg):
    return cfg['out'] or os.path.join('out', f"memory_{model_name(cfg)}")


def main(argv):
    cfg = command_line(argv, DEFAULTS, RULES, __doc__, train_config.meanings())
    if cfg['device'] in ('auto', 'cuda') and torch.cuda.is_available():  # before CUDA's first allocation
        print(memory_options.cuda_allocator(), flush=True)
    try:
        result = run(cfg, argv)
    except ValueError as e:
        sys.exit(f"error: {e}")
    prefix, text = output_prefix(cfg), markdown(result)
    rows = [dict(r) for r in result['rows']]
    for r in rows:  # the JSON's rows: each byte count in GiB too
        r.update({f'{k}_gib': None if r[k] is None else round(gib(r[k]), 4) for k in BYTE_KEYS})
    try:
        os.makedirs(os.path.dirname(prefix) or '.', exist_ok=True)
        with open(prefix + '.md', 'w') as f:
            f.write(text)
        with open(prefix + '.json', 'w') as f:
            json.dump({**result, 'rows': rows}, f, indent=1)
        plot(result, prefix + '.png')
    except OSError as e:  # a full disk, a read-only folder, a file where a folder should be
        sys.exit(f"error: cannot write the report {prefix}.* ({e.strerror or e}); free space or choose another --out")
    print(f"{text}wrote {prefix}.md, {prefix}.json, {prefix}.png")


if __name__ == '__main__':
    main(sys.argv[1:])
