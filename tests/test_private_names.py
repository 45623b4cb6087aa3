# SPDX-License-Identifier: BSD-3-Clause
"""The private names of torch and torch_xla that the scripts use where no public one does the
job, each checked by its name: the day an upgrade removes one, this says which and where."""

import importlib

import pytest
import torch

from conftest import REPO

# (module, name, the file that uses it, what for)
PRIVATE = [
    ('torch.distributed.checkpoint._fsspec_filesystem', 'FsspecReader', 'sharded_checkpoints.py',
     'reads the shards from any fsspec URL (gs://)'),
    ('torch.distributed.checkpoint._fsspec_filesystem', 'FsspecWriter', 'sharded_checkpoints.py',
     'writes them'),
    ('torch_xla', '_XLAC._get_xla_sharding_spec', 'train_resnet_spmd.py',
     "say_held: whether a tensor is sharded"),
    ('torch_xla', '_XLAC._get_local_shard_replica_and_indices', 'train_resnet_spmd.py',
     "say_held: the first device's shard of it, without copying it to the host"),
]


@pytest.mark.parametrize('module,name,user,why', PRIVATE, ids=[name.split('.')[-1] for _, name, *_ in PRIVATE])
def test_each_private_name_used_is_there(module, name, user, why):
  assert name in (REPO / user).read_text(), f'{user} no longer uses {name}: drop it from this list'
  found = importlib.import_module(module)
  for part in name.split('.'):
    found = getattr(found, part, None)
  assert found is not None, (
      f'{module}.{name} is gone: {user} uses it ({why}); find what replaced it')


def test_the_readers_load_id_and_the_loaders_workers_are_there(tmp_path):
  # FsspecReader.load_id: ShardsReader.read_metadata stamps the index with it, as torch's does.
  from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
  assert isinstance(getattr(FsspecReader(str(tmp_path)), 'load_id', None), str), (
      'FsspecReader.load_id is gone: sharded_checkpoints.ShardsReader.read_metadata sets it')
  # A DataLoader iterator's _workers: utils.EpochLoader.worker_death reads their exit codes.
  loader = torch.utils.data.DataLoader(list(range(4)), num_workers=1)
  iterator = iter(loader)
  try:
    workers = getattr(iterator, '_workers', None)
    assert workers and all(hasattr(w, 'exitcode') for w in workers), (
        "DataLoader's iterator has no _workers: utils.EpochLoader.worker_death reads them")
    assert [int(batch) for batch in iterator] == [0, 1, 2, 3]
  finally:
    del iterator
