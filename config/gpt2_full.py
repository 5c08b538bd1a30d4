# GPT-2 124M on OpenWebText, full-parameter AdamW, with the settings of config/gpt2_lisa_wor.py
# (see that file for their sources). The paper's figure shows LISA and LISA-wor only; this is
# nanoGPT's baseline, for reference.
import os

exec(open(os.path.join(os.path.dirname(__file__), 'gpt2_lisa_wor.py')).read())
out_dir = 'out-gpt2-full'
wandb_run_name = 'gpt2-124m-full'
method = 'full'
