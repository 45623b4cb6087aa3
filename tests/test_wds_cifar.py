# SPDX-License-Identifier: BSD-3-Clause
"""make_cifar_shards.py and train_wds_cifar.py: shards from the CIFAR-10 python layout,
streamed from local disk and over http, split across replicas and loader workers."""

import contextlib
import functools
import http.server
import io
import itertools
import json
import os
import pathlib
import pickle
import re
import shlex
import signal
import socket
import subprocess
import sys
import tarfile
import textwrap
import threading
import time
from types import SimpleNamespace

import braceexpand
import fsspec
import numpy as np
import PIL.Image
import pytest
import torch
import webdataset as wds

import make_cifar_shards
import supervisor
import train_wds_cifar
import train_wds_cifar as wds_cifar
import utils
from conftest import (COLOURS, ONE_PROCESS, REPO, SlowLink, assert_nothing_left, assert_one_error,
                      assert_same_training, both, closed_port, crafted_jpeg, finish, loader_processes,
                      make_cifar_python, make_image_folder, oversized_image, read_json,
                      run_and_signal, run_script, script_env, seeded_random, start_script,
                      training_losses, wait_for, write_image)


@pytest.fixture(scope='module')
def shards(tmp_path_factory):
  """CIFAR-format colour data (5 x 96 train, 200 test) written as shards of 50 samples."""
  root = tmp_path_factory.mktemp('cifar')
  make_cifar_python(root / 'cifar-10-batches-py', per_batch=96, test_count=200)
  result = run_script('make_cifar_shards.py', '--cifar_dir', root / 'cifar-10-batches-py',
                      '--output', root / 'shards' / 'cifar', '--samples_per_shard', 50)
  assert result.returncode == 0, both(result)
  return root


@pytest.fixture(scope='module')
def tutorial_shards(shards):
  """The same data written as the Cloud TPU WebDataset tutorial writes CIFAR-10: ShardWriter,
  one sample = {'__key__': '%07d' % i, 'ppm': PIL image, 'cls': int}, train/ and val/ folders.
  Every 16th training sample is a corrupt ppm (30 of 480)."""
  for split, batches in [('train', [f'data_batch_{i}' for i in range(1, 6)]), ('val', ['test_batch'])]:
    parts = [cifar_split(shards / 'cifar-10-batches-py', name) for name in batches]
    images, labels = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    (shards / 'shards' / 'tutorial' / split).mkdir(parents=True)
    pattern = str(shards / 'shards' / 'tutorial' / split / f'cifar-{split}-%06d.tar')
    with wds.ShardWriter(pattern, maxcount=50, verbose=0) as sink:
      for i, (image, label) in enumerate(zip(images, labels)):
        ppm = PIL.Image.fromarray(image)
        if split == 'train' and i % 16 == 5:
          ppm = b'P6\n32 32\n255\n' + image.tobytes()[:100]  # Cut short.
        sink.write({'__key__': '%07d' % i, 'ppm': ppm, 'cls': int(label)})
  return shards / 'shards' / 'tutorial'


@pytest.fixture(scope='module')
def png_shards(shards):
  """The same data as make_cifar_shards.py --format png writes it."""
  result = run_script('make_cifar_shards.py', '--cifar_dir', shards / 'cifar-10-batches-py',
                      '--output', shards / 'shards' / 'png' / 'cifar', '--samples_per_shard', 50,
                      '--format', 'png')
  assert result.returncode == 0, both(result)
  return shards / 'shards' / 'png'


