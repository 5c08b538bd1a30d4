"""eval.py: the loss on a split (train.py's windows, and a full pass), multiple choice scored as
lm-evaluation-harness scores HellaSwag (its own run when lm_eval is installed), and one-line errors."""

import importlib.util
import json
import math
import os
import pickle
import re
import sys

import numpy as np
import pytest
import torch
from conftest import assert_one_line_error, assert_same_state, run_script, run_train, tiny_model_config
from torch.nn import functional as F

from builder import trained_model
from eval import MC_TASK, full_loss, window_loss, write_mc_task
from infra.multiple_choice import continuation_logprobs, encode_pair, mc_accuracy, mc_example, read_mc
from model import Transformer

HAS_LM_EVAL = importlib.util.find_spec('lm_eval') is not None

# HellaSwag's fields (hellaswag_val.jsonl); the texts use only characters of shakespeare_char's vocabulary
EXAMPLES = [
    dict(
        ind=1,
        activity_label='Fencing',
        ctx_a='Two men hold swords.',
        ctx_b='they',
        endings=['run away from the hall and go home.', 'bow and begin to fence.', 'eat.', 'sing a song of love.'],
        label=1,
        split='val',
        split_type='indomain',
        source_id='x',
    ),
    dict(
        ind=2,
        activity_label='Cooking',
        ctx_a='A woman cuts bread on a board.',
        ctx_b='she',
        endings=['puts the bread in a bag.', 'flies.', 'reads the paper in the garden by the sea.', 'smiles.'],
        label='0',
        split='val',
        split_type='zeroshot',
        source_id='y',
    ),
    dict(
        ind=3,
        activity_label='Running',
        ctx_a='A man runs on a track.',
        ctx_b='he',
        endings=['stops and drinks water.', 'swims.', 'jumps over the bar and lands.', 'sleeps on the grass.'],
        label=2,
        split='val',
        split_type='indomain',
        source_id='z',
    ),
]


def write_jsonl(path, docs):
    path.write_text(''.join((d if isinstance(d, str) else json.dumps(d)) + '\n' for d in docs))
    return str(path)


def uniform(model):
    """Every weight zero: the head's logits are all 0, each token has probability 1 / vocab_size."""
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


# -----------------------------------------------------------------------------
# scoring


def test_continuation_logprob_sums_the_continuation_tokens():
    torch.manual_seed(0)
    model = Transformer(tiny_model_config('gpt2')).eval()  # vocab 64, block_size 16
    # the third is 18 tokens: the first is dropped (lm-eval's truncation on the left)
    requests = [([1, 2, 3], [4, 5]), ([7], [8, 9, 10]), ([1] * 14, [2, 3, 4, 5])]
    expected = []
    for ctx, cont in requests:  # one full forward each: the log-prob of each continuation token at its position
        row = (ctx + cont)[-17:]
        logprobs = F.log_softmax(model.lm_head(model.hidden_states(torch.tensor([row[:-1]]))), dim=-1)[0]
        expected.append(sum(logprobs[i - 1, row[i]].item() for i in range(len(row) - len(cont), len(row))))
    for batch_size in (16, 1):  # padded together, and one by one
        assert continuation_logprobs(model, requests, batch_size=batch_size) == pytest.approx(expected, abs=1e-5)
    # by hand: uniform over 64 ids, each continuation token costs log 64
    sums = continuation_logprobs(uniform(model), requests)
    assert sums == pytest.approx([-2 * math.log(64), -3 * math.log(64), -4 * math.log(64)], abs=1e-5)


