"""Hugging Face import and export (hf.py; export.py is its command line) against transformers itself,
offline: tiny random GPT2LMHeadModel / LlamaForCausalLM models are built and saved inside each test."""

import contextlib
import io
import json
import os
import pickle
import re
import runpy
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import export  # noqa: E402
import hf  # noqa: E402
from model import Transformer, TransformerConfig  # noqa: E402

transformers = pytest.importorskip('transformers')
VOCAB, POSITIONS = 96, 16  # >= the 80 characters of data/shakespeare_char, which train.py reads


def randomize(model, seed=0):
    """Weights far from the 0.02 init (norm gains around 1), so that a wrong layout, transpose or GELU
    moves the logits by much more than the tolerance."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                torch.randn(p.shape, generator=g) * (0.1 if 'norm' in name or 'ln' in name else 0.3)
                + (1.0 if name.endswith('weight') and p.dim() == 1 else 0.0)
            )
    return model


def hf_model(kind):
    """A random transformers model of one of the cases below."""
    torch.manual_seed(0)
    if kind.startswith('gpt2'):
        cfg = transformers.GPT2Config(
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=POSITIONS,
            vocab_size=VOCAB,
            tie_word_embeddings=kind == 'gpt2',
            bos_token_id=0,
            eos_token_id=0,
        )
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        heads, kv = (4, 2) if kind == 'llama-gqa' else (4, 4)
        cfg = transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            vocab_size=VOCAB,
            max_position_embeddings=POSITIONS,
            rope_theta=5000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=kind == 'llama-tied',
            bos_token_id=1,
            eos_token_id=2,
        )
        model = transformers.LlamaForCausalLM(cfg)
    return randomize(model).eval()


CASES = ['gpt2', 'gpt2-untied', 'llama-gqa', 'llama-tied']


def save_hf(kind, path):
    model = hf_model(kind)
    model.save_pretrained(path)
    return model


def our_logits(model, idx):
    return model.lm_head(model.hidden_states(idx))


def tokens(n=2, t=POSITIONS, seed=1, vocab=VOCAB):
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
@pytest.mark.parametrize('kind', CASES)
def test_import_gives_transformers_logits(tmp_path, kind):
    ref = save_hf(kind, tmp_path)
    model = hf.load(str(tmp_path)).eval()
    assert model.config.tie_embeddings == (kind in ('gpt2', 'llama-tied'))
    assert (model.lm_head.weight is model.wte.weight) == model.config.tie_embeddings
    idx = tokens()
    expected = ref(idx).logits
    assert (our_logits(model, idx) - expected).abs().max() < 1e-5
    _, loss = model(idx[:, :-1], idx[:, 1:])
    assert abs(loss.item() - ref(idx, labels=idx).loss.item()) < 1e-5  # HF shifts the labels itself
    if kind.startswith('gpt2'):
        # the check can fail: GPT-2 with exact GELU is far off (why the tanh option exists)
        assert model.config.gelu == 'tanh'
        exact = Transformer(TransformerConfig(**{**vars(model.config), 'gelu': 'exact'})).eval()
        exact.load_state_dict(model.state_dict())
        assert (our_logits(exact, idx) - expected).abs().max() > 1e-4


@torch.no_grad()
@pytest.mark.parametrize(
    'args',
    [
        dict(arch='gpt2', bias=False),  # train.py's default: exact GELU, no biases (exported as zeros)
        dict(arch='gpt2', gelu='tanh', tie_embeddings=False, mlp_hidden=40, norm_eps=1e-4),
        dict(arch='llama', n_kv_head=2, rope_theta=500.0, norm_eps=1e-4),
        dict(arch='llama', tie_embeddings=True, mlp_hidden=40),
    ],
)
def test_export_gives_transformers_logits(tmp_path, args):
    model = randomize(
        Transformer(TransformerConfig(n_layer=2, n_head=4, n_embd=32, block_size=POSITIONS, vocab_size=VOCAB, **args))
    ).eval()
    hf.save(model, str(tmp_path))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    # every tensor transformers has is in the file (none left to its initialisation); a tied head is stored once
    expected = set(theirs.state_dict()) - ({'lm_head.weight'} if model.config.tie_embeddings else set())
    assert set(load_file(tmp_path / 'model.safetensors')) == expected
    idx = tokens()
    ours = our_logits(model, idx)
    assert (ours - theirs(idx).logits).abs().max() < 1e-5
    if args['arch'] == 'gpt2':  # the check can fail: the other GELU is far off on these weights
        other = Transformer(
            TransformerConfig(**{**vars(model.config), 'gelu': 'exact' if model.config.gelu == 'tanh' else 'tanh'})
        )
        other.load_state_dict(model.state_dict())
        assert (our_logits(other.eval(), idx) - ours).abs().max() > 1e-4


@pytest.mark.parametrize('umask', [0o022, 0o027])
@pytest.mark.parametrize('max_shard_size', ['5GB', '20KB'])
def test_every_exported_file_follows_the_umask(tmp_path, umask, max_shard_size):
    """safetensors writes the weights 0600: an export on a shared disk others could not read. Each file, shards
    and index included, gets the mode the umask gives config.json."""
    model = Transformer(TransformerConfig(n_layer=2, n_head=4, n_embd=32, block_size=POSITIONS, vocab_size=VOCAB))
    old = os.umask(umask)
    try:
        weights = hf.save(model, str(tmp_path / 'hf'), max_shard_size=max_shard_size)
    finally:
        os.umask(old)
    assert (len(weights) > 1) == (max_shard_size == '20KB'), weights
    modes = {name: oct(os.stat(tmp_path / 'hf' / name).st_mode & 0o777) for name in os.listdir(tmp_path / 'hf')}
    assert set(weights) <= set(modes) and set(modes.values()) == {oct(0o666 & ~umask)}, modes


def test_old_checkpoints_keep_exact_gelu_and_their_tying():
    """model_args saved before the gelu and tie_embeddings fields existed build what they built then."""
    old = dict(
        arch='gpt2',
        block_size=16,
        vocab_size=65,
        n_layer=1,
        n_head=2,
        n_kv_head=2,
        n_embd=16,
        mlp_hidden=64,
        dropout=0.0,
        bias=False,
        rope_theta=10000.0,
        norm_eps=1e-5,
    )
    gpt2 = Transformer(TransformerConfig(**old))
    assert gpt2.config.gelu == 'exact' and gpt2.blocks[0].mlp.approximate == 'none'
    assert gpt2.lm_head.weight is gpt2.wte.weight
    llama = Transformer(TransformerConfig(**dict(old, arch='llama')))
    assert llama.lm_head.weight is not llama.wte.weight and not llama.config.tie_embeddings


# -----------------------------------------------------------------------------
# weight files: sharded safetensors, pytorch_model.bin, GPT2Model-style names


def assert_same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_sharded_safetensors_and_pytorch_bin_read_alike(tmp_path):
    ref = save_hf('llama-gqa', tmp_path / 'single')
    ref.save_pretrained(tmp_path / 'sharded', max_shard_size='20KB')
    assert os.path.exists(tmp_path / 'sharded' / 'model.safetensors.index.json')
    assert len([f for f in os.listdir(tmp_path / 'sharded') if f.endswith('.safetensors')]) > 2
    (tmp_path / 'bin').mkdir()
    (tmp_path / 'bin' / 'config.json').write_text((tmp_path / 'single' / 'config.json').read_text())
    torch.save(ref.state_dict(), tmp_path / 'bin' / 'pytorch_model.bin')
    single = hf.load(str(tmp_path / 'single'))
    assert_same_model(single, hf.load(str(tmp_path / 'sharded')))
    assert_same_model(single, hf.load(str(tmp_path / 'bin')))


def test_gpt2_hub_layout_without_prefix_and_with_mask_buffers(tmp_path):
    """The hub's GPT-2 files were saved from GPT2Model: no 'transformer.' prefix, causal-mask buffers."""
    ref = save_hf('gpt2', tmp_path / 'hf')
    state = {
        k.removeprefix('transformer.'): v.contiguous() for k, v in ref.state_dict().items() if k != 'lm_head.weight'
    }
    state['h.0.attn.bias'] = torch.ones(1, 1, POSITIONS, POSITIONS)
    (tmp_path / 'hub').mkdir()
    save_file(state, tmp_path / 'hub' / 'model.safetensors', metadata={'format': 'pt'})
    (tmp_path / 'hub' / 'config.json').write_text((tmp_path / 'hf' / 'config.json').read_text())
    assert_same_model(hf.load(str(tmp_path / 'hf')), hf.load(str(tmp_path / 'hub')))