def cifar_split(folder, name):
  with open(folder / name, 'rb') as f:
    batch = pickle.load(f, encoding='bytes')
  images = np.asarray(batch[b'data'], np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
  return images, np.asarray(batch[b'labels'])


def never(message):
  raise AssertionError(message)


def samples_of(urls, on_bad=never, num_classes=10, read_timeout=20):
  """(where, image file key, its bytes, label) of every sample of the shards, as the script's
  pipeline reads them (with its parse)."""
  return wds_cifar.read_samples(urls, wds_cifar.parse, num_classes, on_bad, read_timeout)


def decoded(urls, on_bad=never, num_classes=10):
  """(image uint8 H x W x 3, label) of every sample of the shards, as the script reads them."""
  return [(wds_cifar.decode(image_key, data).permute(1, 2, 0).numpy(), label)
          for _, image_key, data, label in samples_of(urls, on_bad, num_classes)]


def test_writer_stores_every_image_and_label_exactly(shards):
  train = sorted((shards / 'shards').glob('cifar-train-*.tar'))
  test = sorted((shards / 'shards').glob('cifar-test-*.tar'))
  assert [p.name for p in train] == [f'cifar-train-{i:06d}.tar' for i in range(10)]
  assert [p.name for p in test] == [f'cifar-test-{i:06d}.tar' for i in range(4)]
  # Test shards keep the file's order; every image is byte-identical.
  images, labels = cifar_split(shards / 'cifar-10-batches-py', 'test_batch')
  read = decoded([str(p) for p in test])
  assert all((a == b).all() and l == m for (a, l), b, m in zip(read, images, labels, strict=True))
  # Training shards hold all 480 training samples once, shuffled across the 5 batches.
  parts = [cifar_split(shards / 'cifar-10-batches-py', f'data_batch_{i}') for i in range(1, 6)]
  expected = sorted((img.tobytes(), int(l)) for part in parts for img, l in zip(*part))
  read = decoded([str(p) for p in train])
  assert sorted((img.tobytes(), l) for img, l in read) == expected
  first_labels = [l for _, l in read[:50]]
  assert len(set(first_labels)) == len(COLOURS)  # Shuffled: every shard holds every class.
  # The class names beside them, a line each, in label order.
  assert (shards / 'shards' / 'cifar-classes.txt').read_text().split('\n') == [*COLOURS, '']


def test_writer_repeat_png_and_fsspec_output(shards, tmp_path):
  images, labels = cifar_split(shards / 'cifar-10-batches-py', 'data_batch_1')
  order = list(range(len(labels))) * 2
  urls = make_cifar_shards.write_shards(
      ((*make_cifar_shards.encode(images[i], 'png'), labels[i]) for i in order),
      'memory://out/c-train-%06d.tar', 64)
  assert urls == [f'memory://out/c-train-{i:06d}.tar' for i in range(3)]
  assert not fsspec.filesystem('memory').glob('/out/*.tmp')
  read = decoded(urls)
  assert len(read) == 192 and [l for _, l in read] == list(labels) * 2
  assert all(np.array_equal(image, images[i]) for (image, _), i in zip(read, order, strict=True))
  # PNG, as other tools read them: webdataset's own pipeline and PIL.
  fsspec.filesystem('memory').get('/out/c-train-000000.tar', str(tmp_path / 'c.tar'))
  first = next(iter(wds.WebDataset(str(tmp_path / 'c.tar'), shardshuffle=False).decode('pil')))
  assert np.array_equal(np.asarray(first['png']), images[0]) and first['cls'] == labels[0]


def test_writer_keeps_an_image_folders_files_as_they_are(tmp_path):
  make_image_folder(tmp_path / 'img', 'train', 30, size=40)
  make_image_folder(tmp_path / 'img', 'val', 5, size=40)
  # As ImageNet has them: a PNG named .JPEG (n02105855_2933); and a BMP, kept as a PNG.
  red = PIL.Image.open(tmp_path / 'img' / 'train' / 'red' / '0.png')
  red.transpose(PIL.Image.Transpose.FLIP_LEFT_RIGHT).save(
      tmp_path / 'img' / 'train' / 'red' / 'png-named.JPEG', format='PNG')
  photo = red.transpose(PIL.Image.Transpose.FLIP_TOP_BOTTOM)
  photo.save(tmp_path / 'img' / 'train' / 'red' / 'bitmap.bmp')
  result = run_script('make_cifar_shards.py', '--image_folder', tmp_path / 'img', '--output',
                      tmp_path / 'out' / 'c', '--samples_per_shard', 32, '--shuffle_seed', 7,
                      '--results_json', tmp_path / 'flags.json')
  assert result.returncode == 0, both(result)
  assert re.search(r'^Writing 122 training samples shuffled with --shuffle_seed 7 and 20 val '
                   r'samples, original images', result.stdout, re.M), result.stdout
  assert 'Classes (4, in ' in result.stdout and ': blue green red yellow\n' in result.stdout
  command = re.search(r'^  (python train_wds_cifar\.py .*)$', result.stdout, re.M).group(1)
  out = tmp_path / 'out'
  assert shlex.split(command)[2:] == [
      '--wds_traindir', f'{out}/c-train-{{000000..000003}}.tar', '--trainsize', '122',
      '--wds_testdir', f'{out}/c-val-{{000000..000000}}.tar', '--testsize', '20', '--batch_size',
      '64']
  assert read_json(tmp_path / 'flags.json')['wds_traindir'] == f'{out}/c-train-{{000000..000003}}.tar'
  assert sorted(p.name for p in out.iterdir()) == [
      'c-classes.txt', *(f'c-train-{i:06d}.tar' for i in range(4)), 'c-val-000000.tar']
  def members(pattern):
    return [(key, data, label) for _, key, data, label in samples_of(
        sorted(map(str, out.glob(pattern))), never, 4)]
  def files(split):
    return [(path, COLOURS_ORDER.index(path.parent.name))
            for path in sorted((tmp_path / 'img' / split).glob('*/*'))]
  # Every file once with its class, its very bytes (the kind by what they are, not their name).
  kinds = {'.png': 'png', '.jpg': 'jpg', '.JPEG': 'png'}
  for pattern, split in (('c-train-*', 'train'), ('c-val-*', 'val')):
    kept = members(pattern)
    by_bytes = {data: (key, label) for key, data, label in kept}
    assert len(by_bytes) == len(kept) == len(files(split))
    for path, label in files(split):
      if path.suffix != '.bmp':
        assert by_bytes.pop(path.read_bytes()) == (kinds[path.suffix], label), path
    # Left: the BMP, as a PNG of its very pixels.
    assert list(by_bytes.values()) == ([('png', 2)] if split == 'train' else [])
    if by_bytes:
      bitmap = PIL.Image.open(io.BytesIO(next(iter(by_bytes))))
      assert np.array_equal(np.asarray(bitmap), np.asarray(photo.convert('RGB')))
    # Shuffled: the evaluation samples are not class by class as the folder holds them.
    labels = [label for _, _, label in kept]
    assert labels != sorted(labels)


COLOURS_ORDER = sorted(COLOURS)


def test_writer_stopped_by_ctrl_c_leaves_only_whole_shards(tmp_path):
  make_cifar_python(tmp_path / 'cifar', per_batch=500, test_count=10)
  args = ['--cifar_dir', tmp_path / 'cifar', '--output', tmp_path / 'out' / 'c', '--repeat', 40,
          '--samples_per_shard', 50]  # 100,000 samples in 2,000 shards: seconds of writing.
  process = start_script('make_cifar_shards.py', *args)
  wait_for(process, r'^Writing 100,000 training samples')
  while not list((tmp_path / 'out').glob('c-train-*.tar')):  # What it writes, as it writes.
    assert process.poll() is None
  os.killpg(process.pid, signal.SIGINT)  # A terminal's Ctrl-C.
  code, out = finish(process)
  assert code == 130, out
  assert out.strip().splitlines()[-1] == (
      'error: stopped by Ctrl-C: the shards written are whole (one half-written is removed); run '
      'the same command to write them all'), out
  written = sorted((tmp_path / 'out').iterdir())
  assert 0 < len(written) < 2000 and all(path.suffix == '.tar' for path in written), written
  counter = train_wds_cifar.BadData(strict=True)  # Each is whole: read to its end, none bad.
  assert len(list(samples_of(map(str, written), counter, 10))) == 50 * len(written)
  # The same command then writes them all: tests/test_shard_writer.py's SIGTERM test (the same
  # way out of the writer, a run of 100,000 samples less here).


def test_shards_written_to_a_bucket_are_read_back_from_it(bucket, tmp_path, monkeypatch):
  make_image_folder(tmp_path / 'img', 'train', 6, size=40)
  make_image_folder(tmp_path / 'img', 'val', 2, size=40)
  result = run_script('make_cifar_shards.py', '--image_folder', tmp_path / 'img', '--output',
                      'gs://data/photos/photos', '--samples_per_shard', 8, env=script_env(**bucket))
  assert result.returncode == 0, both(result)
  assert '--wds_traindir "gs://data/photos/photos-train-{000000..000002}.tar"' in result.stdout
  # Read back as a replica reads, through gcsfs: the files' very bytes, the classes.
  for name, value in bucket.items():
    monkeypatch.setenv(name, value)
  fs = fsspec.filesystem('gs', skip_instance_cache=True)
  assert sorted(fs.ls('data/photos')) == ['data/photos/photos-classes.txt', *(
      f'data/photos/photos-train-{i:06d}.tar' for i in range(3)), 'data/photos/photos-val-000000.tar']
  fsspec.filesystem('gs').clear_instance_cache()
  urls = list(braceexpand.braceexpand('gs://data/photos/photos-{train-{000000..000002},val-000000}.tar'))
  read = sorted(data for _, _, data, _ in samples_of(urls, never, 4))
  assert read == sorted(path.read_bytes() for path in (tmp_path / 'img').glob('*/*/*'))
  assert wds_cifar.shard_classes('gs://data/photos/photos-train-{000000..000002}.tar') == sorted(COLOURS)
  # A checkpoint goes up in one upload, as the shards do: no temporary object, no rename.
  state = dict(model={'w': torch.ones(4)}, optimizer={}, lr_scheduler=None, epoch=1, step=2,
               global_step=2, rng={}, flags={}, results={})
  utils.write_checkpoint(state, 'gs://data/ckpt', keep=2, best=False)
  assert fs.ls('data/ckpt', refresh=True) == ['data/ckpt/ckpt-00000002.pt']
  assert torch.equal(utils.load_checkpoint('gs://data/ckpt/ckpt-00000002.pt')['model']['w'],
                     torch.ones(4))


def test_checkpoints_to_a_url_keep_the_newest_and_the_best():
  # fsspec's memory file system stands for a bucket: the same calls as gs://.
  ckpt_dir = 'memory://ckpt/run1'
  for step in (2, 4, 6):
    state = dict(model={'w': torch.full((4,), float(step))}, optimizer={}, lr_scheduler=None,
                 epoch=1, step=step, global_step=step, rng={}, flags={}, results={})
    utils.write_checkpoint(state, ckpt_dir, keep=2, best=step == 4)
  names = sorted(fsspec.filesystem('memory').ls('/ckpt/run1', detail=False))
  assert names == ['/ckpt/run1/best.pt', '/ckpt/run1/ckpt-00000004.pt', '/ckpt/run1/ckpt-00000006.pt']
  path, state = utils.find_checkpoint(None, ckpt_dir)
  assert path == 'memory://ckpt/run1/ckpt-00000006.pt'
  assert torch.equal(state['model']['w'], torch.full((4,), 6.0))
  assert torch.equal(utils.load_checkpoint(f'{ckpt_dir}/best.pt')['model']['w'], torch.full((4,), 4.0))
  # A bucket has no lock: a checkpoint this run neither found (find_checkpoint noted those)
  # nor wrote is another run's, and the next save ends the run before it replaces anything.
  fs = fsspec.filesystem('memory')
  fs.pipe('/ckpt/run1/ckpt-00000008.pt', b'the other run')
  state.update(step=8, global_step=8)
  with pytest.raises(utils.UsageError, match=r'^--ckpt_dir memory://ckpt/run1 holds '
                     r'ckpt-00000008\.pt, which this run did not write: another run writes there '
                     r'\(nothing of it was replaced\); give each run its own --ckpt_dir$'):
    utils.write_checkpoint(state, ckpt_dir, keep=2, best=False)
  assert fs.cat('/ckpt/run1/ckpt-00000008.pt') == b'the other run'
  assert len(fs.ls('/ckpt/run1')) == 4


def train_shards(urls, rank, world_size, batches, **flags):
  cfg = dict(batch_size=16, shuffle_buffer=64, seed=5, fail_on_bad_data=True, num_workers=2,
             read_timeout=20, trainsize=480,
             img_dim=32, num_classes=10)
  return wds_cifar.TrainShards(urls, rank, world_size, batches, SimpleNamespace(**{**cfg, **flags}))


@pytest.mark.parametrize('num_shards', [32, 33, 64, 100, 257])
def test_every_shard_goes_to_one_replica_and_worker_per_epoch(num_shards):
  urls = [f's{i}' for i in range(num_shards)]
  for world_size, workers in itertools.product([1, 2, 3, 4, 8, 32], [0, 1, 2, 4]):
    feeders = max(1, workers)
    if num_shards < world_size * feeders:
      continue  # Refused at start (tested below).
    for epoch in (1, 2):
      got = [train_shards(urls, r, world_size, 1, seed=7).shards(epoch, w, feeders)
             for r in range(world_size) for w in range(feeders)]
      flat = [s for part in got for s in part]
      assert sorted(flat) == sorted(urls)
      assert min(map(len, got)) >= 1
  orders = {tuple(train_shards(urls, 0, 1, 1, seed=7).shards(e, 0, 1)) for e in range(1, 4)}
  assert len(orders) == 3  # A new order every epoch.


def take_batches(dataset, num_workers, steps):
  loader = utils.EpochLoader(torch.utils.data.DataLoader(dataset, batch_size=None,
                                                         num_workers=num_workers), steps, dataset)
  batches = list(loader)
  loader.check()
  return batches


@pytest.mark.parametrize('world_size,num_workers', [(1, 0), (2, 2), (3, 1), (4, 2)])
def test_every_replica_runs_the_same_steps_and_refills_when_short(shards, world_size, num_workers):
  train = [str(p) for p in sorted((shards / 'shards').glob('cifar-train-*.tar'))]
  batch_size = 16
  steps = 480 // (batch_size * world_size)
  seen, repeated = [], 0
  for rank in range(world_size):
    dataset = train_shards(train, rank, world_size, steps, batch_size=batch_size,
                           shuffle_buffer=100, seed=3, num_workers=num_workers)
    dataset.set_epoch(1)
    batches = take_batches(dataset, num_workers, steps)
    assert len(batches) == steps
    assert all(images.shape == (batch_size, 3, 32, 32) and images.dtype == torch.uint8
               for images, _ in batches)
    seen += [img.numpy().tobytes() for images, _ in batches for img in images]
    bad, again, lacking = dataset.read_counts()
    assert bad == 0 and lacking == 0  # Nothing is wrong: said by no line.
    repeated += again
  # Shards of 50 do not split 480 samples evenly: short replicas read some samples twice
  # (and say so) rather than run fewer steps.
  assert len(seen) == steps * batch_size * world_size
  if world_size == 1:
    assert repeated == 0  # One replica holds all 480 samples: 30 whole batches, no refill.
  if (world_size, num_workers) == (3, 1):
    assert repeated > 0  # 10 shards for 3 replicas: 4, 3, 3 shards of 50 for 160 samples each.
  # A --trainsize larger than the shards hold: what they lack is counted, and said.
  dataset = train_shards(train, 0, 1, 600 // 16, num_workers=0, trainsize=600)
  dataset.set_epoch(1)
  take_batches(dataset, 0, 600 // 16)
  assert dataset.read_counts()[1:] == [600 // 16 * 16 - 480, 120]


def test_same_seed_and_epoch_give_the_same_batches_with_workers(shards):
  train = [str(p) for p in sorted((shards / 'shards').glob('cifar-train-*.tar'))]
  def epoch_batches(epoch):
    dataset = train_shards(train, 0, 2, 10)
    dataset.set_epoch(epoch)
    return torch.stack([b for b, _ in take_batches(dataset, 2, 10)])
  first = epoch_batches(1)
  assert len(first) == 10
  assert torch.equal(first, epoch_batches(1))  # Two loaders, each with two worker processes.
  assert not torch.equal(first, epoch_batches(2))


def test_workers_kept_through_the_run_make_each_epoch_as_new_ones_would(shards):
  # A replica's loader workers are started by spawn and kept for the run: they must read
  # each epoch's number and resume point when it begins.
  train = [str(p) for p in sorted((shards / 'shards').glob('cifar-train-*.tar'))]
  def epoch_batches(loader):
    return [torch.cat([images.flatten(), labels]) for images, labels in loader]
  def loader(dataset, epoch, skip, **kept):
    epoch_loader = utils.EpochLoader(torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=2, **kept), 6, order=dataset)
    epoch_loader.set_epoch(epoch, skip)
    return epoch_loader
  kept = loader(train_shards(train, 0, 1, 6), 1, 0, persistent_workers=True,
                multiprocessing_context='spawn')
  for epoch, skip in [(1, 0), (2, 3), (3, 0)]:
    kept.set_epoch(epoch, skip)
    expected = epoch_batches(loader(train_shards(train, 0, 1, 6), epoch, skip))
    assert len(expected) == 6 - skip
    assert torch.equal(torch.stack(epoch_batches(kept)), torch.stack(expected)), epoch


@pytest.mark.parametrize('num_workers,image_format', [(0, 'rgb'), (1, 'png'), (3, 'tutorial'),
                                                       (2, 'photos')])
def test_resumed_stream_gives_the_batches_after_the_skip_and_ends_with_the_epoch(
    request, num_workers, image_format):
  # rgb and png from make_cifar_shards.py; the tutorial's ppm, with its corrupt samples; the
  # photos' files as they are (PNG, JPEG and a broken one), cropped and resized to 24 px.
  if image_format == 'photos':
    folder, prefix, img_dim, count = request.getfixturevalue('photo_shards')[0], 'photos', 24, 17
  else:
    folder = request.getfixturevalue({'rgb': 'shards', 'png': 'png_shards',
                                      'tutorial': 'tutorial_shards'}[image_format])
    folder = folder / {'rgb': 'shards', 'png': '.', 'tutorial': 'train'}[image_format]
    prefix, img_dim, count = 'cifar', 32, 10
  train = [str(p) for p in sorted(folder.glob(f'{prefix}-train-*.tar'))]
  assert len(train) == count
  def batches(skip, steps):
    dataset = train_shards(train, 1, 2, steps, batch_size=8, shuffle_buffer=40,
                           num_workers=num_workers, img_dim=img_dim,
                           fail_on_bad_data=image_format in ('rgb', 'png'))
    dataset.set_epoch(2, skip)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=num_workers)
    # No cap: the workers stop when the epoch has its batches (islice: a bound, not a cap).
    return [torch.cat([images.flatten(), labels]) for images, labels in
            itertools.islice((b for b in loader if b is not None), steps + 10)]
  whole = batches(0, 30)
  assert len(whole) == 30
  for skip in [1, 2, 3, 4, 5, 13, 29]:
    assert torch.equal(torch.stack(batches(skip, 30)), torch.stack(whole[skip:])), skip


def webdataset_samples(path):
  """The samples of a tar as webdataset's own reader gives them (tarfile, then grouped)."""
  with open(path, 'rb') as f:
    files = wds.tariterators.tar_file_expander([dict(url=str(path), stream=f)])
    return [dict(sample) for sample in wds.tariterators.group_by_keys(files)]


def script_samples(path):
  with open(path, 'rb') as f:
    return [dict(sample) for sample in train_wds_cifar.tar_samples(train_wds_cifar.TarFiles(f),
                                                                   str(path))]


def test_the_tar_reader_gives_what_webdataset_gives_for_every_tar_format(shards, tutorial_shards,
                                                                         png_shards, tmp_path):
  # The script's tar reader (a fraction of the cost of webdataset's) gives the same samples,
  # bytes and order: the batches of a seed are those of the releases that read with webdataset.
  written = [*(shards / 'shards').glob('cifar-*.tar'), *(shards / 'shards' / 'png').glob('*.tar'),
             *(shards / 'shards' / 'tutorial').glob('*/*.tar')]  # ShardWriter's: pax headers
  rng = seeded_random()
  files = [(f'{i:04d}.{ext}', rng.randbytes(rng.randrange(0, 3000))) for i in range(40)
           for ext in ('jpg', 'cls')]
  files += [('d.x/' + 'long' * 40 + '.JPG', b'x' * 700), ('__meta__', b'm'), ('a/__b__/c.jpg', b''),
            ('noextension', b'n'), ('sub.dir/k.Tar.Gz', bytes(512)), ('ünï.cöde.png', b'u' * 9)]
  for name, (fmt, mode) in {'gnu.tar': (tarfile.GNU_FORMAT, 'w'), 'pax.tar.gz': (tarfile.PAX_FORMAT,
                            'w:gz'), 'ustar.tar.xz': (tarfile.USTAR_FORMAT, 'w:xz'),
                            'pax.tar.bz2': (tarfile.PAX_FORMAT, 'w:bz2')}.items():
    with tarfile.open(tmp_path / name, mode, format=fmt) as tar:
      folder = tarfile.TarInfo('d.x')
      folder.type = tarfile.DIRTYPE
      tar.addfile(folder)
      for file_name, data in files:
        if fmt == tarfile.USTAR_FORMAT and len(file_name) > 100:
          file_name = 'd.x/' + 'long' * 20 + '.JPG'  # Split into ustar's prefix and name.
        info = tarfile.TarInfo(file_name)
        info.size, info.mtime = len(data), 1.5e9 + 0.25  # A float: a pax header (PAX_FORMAT).
        tar.addfile(info, io.BytesIO(data))
      link = tarfile.TarInfo('0001.lnk')
      link.type, link.linkname = tarfile.SYMTYPE, 'l' * (99 if fmt == tarfile.USTAR_FORMAT else 150)
      tar.addfile(link)
    written.append(tmp_path / name)
  for path in written:
    ours = script_samples(path)
    assert ours == webdataset_samples(path) and len(ours) > 5, path
  # A duplicate name: the same error as webdataset's.
  with tarfile.open(tmp_path / 'twice.tar', 'w') as tar:
    for _ in range(2):
      info = tarfile.TarInfo('k.jpg')
      tar.addfile(info, io.BytesIO())
  with pytest.raises(ValueError) as error:
    script_samples(tmp_path / 'twice.tar')
  assert error.value.args[0].startswith('k.jpg: duplicate file name in tar file jpg')
  # A file cut short, and a header that is not one, are ReadErrors naming the byte.
  data = (shards / 'shards' / 'cifar-test-000000.tar').read_bytes()
  with tarfile.open(shards / 'shards' / 'cifar-test-000000.tar') as tar:
    second = tar.getmembers()[1].offset  # Its header's first byte.
  for cut, match in [(data[:second - 100], rf'unexpected end of data @ byte {second - 100}'),
                     (data[:second] + b'?' * 512 + data[second + 512:],
                      rf'bad checksum @ byte {second}')]:
    (tmp_path / 'bad.tar').write_bytes(cut)
    with pytest.raises(tarfile.ReadError, match=match):
      script_samples(tmp_path / 'bad.tar')


def truncated_copy(src, dst):
  data = src.read_bytes()
  dst.write_bytes(data[:len(data) // 2 + 100])
  return str(dst)


def test_truncated_shard_is_skipped_with_a_warning_or_fatal(shards, tmp_path, capsys):
  test = [str(p) for p in sorted((shards / 'shards').glob('cifar-test-*.tar'))]
  bad = truncated_copy(shards / 'shards' / 'cifar-test-000001.tar', tmp_path / 'bad.tar')
  counter = train_wds_cifar.BadData(strict=False)
  missing = str(tmp_path / 'missing.tar')
  read = list(samples_of([test[0], bad, missing, test[2]], counter, 10))
  assert counter.count == 2
  assert 100 < len(read) < 150  # The good shards and the readable start of the bad one.
  # Read again, as a replica whose shards ran out reads them to fill its epoch: counted once.
  assert len(list(samples_of([bad], counter, 10))) == len(read) - 100
  assert counter.count == 2
  err = capsys.readouterr().err
  assert len(re.findall(r'^warning: shard \S*bad\.tar cannot be read to the end', err, re.M)) == 1
  assert re.search(r'^warning: shard \S*missing\.tar is missing; skipped$', err, re.M)
  with pytest.raises(utils.BadDataError, match=r'bad\.tar cannot be read.*--fail_on_bad_data'):
    list(samples_of([bad], train_wds_cifar.BadData(strict=True), 10))


def test_shard_cut_inside_a_tar_header_is_a_bad_shard(shards, tmp_path, capsys):
  # tarfile takes a header cut short for the end of the archive and says nothing: the cut
  # shard, in the middle of the list, must be counted and named all the same.
  source = shards / 'shards' / 'cifar-test-000001.tar'
  with tarfile.open(source) as tar:
    starts = [m.offset for m in tar.getmembers() if m.name.endswith('.rgb')][1:]
  rng = seeded_random()
  cut = rng.choice(starts) + rng.randrange(1, tarfile.BLOCKSIZE)  # Inside a sample's first header.
  (tmp_path / 'test').mkdir()
  for i in range(4):
    data = (shards / 'shards' / f'cifar-test-{i:06d}.tar').read_bytes()
    (tmp_path / 'test' / f'cifar-test-{i:06d}.tar').write_bytes(data[:cut] if i == 1 else data)
  test = [str(tmp_path / 'test' / f'cifar-test-{i:06d}.tar') for i in range(4)]
  counter = train_wds_cifar.BadData(strict=False)
  read = list(samples_of(test, counter, 10))
  assert counter.count == 1 and len(read) == 150 + starts.index(cut - cut % 512) + 1, len(read)
  assert re.search(r'^warning: shard \S*cifar-test-000001\.tar cannot be read to the end \(it ends '
                   rf'inside a tar header, after {cut} bytes: the rest of it is lost\); skipped$',
                   capsys.readouterr().err, re.M)
  # The run: with --fail_on_bad_data, one line (at its first evaluation, which one batch of
  # 200 reads whole, after one step). In one process (--num_cores 1, no replica to start): a
  # replica's error reaches the launcher as one line in the tests of a server that stops.
  result = run_script('train_wds_cifar.py', '--wds_traindir',
                      shards / 'shards' / 'cifar-train-{000000..000009}.tar', '--trainsize', 480,
                      '--wds_testdir', tmp_path / 'test' / 'cifar-test-{000000..000003}.tar',
                      '--testsize', 200, '--fail_on_bad_data', '--num_workers', 0, '--num_steps', 1,
                      '--batch_size', 16, '--test_set_batch_size', 200, '--num_cores', 1,
                      timeout=300)
  assert_one_error(result, 2, r'shard \S+cifar-test-000001\.tar cannot be read to the end \(it '
                   r'ends inside a tar header, after \d+ bytes: the rest of it is lost\): replace '
                   r'it, or drop --fail_on_bad_data')
  assert ONE_PROCESS.search(result.stdout), \
      result.stdout


def adapt_parse():
  """The parse of docs/adapt.md's example (labels in a json file), as a copier puts it in the
  script."""
  page = (REPO / 'docs' / 'adapt.md').read_text()
  block = re.search(r'^ *```python\n( *def parse\(.*?)^ *```', page, re.M | re.S)[1]
  namespace = dict(vars(wds_cifar), json=json)
  exec(textwrap.dedent(block), namespace)
  return namespace['parse']


def careless_parse(sample, num_classes):
  """A copier's parse that does not say what is wrong with a sample."""
  return 'jpg', sample['jpg'], json.loads(sample['json'])['label']


def json_shard(path, labels):
  """A shard of samples a, b, ... of a 4x4 JPEG and a json file of each of labels."""
  jpeg = io.BytesIO()
  PIL.Image.new('RGB', (4, 4)).save(jpeg, 'JPEG')
  return write_tar(path, [member for key, label in zip('abcdefgh', labels) for member in
                          ((f'{key}.jpg', jpeg.getvalue()), (f'{key}.json', label.encode()))])


def test_a_copiers_parse_skips_the_sample_it_refuses_and_raises_its_own_bugs(tmp_path):
  # Labels in a json file, sample b's broken. docs/adapt.md's parse refuses b (BadSample):
  # b alone is skipped, c and d are read, the warning names b.
  shard = json_shard(tmp_path / 'j.tar', ['{"label": 1}', '{"label": 2', '{"label": 3}', '{"label": 0}'])
  skipped = []
  read = list(wds_cifar.read_samples([shard], adapt_parse(), 4, skipped.append, 20))
  assert [label for *_, label in read] == [1, 3, 0]
  assert [str(e) for e in skipped] == [
      f'sample b of {shard} has no label in its json file (JSONDecodeError: Expecting \',\' '
      'delimiter: line 1 column 12 (char 11))']
  with pytest.raises(utils.BadDataError, match=rf'^sample b of {re.escape(shard)} has no label .*: '
                     'replace it, or drop --fail_on_bad_data to skip it$'):
    list(wds_cifar.read_samples([shard], adapt_parse(), 4, wds_cifar.BadData(strict=True), 20))
  # A parse that lets the json's error out, or reads a label that is not there: its bug, raised
  # as it is at sample b, from its own line; no shard blamed, nothing skipped.
  no_label = json_shard(tmp_path / 'k.tar', ['{"label": 1}', '{"class": 2}', '{"label": 3}'])
  for shard, error in ((shard, json.JSONDecodeError), (no_label, KeyError)):
    skipped, read = [], []
    with pytest.raises(error) as raised:
      for sample in wds_cifar.read_samples([shard], careless_parse, 4, skipped.append, 20):
        read.append(sample)
    assert [label for *_, label in read] == [1] and skipped == []
    ours = [entry for entry in raised.traceback if entry.path == pathlib.Path(__file__)]
    assert ours[-1].name == 'careless_parse', raised.traceback


def test_shard_cut_between_a_samples_files_is_one_bad_shard(shards, tmp_path, capsys):
  # Cut where a sample's cls header would start: its image arrives alone, then the tar ends.
  # One cut, one count, said as a cut (not as a sample of unknown keys).
  source = shards / 'shards' / 'cifar-test-000001.tar'
  with tarfile.open(source) as tar:
    cls_headers = [m.offset for m in tar.getmembers() if m.name.endswith('.cls')]
  cut = cls_headers[seeded_random().randrange(1, len(cls_headers))]
  (tmp_path / 'cut.tar').write_bytes(source.read_bytes()[:cut])
  counter = train_wds_cifar.BadData(strict=False)
  read = list(samples_of([str(tmp_path / 'cut.tar')], counter, 10))
  assert counter.count == 1 and len(read) == cls_headers.index(cut), len(read)
  err = capsys.readouterr().err
  assert re.fullmatch(r'warning: shard \S*cut\.tar cannot be read to the end \(it ends inside a '
                      rf'tar header, after {cut} bytes: the rest of it is lost\); skipped\n', err), err


def write_tar(path, members):
  with tarfile.open(path, 'w') as tar:
    for name, data in members:
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))
  return str(path)


def test_a_file_over_what_a_sample_may_hold_is_refused_from_its_header(tmp_path, monkeypatch):
  # A .tar.gz of a few KB whose one file is far larger (zeros): refused before it is read. The
  # limit follows PIL's pixel limit (4 bytes a pixel): lowered here, so that 100 KB is over it.
  monkeypatch.setattr(PIL.Image, 'MAX_IMAGE_PIXELS', 10_000)
  path = tmp_path / 'zeros.tar.gz'
  with tarfile.open(path, 'w:gz') as tar:
    for name, data in [('a.rgb', bytes(3072)), ('a.cls', b'1'), ('b.rgb', bytes(100_000)),
                       ('b.cls', b'2'), ('c.rgb', bytes(3072)), ('c.cls', b'3')]:
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))
  assert path.stat().st_size < 2000
  skipped = []
  read = list(samples_of([str(path)], skipped.append, 10))
  assert read == []  # (Sample a, whole only once the next one starts, goes with the shard.)
  assert [str(e) for e in skipped] == [
      f'shard {path} cannot be read to the end (ReadError: a file of 100,000 bytes @ byte 4608, '
      "over the 40,000 that a sample's file may hold (4 bytes a pixel at PIL's "
      'Image.MAX_IMAGE_PIXELS))']