def test_acc_norm_divides_by_the_characters_of_the_ending():
    """Under a uniform model every token costs the same: acc picks the shortest ending, acc_norm (log-prob per
    character, the space before it not counted, as lm-eval) the longest; tokens here are characters."""
    model = uniform(Transformer(tiny_model_config('llama')))
    encode = lambda text: [ord(c) % 64 for c in text]  # noqa: E731
    long_right = mc_example(dict(ctx='A man', endings=['ran.', 'sat down on a chair.', 'sat down.'], label=1), 'a')
    short_right = dict(long_right, gold=0)
    assert mc_accuracy(model, [long_right], encode) == {'acc': 0.0, 'acc_norm': 1.0, 'n': 1}
    assert mc_accuracy(model, [short_right], encode) == {'acc': 1.0, 'acc_norm': 0.0, 'n': 1}
    model.train()
    mc_accuracy(model, [long_right, short_right], encode)
    assert model.training  # train.py's model goes back to training mode


def test_acc_norm_is_not_per_token(monkeypatch):
    """Log-probabilities where the three rules disagree: the largest sum (acc) is ending 0, the largest per
    character (acc_norm) ending 2, the largest per token (llm.c's normalisation: ' ' + ending is one token
    a character here) ending 1."""
    from infra import multiple_choice as evaluation

    lls = [-2.0, -3.0, -5.6]  # per character: -1, -0.75, -0.7; per token (3, 5, 9): -0.67, -0.6, -0.62
    scored = []
    monkeypatch.setattr(
        evaluation, 'continuation_logprobs', lambda model, requests, *a, **kw: scored.append(requests) or lls
    )
    example = {'query': 'Go', 'choices': ['ab', 'abcd', 'abcdefgh'], 'gold': 2}
    encode = lambda text: [ord(c) for c in text]  # noqa: E731
    model = torch.nn.Linear(1, 1)  # never called: the scores are the ones above
    assert evaluation.mc_accuracy(model, [example], encode) == {'acc': 0.0, 'acc_norm': 1.0, 'n': 1}
    # what was scored: each ending after a space, given the query
    assert scored[0] == [([71, 111], [32, *map(ord, choice)]) for choice in example['choices']]
    assert evaluation.mc_accuracy(model, [dict(example, gold=0)], encode) == {'acc': 1.0, 'acc_norm': 0.0, 'n': 1}


def test_hellaswag_text_is_built_as_lm_eval_builds_it():
    doc = dict(
        activity_label='Personal Care and Style',
        ctx_a='[header] How to dye hair [title] Pick a color.',
        ctx_b='then you',
        endings=['  mix the dye [step] well.', 'wait.'],
        label='1',
    )
    assert mc_example(doc, 'x') == {
        'query': 'Personal Care and Style: How to dye hair. Pick a color. Then you',
        'choices': ['mix the dye well.', 'wait.'],
        'gold': 1,
    }


def test_full_pass_predicts_every_token_once(tmp_path):
    torch.manual_seed(0)
    model = Transformer(tiny_model_config('llama', n_kv_head=2)).eval()  # block_size 16
    ids = np.random.default_rng(0).integers(0, 64, 103).astype(np.uint16)
    ids.tofile(tmp_path / 'val.bin')
    loss, n = full_loss(model, str(tmp_path / 'val.bin'), 'uint16', 16, batch_size=3)
    total = 0.0  # by hand: windows 0-15, 16-31, ..., 96-101 (6 inputs), each with its next tokens as targets
    for start in range(0, 102, 16):
        x = torch.from_numpy(ids[start : start + 17].astype(np.int64))
        logits = model.lm_head(model.hidden_states(x[None, :-1]))[0]
        total += F.cross_entropy(logits, x[1:], reduction='sum').item()
    assert n == 102 and loss == pytest.approx(total / 102, rel=1e-6)


