# GPT-2 124M on OpenWebText with LISA (i.i.d. layer draws, no gradient scale): the paper's baseline
# for config/gpt2_lisa_wor.py, with the same settings (gamma=3, K=100; see that file for their sources).
import os

exec(open(os.path.join(os.path.dirname(__file__), 'gpt2_lisa_wor.py')).read())
out_dir = 'out-gpt2-lisa'
wandb_run_name = 'gpt2-124m-lisa'
method = 'lisa'
