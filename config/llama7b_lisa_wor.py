# LLaMA-7B with LISA-wor at the paper's memory setting (section "GPU memory consumption" and the
# appendix): one device, pure bf16, micro-batch 16 x 256 tokens, 32 accumulation steps (512
# sequences per iteration), activation checkpointing, 2 of 32 blocks active.
# $ python data/openwebtext/prepare.py
# $ python train.py config/llama7b_lisa_wor.py
out_dir = 'out-llama7b-lisa-wor'
dataset = 'openwebtext'  # the paper used C4; any corpus prepared with the GPT-2 tokenizer works
preset = 'llama-7b'
# GPT-2's tokenizer (data/*/prepare.py), not LLaMA's 32000: the embedding and head get 18,304 more
# rows, 2 x 18304 x 4096 x 2 bytes = 286 MiB more bf16 weights than the paper's model
vocab_size = 50304
block_size = 256
batch_size = 16
gradient_accumulation_steps = 32
activation_checkpointing = True
precision = 'bf16'  # the paper's table: bf16 weights, gradients and AdamW state
# Not stated by the paper (it reports memory only): LLaMA's pre-training recipe
learning_rate = 3e-4
min_lr = 3e-5
warmup_iters = 2000
max_iters = 150000  # GaLore's LLaMA-7B run length
lr_decay_iters = 150000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
eval_interval = 1000
eval_iters = 50
method = 'lisa_wor'
omgd_gamma = 2
omgd_period = 100  # K of the paper's GPT-2 run; its memory experiment does not state one
omgd_state = 'drop'  # frees a frozen block's optimizer state: the paper's Optimizer column (2.48 GB)