def test_eval_py_shows_progress_on_stderr_and_train_py_does_not(tmp_path, capsys):
    """The full pass and the choices' scoring (minutes on a CPU) show a tqdm bar on stderr with progress=True,
    eval.py's; train.py's periodic scoring calls them without, and the results do not change."""
    torch.manual_seed(0)
    model = Transformer(tiny_model_config('llama', n_kv_head=2)).eval()
    np.random.default_rng(0).integers(0, 64, 103).astype(np.uint16).tofile(tmp_path / 'val.bin')
    example = {'query': 'Go', 'choices': ['ab', 'abcd'], 'gold': 1}
    encode = lambda text: [ord(c) % 64 for c in text]  # noqa: E731
    quiet = full_loss(model, str(tmp_path / 'val.bin'), 'uint16', 16, 3), mc_accuracy(model, [example], encode)
    assert capsys.readouterr() == ('', '')
    shown = (
        full_loss(model, str(tmp_path / 'val.bin'), 'uint16', 16, 3, progress=True),
        mc_accuracy(model, [example], encode, progress=True),
    )
    out, err = capsys.readouterr()
    assert shown == quiet and out == ''
    assert re.search(r'every token: 100%.* 3/3 ', err) and re.search(r'scoring choices: 100%.* 1/1 ', err), err


# -----------------------------------------------------------------------------
# eval.py on train.py's checkpoint


@pytest.fixture(scope='module')
def run(tmp_path_factory):
    """A tiny train.py run on shakespeare_char and what it printed."""
    out_dir = tmp_path_factory.mktemp('run')
    result = run_train(f'--out_dir={out_dir}', '--max_iters=4', '--eval_interval=4')
    return out_dir, result.stdout


def test_loss_is_the_one_train_py_printed(run, tmp_path):
    out_dir, stdout = run
    printed = [line for line in stdout.splitlines() if line.startswith('step 4:')][0]  # the checkpoint's iteration
    val = printed.split('val loss ')[1]
    result = run_script('eval.py', [f'--out_dir={out_dir}', '--device=cpu'])
    assert result.returncode == 0, result.stderr
    assert re.search(
        f"^val loss {val}, perplexity [\\d.]+ \\(shakespeare_char, train.py's "
        f"windows: 2 batches of 8 x 32 tokens, seed 1338\\)$",
        result.stdout,
        re.M,
    ), result.stdout
    # the full pass, through eval.py, on a split written here (a dataset given by its path)
    np.random.default_rng(1).integers(0, 65, 300).astype(np.uint16).tofile(tmp_path / 'val.bin')
    from infra.checkpoint import read
    from model import TransformerConfig

    model = Transformer(TransformerConfig(**read(os.path.join(out_dir, 'ckpt.pt'))['model_args']))
    model.load_state_dict(read(os.path.join(out_dir, 'ckpt.pt'))['model'])
    loss, n = full_loss(model.eval(), str(tmp_path / 'val.bin'), 'uint16', 32, 5)
    result = run_script('eval.py', [f'--out_dir={out_dir}', f'--dataset={tmp_path}', '--full=True', '--batch_size=5'])
    assert (
        f"val loss {loss:.4f}, perplexity {math.exp(loss):.4g} ({tmp_path}, every token once: 299 predictions "
        f"in windows of 32)" in result.stdout
    ), result.stdout + result.stderr
    assert window_loss(model, str(tmp_path / 'val.bin'), 'uint16', 32, 5, 3, seed=1) > 0


def test_mc_on_a_checkpoint_and_lm_eval_refused_without_the_package(run, tmp_path, monkeypatch):
    out_dir, _ = run
    path = write_jsonl(tmp_path / 'mc.jsonl', EXAMPLES)
    result = run_script('eval.py', [f'--out_dir={out_dir}', '--loss=False', f'--mc_path={path}', '--mc_limit=2'])
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith(f"mc {path}: acc ") and line.endswith("(2 examples)"), line
    monkeypatch.setitem(sys.modules, 'lm_eval', None)  # as if it were not installed
    result = run_script('eval.py', [f'--out_dir={out_dir}', '--loss=False', f'--mc_path={path}', '--lm_eval=True'])
    assert_one_line_error(
        result,
        r'^error: lm_eval=True needs lm-evaluation-harness \(.*\): pip install '
        r'"lm-eval\[hf\]"$',
    )


