# SPDX-License-Identifier: BSD-3-Clause
"""Sharded checkpoints, for the SPMD scripts (their kit: the script, utils.py and this module):
each host writes and reads only the shards its devices hold, through torch.distributed.
checkpoint, into a folder beside the checkpoint's file (ckpt-N/ beside ckpt-N.pt), and a run
reads them on any mesh. The file (utils.write_checkpoint's) holds the rest and names the folder;
a checkpoint is one once its file is there, so whole or ignored as a file is. The folder rule:
a folder stays while a file (ckpt-N.pt, or best.pt) names it. Nothing here needs editing."""

import asyncio
import contextlib
import enum
import os
import pickle
import uuid

import fsspec
import torch
import torch.distributed.checkpoint as dcp
import torch_xla
# torch 2.9 has no public name for these (tests/test_private_names.py).
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch_xla.experimental.distributed_checkpoint import (SPMDLoadPlanner, SPMDSavePlanner,
                                                          prime_optimizer)

import utils

_best = {}  # {ckpt_dir: the global step whose folder its best.pt names, or None}


def write_sharded(state, ckpt_dir, keep, best):
  """utils.write_checkpoint of a state whose device tensors (the weights, the optimizer's state)
  every host writes itself, only the shards its devices hold, into ckpt-N/ beside ckpt-N.pt,
  which holds the rest (and each weight's shape) and the id of this save, which the folder's
  index holds too (process 0's, which writes both)."""
  tensors, rest = split_tensors(dict(model=state['model'], optimizer=state['optimizer']['state']))
  save_id = uuid.uuid4().hex
  plain = dict(state, model={name: weight.shape for name, weight in state['model'].items()},
               optimizer=dict(state['optimizer'], state=rest['optimizer']), shards_id=save_id)

  def write(folder):
    if torch.distributed.is_initialized():  # Several hosts: none writes if process 0 refused.
      try:
        torch.distributed.barrier()
      except RuntimeError:
        raise utils.UsageError(f'process 0 ended before checkpoint {folder} was written: its '
                               'line says why') from None
    torch_xla.sync(wait=True)  # The planner reads each tensor's shards: none may be in flight.
    try:
      dcp.save(tensors, storage_writer=ShardsWriter(folder, save_id),
               planner=SPMDSavePlanner(), no_dist=not torch.distributed.is_initialized())
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is one.
      raise shards_error(e, f'cannot write checkpoint {folder}', 'free space in --ckpt_dir or '
                         'give another; the checkpoints already there are kept') from None
  return write_with_folder(plain, ckpt_dir, keep, best, write)


def write_with_folder(state, ckpt_dir, keep, best, write):
  """utils.write_checkpoint of a file that names its folder, which write(folder) fills on every
  host first; then the folders of older steps that no file names (rotated out, or of a save cut
  short) are removed. A newer one stays: a resume may have passed over its checkpoint."""
  step = state['global_step']
  path = utils.write_checkpoint(dict(state, shards=f'ckpt-{step:08d}'), ckpt_dir, keep, best,
                                shards=lambda path: write(path[:-len('.pt')]))
  if utils.is_master():
    _best[ckpt_dir] = step if best else _best[ckpt_dir] if ckpt_dir in _best else best_step(
        ckpt_dir)
    named = {_best[ckpt_dir], *utils.list_checkpoints(ckpt_dir)}
    for older, folder in utils.list_checkpoints(ckpt_dir, suffix='').items():
      if older < step and older not in named:
        utils.remove(folder)
  return path


def best_step(ckpt_dir):
  """The global step whose folder ckpt_dir/best.pt names, or None (no best.pt, or one cut
  short). A read that fails is a UsageError: no folder is removed on a guess."""
  path = f'{ckpt_dir.rstrip("/")}/best.pt'
  fs, where = utils.url_fs(path)
  try:
    if not fs.exists(where):
      return None
  except asyncio.TimeoutError:
    raise utils.BucketTimeout(f'cannot read checkpoint {path}') from None
  try:
    return utils.load_checkpoint(path)['global_step']
  except utils.UnreadableCheckpoint:
    return None


