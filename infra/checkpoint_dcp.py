"""Sharded checkpoints with torch.distributed.checkpoint (DCP), train.py's format under torchrun: out_dir/step_NNNNNNN/
holds the ranks' shards, DCP's index (.metadata), values.pt (the rest) and .complete, written into a .tmp folder then
renamed; a resume reshards onto any number of ranks. Nothing read runs code; an index of all but tensors is refused."""

import contextlib
import os
import pickle
import re
import shutil
import threading
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException as _DCPException  # a BaseException
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType

from infra import checkpoint_file, distributed
from infra.checkpoint_file import CheckpointError, fsync

FAILURES = (Exception, _DCPException)
MARKER = '.complete'
# written first by a save or a removal: what an interrupted one leaves is known as ours by it, never by its name
WRITING, REMOVING = '.writing', '.removing'
VALUES = 'values.pt'
DAMAGED = 'set aside as damaged'
STEP = re.compile(r'^step_(\d{7,})$')


def complete_steps(out_dir):
    """[(iter_num, path)] of the complete checkpoints in out_dir, oldest first."""
    steps = [(int(m.group(1)), os.path.join(out_dir, name)) for name in _folders(out_dir) if (m := STEP.match(name))]
    return sorted(step for step in steps if os.path.isfile(os.path.join(step[1], MARKER)))


def remove_incomplete(out_dir):
    """Remove folders an interrupted save or removal marked; returns (their names, not_resumable()'s but damaged)."""
    removed = [name for name in _folders(out_dir) if _interrupted(os.path.join(out_dir, name))]
    for name in removed:
        shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
    return removed, [name for name, why in not_resumable(out_dir) if why != DAMAGED]


def not_resumable(out_dir):
    """[(name, why)] of out_dir's folders with a values.pt that do not resume, but for this code's interrupted saves."""
    found = []
    for name in _folders(out_dir):
        path = os.path.join(out_dir, name)
        complete = os.path.isfile(os.path.join(path, MARKER))
        if (complete and STEP.match(name)) or _interrupted(path) or not os.path.isfile(os.path.join(path, VALUES)):
            continue
        why = DAMAGED if name.endswith('.damaged') else 'not named step_NNNNNNN'
        found.append((name, why if complete else f'no {MARKER} file'))
    return found


def _folders(out_dir):
    try:
        names = sorted(os.listdir(out_dir))
    except OSError:  # no out_dir (yet), or not a folder
        return []
    return [name for name in names if os.path.isdir(os.path.join(out_dir, name))]


def _interrupted(path):
    return any(os.path.isfile(os.path.join(path, m)) for m in (WRITING, REMOVING))


def _mark(folder, marker):
    with open(os.path.join(folder, marker), 'w') as f:
        f.write(f"{marker[1:]} by train.py (checkpoint_dcp.py)\n")
    fsync(os.path.join(folder, marker))


def _model_tensors(model):
    """(the model's state dict less tied parameters' second names, {second name: first})."""
    first = {p: name for name, p in model.named_parameters()}  # named_parameters lists a tied one once
    tied = {name: first[p] for name, p in model.named_parameters(remove_duplicate=False) if first[p] != name}
    return {k: v for k, v in model.state_dict().items() if k not in tied}, tied


def _optimizer_parts(model, optimizer):
    """optimizer.state_dict() by parameter name: ({name: {key: tensor}} for DCP, the rest for values.pt: the groups,
    non-tensor state, the tensors' layout (shape, dtype, whether shaped like the parameter) to load them back)."""
    names = distributed.param_names(model, optimizer)
    params = [p for g in optimizer.param_groups for p in g['params']]
    sd = optimizer.state_dict()
    tensors, other, layout = {}, {}, {}
    for i, state in sd['state'].items():
        name, shape = names[i], params[i].shape
        other[name] = {k: v for k, v in state.items() if not torch.is_tensor(v)}
        if found := {k: v for k, v in state.items() if torch.is_tensor(v)}:
            tensors[name] = found
            layout[name] = {k: (tuple(v.shape), v.dtype, v.shape == shape and v.dim() > 0) for k, v in found.items()}
    groups = [{**g, 'params': [names[i] for i in g['params']]} for g in sd['param_groups']]
    return tensors, {'param_groups': groups, 'state': other, 'layout': layout}