def test_sample_without_label_is_skipped(tmp_path):
  path = write_tar(tmp_path / 'odd.tar', [('a.rgb', bytes(3072)), ('a.cls', b'1'),
                                          ('b.rgb', bytes(3072)), ('c.rgb', bytes(5)),
                                          ('c.cls', b'2')])
  counter = train_wds_cifar.BadData(strict=False)
  read = list(samples_of([path], counter, 10))
  assert [label for *_, label in read] == [1] and counter.count == 2


def test_images_over_the_pixel_limit_are_bad_samples_read_from_their_headers(tmp_path, capfd):
  # Each would take 300 MB to 2.7 GB decoded; its header alone refuses it, as any bad sample:
  # a warning and skipped, or one line with --fail_on_bad_data.
  good = io.BytesIO()
  PIL.Image.new('RGB', (32, 32), (30, 200, 30)).save(good, format='PNG')
  members = [('0.png', good.getvalue()), ('0.cls', b'1')]
  for i, (kind, side) in enumerate([('PNG', 10000), ('PNG', 30000), ('JPEG', 30000)], 1):
    members += [(f'{i}.{kind.lower()}', oversized_image(kind, side)), (f'{i}.cls', b'2')]
  members += [('4.jpg', crafted_jpeg()), ('4.cls', b'2')]  # A small frame hidden before its own.
  bad = write_tar(tmp_path / 'big.tar', members + [('5.png', good.getvalue()), ('5.cls', b'3')])
  cfg = SimpleNamespace(img_dim=32, num_classes=10, test_set_batch_size=2, fail_on_bad_data=False,
                        num_workers=0, read_timeout=20, testsize=6)
  batches = list(wds_cifar.TestShards([bad], 0, 1, cfg))
  assert [labels.tolist() for _, labels in batches] == [[1, 3]]
  warnings = capfd.readouterr().err.splitlines()
  assert [re.sub(r'^warning: sample (\d) of \S+big\.tar has no readable (\w+) image \((.{24}).*',
                 r'\1 \2 \3', line) for line in warnings] == [
      '1 png 10000x10000 pixels, over', '2 png 30000x30000 pixels, over',
      '3 jpeg 30000x30000 pixels, over', '4 jpg 30000x30000 pixels, over'], warnings
  with pytest.raises(utils.BadDataError, match=r'sample 1 of \S+big\.tar has no readable png image '
                     r'\(10000x10000 pixels, over the limit of 89,478,485 .*--fail_on_bad_data'):
    list(wds_cifar.TestShards([bad], 0, 1, SimpleNamespace(**{**vars(cfg), 'fail_on_bad_data': True})))


