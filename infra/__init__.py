"""The machinery a fork rarely opens: checkpoints (checkpoint.py, with its two formats), torchrun
(distributed.py, ddp_check.py), what a run reports (metrics.py), memory (memory_options.py,
optimizer_offload.py), multiple-choice scoring (multiple_choice.py). The base layer: it imports nothing of the
model, the method or the run, which are one folder up (tests/test_layers.py)."""
