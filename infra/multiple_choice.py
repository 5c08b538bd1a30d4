"""
Multiple choice in HellaSwag's jsonl format, scored as lm-evaluation-harness scores HellaSwag: each ending, after
a space, by the sum of its tokens' log-probabilities given the context; acc takes the largest sum, acc_norm the
largest per character. For eval.py and train.py's eval_mc_path.
"""

import json
import re
from contextlib import nullcontext

import torch
from torch.nn import functional as F
from tqdm.auto import tqdm


class EvalError(ValueError):
    """Bad input; the message says what to do."""


def preprocess(text):
    """lm-evaluation-harness's HellaSwag clean-up (tasks/hellaswag/utils.py) of WikiHow's [title] markers."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def mc_example(doc, where):
    """{'query', 'choices', 'gold'} of one HellaSwag example, as lm-evaluation-harness builds them."""
    if not isinstance(doc, dict):
        raise EvalError(f"{where}: a {type(doc).__name__}, not a JSON object with ctx_a, ctx_b, endings and label")
    endings = doc.get('endings')
    if not (isinstance(endings, list) and len(endings) >= 2 and all(isinstance(e, str) for e in endings)):
        raise EvalError(f"{where}: 'endings' must be a list of at least 2 strings, got {endings!r:.80}")
    label = doc.get('label')
    if isinstance(label, str) and label.strip().isdigit():
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(endings):
        raise EvalError(
            f"{where}: 'label' must be the index of the right ending (0 to {len(endings) - 1}), "
            f"got {doc.get('label')!r}"
        )
    if isinstance(doc.get('ctx_a'), str) and isinstance(doc.get('ctx_b', ''), str):
        ctx = doc['ctx_a'] + " " + doc.get('ctx_b', '').capitalize()
    elif isinstance(doc.get('ctx'), str):
        ctx = doc['ctx']
    else:
        raise EvalError(f"{where}: no context: give the strings 'ctx_a' and 'ctx_b' (or 'ctx')")
    activity = doc.get('activity_label', '')
    if not isinstance(activity, str):
        raise EvalError(f"{where}: 'activity_label' must be a string, got {activity!r:.80}")
    query = preprocess(f"{activity}: {ctx}" if activity else ctx)
    choices = [preprocess(e) for e in endings]
    if not query or not all(choices):
        raise EvalError(f"{where}: an empty {'context' if not query else 'ending'}; every example needs text to score")
    return {'query': query, 'choices': choices, 'gold': label}


def read_mc(path, limit=0, encode=None):
    """The first `limit` (all: 0) examples of a HellaSwag jsonl file, or an EvalError naming the file and line.
    encode: every text must encode (train.py refuses it at the start, not at an evaluation)."""
    try:
        with open(path, encoding='utf-8') as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        reason = 'not UTF-8 text' if isinstance(e, UnicodeDecodeError) else e.strerror
        raise EvalError(f"mc_path={path}: cannot read it ({reason}); give a HellaSwag jsonl file") from None
    examples = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            doc = json.loads(line)
        except ValueError as e:
            raise EvalError(f"{where}: not JSON ({e}); a HellaSwag file holds one JSON object a line") from None
        examples.append(mc_example(doc, where))
        if len(examples) == limit:
            break
    if not examples:
        raise EvalError(f"mc_path={path} holds no examples; a HellaSwag file holds one JSON object a line")
    for number, ex in enumerate(examples if encode is not None else [], 1):
        try:
            for text in (ex['query'], *ex['choices']):
                encode(text)
        except ValueError as e:
            raise EvalError(f"{path}, example {number}: {e}") from None
    return examples


def encode_pair(encode, context, continuation):
    """(context ids, continuation ids): what follows the context's ids in the whole text's, as lm-eval splits them."""
    whole, ctx = encode(context + continuation), encode(context)
    return ctx, whole[len(ctx) :]


@torch.no_grad()
def continuation_logprobs(model, requests, device='cpu', autocast=nullcontext(), batch_size=16, progress=False):
    """Each (context ids, continuation ids) request's sum of continuation log-probabilities, in float64; one
    longer than block_size + 1 tokens loses tokens on the left, as lm-evaluation-harness truncates."""
    block_size = model.config.block_size
    sums = []
    for i in tqdm(range(0, len(requests), batch_size), desc='scoring choices', unit='batch', disable=not progress):
        chunk = requests[i : i + batch_size]
        rows = [(ctx + cont)[-(block_size + 1) :] for ctx, cont in chunk]
        T = max(len(r) for r in rows) - 1
        x = torch.zeros(len(rows), T, dtype=torch.long)
        y = torch.full((len(rows), T), -1, dtype=torch.long)  # -1: not a continuation token
        for j, (row, (_, cont)) in enumerate(zip(rows, chunk)):
            n = min(len(cont), len(row) - 1)
            x[j, : len(row) - 1] = torch.tensor(row[:-1])
            y[j, len(row) - 1 - n : len(row) - 1] = torch.tensor(row[-n:])
        x, y = x.to(device), y.to(device)
        scored = y >= 0
        with autocast:
            logits = model.lm_head(model.hidden_states(x)[scored])
        logprobs = F.log_softmax(logits.float(), dim=-1).gather(1, y[scored][:, None])[:, 0]
        row_of = torch.arange(len(rows), device=device)[:, None].expand(-1, T)[scored]
        totals = torch.zeros(len(rows), dtype=torch.float64, device=device)
        sums += totals.index_add_(0, row_of, logprobs.double()).tolist()
    return sums


def mc_accuracy(model, examples, encode, device='cpu', autocast=nullcontext(), batch_size=16, progress=False):
    """{'acc', 'acc_norm', 'n'} of a model on read_mc() examples (a tie: the first wins); encode: text -> ids."""
    requests, spans = [], []
    for number, ex in enumerate(examples):
        try:
            pairs = [encode_pair(encode, ex['query'], ' ' + choice) for choice in ex['choices']]
        except ValueError as e:  # characters outside a character-level vocabulary
            raise EvalError(f"mc example {number + 1}: {e}") from None
        spans.append((len(requests), len(pairs)))
        requests += pairs
    was_training = model.training
    model.eval()
    try:
        lls = continuation_logprobs(model, requests, device, autocast, batch_size, progress)
    finally:
        model.train(was_training)
    correct = correct_norm = 0
    for ex, (start, count) in zip(examples, spans):
        ll = lls[start : start + count]
        norm = [v / len(choice) for v, choice in zip(ll, ex['choices'])]
        correct += max(range(count), key=ll.__getitem__) == ex['gold']
        correct_norm += max(range(count), key=norm.__getitem__) == ex['gold']
    return {'acc': correct / len(examples), 'acc_norm': correct_norm / len(examples), 'n': len(examples)}