def test_bad_sample_warnings_stop_after_a_few_and_the_count_goes_on(tmp_path, capfd):
  bad = write_tar(tmp_path / 'bad.tar', [(f'{i:04d}.{key}', data) for i in range(40)
                                         for key, data in [('png', b'not a png'), ('cls', b'1')]])
  # Two loader workers of a replica count in one shared tensor, one slot each.
  dataset = wds_cifar.TestShards([bad, bad], 0, 1, SimpleNamespace(
      img_dim=32, num_classes=10, test_set_batch_size=8, fail_on_bad_data=False, num_workers=2,
      read_timeout=20, testsize=80))
  assert list(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)) == []
  assert dataset.counts.tolist() == [40, 40]
  warnings = capfd.readouterr().err.splitlines()
  # The workers' first few, together (each reads the count of both: a race may skip one).
  assert 1 <= len(warnings) <= train_wds_cifar.BadData.SHOWN == 5, warnings
  assert all(re.match(r'warning: sample \d{4} of \S+bad\.tar has no readable png image \(not an '
                      r'image file\); skipped', line) for line in warnings), warnings
  # Alone, a worker says exactly the first five, the last saying that more are counted.
  dataset.counts.zero_()
  assert list(dataset) == [] and dataset.counts.tolist() == [40, 0]  # The same shard twice: once.
  warnings = capfd.readouterr().err.splitlines()
  assert len(warnings) == 5
  assert warnings[-1].endswith('skipped (more are counted, not shown: see the count at the end)')