def test_train_py_scores_the_mc_file_at_every_evaluation(tmp_path):
    """eval_mc_path: the eval records (and the log line) carry the scores multiple_choice.mc_accuracy gives the
    weights of that iteration; the last evaluation's are those of the checkpoint."""
    from data.tokenizer import Tokenizer, read_meta
    from dataloader import data_dir
    from infra.checkpoint import read
    from model import TransformerConfig

    path = write_jsonl(tmp_path / 'mc.jsonl', EXAMPLES * 4)  # 12 examples, 10 scored
    out_dir = tmp_path / 'run'
    result = run_train(
        f'--out_dir={out_dir}', '--max_iters=6', '--eval_interval=3', f'--eval_mc_path={path}', '--eval_mc_limit=10'
    )
    records = [json.loads(line) for line in open(out_dir / 'metrics.jsonl')]
    evals = [r for r in records if r['kind'] == 'eval']
    assert [r['iter'] for r in evals] == [0, 3, 6] and all(0 <= r['mc_acc'] <= 1 for r in evals)
    checkpoint = read(str(out_dir / 'ckpt.pt'))
    model = Transformer(TransformerConfig(**checkpoint['model_args']))
    model.load_state_dict(checkpoint['model'])
    encode = Tokenizer.from_meta(read_meta(data_dir('shakespeare_char'))).encode
    scores = mc_accuracy(model, read_mc(path, 10), encode)
    assert (evals[-1]['mc_acc'], evals[-1]['mc_acc_norm']) == (scores['acc'], scores['acc_norm'])
    assert f"mc acc {scores['acc']:.4f}, acc_norm {scores['acc_norm']:.4f}" in result.stdout
    run_train(f'--out_dir={tmp_path / "without"}', '--max_iters=6', '--eval_interval=3')  # scoring draws no numbers
    assert_same_state(checkpoint, read(str(tmp_path / 'without' / 'ckpt.pt')))


def test_train_py_refuses_a_bad_mc_file_before_training(tmp_path):
    result = run_train(
        f'--out_dir={tmp_path / "run"}',
        '--max_iters=2',
        f'--eval_mc_path={write_jsonl(tmp_path / "mc.jsonl", [EXAMPLES[0], "{oops"])}',
        expect_ok=False,
    )
    assert_one_line_error(result, r"^error: eval_mc_path: .*mc.jsonl, line 2: not JSON")
    assert not (tmp_path / 'run' / 'ckpt.pt').exists()
    unknown = dict(EXAMPLES[0], endings=['bow @ once.', 'run.'], label=0)  # '@' is not in shakespeare_char
    result = run_train(
        f'--out_dir={tmp_path / "run"}',
        '--max_iters=2',
        f'--eval_mc_path={write_jsonl(tmp_path / "mc2.jsonl", [EXAMPLES[1], unknown])}',
        expect_ok=False,
    )
    assert_one_line_error(result, r"^error: eval_mc_path: .*mc2.jsonl, example 2: .*@")
    assert not (tmp_path / 'run' / 'ckpt.pt').exists()