class Saver:
    """Saves train.py's checkpoints as step folders (call save() on every rank); finish() at the end."""

    def __init__(self, out_dir, ranks, keep_last, use_async=False, replaces=()):
        self.out_dir, self.ranks, self.keep_last = out_dir, ranks, keep_last
        self.use_async = use_async and ranks.enabled
        # DCP's collectives go over a gloo group of their own: async_save runs them in a thread beside training's
        self.group = dist.new_group(backend='gloo') if ranks.enabled else None
        self.pending, self.error = None, None  # a background save's (future, tmp path, completed event); a failure
        self.replaces = list(replaces)  # an earlier run's checkpoints (overwrite=True): removed once this run saved one
        _SAVERS.add(self)

    def save(self, objects, values, device_type='cpu'):
        """Write the checkpoint of values['iter_num'], return its folder; a collective (NonFiniteState first)."""
        model, optimizer = objects['model'], objects['optimizer']
        checkpoint_file.check_finite(self.ranks, model, optimizer)
        self.wait()  # the previous background save is complete (or failed: raised here) before this one
        rank_rngs = checkpoint_file.gather_rng(self.ranks, device_type)
        final = os.path.join(self.out_dir, f"step_{values['iter_num']:07d}")
        tmp = final + '.tmp'
        model_sd, tied = _model_tensors(model)
        optim_tensors, optim_rest = _optimizer_parts(model, optimizer)
        if self.ranks.master:
            states = {name: obj.state_dict() for name, obj in objects.items() if name not in ('model', 'optimizer')}
            checkpoint = {**states, **values, 'world_size': self.ranks.world_size, 'rng': {'ranks': rank_rngs}}
            checkpoint.update(optimizer_rest=optim_rest, tied=tied, format='dcp')
            try:
                if os.path.exists(tmp) and not os.path.isfile(os.path.join(tmp, WRITING)):
                    raise FileExistsError(f"{tmp} exists and no save of train.py wrote it: move it away")
                remove_checkpoints([tmp])  # this code's save of the same iteration cut short, if any
                os.makedirs(tmp)
                _mark(tmp, WRITING)  # first: a save cut short is known as this code's by it
                with open(os.path.join(tmp, VALUES), 'wb') as f:
                    torch.save(checkpoint, f)
                fsync(os.path.join(tmp, VALUES))
            except OSError as e:
                self.error = f"cannot write {tmp} ({e.strerror or e})"
        self._raise_if_failed()
        state = {'model': model_sd, 'optimizer': optim_tensors}
        kwargs = dict(checkpoint_id=tmp, process_group=self.group, no_dist=not self.ranks.enabled)
        if self.use_async:  # the state is copied to host memory now; the write goes on in a thread
            future = dcp.async_save(state, **kwargs)
            future = getattr(future, 'upload_completion', future)  # AsyncSaveResponse (newer staging API)
            completed = threading.Event()
            if self.ranks.master:
                future.add_done_callback(lambda f: self._complete(f, tmp, final, completed))
            else:
                completed.set()
            self.pending = (future, tmp, completed)
            return final
        try:
            with _single_process_quiet():
                dcp.save(state, **kwargs)
            if self.ranks.master:
                self._complete(None, tmp, final)
        except FAILURES as e:
            self.error = self.error or _failed(tmp, e)
        self._raise_if_failed()
        return final

    def _complete(self, future, tmp, final, completed=None):
        """Rank 0, once all shards and the index are written: marker, rename, pruning (async: in the writer thread)."""
        try:
            if future is not None:
                future.result()
            if os.path.exists(final) and final not in self.replaces:  # only what overwrite=True hands over is replaced
                self.error = f"{final} exists and this run did not write it; move it out of out_dir, then resume"
                return
            _mark(tmp, MARKER)
            os.remove(os.path.join(tmp, WRITING))
            remove_checkpoints([final])  # this iteration's checkpoint of an earlier run (overwrite=True), if any
            os.replace(tmp, final)
            with contextlib.suppress(OSError):
                fsync(self.out_dir)
            # an earlier run's (overwrite=True) first: pruning then counts only this run's folders
            remove_checkpoints([p for p in self.replaces if p != final])
            self.replaces = []
            if self.keep_last:  # the oldest beyond the newest keep_last
                remove_checkpoints([path for _, path in complete_steps(self.out_dir)[: -self.keep_last]])
        except FAILURES as e:
            self.error = self.error or _failed(tmp, e)
        finally:
            if completed is not None:
                completed.set()

    def _raise_if_failed(self):
        if self.ranks.any(self.error is not None):
            error, self.error = self.error, None
            raise CheckpointError(f"{error or 'another rank could not write its shards'}; {checkpoint_file.INTACT}")

    def wait(self, collective=True):
        """Wait for a background save; its failure raised on every rank (a collective), unless collective=False."""
        if self.pending is not None:
            future, tmp, completed = self.pending
            self.pending = None
            try:
                future.result()
            except FAILURES as e:
                self.error = self.error or _failed(tmp, e)
            completed.wait()
        if collective:
            self._raise_if_failed()

    def finish(self, failed=False):
        """At the end of the run, on every rank: wait() for the last background save (failed=True: no collective)."""
        self.wait(collective=not failed)
        _SAVERS.discard(self)


