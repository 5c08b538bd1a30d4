# GPT-2 124M on OpenWebText with LISA-wor, as in the paper's pre-training experiment:
# 3 of 12 blocks active, switching every 100 iterations after 1000 iterations of full training;
# batch 60 x 1024 tokens x 8 accumulation steps (~0.5M tokens), AdamW(0.9, 0.95), lr 6e-4 -> 6e-5,
# 2000 warm-up iterations, 100k iterations.
# $ python data/openwebtext/prepare.py
# $ torchrun --standalone --nproc_per_node=4 train.py config/gpt2_lisa_wor.py
out_dir = 'out-gpt2-lisa-wor'
wandb_log = False
wandb_project = 'omgd'
wandb_run_name = 'gpt2-124m-lisa-wor'
dataset = 'openwebtext'
preset = 'gpt2'
vocab_size = 50304  # GPT-2's 50257 padded to a multiple of 64 for speed
dropout = 0.0
block_size = 1024
batch_size = 60
gradient_accumulation_steps = 8  # in total over all ranks
max_iters = 100000
lr_decay_iters = 100000
learning_rate = 6e-4
min_lr = 6e-5
warmup_iters = 2000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
eval_interval = 1000
eval_iters = 200
log_interval = 10
method = 'lisa_wor'
omgd_gamma = 3
omgd_period = 100
omgd_warmup = 1000