@pytest.mark.parametrize(
    'args, docs, pattern',
    [
        (['--mc_path={tmp}/none.jsonl'], None, r"mc_path=.*none.jsonl: cannot read it \(No such file or directory\)"),
        (['--mc_path={mc}'], [EXAMPLES[0], '{"ctx": "oops"'], r"mc.jsonl, line 2: not JSON"),
        (
            ['--mc_path={mc}'],
            [dict(EXAMPLES[0], label=4)],
            r"line 1: 'label' must be the index of the right ending "
            r"\(0 to 3\), got 4",
        ),
        (['--mc_path={mc}'], [{'ctx': 'a', 'label': 0}], r"line 1: 'endings' must be a list of at least 2 strings"),
        (
            ['--mc_path={mc}'],
            [dict(EXAMPLES[0], ctx_b='{')],
            r"mc example 1: characters '\{' are not in the dataset's "
            r"vocabulary",
        ),
        (['--mc_path={mc}'], [''], r"holds no examples"),
        (
            ['--split=test'],
            None,
            r"unknown split 'test' of dataset 'shakespeare_char'; its prepared splits: train, val",
        ),
        # a mistyped name: the datasets there are, not a prepare script that does not exist
        (
            ['--dataset=shakespeare_chars'],
            None,
            r"dataset 'shakespeare_chars' has no prepared splits in .*shakespeare_chars; "
            r"there is no data/shakespeare_chars/prepare.py either: the datasets are "
            r"c4, openwebtext, shakespeare, shakespeare_char(, [\w.-]+)* \(or give the "
            r"path of a prepared folder\)$",
        ),
        (
            ['--dataset=openwebtext'],
            None,
            r"dataset 'openwebtext' has no prepared splits in .*; run "
            r"`python data/openwebtext/prepare.py` first$",
        ),
        (['--block_size=64'], None, r"block_size=64 is longer than the model's 32 positions"),
        (['--out_dir={tmp}'], None, r"no checkpoint at .*ckpt.pt"),
        (['--out_dir={tmp}/ckpt.pt'], None, r"no checkpoint at"),
        (['--hf_dir={tmp}/none'], None, r"hf_dir=.*none is not a directory"),
        (['--hf_dir={tmp}'], None, r"holds no config.json"),
        (['--lm_eval=True'], None, r"lm_eval=True has nothing to run"),
        (['--mc_limit=-1'], None, r"mc_limit must be >= 0"),
        (['--mc_pth=x'], None, r"unknown config key 'mc_pth'; did you mean mc_path"),
    ],
)
def test_bad_input_is_one_error_line(run, tmp_path, args, docs, pattern):
    out_dir, _ = run
    mc = write_jsonl(tmp_path / 'mc.jsonl', docs) if docs is not None else ''
    args = [a.format(tmp=tmp_path, mc=mc) for a in args]
    assert_one_line_error(run_script('eval.py', [f'--out_dir={out_dir}', *args]), pattern)


def test_a_run_of_step_folders_is_named_by_the_folder_read(tmp_path):
    """eval.py names the checkpoint it read: a run that wrote step folders (any run on several ranks; one rank with
    checkpoint_format=dcp here) by its newest folder, not an out_dir/ckpt.pt that does not exist; --help says so."""
    run_train(f'--out_dir={tmp_path}', '--max_iters=4', '--eval_interval=2', '--checkpoint_format=dcp')
    assert not (tmp_path / 'ckpt.pt').exists()
    result = run_script('eval.py', [f'--out_dir={tmp_path}', '--device=cpu'])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"model: {tmp_path / 'step_0000004'} (iteration 4), gpt2,"), result.stdout
    result = run_script('eval.py', ['--help'])
    assert re.search(
        r"^\s*--out_dir=\S+\s+the run whose checkpoint \(ckpt.pt or newest step folder\) to evaluate$",
        result.stdout,
        re.M,
    ), result.stdout


def test_checkpoint_that_does_not_load_is_one_error_line(run, tmp_path):
    out_dir, _ = run
    checkpoint = torch.load(os.path.join(out_dir, 'ckpt.pt'), weights_only=True)
    checkpoint['model_args']['n_embd'] = 48  # weights of another shape
    torch.save(checkpoint, tmp_path / 'ckpt.pt')
    assert_one_line_error(
        run_script('eval.py', [f'--out_dir={tmp_path}']),
        r"ckpt.pt is not a checkpoint of train.py \(RuntimeError: Error\(s\) in loading state_dict",
    )
    checkpoint = torch.load(os.path.join(out_dir, 'ckpt.pt'), weights_only=True)
    checkpoint['model']['blocks.0.ln_1.weight'][0] = float('nan')  # a diverged model's loss would print as nan
    torch.save(checkpoint, tmp_path / 'ckpt.pt')
    assert_one_line_error(
        run_script('eval.py', [f'--out_dir={tmp_path}']), r"ckpt.pt holds NaN or inf weights \(1 tensor\(s\), e\.g\. "
    )
    (tmp_path / 'ckpt.pt').write_bytes(b'not a checkpoint')
    assert_one_line_error(run_script('eval.py', [f'--out_dir={tmp_path}']), r"cannot read checkpoint .*corrupt")


