"""
Where a switch iteration's time goes, per omgd_state: each iteration of bench.py's row, split into the
cycler's switch (host time to return, then the wait for the GPU), the prefetch, and the training step.
bench.py's 'switch ms/iter' column gives the total; this says which part grows.

    python experiments/switch_timing.py --preset=gpt2 --vocab_size=50304 --batch_size=12 --block_size=1024 \
        --omgd_gamma=3 --omgd_period=5 --policies=keep,offload          # one GPU, compiled per block

Keys: bench.py's (the row is its first method, lisa_wor by default), policies, iters (the run's length) and
shown (the last iterations printed, after a warm-up of whole cycles).
"""

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's modules
import bench  # noqa: E402
import train_config  # noqa: E402
from configurator import at_least, command_line  # noqa: E402

DEFAULTS = {**bench.DEFAULTS, 'methods': 'lisa_wor', 'policies': 'keep,offload', 'iters': 50, 'shown': 25}
RULES = {**bench.RULES, 'iters': at_least(2), 'shown': at_least(1)}


def time_iterations(cfg, device):
    """[(iteration, switched, switch host ms, switch wait ms, prefetch ms, step ms)] of the last `shown`."""
    run = bench.MethodRun(cfg, device)
    trainer, rows = run.trainer, []
    for it in range(cfg['iters']):
        run.sync()
        t0 = time.perf_counter()
        switched = trainer.cycler.step(it)
        t1 = time.perf_counter()
        run.sync()
        t2 = time.perf_counter()
        trainer.cycler.prefetch(it)
        run.sync()
        t3 = time.perf_counter()
        trainer.train_step(trainer.model)
        run.sync()
        t4 = time.perf_counter()
        rows.append((it, switched, *(1000 * d for d in (t1 - t0, t2 - t1, t3 - t2, t4 - t3))))
    return rows[-cfg['shown'] :]


def main(argv):
    given = set()
    cfg = command_line(argv, DEFAULTS, RULES, __doc__, train_config.meanings(), given)
    device = bench.setup(cfg, given)[0]
    cfg['method'] = cfg['methods'].split(',')[0]
    for policy in cfg['policies'].split(','):
        rows = time_iterations({**cfg, 'omgd_state': policy}, device)
        print(
            f"== {cfg['method']}, omgd_state={policy}: iteration | switch host ms | switch wait ms | prefetch ms "
            f"| step ms"
        )
        for it, switched, *ms in rows:
            print(f"{it} {'S' if switched else ' '} | " + ' | '.join(f"{v:.1f}" for v in ms))
        plain = [r[5] for r in rows if not r[1]]
        switches = [r for r in rows if r[1]]
        if plain and switches:
            print(
                f"median step {statistics.median(plain):.1f} ms; switch iterations: the switch "
                f"{statistics.mean(r[2] + r[3] for r in switches):.1f} ms + the step "
                f"{statistics.mean(r[5] for r in switches):.1f} ms",
                flush=True,
            )
        if device.type == 'cuda':
            torch.cuda.empty_cache()


if __name__ == '__main__':
    main(sys.argv[1:])