def test_hub_name_goes_through_transformers(monkeypatch):
    import types

    ref = hf_model('gpt2')
    fake = types.SimpleNamespace(GPT2LMHeadModel=types.SimpleNamespace(from_pretrained=lambda name: ref))
    monkeypatch.setitem(sys.modules, 'transformers', fake)
    model = hf.from_pretrained('gpt2', dropout=0.1)
    assert model.config.dropout == 0.1 and model.config.gelu == 'tanh'
    with torch.no_grad():
        idx = tokens()
        assert (our_logits(model.eval(), idx) - ref(idx).logits).abs().max() < 1e-5
    monkeypatch.setitem(sys.modules, 'transformers', None)  # not installed
    with pytest.raises(hf.HFError, match=r"pip install transformers, or pass a downloaded directory"):
        hf.from_pretrained('gpt2')


# -----------------------------------------------------------------------------
# refusals: one line naming what cannot be mapped


def edit_config(path, **changes):
    config = json.loads((path / 'config.json').read_text())
    config.update(changes)
    (path / 'config.json').write_text(json.dumps(config))


@pytest.mark.parametrize(
    'kind, changes, pattern',
    [
        (
            'llama-gqa',
            dict(architectures=['MistralForCausalLM'], model_type='mistral'),
            r"MistralForCausalLM cannot be mapped; this repository imports GPT2LMHeadModel and LlamaForCausalLM",
        ),
        (
            'llama-gqa',
            dict(rope_parameters={'rope_type': 'llama3', 'factor': 8.0, 'rope_theta': 5e5}),
            r"rope scaling 'llama3' cannot be mapped",
        ),
        ('llama-gqa', dict(rope_scaling={'type': 'linear', 'factor': 2.0}), r"rope scaling 'linear' cannot be mapped"),
        ('llama-gqa', dict(attention_bias=True), r"LLaMA with biases \(attention_bias=true\) cannot be mapped"),
        ('llama-gqa', dict(mlp_bias=True), r"LLaMA with biases \(mlp_bias=true\) cannot be mapped"),
        ('llama-gqa', dict(hidden_act='gelu'), r"hidden_act 'gelu' cannot be mapped"),
        ('llama-gqa', dict(head_dim=16), r"head_dim=16 x num_attention_heads=4 != hidden_size=32"),
        ('gpt2', dict(activation_function='relu'), r"GPT-2 with activation_function 'relu' cannot be mapped"),
        ('gpt2', dict(scale_attn_by_inverse_layer_idx=True), r"scale_attn_by_inverse_layer_idx=true cannot be mapped"),
        (
            'llama-gqa',
            dict(num_key_value_heads=4),
            r"'model.layers.0.self_attn.k_proj.weight' has shape \(16, 32\), "
            r"the config gives \(32, 32\)",
        ),
        ('llama-gqa', dict(tie_word_embeddings=True), r"tie_word_embeddings is true but lm_head.weight differs"),
        ('gpt2-untied', dict(tie_word_embeddings=True), r"tie_word_embeddings is true but lm_head.weight differs"),
    ],
)
def test_what_cannot_be_mapped_is_refused_in_one_line(tmp_path, kind, changes, pattern):
    save_hf(kind, tmp_path)
    hf.load(str(tmp_path))  # loads before the edit
    edit_config(tmp_path, **changes)
    with pytest.raises(hf.HFError) as e:
        hf.load(str(tmp_path))
    assert '\n' not in str(e.value) and re.search(pattern, str(e.value)), str(e.value)
    assert str(tmp_path) in str(e.value)  # names the file


