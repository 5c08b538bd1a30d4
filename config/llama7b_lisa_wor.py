# LLaMA-7B with LISA-wor at the paper's memory setting (section "GPU memory consumption" and the
# appendix): one device, pure bf16, micro-batch 16 x 256 tokens, 32 accumulation steps (512
# sequences per iteration), activation checkpointing, 2 of 32 blocks active.
# Data: the paper pre-trains on C4 (English). A 1B-token slice, streamed (only the shards it reads
# are downloaded; train.bin is 2 bytes a token, 2 GB), then training on it:
# $ python data/c4/prepare.py --max_tokens=1000000000 --max_val_tokens=10000000 --num_proc=16
# $ python train.py config/llama7b_lisa_wor.py --dataset=c4
# With LLaMA's own tokenizer (a local Hugging Face directory with tokenizer.json), prepare with
# --tokenizer=DIR and train with --vocab_size=0 (the dataset's: 32000 for LLaMA-1/2; a vocabulary
# above 65,536, e.g. LLaMA-3's 128,256, is stored as uint32). All of C4-en, its disk and time:
# docs/data.md. Without C4: python data/openwebtext/prepare.py and this config as it is.
out_dir = 'out-llama7b-lisa-wor'
gpu_config = True  # refused at once on a machine without CUDA (--device=cpu runs it there anyway)
dataset = 'openwebtext'  # the paper used C4: --dataset=c4 after data/c4/prepare.py (above)
preset = 'llama-7b'
# GPT-2's tokenizer (data/*/prepare.py' default), not LLaMA's 32000: the embedding and head get
# 18,304 more rows, 2 x 18304 x 4096 x 2 bytes = 286 MiB more bf16 weights than the paper's model
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