# -----------------------------------------------------------------------------
# a Hugging Face directory with GPT-2's BPE, and lm-evaluation-harness on it


@pytest.fixture(scope='module')
def hf_gpt2(tmp_path_factory):
    """(directory, model): a tiny GPT-2 with GPT-2's vocabulary in Hugging Face form, as export.py writes it."""
    import hf
    from hf import write_gpt2_tokenizer

    torch.manual_seed(0)
    model = Transformer(
        tiny_model_config('gpt2', vocab_size=50257, block_size=64, n_layer=1, n_embd=16, n_head=2)
    ).eval()
    with torch.no_grad():
        for p in model.parameters():  # more peaked than the init's: the endings' scores differ clearly
            p.mul_(4)
    directory = tmp_path_factory.mktemp('hf')
    hf.save(model, str(directory))
    write_gpt2_tokenizer(str(directory), 64)
    return str(directory), model


def test_mc_on_a_hugging_face_directory(hf_gpt2, tmp_path):
    from data.tokenizer import Tokenizer

    directory, model = hf_gpt2
    path = write_jsonl(tmp_path / 'mc.jsonl', EXAMPLES)
    expected = mc_accuracy(model, read_mc(path), Tokenizer('gpt2').encode)
    result = run_script('eval.py', [f'--hf_dir={directory}', f'--mc_path={path}', '--device=cpu'])
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1:] == [
        "loss: skipped, no dataset (pass --dataset=NAME, a prepared folder of data/)",
        f"mc {path}: acc {expected['acc']:.4f}, acc_norm {expected['acc_norm']:.4f} (3 examples)",
    ]


# CI's newest torch installs lm-eval and sets OMGD_LM_EVAL=required (.ci/run): there the cross-checks below run,
# and a missing lm-eval fails them instead of skipping them
LM_EVAL_REQUIRED = os.environ.get('OMGD_LM_EVAL') == 'required'
needs_lm_eval = pytest.mark.skipif(
    not HAS_LM_EVAL and not LM_EVAL_REQUIRED,
    reason='lm-evaluation-harness is not installed (pip install "lm-eval[hf]")',
)


def test_ci_runs_the_lm_eval_cross_checks():
    """.ci/run installs lm-eval before the suite on its newest torch and requires it there, so that the cross-checks
    below run against the real harness in CI instead of skipping."""
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), '.ci', 'run')) as f:
        run = f.read()
    install = re.search(r'^python -m (?:uv )?pip install .*"lm-eval\[hf\]==[\d.]+"$', run, re.M)
    suite = re.search(r'^OMGD_LM_EVAL=required .*python -m pytest -q .*tests$', run, re.M)
    assert install and suite and install.start() < suite.start(), run


