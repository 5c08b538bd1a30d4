# A small GPT-2-style model on character-level Shakespeare with LISA-wor: 8 blocks, 2 active,
# switching every 25 iterations. About 12 minutes of CPU time at one thread (1,000 iterations of 0.62 s
# and 11 evaluations of 11 s, measured on a loaded 2-core machine), which is the wall time on a free core;
# OMP_NUM_THREADS=1 on a busy machine (README: Threads).
# $ python train.py config/shakespeare_lisa_wor.py
# $ torchrun --standalone --nproc_per_node=2 train.py config/shakespeare_lisa_wor.py   # 2 ranks, the same windows
out_dir = 'out-shakespeare-lisa-wor'
dataset = 'shakespeare_char'
n_layer = 8
n_head = 4
n_embd = 128
block_size = 128
# 4,096 tokens an iteration as 2 micro-steps of 16 windows: gradient_accumulation_steps counts the micro-steps
# of all ranks, so 1 or 2 ranks run it as it is; 4 ranks: --gradient_accumulation_steps=4 --batch_size=8
batch_size = 16
gradient_accumulation_steps = 2
eval_iters = 40  # 40 x 16 windows: the 640 of 20 x 32 on one rank
max_iters = 1000
lr_decay_iters = 1000
eval_interval = 100
method = 'lisa_wor'
omgd_gamma = 2
omgd_period = 25