def test_biases_and_missing_tensors_in_the_weights_are_refused(tmp_path):
    """A LLaMA whose config denies biases the weights have, and weights short of a tensor."""
    transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=4,
            vocab_size=VOCAB,
            max_position_embeddings=POSITIONS,
            attention_bias=True,
        )
    ).save_pretrained(tmp_path)
    with pytest.raises(hf.HFError, match=r"attention_bias=true"):
        hf.load(str(tmp_path))
    edit_config(tmp_path, attention_bias=False)
    with pytest.raises(hf.HFError, match=r"tensor 'model\.layers\.0\.self_attn\.[qkvo]_proj\.bias' cannot be mapped"):
        hf.load(str(tmp_path))
    state = load_file(tmp_path / 'model.safetensors')
    state = {k: v for k, v in state.items() if not k.endswith('.bias') and 'norm' not in k}
    save_file(state, tmp_path / 'model.safetensors', metadata={'format': 'pt'})
    with pytest.raises(
        hf.HFError,
        match=r"the weights lack 3 tensor\(s\) the config needs, e\.g\. "
        r"'model\.layers\.0\.input_layernorm\.weight'",
    ):
        hf.load(str(tmp_path))
    os.remove(tmp_path / 'model.safetensors')
    with pytest.raises(hf.HFError, match=r"holds no weights: expected model\.safetensors"):
        hf.load(str(tmp_path))
    with pytest.raises(hf.HFError, match=r"holds no config\.json"):
        hf.load(str(tmp_path / 'nothing'))


# -----------------------------------------------------------------------------
# through train.py and export.py


def train(*args):
    """train.py in this process (its module-level script), tiny and quick; returns its stdout."""
    argv = [
        'train.py',
        '--n_layer=2',
        '--n_head=2',
        '--n_embd=32',
        f'--block_size={POSITIONS}',
        '--batch_size=4',
        '--max_iters=3',
        '--eval_interval=3',
        '--eval_iters=1',
        '--log_interval=1',
        '--sample_tokens=0',
        '--compile=False',
        '--omgd_gamma=1',
        '--omgd_period=1',
        '--warmup_iters=1',
        '--lr_decay_iters=3',
        '--device=cpu',
        '--dtype=float32',
        *args,
    ]
    out, old_argv, cwd = io.StringIO(), sys.argv, os.getcwd()
    try:
        sys.argv = argv
        os.chdir(ROOT)
        with contextlib.redirect_stdout(out):
            try:
                runpy.run_path(os.path.join(ROOT, 'train.py'), run_name='__main__')
            except SystemExit as e:  # train.py ends in sys.exit(main(...)): 0 is a finished run
                if e.code:
                    raise
    finally:
        sys.argv = old_argv
        os.chdir(cwd)
    return out.getvalue()


def export_dir(out_dir, hf_dir):
    lines = []
    hf.export(str(out_dir), str(hf_dir), log=lines.append)
    return '\n'.join(lines)


