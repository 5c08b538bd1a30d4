"""The machinery a fork rarely opens: checkpoints (checkpoint.py, with its two formats), torchrun
(distributed.py, ddp_check.py), what a run reports (metrics.py), memory (memory_options.py,
optimizer_offload.py, memory_estimate.py), Hugging Face in and out (hf.py), multiple-choice scoring
(multiple_choice.py). The files a fork edits and the scripts people run are one folder up."""
