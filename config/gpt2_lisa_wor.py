# GPT-2 124M on OpenWebText with LISA-wor: the paper's pre-training experiment (section "GPT-2
# pre-training" and appendix "Experimental Details"). Every value is the paper's unless its
# comment names another source; the paper ran nanoGPT's code, so nanoGPT's train.py fills its gaps.
# $ python data/openwebtext/prepare.py
# $ torchrun --standalone --nproc_per_node=4 train.py config/gpt2_lisa_wor.py
out_dir = 'out-gpt2-lisa-wor'
gpu_config = True  # refused at once on a machine without CUDA (--device=cpu runs it there anyway)
wandb_log = False
wandb_project = 'omgd'
wandb_run_name = 'gpt2-124m-lisa-wor'
dataset = 'openwebtext'
preset = 'gpt2'  # 12 layers, 12 heads, 768 wide
vocab_size = 50304  # nanoGPT: GPT-2's 50257 padded to a multiple of 64 for speed
dropout = 0.0  # nanoGPT's pre-training value
block_size = 1024
batch_size = 60
# The paper: 60 per GPU x 8 accumulation steps, "approximately 0.5M tokens per iteration" (491,520,
# i.e. 8 micro-batches in all). Here the count is over all ranks: the same tokens on any number of GPUs.
gradient_accumulation_steps = 8
max_iters = 100000
lr_decay_iters = 100000
learning_rate = 6e-4
min_lr = 6e-5
warmup_iters = 2000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # nanoGPT's default; the paper does not state it
eval_interval = 1000  # nanoGPT's
eval_iters = 200  # nanoGPT's
log_interval = 10  # nanoGPT's
sampling = 'rr'  # this repository's default (each window once per epoch); nanoGPT samples i.i.d.: --sampling=iid
method = 'lisa_wor'
omgd_gamma = 3
omgd_period = 100
omgd_warmup = 0  # the paper describes no full-training warm-up before cycling
# The paper's code never frees a frozen block's AdamW moments, which is 'keep'. 'offload' (DDP only)
# gives the same numbers with the moments parked in CPU memory; 'drop' restarts them at each
# activation and saves the most device memory.
omgd_state = 'keep'
omgd_scale_after_clip = True  # the paper's code clips the gradient norm, then scales by N_L/gamma