def checkpoint_model(out_dir):
    checkpoint = torch.load(out_dir / 'ckpt.pt', weights_only=True)
    model = Transformer(TransformerConfig(**checkpoint['model_args']))
    model.load_state_dict(checkpoint['model'])
    return model.eval()


@pytest.mark.parametrize('kind', ['gpt2', 'llama-gqa'])
def test_init_from_hf_then_export_gives_the_same_tensors(tmp_path, kind):
    save_hf(kind, tmp_path / 'in')
    # a learning rate of 1e-30 makes every AdamW step and weight decay smaller than half a unit in the last
    # place of every weight (|w| > 1e-5 here), so training leaves the weights bitwise as imported
    train(f'--init_from={tmp_path / "in"}', f'--out_dir={tmp_path / "run"}', '--learning_rate=1e-30', '--min_lr=0')
    export_dir(tmp_path / 'run', tmp_path / 'out')
    before, after = load_file(tmp_path / 'in' / 'model.safetensors'), load_file(tmp_path / 'out' / 'model.safetensors')
    assert before.keys() == after.keys()
    for k in before:
        assert before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]), k
    hf_in = json.loads((tmp_path / 'in' / 'config.json').read_text())
    hf_out = json.loads((tmp_path / 'out' / 'config.json').read_text())
    assert TransformerConfig(**hf.config_from_hf(hf_in)) == TransformerConfig(**hf.config_from_hf(hf_out))


@pytest.mark.parametrize('start', ['scratch-gpt2', 'scratch-llama', 'hf-gpt2-untied', 'hf-llama-tied'])
def test_trained_here_and_exported_gives_the_same_logits_in_transformers(tmp_path, start):
    if start == 'scratch-gpt2':  # train.py's default architecture: exact GELU, no biases (exported as zeros)
        args = []
    elif start == 'scratch-llama':
        args = ['--arch=llama', '--n_head=4', '--n_kv_head=2']
    else:
        save_hf(start.removeprefix('hf-'), tmp_path / 'in')
        args = [f'--init_from={tmp_path / "in"}']
    train(f'--out_dir={tmp_path / "run"}', *args)
    note = export_dir(tmp_path / 'run', tmp_path / 'out')
    assert 'character-level' in note and 'meta.pkl' in note
    assert not os.path.exists(tmp_path / 'out' / 'vocab.json')
    ours = checkpoint_model(tmp_path / 'run')
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'out').eval()
    idx = tokens(vocab=ours.config.vocab_size)
    with torch.no_grad():
        assert (our_logits(ours, idx) - theirs(idx).logits).abs().max() < 1e-5
    if start.startswith('hf-'):  # trained: the weights moved away from the import
        assert not torch.equal(ours.blocks[0].ln_1.weight, hf.load(str(tmp_path / 'in')).blocks[0].ln_1.weight)


def train_error(*args):
    """The one-line error of a train.py run that must fail (printed, or the message of its exit)."""
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(io.StringIO()) as err:
        train(*args)
    message = e.value.code if isinstance(e.value.code, str) else err.getvalue().strip()
    assert e.value.code != 0 and message.startswith('error: ') and '\n' not in message, message
    return message


@pytest.mark.once  # a docs check, the slowest test; the import and training are tested on every torch above
def test_the_cpu_run_of_docs_models_md_runs_as_written(tmp_path):
    """docs/models.md's stand-in run of config/finetune_shakespeare_lisa_wor.py (a GPU config) on the CPU, as written
    there: DIR a tiny random 8-block GPT-2 (there: 48 blocks), out_dir a temporary one. It trains, switches and
    saves; without its --device=cpu it would be refused on a machine without CUDA."""
    import shlex

    from conftest import run_script

    text = open(os.path.join(ROOT, 'docs', 'models.md')).read()
    command = re.search(
        r'^python train\.py config/finetune_shakespeare_lisa_wor\.py --init_from=DIR .*?(?=\n```)', text, re.M | re.S
    ).group(0)
    argv = shlex.split(command.replace('\\\n', ' '))[2:]
    config = transformers.GPT2Config(n_embd=16, n_layer=8, n_head=2, n_positions=1024, vocab_size=50257)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / 'in')
    argv = [a.replace('=DIR', f'={tmp_path / "in"}') for a in argv] + [f'--out_dir={tmp_path / "run"}']
    result = run_script('train.py', argv)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert 'cycle 1: active blocks' in result.stdout and (tmp_path / 'run' / 'ckpt.pt').exists()


def test_train_refuses_what_does_not_fit_the_pretrained_model(tmp_path):
    save_hf('llama-gqa', tmp_path / 'in')
    run = f'--out_dir={tmp_path / "run"}'
    assert f"block_size=32 is longer than the 16 positions of {tmp_path / 'in'}; use --block_size=16" in train_error(
        f'--init_from={tmp_path / "in"}', run, '--block_size=32'
    )
    assert (
        "init_from must be 'scratch', 'resume', 'auto', a GPT-2 name or a Hugging Face model directory, got"
        in train_error(f'--init_from={tmp_path / "nowhere"}', run)
    )
    edit_config(tmp_path / 'in', rope_scaling={'rope_type': 'yarn', 'factor': 4.0})
    assert "rope scaling 'yarn' cannot be mapped" in train_error(f'--init_from={tmp_path / "in"}', run)
    assert not os.path.exists(tmp_path / 'run' / 'ckpt.pt')