def test_an_image_that_cannot_be_read_gives_its_place_to_another_of_its_batch(tmp_path, capsys):
  # A sample is left out only after its batch is made, from undecoded samples: a resumed run,
  # which does not decode what it skips, makes the very same batches.
  rng = np.random.default_rng(seeded_random().randrange(2**32))
  images = rng.integers(0, 256, (16, 32, 32, 3), dtype=np.uint8)
  members = []
  for i, image in enumerate(images):
    data = encoded(image, 'PNG')
    members += [(f'{i:04d}.png', data[:60] if i in (3, 9) else data), (f'{i:04d}.cls', b'%d' % i)]
  dataset = train_shards([write_tar(tmp_path / 'some-bad.tar', members)], 0, 1, 2, batch_size=8,
                         shuffle_buffer=1, num_workers=0, fail_on_bad_data=False, num_classes=16,
                         trainsize=16)
  dataset.set_epoch(1)
  batches = take_batches(dataset, 0, 2)
  labels = torch.cat([labels for _, labels in batches]).tolist()
  assert sorted(set(labels)) == sorted(set(range(16)) - {3, 9}) and len(labels) == 16
  assert labels[3] == 4 and labels[9] == 10, labels  # The next readable one's.
  for images_, labels_ in batches:
    for view, label in zip(images_, labels_):  # Each a crop of its own image, flipped or not.
      source = torch.from_numpy(np.pad(images[label], ((4, 4), (4, 4), (0, 0)))).permute(2, 0, 1)
      windows = source.unfold(1, 32, 1).unfold(2, 32, 1)
      assert any(torch.equal(windows[:, r, c], view) or
                 torch.equal(windows[:, r, c].flip(-1), view)
                 for r in range(9) for c in range(9)), label
  assert dataset.read_counts() == [2, 0, 0]
  err = capsys.readouterr().err
  assert len(re.findall(r'^warning: sample 000[39] of \S+some-bad\.tar has no readable png image', err,
                        re.M)) == 2, err


def encoded(image, image_format, **options):
  with io.BytesIO() as f:
    PIL.Image.fromarray(image).save(f, format=image_format, **options)
    return f.getvalue()


def test_reads_every_image_format_of_the_tutorials_in_one_set(tmp_path):
  rng = np.random.default_rng(seeded_random().randrange(2**32))
  images = rng.integers(0, 256, (9, 32, 32, 3), dtype=np.uint8)
  images[[2, 6]] = np.kron(images[[2, 6], :2, :2], np.ones((1, 16, 16, 1), np.uint8))  # Smooth.
  gray = rng.integers(0, 256, (32, 32), dtype=np.uint8)
  rgba = rng.integers(0, 256, (32, 32, 4), dtype=np.uint8)
  # Written by webdataset's own TarWriter from PIL images and arrays, as people write sets.
  samples = [{'ppm': PIL.Image.fromarray(images[0])}, {'png': PIL.Image.fromarray(images[1])},
             {'jpg': PIL.Image.fromarray(images[2])}, {'npy': images[3]},
             {'rgb': images[4].tobytes()}, {'webp': encoded(images[5], 'WEBP', lossless=True)},
             {'jpeg': encoded(images[6], 'JPEG', quality=95)},
             {'ppm': encoded(images[7], 'PPM').replace(b'P6\n', b'P6\n# a comment\n')},
             {'png': encoded(images[8], 'PNG')}, {'png': encoded(gray, 'PNG')},
             {'png': encoded(rgba, 'PNG')}]
  with wds.TarWriter(str(tmp_path / 'mixed.tar')) as sink:
    for i, sample in enumerate(samples):
      sink.write({'__key__': f'{i:06d}', **sample, 'cls': i})
  read = decoded([str(tmp_path / 'mixed.tar')], num_classes=len(samples))
  assert [label for _, label in read] == list(range(len(samples)))
  expected = [*images, np.repeat(gray[:, :, None], 3, 2), rgba[:, :, :3]]
  for i, ((image, _), source) in enumerate(zip(read, expected, strict=True)):
    assert image.shape == (32, 32, 3) and image.dtype == np.uint8
    if i in (2, 6):  # JPEG: lossy, within its usual error.
      assert np.abs(image.astype(int) - source).mean() < 8, i
    else:
      assert np.array_equal(image, source), i


class QuietHandler(http.server.SimpleHTTPRequestHandler):
  requests = []  # 'GET /path' of each request, in turn

  def log_message(self, *args):
    pass

  def send_head(self):
    self.requests.append(f'{self.command} {self.path}')
    return super().send_head()


class QuietServer(http.server.ThreadingHTTPServer):

  def handle_error(self, request, client_address):
    pass  # A reader that stops early closes its connection mid-file: not an error here.


@pytest.fixture
def http_shards(shards):
  server = QuietServer(
      ('127.0.0.1', 0), functools.partial(QuietHandler, directory=str(shards / 'shards')))
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield f'http://127.0.0.1:{server.server_port}'
  server.shutdown()


def test_reads_shards_from_a_pipe_command(shards):
  test = sorted((shards / 'shards').glob('cifar-test-*.tar'))
  piped = decoded([f'pipe:cat {p}' for p in test])
  local = decoded([str(p) for p in test])
  assert len(piped) == 200
  assert all((a == b).all() and l == m for (a, l), (b, m) in zip(local, piped, strict=True))


def test_reads_shards_over_http(http_shards, shards):
  urls = list(braceexpand.braceexpand(http_shards + '/cifar-test-{000000..000003}.tar'))
  assert not any(map(supervisor.shard_missing, urls))
  # The start check reads a shard's first samples as training reads it: one GET.
  before = len(QuietHandler.requests)
  supervisor.check_format('wds_testdir', urls[0],
                          lambda urls, on_bad: samples_of(urls, on_bad, 10))
  assert QuietHandler.requests[before:] == ['GET /cifar-test-000000.tar']
  assert supervisor.shard_missing(http_shards + '/nope.tar')  # 404: missing, not unreachable.
  local = decoded([str(p) for p in sorted((shards / 'shards').glob('cifar-test-*.tar'))])
  remote = decoded(urls)
  assert len(remote) == 200
  assert all((a == b).all() and l == m for (a, l), (b, m) in zip(local, remote, strict=True))


class StatusHandler(QuietHandler):
  """Answers /CODE/... with that HTTP status: a server that fails (5xx) or refuses (403)."""

  def send_head(self):
    self.send_error(int(self.path.split('/')[1]))