def lm_eval_samples(directory, examples, tmp_path):
    """lm-evaluation-harness itself (HFLM on a Hugging Face directory, transformers' model and tokenizer) on the
    examples as eval.py's local task, offline: (its results, each example's per-ending log-probabilities)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    task_dir = tmp_path / 'task'
    task_dir.mkdir()
    write_mc_task(examples, str(task_dir))
    results = lm_eval.simple_evaluate(
        model=HFLM(pretrained=directory, device='cpu', batch_size=4),
        tasks=[MC_TASK],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        num_fewshot=0,
    )
    return results, [[resp[0] for resp in sample['filtered_resps']] for sample in results['samples'][MC_TASK]]


def assert_lm_eval_agrees(directory, model, encode, tmp_path):
    """Every ending's log-probability in lm-eval equals eval.py's to 1e-4, and so do acc and acc_norm."""
    examples = read_mc(write_jsonl(tmp_path / 'mc.jsonl', EXAMPLES))
    results, theirs = lm_eval_samples(directory, examples, tmp_path)
    ours = [
        continuation_logprobs(model, [encode_pair(encode, ex['query'], ' ' + c) for c in ex['choices']])
        for ex in examples
    ]
    assert np.allclose(theirs, ours, atol=1e-4)
    expected = mc_accuracy(model, examples, encode)
    assert results['results'][MC_TASK]['acc,none'] == pytest.approx(expected['acc'])
    assert results['results'][MC_TASK]['acc_norm,none'] == pytest.approx(expected['acc_norm'])
    return expected


@needs_lm_eval
def test_lm_eval_scores_the_same_log_probabilities(hf_gpt2, tmp_path):
    """lm-eval's HFLM on the exported directory (transformers' GPT-2) gives each ending the log-probability
    eval.py gives it, and so the same acc and acc_norm; offline, from the local task eval.py writes."""
    from data.tokenizer import Tokenizer

    directory, model = hf_gpt2
    expected = assert_lm_eval_agrees(directory, model, Tokenizer('gpt2').encode, tmp_path)
    # and through eval.py
    result = run_script(
        'eval.py', [f'--hf_dir={directory}', f'--mc_path={tmp_path / "mc.jsonl"}', '--lm_eval=True', '--device=cpu']
    )
    assert result.returncode == 0, result.stderr
    assert f"lm-eval {MC_TASK}: acc {expected['acc']:.4f}, acc_norm {expected['acc_norm']:.4f}" in result.stdout


@needs_lm_eval
def test_an_lm_eval_include_that_is_no_directory_is_refused_before_the_loss(run, tmp_path):
    out_dir, _ = run
    path = write_jsonl(tmp_path / 'mc.jsonl', EXAMPLES)
    missing = tmp_path / 'no_such_tasks'
    argv = [f'--out_dir={out_dir}', f'--mc_path={path}', '--lm_eval=True', f'--lm_eval_include={missing}']
    result = run_script('eval.py', argv)
    assert_one_line_error(result, rf"^error: lm_eval_include={re.escape(str(missing))} is not a directory; ")
    assert not result.stdout  # no loss, no mc score: the refusal comes before any forward


@needs_lm_eval
def test_lm_eval_on_a_character_level_model(run, tmp_path):
    """train.py's default (character-level) model: export writes its characters as a tokenizer transformers
    reads, so lm-eval scores every ending as eval.py does, from the checkpoint and from the exported directory;
    a directory exported without a tokenizer, or with another dataset's, is refused in one line."""
    import hf
    from data.tokenizer import Tokenizer, read_meta
    from dataloader import data_dir

    mc = ['--loss=False', f'--mc_path={write_jsonl(tmp_path / "mc.jsonl", EXAMPLES)}', '--lm_eval=True', '--device=cpu']
    # the tiny run's 32 positions are fewer than the longest ending's 36 characters: lm-eval would assert
    assert_one_line_error(
        run_script('eval.py', [f'--out_dir={run[0]}', *mc]),
        r"mc.jsonl, example 1: an ending of 36 tokens is longer than the model's 32 positions, "
        r"which lm-eval cannot score; shorten it",
    )
    out_dir = tmp_path / 'run'
    run_train(f'--out_dir={out_dir}', '--max_iters=4', '--eval_interval=4', '--block_size=64')
    model, checkpoint, _ = trained_model(str(out_dir))
    tok = Tokenizer.from_meta(read_meta(data_dir(checkpoint['config']['dataset'])))
    hf.export(str(out_dir), str(tmp_path / 'hf'), log=lambda line: None)
    expected = assert_lm_eval_agrees(str(tmp_path / 'hf'), model.eval(), tok.encode, tmp_path)
    scores = f"acc {expected['acc']:.4f}, acc_norm {expected['acc_norm']:.4f}"
    for source in (
        [f'--out_dir={out_dir}'],
        [f'--hf_dir={tmp_path / "hf"}', '--dataset=shakespeare_char'],
        [f'--hf_dir={tmp_path / "hf"}'],
    ):
        result = run_script('eval.py', source + mc)
        assert result.returncode == 0, result.stderr
        assert f"mc {tmp_path / 'mc.jsonl'}: {scores} (3 examples)" in result.stdout, result.stdout
        assert f"lm-eval {MC_TASK}: {scores}" in result.stdout, result.stdout
    hf.export(str(out_dir), str(tmp_path / 'weights'), tokenizer='none', log=lambda line: None)
    assert_one_line_error(
        run_script('eval.py', [f'--hf_dir={tmp_path / "weights"}', '--dataset=shakespeare_char', *mc]),
        r"holds no tokenizer \(tokenizer.json, .*\), and lm-eval would read it with an empty one; "
        r"export the checkpoint again",
    )
    other = tmp_path / 'other'  # a character dataset of other characters: other ids for the same text
    other.mkdir()
    letters = sorted(set(''.join(tok.itos.values())), reverse=True)
    with open(other / 'meta.pkl', 'wb') as f:
        pickle.dump(
            {
                'vocab_size': len(letters),
                'itos': dict(enumerate(letters)),
                'stoi': {c: i for i, c in enumerate(letters)},
            },
            f,
        )
    assert_one_line_error(
        run_script('eval.py', [f'--hf_dir={tmp_path / "hf"}', f'--dataset={other}', *mc]),
        r"the tokenizer of .* encodes the mc texts differently from dataset .*'s",
    )