# -----------------------------------------------------------------------------
# tokenizers in the export


def fake_checkpoint(out_dir, dataset, arch='gpt2', vocab_size=VOCAB):
    model = Transformer(
        TransformerConfig(arch=arch, n_layer=1, n_head=2, n_embd=16, block_size=POSITIONS, vocab_size=vocab_size)
    )
    out_dir.mkdir()
    torch.save(
        {
            'model': model.state_dict(),
            'model_args': vars(model.config),
            'iter_num': 0,
            'config': {'dataset': str(dataset)},
        },
        out_dir / 'ckpt.pt',
    )


def test_gpt2_bpe_dataset_exports_gpt2s_tokenizer(tmp_path):
    from data.gpt2_bpe import gpt2_encoding

    (tmp_path / 'data').mkdir()  # no meta.pkl: GPT-2 BPE
    fake_checkpoint(tmp_path / 'run', tmp_path / 'data', vocab_size=50304)
    note = export_dir(tmp_path / 'run', tmp_path / 'out')
    assert 'GPT-2 BPE' in note
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / 'out')
    text = "ROMEO: But soft, what light through yonder window breaks?\n  It is the east, and Juliet is the sun."
    assert tok(text)['input_ids'] == gpt2_encoding().encode_ordinary(text)
    assert tok.eos_token_id == 50256 and tok('a<|endoftext|>b')['input_ids'] == [64, 50256, 65]
    config = json.loads((tmp_path / 'out' / 'config.json').read_text())
    assert config['eos_token_id'] == config['bos_token_id'] == 50256
    assert json.loads((tmp_path / 'out' / 'generation_config.json').read_text())['eos_token_id'] == 50256
    with pytest.raises(hf.ExportError, match=r"already holds config\.json; .* --overwrite=True"):
        export_dir(tmp_path / 'run', tmp_path / 'out')


@pytest.mark.parametrize('arch', ['gpt2', 'llama'])
def test_a_sharded_export_generates_our_greedy_tokens_in_transformers(tmp_path, arch):
    """max_shard_size splits the weights into shards with an index (save_pretrained's layout); transformers
    loads them with the exported GPT-2 tokenizer and, greedy, generates the tokens our model generates
    (Transformer.generate with top_k=1, what sample.py runs)."""
    (tmp_path / 'data').mkdir()  # no meta.pkl: GPT-2 BPE
    model = randomize(
        Transformer(
            TransformerConfig(arch=arch, n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=50304, bias=True)
        )
    )
    (tmp_path / 'run').mkdir()
    torch.save(
        {
            'model': model.state_dict(),
            'model_args': vars(model.config),
            'iter_num': 0,
            'config': {'dataset': str(tmp_path / 'data')},
        },
        tmp_path / 'run' / 'ckpt.pt',
    )
    lines = []
    hf.export(str(tmp_path / 'run'), str(tmp_path / 'out'), max_shard_size='2MB', log=lines.append)
    shards = sorted(p.name for p in (tmp_path / 'out').glob('model-*.safetensors'))
    assert len(shards) > 1 and f"{len(shards)} shards with model.safetensors.index.json" in lines[0]
    index = json.loads((tmp_path / 'out' / 'model.safetensors.index.json').read_text())
    assert sorted(set(index['weight_map'].values())) == shards
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / 'out')
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'out').eval()
    prompt = tok('ROMEO: But soft, what light', return_tensors='pt')['input_ids']
    with torch.no_grad():
        expected = model.eval().generate(prompt, 12, top_k=1)
        generated = theirs.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert generated.tolist() == expected.tolist()
    assert hf.load(str(tmp_path / 'out')).state_dict().keys() == model.state_dict().keys()  # our import reads shards
    # a number of bytes, as export.py's command line gives it (a string): the same shards
    hf.export(str(tmp_path / 'run'), str(tmp_path / 'bytes'), max_shard_size='2000000', log=lines.append)
    assert sorted(p.name for p in (tmp_path / 'bytes').glob('model-*.safetensors')) == shards
    with pytest.raises(hf.ExportError, match=r"max_shard_size must be a size like '5GB'"):
        hf.export(str(tmp_path / 'run'), str(tmp_path / 'bad'), max_shard_size='big')