def read_sharded(state, weights, optimizer):
  """Loads the shards of a write_sharded checkpoint into the model's weights (its state_dict)
  and the optimizer's state, in place: each host reads what its devices hold on this run's mesh,
  whatever the mesh that wrote them. Returns the state with the optimizer's state_dict whole."""
  if not optimizer.state:  # Its state to load into (utils.make_optimizer_state's, else made by a
    prime_optimizer(optimizer)  # step of zero gradients), sharded as its weights are.
    optimizer.zero_grad(set_to_none=True)  # The first step's graph as a fresh run's.
  torch_xla.sync(wait=True)  # That state on the devices, done: the planner reads its shards.
  groups = [len(group['params']) for group in optimizer.param_groups]
  if groups != [len(group['params']) for group in state['optimizer']['param_groups']]:
    raise utils.UsageError(f'checkpoint {state["shards"]} was saved with other parameter groups '
                           f'than build_optimizer makes now ({groups} parameters): give the '
                           'optimizer of that run, or another --ckpt_dir')
  folder = state['shards']
  reader = ShardsReader(folder, **utils.fs_options(folder))
  try:
    index = reader.read_metadata()
    if state.get('shards_id', index.storage_meta.save_id) != index.storage_meta.save_id:
      raise utils.UsageError(f'{folder} is not the folder of shards saved with {folder}.pt (its '
                             'index names another save): nothing was changed; put back the '
                             'folder saved with it, or move both out of --ckpt_dir to resume '
                             'from the one before')
    saved = index.state_dict_metadata
    # A parameter without state there had no gradient in that run (frozen, or SGD without
    # momentum then): it starts without one here too, as a whole file's restore does.
    parameters = [p for group in optimizer.param_groups for p in group['params']]
    with_state = {name.split('.')[1] for name in saved if name.startswith('optimizer.')}
    for index in [index for index in optimizer.state_dict()['state']
                  if str(index) not in with_state]:
      del optimizer.state[parameters[index]]
    optimizer_state = optimizer.state_dict()['state']  # The optimizer's own tensors.
    tensors, _ = split_tensors(dict(model=weights, optimizer=optimizer_state))
    missing = [name for name in flat_names(tensors) if name not in saved]
    if not missing:
      dcp.load(tensors, storage_reader=reader, planner=SPMDLoadPlanner(),
               no_dist=not torch.distributed.is_initialized())
  except BaseException as e:  # (shards_error gives back our own UsageError as it is.)
    raise shards_error(e, f'cannot read checkpoint {folder}', 'nothing was changed; make it '
                       'readable, or move it out of --ckpt_dir to resume from the one before'
                       ) from None
  if missing:  # The weights were checked (utils.check_same_model): another optimizer's state.
    raise utils.UsageError(f'checkpoint {folder} holds no {missing[0]} ({len(missing)} tensors '
                           'of this run are not there): it was saved with another optimizer; '
                           'give the optimizer of that run, or another --ckpt_dir')
  merged = {index: {**state['optimizer']['state'].get(index, {}), **values}
            for index, values in optimizer_state.items()}
  return dict(state, optimizer=dict(state['optimizer'], state=merged))


def split_tensors(tree):
  """(its tensors, the rest) of a tree of dicts, each as a tree of the same keys."""
  tensors, rest = {}, {}
  for key, value in tree.items():
    if isinstance(value, dict):
      tensors[key], rest[key] = split_tensors(value)
    else:
      (tensors if isinstance(value, torch.Tensor) else rest)[key] = value
  return tensors, rest


def flat_names(tree, prefix=''):
  """The names torch.distributed.checkpoint gives the leaves of a tree of dicts (a.b.c)."""
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from flat_names(value, f'{prefix}{key}.')
    else:
      yield f'{prefix}{key}'


# What the storage says of a save or load that failed: the disk or the network (OSError, the
# bucket's deadline), a shard cut short (EOFError), an index refused (UnpicklingError), and
# torch's zip reader or writer of a shard's file (inline_container.cc: a write cut short by a
# full disk, an unreadable archive), which says so in a RuntimeError.
STORAGE_ERRORS = (OSError, EOFError, pickle.UnpicklingError)


