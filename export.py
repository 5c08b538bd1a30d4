"""
Export train.py's checkpoint as a Hugging Face model directory, which transformers, vLLM and lm-evaluation-harness
read (the mapping and the writing are hf.py's; docs/models.md lists the files and how to load them).

$ python export.py --out_dir=out --hf_dir=out/hf

Keys: out_dir, hf_dir, dtype ('' keeps the checkpoint's; float32, bfloat16, float16), overwrite (write into an
hf_dir that holds a model), tokenizer ('' the dataset's, 'none' the weights only), max_shard_size ('5GB': larger
models are written as shards with an index, as transformers does). A failed export leaves hf_dir as it was.
"""

import sys


def main(argv):
    from configurator import command_line
    from hf import export

    defaults = dict(out_dir='out', hf_dir='', dtype='', overwrite=False, tokenizer='', max_shard_size='5GB')
    cfg = command_line(argv, defaults, usage=__doc__)
    try:
        export(**cfg)
    except ValueError as e:  # ExportError, CheckpointError, a checkpoint that is not train.py's
        sys.exit(f"error: {e}")


if __name__ == '__main__':
    main(sys.argv[1:])