def test_hf_tokenizer_dataset_exports_its_tokenizer_files(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok_dir = tmp_path / 'tok'
    tok_dir.mkdir()
    vocab = {
        '<s>': 0,
        '</s>': 1,
        '<unk>': 2,
        **{w: i + 3 for i, w in enumerate('to be or not that is the question'.split())},
    }
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token='<unk>'))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(['<s>', '</s>'])
    tokenizer.save(str(tok_dir / 'tokenizer.json'))
    (tok_dir / 'tokenizer_config.json').write_text(
        json.dumps(
            {
                'tokenizer_class': 'PreTrainedTokenizerFast',
                'bos_token': '<s>',
                'eos_token': '</s>',
                'unk_token': '<unk>',
            }
        )
    )
    (tmp_path / 'data').mkdir()
    with open(tmp_path / 'data' / 'meta.pkl', 'wb') as f:
        pickle.dump({'tokenizer': str(tok_dir), 'vocab_size': len(vocab)}, f)
    fake_checkpoint(tmp_path / 'run', tmp_path / 'data', arch='llama')
    note = export_dir(tmp_path / 'run', tmp_path / 'out')
    assert 'tokenizer.json, tokenizer_config.json' in note
    assert (tmp_path / 'out' / 'tokenizer.json').read_bytes() == (tok_dir / 'tokenizer.json').read_bytes()
    config = json.loads((tmp_path / 'out' / 'config.json').read_text())
    assert (config['bos_token_id'], config['eos_token_id']) == (0, 1)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / 'out')
    assert tok('to be or not to be')['input_ids'] == [3, 4, 5, 6, 3, 4]
    for damaged in ('{"bos_token": ', '["<s>"]'):  # cut short, or JSON that is not an object: one line, no export
        (tok_dir / 'tokenizer_config.json').write_text(damaged)
        with pytest.raises(hf.ExportError, match=rf"^{re.escape(str(tok_dir))}: its tokenizer files cannot be read"):
            hf.export(str(tmp_path / 'run'), str(tmp_path / 'again'))
        assert not (tmp_path / 'again').exists()


def test_character_level_dataset_exports_a_tokenizer_transformers_reads(tmp_path):
    """The default model's vocabulary (data/shakespeare_char: one id a character, meta.pkl's itos) is exported
    as tokenizer.json, a word-level tokenizer over the characters: AutoTokenizer encodes any text of them as
    data/tokenizer.py does and decodes it back, and eval.py reads the directory as that character tokenizer."""
    from data.tokenizer import Tokenizer

    chars = sorted(set("ROMEO: But soft, what light through yonder window breaks?\n\t'\"-\u00e9"))
    itos = dict(enumerate(chars))
    (tmp_path / 'data').mkdir()
    with open(tmp_path / 'data' / 'meta.pkl', 'wb') as f:
        pickle.dump({'vocab_size': len(chars), 'itos': itos, 'stoi': {c: i for i, c in itos.items()}}, f)
    fake_checkpoint(tmp_path / 'run', tmp_path / 'data', vocab_size=len(chars))
    note = export_dir(tmp_path / 'run', tmp_path / 'out')
    assert f"\ntokenizer: tokenizer.json, tokenizer_config.json: the {len(chars)} characters of " in note, note
    ours = Tokenizer('char', itos)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / 'out')
    for text in ('ROMEO:', "ROMEO:\nBut soft , what light\n\n  through yonder  window breaks ?\t'\"-\u00e9", ' ', '\n'):
        ids = tok(text)['input_ids']
        assert ids == ours.encode(text) and tok.decode(ids) == text, text
    assert tok('ROMEO:', return_tensors='pt')['input_ids'].tolist() == [ours.encode('ROMEO:')]
    # the newline is bos, the start lm-eval and sample.py give a character model; no eos, no unknown token
    assert tok.bos_token_id == ours.stoi['\n'] and tok.eos_token_id is None and len(tok) == len(chars)
    config = json.loads((tmp_path / 'out' / 'config.json').read_text())
    assert config['bos_token_id'] == ours.stoi['\n'] and config.get('eos_token_id') is None
    with pytest.raises(Exception, match='UNK'):  # a character outside the vocabulary: an error, as ours
        tok('ROMEO\u00a7')
    assert hf.read_char_tokenizer(str(tmp_path / 'out')) == itos
    from eval import tokenizer_for

    assert tokenizer_for('', str(tmp_path / 'out')).encode('ROMEO: soft') == ours.encode('ROMEO: soft')


def test_export_refusals_are_one_line(tmp_path, capsys):
    for argv, pattern in (
        (['--out_dir=' + str(tmp_path)], r"--hf_dir is required"),
        ([f'--out_dir={tmp_path}', f'--hf_dir={tmp_path / "hf"}'], r"no checkpoint at"),
        ([f'--out_dir={tmp_path}', '--hf_dir=x', '--dtype=fp8'], r"dtype must be '' .* got 'fp8'"),
    ):
        with pytest.raises(SystemExit) as e:
            export.main(argv)
        assert str(e.value.code).startswith('error: ') and '\n' not in str(e.value.code)
        assert re.search(pattern, str(e.value.code)), e.value.code


# -----------------------------------------------------------------------------
# what an export replaces: its own files only, and only once the new ones are complete


def char_dataset(path, chars='ROMEO: soft,\n'):
    path.mkdir()
    itos = dict(enumerate(sorted(set(chars))))
    with open(path / 'meta.pkl', 'wb') as f:
        pickle.dump({'vocab_size': len(itos), 'itos': itos, 'stoi': {c: i for i, c in itos.items()}}, f)
    return len(itos)