def shards_error(error, what, advice):
  """The one-line error of a save or load of shards that the storage failed; any other error
  (our own UsageError, a bug in a planner) as it is, which is then a traceback."""
  failures = getattr(error, 'failures', None)  # {rank: (exception, traceback)}
  cause = next(iter(failures.values()))[0] if failures else error
  context = cause  # A bucket's deadline (utils.fs_options), which torch's zip writer may have
  while context is not None and not isinstance(context, asyncio.TimeoutError):  # met as a
    context = context.__cause__ or context.__context__  # short write (a RuntimeError).
  if context is not None:
    return utils.BucketTimeout(what)
  if isinstance(cause, STORAGE_ERRORS) or (isinstance(cause, RuntimeError) and
                                           'inline_container.cc' in str(cause)):
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else ''
    return utils.UsageError(f'{what} ({type(cause).__name__}: {first}): {advice}')
  return cause


class ShardsWriter(FsspecWriter):
  """torch.distributed.checkpoint's writer of a folder of shards, whose index (.metadata) names
  the save (save_id), and whose write to a bucket that fails sends nothing more: neither the
  file's last part nor a request to remove it, each of which would wait a deadline of its own.
  (The folder is no checkpoint without its file, and a later save removes it.)"""

  def __init__(self, folder, save_id):
    local = fsspec.utils.get_protocol(folder) == 'file'  # Else no file to fsync, but os.sync().
    super().__init__(folder, sync_files=local, **utils.fs_options(folder))
    self.save_id = save_id  # (dcp.save resets it only when given a checkpoint_id.)
    if not local:
      self.fs.create_stream = self.create_stream

  @contextlib.contextmanager
  def create_stream(self, path, mode):
    stream = self.fs.fs.open(os.fspath(path), mode)
    try:
      yield stream
    except BaseException:
      stream.closed = True  # So closing it sends nothing (an upload begun expires unfinished).
      raise
    stream.close()


class ShardsReader(FsspecReader):
  """torch.distributed.checkpoint's reader, whose index of the shards (.metadata, a pickle) may
  hold only that index's own classes: a crafted one cannot run code as it loads."""

  ALLOWED = {('torch.distributed.checkpoint.metadata', name) for name in (
      'Metadata', 'TensorStorageMetadata', 'ChunkStorageMetadata', 'BytesStorageMetadata',
      'TensorProperties', 'MetadataIndex', 'StorageMeta', '_MEM_FORMAT_ENCODING')} | {
          ('torch.distributed.checkpoint.filesystem', '_StorageInfo'), ('torch', 'Size'),
          ('torch.serialization', '_get_layout')}

  class Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
      if (module, name) == ('builtins', 'getattr'):  # An Enum member, as Python 3.11.2 pickles it.
        return ShardsReader.enum_member
      if (module, name) in ShardsReader.ALLOWED or (
          module == 'torch' and isinstance(getattr(torch, name, None), torch.dtype)):
        return super().find_class(module, name)
      raise pickle.UnpicklingError(f'{module}.{name} is not part of a checkpoint\'s index')

  @staticmethod
  def enum_member(cls, name):
    """getattr(cls, name) for a member of an Enum of the index alone."""
    if isinstance(cls, enum.EnumMeta) and name in cls.__members__ and (
        cls.__module__, cls.__name__) in ShardsReader.ALLOWED:
      return cls[name]
    raise pickle.UnpicklingError(f'getattr({cls!r}, {name!r}) is not part of a checkpoint\'s index')

  def read_metadata(self, *args, **kwargs):
    """FsspecReader's, with Unpickler: the index whole, with this load's id (load_id), as
    torch's own read_metadata gives it."""
    with self.fs.create_stream(self.fs.concat_path(self.path, '.metadata'), 'rb') as f:
      metadata = self.Unpickler(f).load()
    if not isinstance(metadata, dcp.metadata.Metadata):
      raise pickle.UnpicklingError(f'it holds a {type(metadata).__name__}, not an index')
    metadata.storage_meta = metadata.storage_meta or dcp.metadata.StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata
