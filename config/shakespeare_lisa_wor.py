# A small GPT-2-style model on character-level Shakespeare with LISA-wor: 8 blocks, 2 active,
# switching every 25 iterations. A few minutes on a laptop CPU.
# $ python train.py config/shakespeare_lisa_wor.py
out_dir = 'out-shakespeare-lisa-wor'
dataset = 'shakespeare_char'
n_layer = 8
n_head = 4
n_embd = 128
block_size = 128
batch_size = 32
max_iters = 1000
lr_decay_iters = 1000
eval_interval = 100
method = 'lisa_wor'
omgd_gamma = 2
omgd_period = 25