def background(setting, device_type):
    """checkpoint_async: 'auto' saves in the background on a GPU only (on the CPU the copy would duplicate state)."""
    return setting == 'yes' or (setting == 'auto' and device_type == 'cuda')


_SAVERS = set()  # savers not finished (what a test reaches the run's background writes through)


def remove_checkpoints(paths):
    """Remove ckpt.pt files and step folders (REMOVING, then the complete marker, first: a removal cut short leaves a
    folder that neither resumes nor is mistaken for someone else's)."""
    for path in paths:
        if os.path.isdir(path):
            _mark(path, REMOVING)
            if os.path.exists(os.path.join(path, MARKER)):
                os.remove(os.path.join(path, MARKER))
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.remove(path)


def _failed(tmp, e):
    return f"cannot write {tmp} ({type(e).__name__}: {checkpoint_file.first_line(e)})"


class _IndexUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle: admit only DCP's index classes, torch's Size, dtypes and layouts, and paths."""

    ALLOWED = {
        ('torch', 'Size'),
        ('collections', 'OrderedDict'),
        ('torch.serialization', '_get_layout'),
        ('pathlib', 'PosixPath'),
        ('pathlib', 'PurePosixPath'),
        ('torch.distributed.checkpoint.filesystem', '_StorageInfo'),
    }

    def find_class(self, module, name):
        index_class = module == 'torch.distributed.checkpoint.metadata'  # its classes, never a function
        kinds = (torch.dtype, torch.layout, torch.memory_format)
        torch_kind = module == 'torch' and isinstance(getattr(torch, name, None), kinds)
        if (module, name) in self.ALLOWED or index_class or torch_kind:
            found = super().find_class(module, name)
            if isinstance(found, type) or not index_class:
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


def _refuse_bytes(path, key):
    return CheckpointError(
        f"{path}/.metadata declares {key!r} a pickled Python object, which train.py never saves "
        f"and which could run code when read: refused; restore a backup or train from scratch"
    )


def _tensors_only(path, index):
    """DCP reads any item but a tensor with torch.load's full unpickler; train.py's step folders hold tensors only."""
    for key, meta in getattr(index, 'state_dict_metadata', {}).items():
        if not isinstance(meta, TensorStorageMetadata):
            raise _refuse_bytes(path, key)


class SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose index is read with _IndexUnpickler and holds tensors only; never reads a bytes item."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get('rank'))
        with self.fs.create_stream(path, 'rb') as f:
            metadata = _IndexUnpickler(f).load()
        _tensors_only(self.path, metadata)
        if getattr(metadata, 'storage_meta', None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        for item in plan.items:  # before anything is read
            if item.type == LoadItemType.BYTE_IO:
                raise _refuse_bytes(self.path, item.dest_index.fqn)
        return super().read_data(plan, planner)


class _TensorsOnly(dcp.DefaultLoadPlanner):
    """DCP's planner, less its load_bytes: the one place DCP's loading unpickles with torch.load's full unpickler."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def load_bytes(self, read_item, value):
        raise _refuse_bytes(self.path, read_item.dest_index.fqn)


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns at every call in one process that it assumes one process: it is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='torch.distributed is disabled')
        yield