@needs_lm_eval
def test_lm_eval_tasks_without_the_hub_or_their_data_is_one_line_at_once(hf_gpt2, tmp_path):
    """--lm_eval_tasks=arc_easy where the Hub does not answer and its data is not cached: one `error:` line saying
    to download it first, without the minute of retries (and 40 lines of traceback) it took. The Hub is a closed
    local port and the cache an empty folder, so this holds online and offline alike. A process of its own:
    datasets and huggingface_hub read HF_HUB_OFFLINE once, when imported (this process may hold them)."""
    import subprocess

    directory, _ = hf_gpt2
    env = {**os.environ, 'HF_ENDPOINT': 'http://127.0.0.1:1', 'HF_HOME': str(tmp_path / 'hf_home')}
    for key in ('HF_HUB_OFFLINE', 'HF_DATASETS_OFFLINE', 'TRANSFORMERS_OFFLINE', 'HF_DATASETS_CACHE', 'HF_HUB_CACHE'):
        env.pop(key, None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = [f'--hf_dir={directory}', '--lm_eval=True', '--lm_eval_tasks=arc_easy', '--device=cpu']
    result = subprocess.run([sys.executable, 'eval.py', *argv], cwd=root, env=env, capture_output=True, text=True)
    assert result.returncode == 1 and 'Traceback' not in result.stderr and 'Retrying' not in result.stderr, (
        result.stderr[-3000:]
    )
    assert re.fullmatch(
        r"error: lm_eval_tasks=arc_easy: the task data is not in the Hugging Face cache and the Hub cannot be "
        r"reached \(.*allenai/ai2_arc.*\); download it first: run this command once where the Hub can be reached "
        r"\(it fills the cache, HF_HOME\), then it runs offline",
        result.stderr.strip().splitlines()[-1],
    ), result.stderr[-3000:]


def test_the_cache_alone_is_used_only_when_the_hub_does_not_answer(monkeypatch):
    import socket

    import eval as eval_py

    for key in ('HF_HUB_OFFLINE', 'HF_DATASETS_OFFLINE'):
        monkeypatch.delenv(key, raising=False)
    with socket.socket() as hub:  # a port that answers
        hub.bind(('127.0.0.1', 0))
        hub.listen()
        monkeypatch.setenv('HF_ENDPOINT', f'http://127.0.0.1:{hub.getsockname()[1]}')
        eval_py.hub_or_cache()
        assert 'HF_HUB_OFFLINE' not in os.environ
    monkeypatch.setenv('HF_ENDPOINT', 'http://127.0.0.1:1')  # a port that does not
    eval_py.hub_or_cache()
    assert os.environ['HF_HUB_OFFLINE'] == os.environ['HF_DATASETS_OFFLINE'] == '1'
