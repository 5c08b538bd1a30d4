# LLaMA-60M (GaLore's pre-training size) with LISA-wor, 2 of 8 blocks active, on any BPE dataset.
# A GPU config: far too slow for a CPU (over a minute per iteration on 2 cores).
# $ python train.py config/llama_60m_lisa_wor.py --dataset=shakespeare
out_dir = 'out-llama-60m-lisa-wor'
gpu_config = True  # refused at once on a machine without CUDA (--device=cpu runs it there anyway)
dataset = 'shakespeare'
preset = 'llama-60m'
vocab_size = 50304  # the GPT-2 tokenizer of data/*/prepare.py, not LLaMA's 32000
block_size = 256
batch_size = 16
gradient_accumulation_steps = 4
learning_rate = 1e-3
max_iters = 2000
lr_decay_iters = 2000
method = 'lisa_wor'
omgd_gamma = 2
omgd_period = 50