def _cannot_read(path, e):
    # DCP's CheckpointException names only the ranks that failed: a rank's refusal as it is, else its first error
    failures = [f[0] for f in getattr(e, 'failures', {}).values() if isinstance(f, tuple) and f]
    refused = [f for f in [e, *failures] if isinstance(f, CheckpointError)]
    return refused[0] if refused else checkpoint_file.unreadable(path, failures[0] if failures else e)


def read_index(path):
    """The step folder's DCP index (.metadata), checked to hold tensors only and to point into whole shard files."""
    try:
        index = SafeReader(path).read_metadata()
    except FAILURES as e:
        raise _cannot_read(path, e) from None
    for info in getattr(index, 'storage_data', {}).values():
        shard = os.path.join(path, info.relative_path)
        size = os.path.getsize(shard) if os.path.isfile(shard) else None
        if size is None or size < info.offset + info.length:
            state = 'missing' if size is None else f'{size} bytes, the index needs {info.offset + info.length}'
            raise CheckpointError(
                f"{path}: shard {info.relative_path} is {state} (a copy cut short or a lost file): "
                f"restore a backup or train from scratch"
            )
    return index


def check_readable(path):
    """The step folder's values.pt, or a CheckpointError naming what would stop a resume; reads no tensor data."""
    values = checkpoint_file.read(os.path.join(path, VALUES), mmap=False)
    if not isinstance(values, dict) or values.get('format') != 'dcp':
        raise CheckpointError(f"{path}/{VALUES} is not a step folder's values; restore a backup or train from scratch")
    index = read_index(path)
    for info in index.storage_data.values():
        if not getattr(info, 'transform_descriptors', None):  # train.py writes no compressed record
            with open(os.path.join(path, info.relative_path), 'rb') as f:
                checkpoint_file.check_archive(f, f"{path}: shard {info.relative_path}", info.offset, info.length)
    return values


def _load(state, path, group=None):
    try:
        reader, planner = SafeReader(path), _TensorsOnly(path)
        with _single_process_quiet():
            dcp.load(
                state, storage_reader=reader, planner=planner, process_group=group, no_dist=not dist.is_initialized()
            )
    except FAILURES as e:
        raise _cannot_read(path, e) from None


def load(path, values, model, optimizer, group=None):
    """Load the step folder into `model` and `optimizer` as built now (sharded or whole); a collective in torchrun."""
    model_sd, _ = _model_tensors(model)
    rest, params = values['optimizer_rest'], dict(model.named_parameters())
    optim = {  # shaped (and sharded) as the state is now, to be filled
        name: {
            k: torch.empty_like(params[name], dtype=dtype) if like_param else torch.empty(shape, dtype=dtype)
            for k, (shape, dtype, like_param) in layout.items()
        }
        for name, layout in rest['layout'].items()
    }
    _load({'model': model_sd, 'optimizer': optim}, path, group)
    model.load_state_dict({**model_sd, **{k: model_sd[v] for k, v in values['tied'].items()}})
    optimizer.load_state_dict(_numbered(rest, optim, distributed.param_names(model, optimizer)))


def _numbered(rest, tensors, order):
    """optimizer.state_dict() of optimizer_rest and tensors {name: {key: tensor}}, numbered by the names in `order`."""
    state = {n: {**other, **tensors.get(n, {})} for n, other in rest['state'].items()}
    return distributed.numbered({**rest, 'state': state}, order)


def consolidate(path, optimizer=True):
    """The step folder as a checkpoint dict in ckpt.pt's format, in host memory; optimizer=False: the weights only."""
    values = check_readable(path)
    template = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in read_index(path).state_dict_metadata.items()
        if optimizer or key.startswith('model.')
    }
    if not any(k.startswith('model.') for k in template):
        raise CheckpointError(f"checkpoint {path} holds no weights; restore a backup or train from scratch")
    _load(template, path)
    model = {k.removeprefix('model.'): v for k, v in template.items() if k.startswith('model.')}
    model.update({k: model[v] for k, v in values['tied'].items()})
    checkpoint = {k: v for k, v in values.items() if k not in ('optimizer_rest', 'tied', 'format')} | {'model': model}
    if optimizer:
        rest = values['optimizer_rest']
        tensors = {n: {k: template[f'optimizer.{n}.{k}'] for k in keys} for n, keys in rest['layout'].items()}
        checkpoint['optimizer'] = _numbered(rest, tensors, [n for g in rest['param_groups'] for n in g['params']])
    return checkpoint
