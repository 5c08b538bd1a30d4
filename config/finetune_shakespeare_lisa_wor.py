# Fine-tune a pretrained GPT-2 XL (1.5B) on Shakespeare with LISA-wor, in the spirit of nanoGPT's
# config/finetune_shakespeare.py: a few iterations at a small constant learning rate. The weights
# come from a local Hugging Face directory (hf.py reads it, no network); docs/models.md says how to
# get them, how to use a LLaMA instead, and what memory this needs on one GPU.
# $ hf download openai-community/gpt2-xl --local-dir models/gpt2-xl \
#       --include config.json model.safetensors
# $ python train.py config/finetune_shakespeare_lisa_wor.py
# $ python export.py --out_dir=out-shakespeare-ft --hf_dir=out-shakespeare-ft/hf
out_dir = 'out-shakespeare-ft'
gpu_config = True  # refused at once on a machine without CUDA (--device=cpu runs it there anyway)
init_from = 'models/gpt2-xl'  # any GPT2LMHeadModel or LlamaForCausalLM directory
dataset = 'shakespeare'  # GPT-2 BPE, prepared on first use; a LLaMA needs data in its own tokenizer
eval_interval = 5
eval_iters = 40
always_save_checkpoint = False  # keep only the best evaluation
block_size = 1024  # GPT-2's context (nanoGPT's default)
batch_size = 1
gradient_accumulation_steps = 32  # 32,768 tokens per iteration, as nanoGPT's
# LISA-wor: 8 of GPT-2 XL's 48 blocks at a time (gamma divides N_L, so every cycle trains each block
# exactly once), switching every 5 iterations: one full cycle in 30 iterations. Embedding, final
# norm and head train throughout; frozen blocks hold no gradients or AdamW state.
method = 'lisa_wor'
omgd_gamma = 8
omgd_period = 5
max_iters = 30
# finetune at a constant small learning rate (nanoGPT's 3e-5)
learning_rate = 3e-5
decay_lr = False
min_lr = 3e-6  # unused without decay_lr, but must not exceed learning_rate
warmup_iters = 0