def files_of(folder):
    """{name: bytes} of every file in folder, hidden ones included."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_a_model_field_the_export_does_not_map_is_refused_before_writing(tmp_path):
    """A fork's new TransformerConfig field (qk_norm) that hf.py does not map: exporting it would write a model
    transformers loads and runs without it, computing other logits. Set, it is refused and nothing is written;
    at its default the model exports as before."""
    import dataclasses

    from model import Transformer, TransformerConfig

    forked = dataclasses.make_dataclass('ForkedConfig', [('qk_norm', bool, False)], bases=(TransformerConfig,))
    shape = dict(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32)
    with pytest.raises(
        hf.ExportError,
        match=r"^the model sets qk_norm=True, which the Hugging Face GPT2LMHeadModel "
        r"export does not map: transformers would load it and compute other "
        r"logits; map it in hf.config_to_hf and hf_state_dict first$",
    ):
        hf.save(Transformer(forked(**shape, qk_norm=True)), str(tmp_path / 'hf'))
    assert not (tmp_path / 'hf').exists()
    hf.save(Transformer(forked(**shape)), str(tmp_path / 'hf'))
    assert hf.load(str(tmp_path / 'hf')).config.n_embd == 16


def test_export_replaces_only_its_own_files(tmp_path):
    """A file the export did not write stays (a model_backup.safetensors was deleted, without --overwrite); an
    earlier export's files that the new one does not write go (its shards, a GPT-2 vocab.json and merges.txt
    beside a new character-level tokenizer): .export_files.json lists what an export wrote."""
    (tmp_path / 'bpe').mkdir()  # no meta.pkl: GPT-2 BPE
    fake_checkpoint(tmp_path / 'gpt2_run', tmp_path / 'bpe', vocab_size=50304)  # 3.2 MB of weights: 2 shards
    fake_checkpoint(tmp_path / 'char_run', tmp_path / 'chars', vocab_size=char_dataset(tmp_path / 'chars'))
    out = tmp_path / 'out'
    out.mkdir()
    foreign = {
        'model_backup.safetensors': b'the user\'s own weights',
        'README.md': b'notes',
        'model-00001-of-00002.safetensors.bak': b'a copy',
        'vocab.txt': b'not ours',
    }
    for name, content in foreign.items():
        (out / name).write_bytes(content)
    hf.export(str(tmp_path / 'gpt2_run'), str(out), max_shard_size='2MB', log=lambda line: None)
    written = files_of(out)
    shards = sorted(n for n in written if n.startswith('model-') and n.endswith('-of-00002.safetensors'))
    assert len(shards) == 2 and {'vocab.json', 'merges.txt', 'model.safetensors.index.json'} <= written.keys()
    assert all(written[name] == content for name, content in foreign.items())
    assert json.loads(written[hf.MANIFEST])['files'] == sorted(set(written) - set(foreign) - {hf.MANIFEST})
    assert not [n for n in os.listdir(out) if n.startswith('.export-tmp-')]
    with pytest.raises(hf.ExportError, match=r"already holds config\.json; .* --overwrite=True"):
        hf.export(str(tmp_path / 'char_run'), str(out), log=lambda line: None)
    hf.export(str(tmp_path / 'char_run'), str(out), overwrite=True, log=lambda line: None)
    after = files_of(out)
    assert all(after[name] == content for name, content in foreign.items())
    ours = {
        'config.json',
        'generation_config.json',
        'model.safetensors',
        'tokenizer.json',
        'tokenizer_config.json',
        hf.MANIFEST,
    }
    assert set(after) == set(foreign) | ours, sorted(after)  # no GPT-2 vocab.json, merges.txt, shards or index
    assert hf.read_char_tokenizer(str(out)) is not None
    assert hf.load(str(out)).config.vocab_size == len(set('ROMEO: soft,\n'))
    transformers.AutoTokenizer.from_pretrained(out)  # a character tokenizer, no GPT-2 files beside it
    # an export from before the manifest: the shards its index lists are its own, other files are not
    hf.export(str(tmp_path / 'gpt2_run'), str(out), overwrite=True, max_shard_size='2MB', log=lambda line: None)
    (out / hf.MANIFEST).unlink()
    hf.export(str(tmp_path / 'char_run'), str(out), overwrite=True, log=lambda line: None)
    left = os.listdir(out)
    assert not [n for n in left if hf.SHARD.fullmatch(n)] and 'model.safetensors.index.json' not in left
    assert all((out / name).read_bytes() == content for name, content in foreign.items())


def test_the_staging_folder_of_a_killed_export_is_removed_and_no_other(tmp_path):
    """A killed export (SIGKILL) leaves its staging folder, with the file it wrote first naming its process:
    the next export removes that folder, and says so. A folder of the same name form without that file, one
    whose process still runs, and one of another machine stay."""
    import socket
    import subprocess

    fake_checkpoint(tmp_path / 'run', tmp_path / 'chars', vocab_size=char_dataset(tmp_path / 'chars'))
    out = tmp_path / 'out'
    out.mkdir()
    gone = subprocess.Popen(['true'])  # a process that has ended: its pid names no process
    gone.wait()
    host = socket.gethostname()
    owners = {
        '.export-tmp-killed': f'{gone.pid}@{host}',
        '.export-tmp-running': f'{os.getpid()}@{host}',
        '.export-tmp-elsewhere': f'{gone.pid}@not-{host}',
        '.export-tmp-no-marker': None,
    }
    for name, owner in owners.items():
        (out / name).mkdir()
        (out / name / 'model.safetensors').write_bytes(b'half of the weights')
        if owner:
            (out / name / hf.STAGING).write_text(owner)
    lines = []
    hf.export(str(tmp_path / 'run'), str(out), log=lines.append)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(set(owners) - {'.export-tmp-killed'})
    assert lines[0] == f"removed .export-tmp-killed from {out}: left by an export that was killed"
    assert hf.STAGING not in os.listdir(out) and hf.load(str(out)).config.vocab_size > 0


def test_a_staging_marker_that_cannot_be_written_leaves_no_folder_and_ends_in_one_line(tmp_path, monkeypatch):
    """The disk is full when staged() writes its marker, the first file of its folder: the folder it made is
    removed (without the marker no later export would ever know it as one to remove), hf_dir keeps the
    user's files, a hf_dir this export created is removed again, and the error is ExportError's one line."""
    import builtins
    import errno

    def full_disk(path, *args, **kwargs):
        if os.path.basename(str(path)) == hf.STAGING:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(hf, 'open', full_disk, raising=False)
    mine = tmp_path / 'out'
    mine.mkdir()
    (mine / 'notes.txt').write_text('mine')
    for hf_dir in (mine, tmp_path / 'new'):
        with pytest.raises(hf.ExportError) as e:
            with hf.staged(str(hf_dir)):
                pytest.fail('the block ran without a marker')
        assert (
            str(e.value) == f"cannot write into --hf_dir={hf_dir} (No space left on device); give a writable directory"
        )
    assert os.listdir(mine) == ['notes.txt'] and not (tmp_path / 'new').exists()


def test_an_export_that_cannot_write_leaves_the_directory_as_it_was(tmp_path, monkeypatch):
    """The disk fills while the weights are written (safetensors' write raises ENOSPC half-way): the old export
    and the user's files are all still there, byte for byte, and export.py ends in one line, no traceback;
    a directory that did not exist is not left behind."""
    import errno

    import safetensors.torch
    from conftest import assert_one_line_error, run_script

    fake_checkpoint(tmp_path / 'run', tmp_path / 'chars', vocab_size=char_dataset(tmp_path / 'chars'))
    out = tmp_path / 'out'
    hf.export(str(tmp_path / 'run'), str(out), log=lambda line: None)
    (out / 'notes.txt').write_text('mine')
    before = files_of(out)

    def full_disk(tensors, filename, metadata=None):
        with open(filename, 'wb') as f:
            f.write(b'\0' * 1000)  # part of the file, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safetensors.torch, 'save_file', full_disk)
    for hf_dir in (out, tmp_path / 'new' / 'hf'):
        result = run_script('export.py', [f'--out_dir={tmp_path / "run"}', f'--hf_dir={hf_dir}', '--overwrite=True'])
        assert_one_line_error(
            result,
            rf"cannot write the export into {re.escape(str(hf_dir))} \(No space left on "
            rf"device\); .* is left as it was: free space",
        )
    assert files_of(out) == before and sorted(os.listdir(out)) == sorted(before)  # no temporary folder either
    assert not (tmp_path / 'new' / 'hf').exists()


@pytest.mark.parametrize('index', ['[1, 2]', '{"weight_map": [1]}', '{"weight_map": {"a": 3}}', '"text"', None])
def test_an_index_that_is_not_an_object_of_file_names_is_one_line(tmp_path, index):
    save_hf('gpt2', tmp_path / 'in')
    (tmp_path / 'in' / 'model.safetensors').unlink()
    if index is None:  # a folder of that name (an IsADirectoryError traceback before)
        (tmp_path / 'in' / 'model.safetensors.index.json').mkdir()
    else:
        (tmp_path / 'in' / 'model.safetensors.index.json').write_text(index)
    for read in (hf.load, hf.from_pretrained):
        with pytest.raises(
            hf.HFError,
            match=r"model\.safetensors\.index\.json is not a Hugging Face index \(a JSON "
            r"object whose weight_map maps tensor names to file names\)",
        ):
            read(str(tmp_path / 'in'))


@pytest.mark.parametrize(
    'itos', [{0: 'a', 1: 'a'}, {1: 'a', 2: 'b'}, {0: 'a', 2: 'b'}, {0: 'ab', 1: 'c'}, {0: 'a', 1: 7}]
)
def test_an_itos_that_is_not_distinct_characters_by_id_is_refused(itos):
    """meta.pkl's itos must be ids 0..N-1 of distinct characters, or the exported tokenizer encodes otherwise."""
    with pytest.raises(hf.ExportError, match=r"^the itos of meta\.pkl is not ids 0\.\.N-1 of distinct characters"):
        hf.char_tokenizer_writer(itos, 'meta.pkl', 64)
    assert hf.char_tokenizer_writer({0: 'a', 1: 'b'}, 'meta.pkl', 64) is not None