def test_a_server_that_fails_or_forbids_is_said_so_at_start_and_mid_run(capsys, monkeypatch):
  server = QuietServer(('127.0.0.1', 0), StatusHandler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  url = f'http://127.0.0.1:{server.server_port}'
  # At start: not "no shard found", nor "do not exist".
  with pytest.raises(utils.UsageError, match=rf'^{url}/500/s-000\.tar: the server failed \(HTTP '
                     r'500 Internal Server Error\); check that it is up, then run again$'):
    supervisor.check_shards('wds_traindir', f'{url}/500/s-{{000..009}}.tar', strict=False)
  with pytest.raises(utils.UsageError, match=rf'^{url}/403/s-000\.tar: HTTP 403 Forbidden: check '
                     r'the URL and that this host may read it \(credentials, permissions\)$'):
    supervisor.check_shards('wds_testdir', f'{url}/403/s-{{000..009}}.tar', strict=False)
  # Mid-run: a shard refused is a bad shard, said in one short line (no request headers).
  skipped = []
  assert not list(samples_of([f'{url}/403/s-000.tar'], skipped.append, 10))
  assert [str(e) for e in skipped] == [f'shard {url}/403/s-000.tar cannot be read: HTTP 403 '
                                       'Forbidden']
  # A long check says how far it is (here at every shard).
  monkeypatch.setattr(supervisor, 'PROGRESS_SECONDS', 0)
  capsys.readouterr()
  with pytest.raises(utils.UsageError, match='no shard found'):
    supervisor.check_shards('wds_traindir', f'{url}/404/s-{{000..001}}.tar', strict=False)
  assert re.findall(r'^Checking --wds_traindir: (\d) of 2 shards \(\d missing\) \.\.\.$',
                    capsys.readouterr().out, re.M) == ['1']
  server.shutdown()


class DroppingHandler(QuietHandler):
  """Sends the first 40 KB of each file's first request, then drops the connection (a reset
  or a proxy that gives up), and whole files after that."""
  dropped = set()

  def copyfile(self, source, outputfile):
    if self.path in self.dropped:
      return super().copyfile(source, outputfile)
    self.dropped.add(self.path)
    outputfile.write(source.read(40_000))
    self.close_connection = True
    self.connection.shutdown(socket.SHUT_RDWR)


def test_a_read_whose_connection_drops_goes_on_where_it_stopped(shards, capsys):
  server = QuietServer(('127.0.0.1', 0), functools.partial(DroppingHandler,
                                                          directory=str(shards / 'shards')))
  threading.Thread(target=server.serve_forever, daemon=True).start()
  names = [f'cifar-test-{i:06d}.tar' for i in range(4)]
  remote = decoded([f'http://127.0.0.1:{server.server_port}/{name}' for name in names])
  server.shutdown()
  local = decoded([str(shards / 'shards' / name) for name in names])
  assert len(DroppingHandler.dropped) == 4 and len(remote) == 200
  assert all((a == b).all() and l == m for (a, l), (b, m) in zip(local, remote, strict=True))
  assert capsys.readouterr().err == ''


class TricklingHandler(QuietHandler):
  """Answers at once, then sends each file a byte every 0.2 s: a half-dead link that never
  goes quiet for as long as a stall limit."""

  def copyfile(self, source, outputfile):
    while byte := source.read(1):
      outputfile.write(byte)
      outputfile.flush()
      time.sleep(0.2)


def test_a_server_that_trickles_fails_each_piece_at_its_deadline(shards):
  # Each MiB must come within --read_timeout (here 0.5 s): at a byte every 0.2 s no read ever
  # waits that long for a byte, and the shard would take 30 hours. 3 tries a shard, 2 shards.
  server = QuietServer(('127.0.0.1', 0), functools.partial(TricklingHandler,
                                                          directory=str(shards / 'shards')))
  threading.Thread(target=server.serve_forever, daemon=True).start()
  urls = [f'http://127.0.0.1:{server.server_port}/cifar-test-{i:06d}.tar' for i in range(2)]
  skipped = []
  with pytest.raises(utils.BadDataError) as failed:
    list(samples_of(urls, skipped.append, 10, read_timeout=0.5))
  server.shutdown()
  assert [str(e) for e in skipped] == [f'shard {urls[0]} cannot be read: less than 4 MiB in 0.5 '
                                       's (3 tries)']
  assert re.fullmatch(rf'127\.0\.0\.1:{server.server_port} failed: less than 4 MiB in 0\.5 s, 3 '
                      rf'tries each, for shard {urls[0]} and then {urls[1]}; check that it is up '
                      r'.*', str(failed.value)), failed.value


def test_a_bucket_that_trickles_is_named_by_its_host_and_tried_by_gcsfs_alone(bucket, monkeypatch):
  # Cloud Storage's emulator behind a link that trickles: each request (a MiB, or a file's
  # size) has --read_timeout (0.5 s), which gcsfs does not try again: the script tries it 3
  # times.
  # The line names the server, not the bucket.
  link = SlowLink(int(bucket['STORAGE_EMULATOR_HOST'].rsplit(':', 1)[1]))
  for name, value in {**bucket, 'STORAGE_EMULATOR_HOST': f'http://127.0.0.1:{link.port}'}.items():
    monkeypatch.setenv(name, value)
  fsspec.filesystem('gs').clear_instance_cache()
  fs = fsspec.filesystem('gs', skip_instance_cache=True)
  urls = ['gs://data/shards/a.tar', 'gs://data/shards/b.tar']
  for url in urls:
    fs.pipe(url[5:], b'\0' * 20480)
  link.trickle = True
  skipped = []
  with pytest.raises(utils.BadDataError) as failed:
    list(samples_of(urls, skipped.append, 10, read_timeout=0.5))
  assert [str(e) for e in skipped] == [f'shard {urls[0]} cannot be read: less than 4 MiB in 0.5 '
                                       's (3 tries)']
  fsspec.filesystem('gs').clear_instance_cache()
  assert re.fullmatch(rf'127\.0\.0\.1:{link.port} failed: less than 4 MiB in 0\.5 s, 3 tries '
                      rf'each, for shard {urls[0]} and then {urls[1]}; .*', str(failed.value)), (
                          failed.value)


@contextlib.contextmanager
def server_process(folder):
  """python -m http.server serving folder on 127.0.0.1, in a session of its own: a process
  that SIGSTOP halts as a server that hangs. Yields (process, URL)."""
  server = subprocess.Popen([sys.executable, '-u', '-m', 'http.server', '--bind', '127.0.0.1',
                             '0', '--directory', str(folder)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
  try:
    yield server, 'http://127.0.0.1:' + re.search(r' port (\d+) ', server.stdout.readline())[1]
  finally:
    server.kill()
    server.wait()


STALL_ERROR = (r'^error: (replica 0: )?127\.0\.0\.1:\d+ failed: less than 4 MiB in 2 s, 3 tries '
               r'each, for shard {url}/cifar-{split}-\d+\.tar and then {url}/cifar-{split}-\d+\.tar; '
               r'check that it is up and that this host \(.+\) reaches it, then run the same '
               r'command again \(with --ckpt_dir it resumes from the last checkpoint\)$')
LOOK_AHEAD = ['--prefetch_factor', 1, '--loader_prefetch_size', 1, '--device_prefetch_size', 1]


def test_a_server_that_stops_answering_mid_epoch_ends_the_run_in_one_line(shards):
  # The server halts (SIGSTOP) once a step is done: no worker can have read more than about
  # 130 of its 240 samples (the loaders hold a few batches ahead). Each read waits
  # --read_timeout 2 s and is tried 3 times; after two shards in a row the run ends: one line
  # naming the server, the last, exit 2, nothing left running. (Its evaluation: below.)
  with server_process(shards / 'shards') as (server, url):
    process = start_script(
        'train_wds_cifar.py', '--wds_traindir', f'{url}/cifar-train-{{000000..000009}}.tar',
        '--trainsize', 480, '--wds_testdir', shards / 'shards' / 'cifar-test-{000000..000003}.tar',
        '--batch_size', 16, '--num_workers', 2, '--shuffle_buffer', 16, *LOOK_AHEAD,
        '--log_steps', 1, '--num_epochs', 1, '--read_timeout', 2)
    read = wait_for(process, r'^\| Training .* Step=0 ')
    os.kill(server.pid, signal.SIGSTOP)
    code, output = finish(process)
  assert_one_error((code, read + output), 2, STALL_ERROR.format(url=url, split='train'))
  assert output.splitlines()[-1].startswith('error: '), output
  assert_nothing_left(session=process.pid)


@pytest.fixture(scope='module')
def photo_shards(tmp_path_factory):
  """The image-folder tests' colour folder (4 classes, 64 training and 5 val images each, PNG
  and JPEG, a red one among the green val ones) and a broken JPEG (its first bytes, then
  noise: an image file that is not one), written as shards that keep the files as they are,
  16 a shard, as for ImageNet. Returns the shard folder and train_wds_cifar.py's data flags."""
  root = tmp_path_factory.mktemp('photos')
  make_image_folder(root / 'data', 'train', 64, seed=1)
  make_image_folder(root / 'data', 'val', 5, seed=2)
  write_image(root / 'data' / 'val' / 'green' / 'red_one.png', COLOURS['red'], 32,
              np.random.default_rng(3))
  (root / 'data' / 'train' / 'blue' / 'broken.jpg').write_bytes(
      b'\xff\xd8\xff' + np.random.default_rng(4).bytes(3000))
  result = run_script('make_cifar_shards.py', '--image_folder', root / 'data', '--output',
                      root / 'shards' / 'photos', '--samples_per_shard', 16, '--results_json',
                      root / 'flags.json')
  assert result.returncode == 0, both(result)
  return root / 'shards', read_json(root / 'flags.json')


def served(folder):
  """A server of the folder's files on 127.0.0.1, in a thread: its URL."""
  server = QuietServer(('127.0.0.1', 0), functools.partial(QuietHandler, directory=str(folder)))
  threading.Thread(target=server.serve_forever, daemon=True).start()
  return server, f'http://127.0.0.1:{server.server_port}'


def test_photos_as_jpeg_shards_over_http_learn_as_their_folders_do(photo_shards, tmp_path):
  # As the image-folder scripts learn the same folder (tests/test_single_core.py): 20 of 21 (the
  # red one among the green cannot be right), with their crops and model, at 40 px; and as
  # train_single_core.py does, in one process (--num_cores 1: no replica to start, its loader
  # workers forked). Replicas with spawned workers read these shards in
  # test_stopped_run_ends_bitwise_equal, and shards over http in
  # test_a_server_that_stops_answering_mid_epoch_ends_the_run_in_one_line. Two epochs: it has
  # 20 of 21 after the first already, and the second counts the bad sample again and shows that
  # nothing new is compiled (a third was 16 more steps, a minute of CPU, for no other check).
  folder, data = photo_shards
  server, url = served(folder)
  urls = {flag: data[flag].replace(str(folder), url) for flag in ('wds_traindir', 'wds_testdir')}
  assert urls['wds_traindir'] == url + '/photos-train-{000000..000016}.tar', data
  result = run_script(
      'train_wds_cifar.py', '--wds_traindir', urls['wds_traindir'], '--trainsize',
      data['trainsize'], '--wds_testdir', urls['wds_testdir'], '--testsize', data['testsize'],
      '--img_dim', 40, '--batch_size', 16, '--test_set_batch_size', 4, '--num_epochs', 2,
      '--lr', 0.005, '--num_workers', 2, '--shuffle_buffer', 64, '--log_steps', 8,
      '--num_cores', 1, '--results_json', tmp_path / 'r.json')
  server.shutdown()
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert ONE_PROCESS.search(result.stdout), \
      result.stdout
  assert re.search(r'^Data: 257 training samples in 17 shards and 21 evaluation samples in 2, at '
                   r'3x40x40 uint8, 4 classes \(the classes file beside the training shards\)\n'
                   r'Model: resnet18 \(ResNet, 11\.18M parameters, 4 classes\)\n'
                   r'Recipe: SGD, lr 0\.005 constant, momentum 0\.9, weight decay 0\.0001 \(--lr as '
                   r'given, --lr_scheduler_type and --weight_decay from the ImageNet recipe, the '
                   r"rest the flags' defaults\); float32 mat-mul precision default$", result.stdout,
                   re.M), result.stdout[:2000]
  results = read_json(tmp_path / 'r.json')
  assert (results['eval_correct'], results['eval_samples']) == (20, 21), result.stdout
  assert results['train_steps'] == 2 * 16
  assert results['compilations_after_epoch'][0] == results['compilations_after_epoch'][-1]
  # The broken JPEG: a line when it is first met, counted each epoch; its batch ran whole.
  assert re.findall(r'^warning: sample \d+ of \S+photos-train-\d+\.tar has no readable jpg image '
                    r'\(.*\); skipped$', result.stderr, re.M), result.stderr
  assert re.findall(r'^Epoch (\d) Replica 0: skipped 1 bad shards or samples$', result.stdout,
                    re.M) == ['1', '2'], result.stdout
  assert results['skipped_bad_data'] == 2


def test_trains_on_the_tutorials_shards_over_http_to_high_accuracy(http_shards, tutorial_shards,
                                                                    tmp_path):
  result = run_script(
      'train_wds_cifar.py', '--wds_traindir',
      http_shards + '/tutorial/train/cifar-train-{000000..000009}.tar', '--trainsize', 480,
      '--wds_testdir', http_shards + '/tutorial/val/cifar-val-{000000..000003}.tar',
      '--testsize', 200, '--batch_size', 16, '--test_set_batch_size', 64, '--num_epochs', 1,
      '--lr', 0.01, '--num_workers', 2, '--shuffle_buffer', 100, '--log_steps', 10,
      '--ckpt_dir', tmp_path / 'ckpt', '--results_json', tmp_path / 'r.json', '--num_cores', 1)
  assert result.returncode == 0, both(result)
  # In one process (--num_cores 1): the reading, the bad samples and the accuracy are the
  # replica's code; a spawned replica's workers read over HTTP in
  # test_a_server_that_stops_answering_mid_epoch_ends_the_run_in_one_line.
  assert ONE_PROCESS.search(result.stdout)
  # What it trains on, said first, as the image-folder scripts say it: 10 classes by default,
  # where the colours are 4.
  assert re.search(r'^Data: 480 training samples in 10 shards and 200 evaluation samples in 4, '
                   r"at 3x32x32 uint8, 10 classes \(CIFAR-10's; give --num_classes for other "
                   r'shards; the labels seen are 0 to 3, in the first 16 training and 16 '
                   r'evaluation samples\)\n'
                   r'Model: resnet18 ', result.stdout, re.M), \
      result.stdout[:1000]
  results = read_json(tmp_path / 'r.json')
  assert results['max_accuracy'] >= 90, result.stdout
  assert results['eval_samples'] == 200  # 200 test samples in batches of 64: padded, counted once.
  assert results['train_steps'] == 30
  assert re.findall(r'Replica Train Samples=(\d+)', result.stdout) == ['480']
  # 30 corrupt samples in the 480 (some read twice to fill the epoch: a worker's shards
  # hold 230, the other's 250, for 240 each): a few warnings, then the count. (What is
  # compiled after epoch 1, and the photos' path, are in the test above.)
  skipped = re.findall(r'^Epoch 1 Replica 0: skipped (\d+) bad shards or samples$', result.stdout,
                       re.M)
  assert len(skipped) == 1 and 25 <= int(skipped[0]) <= 30, result.stdout
  assert results['skipped_bad_data'] == int(skipped[0])
  warnings = re.findall(r'^warning: sample \d{7} of \S+ has no readable ppm image', result.stderr, re.M)
  assert 1 <= len(warnings) <= train_wds_cifar.BadData.SHOWN, result.stderr
  assert re.search(r'^Epoch 1 train end .*, Reduced GlobalRate=\d+\.\d\d$', result.stdout, re.M)
  assert re.search(r'^Total train time: [\d.]+ s$', result.stdout, re.M)
  assert re.search(r'^Saved checkpoint \S+ckpt-00000030\.pt$', result.stdout, re.M)
  best = torch.load(tmp_path / 'ckpt' / 'best.pt', weights_only=True)
  assert best['results']['final_accuracy'] == results['max_accuracy']


class EndlessHandler(QuietHandler):
  """Answers /endless-test-000000.tar with CIFAR samples without end, as fast as they are read."""

  def send_head(self):
    if self.path != '/endless-test-000000.tar':
      return super().send_head()
    self.send_response(200)  # No length: the answer ends when the connection does.
    self.end_headers()
    return io.BytesIO()

  def copyfile(self, source, outputfile):
    if self.path != '/endless-test-000000.tar':
      return super().copyfile(source, outputfile)
    for key in itertools.count():
      for name, data in ((f'{key:08d}.rgb', bytes(3072)), (f'{key:08d}.cls', b'1')):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        outputfile.write(info.tobuf(tarfile.USTAR_FORMAT) + data + bytes(-len(data) % 512))


def test_a_test_shard_that_never_ends_is_one_line(shards, tmp_path):
  # Its samples come fast: no pace limit sees it. Twice --testsize is as far as a worker reads.
  # In one process (--num_cores 1): a replica's error reaches the launcher as one line in the
  # tests of a server that stops.
  server = QuietServer(('127.0.0.1', 0), functools.partial(EndlessHandler, directory=str(tmp_path)))
  threading.Thread(target=server.serve_forever, daemon=True).start()
  result = run_script('train_wds_cifar.py', '--wds_traindir',
                      shards / 'shards' / 'cifar-train-{000000..000009}.tar', '--trainsize', 16,
                      '--wds_testdir', f'http://127.0.0.1:{server.server_port}/endless-test-000000.tar',
                      '--testsize', 12, '--num_workers', 0, '--batch_size', 16, '--num_epochs', 1,
                      '--img_dim', 8, '--num_cores', 1, timeout=300)
  server.shutdown()
  assert_one_error(result, 2, r'^error: the test shards gave a loader worker over 24 samples, '
                   r'twice --testsize \(the last: sample 00000024 of http://\S+/endless-test-'
                   r'000000\.tar\): a shard that does not end, or give the right --testsize; check '
                   r'the shards and their server$')
  assert ONE_PROCESS.search(result.stdout), \
      result.stdout


def test_a_stalled_evaluation_then_a_resume_on_other_shards_are_each_one_line(shards, tmp_path):
  # 1. The test shards' server halts (SIGSTOP) once the start checks have read them: the
  #    evaluation after 4 steps ends the run (one line, exit 2, nothing left), and the
  #    checkpoint of step 2 is the last one kept.
  # 2. The same shards of 4 classes given --num_classes 10, resumed from it with a --trainsize
  #    of one step, evaluated on a file that is not a tar: a line for the classes, the
  #    changed --trainsize, the epoch left with no step and the evaluation that read nothing.
  # Both in one process (--num_cores 1): what they say does not depend on a replica to start.
  # A spawned replica's stalled server is the mid-epoch stall test's
  # (test_a_server_that_stops_answering_mid_epoch_ends_the_run_in_one_line), and a launcher's
  # checkpoint resumed by one process is test_stopped_run_ends_bitwise_equal's.
  (tmp_path / 'bad-test-000000.tar').write_bytes(np.random.default_rng(0).bytes(4096))
  args = ['--wds_traindir', shards / 'shards' / 'cifar-train-{000000..000009}.tar',
          '--num_classes', 10, '--batch_size', 16, '--num_steps', 4, '--num_epochs', 1,
          '--num_workers', 2, '--log_steps', 1, '--ckpt_every_steps', 2, '--ckpt_dir',
          tmp_path / 'ckpt', '--read_timeout', 2, *LOOK_AHEAD]
  with server_process(shards / 'shards') as (server, url):
    process = start_script('train_wds_cifar.py', *args, '--trainsize', 480, '--wds_testdir',
                           f'{url}/cifar-test-{{000000..000003}}.tar', '--num_cores', 1)
    read = wait_for(process, '^Starting ')
    os.kill(server.pid, signal.SIGSTOP)
    code, output = finish(process)
  assert_one_error((code, read + output), 2, STALL_ERROR.format(url=url, split='test'))
  assert output.splitlines()[-1].startswith('error: '), output
  assert_nothing_left(session=process.pid)
  assert sorted(os.listdir(tmp_path / 'ckpt')) == ['.lock', 'ckpt-00000002.pt']
  run = run_script('train_wds_cifar.py', *args, '--trainsize', 16, '--wds_testdir',
                   tmp_path / 'bad-test-000000.tar', '--num_cores', 1, timeout=300)
  assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
  assert ONE_PROCESS.search(run.stdout), \
      run.stdout
  for said in (read, run.stderr):
    assert re.search(r'^warning: --num_classes 10 is more than the 4 classes of the classes file '
                     r'beside the training shards: the model gets outputs that no label asks for$',
                     said, re.M), said
  assert re.search(r'^warning: --trainsize is 16 now, 480 in the run of \S+ckpt-00000002\.pt: '
                   r'epoch 1 goes on from step 2 with other batches than that run would have '
                   r'trained \(give its value to train as it would\)$', run.stderr, re.M)
  assert re.search(r'^warning: the run resumed after step 2 of an epoch that has 1 step now: it '
                   r'trains none of them; the epoch ends here$', run.stderr, re.M), run.stderr
  assert 'Replica Train Samples=0 ' in run.stdout and not training_losses(run.stdout)
  assert re.search(r'^warning: shard \S+bad-test-000000\.tar cannot be read to the end',
                   run.stderr, re.M), run.stderr
  assert re.search(r'^Epoch 1 test end \S+, no test sample was read \(see the warnings above\): '
                   r'no accuracy$', run.stdout, re.M), run.stdout


BAD_INPUTS = {
    'no shard matches': (lambda s: ['--wds_traindir', s / 'nowhere-{000..009}.tar'],
                         r'--wds_traindir: no shard found at \S+nowhere-\{000\.\.009\}\.tar'),
    # 10 of 100 exist: the check stops once more than a tenth are missing.
    'a range mostly missing': (
        lambda s: ['--wds_traindir', s / 'shards' / 'cifar-train-{000000..000099}.tar'],
        r'^error: --wds_traindir: 11 shards do not exist among the first 21 of 100 \(e\.g\. '
        r'\S+cifar-train-000010\.tar\): check the \{first\.\.last\} range of \S+$'),
    'read_timeout nan': (lambda s: ['--read_timeout', 'nan'],
                         r'^error: --read_timeout nan: give a finite number that float32 holds '
                         r'\(at most 3\.4e\+38; see --helpshort\)$'),
    'too few shards for the workers': (
        lambda s: ['--wds_traindir', s / 'shards' / 'cifar-train-000000.tar', '--num_workers', 2,
                   '--num_cores', 1],  # The replica's check: in the command's process.
        r'1 training shard cannot feed 1 replica x 2 loader workers'),
    'not a resnet': (lambda s: ['--model', 'vgg11'], r'--model vgg11 is not a torchvision ResNet'),
    'missing trainsize': (lambda s: ['--trainsize', None], r'--trainsize must have a value other than None'),
    'server refuses connections': (
        lambda s: ['--wds_traindir', f'http://127.0.0.1:{closed_port()}/train-{{000..009}}.tar'],
        r'cannot reach http://127\.0\.0\.1:\d+/train-000\.tar \(\w+.*\): check that the server'),
    'shards of unknown keys': (
        lambda s: ['--wds_traindir', s / 'foreign' / 'keys.tar'],
        r'--wds_traindir: sample 000000 of \S+keys\.tar holds image\.jpg, label, where an image '
        r'\(rgb, ppm, png, jpg, jpeg, webp, npy\) and a label \(cls\) are expected: write the '
        r"shards with such keys .*, or teach this script theirs: IMAGE_KEYS \(the image file's "
        r'extension\), parse \(where the label is\) and decode \(how the image reads\)$'),
    'labels past the classes': (  # Of the training shards' classes file: 4 colours.
        lambda s: ['--wds_testdir', s / 'foreign' / 'labels.tar'],
        r"^error: --wds_testdir: sample 000001 of \S+labels\.tar has label 7, past 4 classes "
        r"\(labels 0 to 3\): give --num_classes, the number of the shards' classes \(1000 for "
        r'ImageNet\)$'),
    'unwritable ckpt_dir': (  # At ImageNet's size: the recipe is said first (see below).
        lambda s: ['--ckpt_dir', s / 'shards' / 'cifar-test-000000.tar' / 'ckpt', '--img_dim',
                   224, '--model', 'resnet50'],
        r'cannot write to --ckpt_dir \S+cifar-test-000000.tar/ckpt'),
    'a flag of the image-folder scripts': (
        lambda s: ['--datadir', s], r'^error: --datadir: give the shards with --wds_traindir and '
        r'--wds_testdir \(see make_cifar_shards\.py\); --datadir belongs to the image-folder '
        r'scripts$'),
}


def test_bucket_that_does_not_answer_is_one_line_within_seconds(tmp_path):
  # gcsfs's own path to a "bucket" on this machine (STORAGE_EMULATOR_HOST): a server that
  # takes connections and never answers, as with no network; google-auth's metadata server
  # at a closed port. Nothing leaves 127.0.0.1.
  silent = socket.create_server(('127.0.0.1', 0))
  held = []
  threading.Thread(target=lambda: [held.append(silent.accept()) for _ in range(100)],
                   daemon=True).start()
  closed = f'127.0.0.1:{closed_port()}'
  env = script_env(STORAGE_EMULATOR_HOST=f'http://127.0.0.1:{silent.getsockname()[1]}',
                   GCE_METADATA_HOST=closed, GCE_METADATA_IP=closed, NO_GCE_CHECK='true',
                   GOOGLE_APPLICATION_CREDENTIALS='', CLOUDSDK_CONFIG=str(tmp_path))
  result = run_script('train_wds_cifar.py', '--wds_traindir', 'gs://bucket/train-{000..009}.tar',
                      '--trainsize', 480, '--wds_testdir', 'gs://bucket/test-{000..003}.tar',
                      '--testsize', 200, '--num_workers', 0, env=env, timeout=300)
  assert_one_error(result, 2, r'^error: gs://bucket/train-000\.tar did not answer within 20 s: '
                   r'check the network, the address and the credentials$')
  # One line said what it was waiting for; gcsfs's retries and fallbacks said nothing.
  assert result.stdout.splitlines()[-1] == 'Reaching gs://bucket (up to 20 s) ...', result.stdout
  assert len(result.stderr.splitlines()) == 1, result.stderr
  silent.close()


def test_shards_of_fewer_classes_and_no_classes_file_say_the_labels_seen(tmp_path):
  # A copier's own shards of 3 classes (no classes file beside them): a 10-class model, as
  # the Data line says, and its labels say why that is not what they want, before any training.
  for split, count in (('train', 24), ('test', 6)):
    with wds.TarWriter(str(tmp_path / f'three-{split}-000000.tar')) as sink:
      for i in range(count):
        sink.write({'__key__': f'{i:06d}', 'jpg': np.full((8, 8, 3), 80 * (i % 3), np.uint8),
                    'cls': i % 3})
  result = run_script('train_wds_cifar.py', '--wds_traindir', tmp_path / 'three-train-000000.tar',
                      '--trainsize', 24, '--wds_testdir', tmp_path / 'three-test-000000.tar',
                      '--num_workers', 1, '--results_json', tmp_path, timeout=300)
  assert_one_error(result, 2, r'^error: --results_json \S+ is a folder')  # To end it here.
  assert re.search(r'^Data: 24 training samples in 1 shard and the evaluation samples in 1, at '
                   r"3x32x32 uint8, 10 classes \(CIFAR-10's; give --num_classes for other shards; "
                   r'the labels seen are 0 to 2, in the first 16 training and 6 evaluation '
                   r'samples\)$', result.stdout,
                   re.M), result.stdout


def test_a_shard_pattern_left_unquoted_is_one_line_that_quotes_it(shards):
  # Typed into bash as a user types it: the shell expands {...} into a name per shard, and absl
  # said `unexpected arguments [...]`, or kept the last of ten --wds_traindir=... without a word.
  pattern = str(shards / 'shards' / 'cifar-train-{000000..000009}.tar')
  test = shlex.quote(str(shards / 'shards' / 'cifar-test-{000000..000003}.tar'))
  for given in (f'--wds_traindir {pattern}', f'--wds_traindir={pattern}'):
    command = (f'{shlex.quote(sys.executable)} train_wds_cifar.py {given} --trainsize 480 '
               f'--wds_testdir {test} --testsize 200')
    result = subprocess.run(['bash', '-c', command], cwd=REPO, env=script_env(),
                            capture_output=True, text=True, timeout=300)
    assert_one_error(result, 2, r'^error: --wds_traindir: the shell expanded its shard pattern '
                     r'into 10 names \(\S+/cifar-train-000000\.tar \.\.\. \S+/cifar-train-000009'
                     rf"\.tar\): quote it, as in --wds_traindir '{re.escape(pattern)}'$")
    assert not result.stdout, result.stdout  # Before any check or line of the run.


@pytest.mark.parametrize('case', BAD_INPUTS)
def test_bad_input_is_one_clear_line_and_exit_2(shards, case):
  make_args, message = BAD_INPUTS[case]
  if not (shards / 'foreign').exists():
    (shards / 'foreign').mkdir()
    with wds.TarWriter(str(shards / 'foreign' / 'keys.tar')) as sink:
      for i in range(200):
        sink.write({'__key__': f'{i:06d}', 'image.jpg': np.zeros((32, 32, 3), np.uint8), 'label': b'1'})
    with wds.TarWriter(str(shards / 'foreign' / 'labels.tar')) as sink:
      for i, label in enumerate([1, 7, 0, 517, 3]):
        sink.write({'__key__': f'{i:06d}', 'jpg': np.zeros((48, 64, 3), np.uint8), 'cls': label})
  args = {'--wds_traindir': str(shards / 'shards' / 'cifar-train-{000000..000009}.tar'),
          '--trainsize': 480, '--wds_testdir': str(shards / 'shards' / 'cifar-test-{000000..000003}.tar'),
          '--testsize': 200}
  extra = make_args(shards)
  args.update(dict(zip(extra[::2], extra[1::2])))
  flat = [str(x) for k, v in args.items() if v is not None for x in (k, v)]
  result = run_script('train_wds_cifar.py', *flat, timeout=300)
  assert_one_error(result, 2, message)
  if case == 'unwritable ckpt_dir':  # ImageNet's recipe, as train_resnet_mp.py has it.
    assert re.search(r'^Recipe: SGD, lr 0\.5 linear warm-up over 0\.9 epochs, then divided by 5 '
                     r'every 20 epochs, momentum 0\.9, weight decay 0\.0001 \(--lr, '
                     r"--lr_scheduler_type and --weight_decay from resnet50's tuned ImageNet "
                     r"recipe, the rest the flags' defaults\); float32 mat-mul precision default$",
                     result.stdout, re.M), result.stdout


def test_stopped_run_ends_bitwise_equal(photo_shards, tmp_path):
  # ImageNet's way: the files as they are, cropped and resized (to 40 px) by a seed of each.
  folder, data = photo_shards
  args = ['--wds_traindir', data['wds_traindir'], '--trainsize', data['trainsize'],
          '--wds_testdir', data['wds_testdir'], '--img_dim', 40, '--batch_size', 8,
          '--test_set_batch_size', 16, '--num_epochs', 2, '--num_steps', 5, '--num_workers', 2,
          '--shuffle_buffer', 40, '--log_steps', 1, '--lr', 0.05, '--ckpt_every_steps', 2]
  # The reference and the last resume in one process (--num_cores 1, loader workers forked):
  # a replica trains the same; the two stops below are of a spawned replica and its workers.
  reference = start_script('train_wds_cifar.py', *args, '--ckpt_dir', tmp_path / 'reference',
                           '--num_cores', 1)
  ckpt_dir = tmp_path / 'ckpt'
  # With torch_xla's compile cache (written; XLA:CPU cannot read it back): the same training.
  run = args + ['--ckpt_dir', ckpt_dir, '--compile_cache_dir', tmp_path / 'cache']
  # SIGTERM to the replica and its loader workers, each at a thread other than its main one
  # (a replica's main thread waits, blocked, for the thread that trains), as a VM shutting
  # down may deliver it, at a random step of epoch 1: the run stops, and the resumed stream
  # must skip exactly what was read before the stop. (A kill in the middle of a save is tested with
  # train_single_core.py, in tests/test_resume.py: this script saves through the same function.)
  stop_step = seeded_random().randrange(0, 4)
  code, out = run_and_signal('train_wds_cifar.py', run, stop_step, signal.SIGTERM, to='threads')
  assert code == 75, f'stopped after step {stop_step}\n{out}'
  assert re.search(r'^Stopped by SIGTERM at epoch \d step \d: saved ', out, re.M), out
  # The resumed run, SIGTERM to its session while its loader workers import (they ignore it only
  # once up): a stop as any other, saved, and the next run goes on from it.
  process = start_script('train_wds_cifar.py', *run)
  out = wait_for(process, r'^Resumed from ')
  loader_processes(process.pid, serving=False, replicas_spawned=True)
  os.killpg(process.pid, signal.SIGTERM)
  code, rest = finish(process)
  assert code == 75, out + rest
  assert re.search(r'^Stopped by SIGTERM at epoch \d step \d: saved ', rest, re.M), out + rest

  result = run_script('train_wds_cifar.py', *run, '--num_cores', 1)
  assert result.returncode == 0, result.stdout + result.stderr
  assert re.search(r'^Resumed from \S+ at epoch \d step \d$', result.stdout, re.M)
  assert ONE_PROCESS.search(result.stdout)
  code, reference_out = finish(reference)
  assert code == 0, reference_out
  resumed, uninterrupted = training_losses(result.stdout), training_losses(reference_out)
  assert resumed and all(uninterrupted[key] == loss for key, loss in resumed.items())
  assert_same_training(ckpt_dir, tmp_path / 'reference')
  assert len(list((tmp_path / 'cache' / 'process-0').iterdir())) >= 5  # A file per graph.
