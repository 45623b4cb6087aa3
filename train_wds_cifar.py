# SPDX-License-Identifier: BSD-3-Clause
"""Trains a ResNet on CIFAR-10 streamed from WebDataset tar shards, on every XLA device.

The shards (written by make_cifar_shards.py) are read from a local folder, http(s), gs://
or any fsspec URL, or a pipe: command. As in the Cloud TPU WebDataset tutorial they are
dealt out to the replicas of all hosts and to the loader workers of each replica, read
sequentially and shuffled in memory; unlike it, every replica runs the same number of
steps, the shard order changes every epoch, and every test sample is counted once.

  python make_cifar_shards.py --cifar_dir data/cifar-10-batches-py --output shards/cifar
  python train_wds_cifar.py --trainsize 50000 --testsize 10000 \
      --wds_traindir 'shards/cifar-train-{000000..000049}.tar' \
      --wds_testdir 'shards/cifar-test-{000000..000009}.tar'

With --ckpt_dir, the same command started again goes on exactly where the last one stopped
(the epoch's stream is rebuilt from (seed, epoch); trained batches are read, not used).
SIGTERM (Ctrl-C): every replica finishes the same step, the master saves, exit code 75 (130).
"""

import io
import itertools
import os
import random
import re
import sys
import tarfile
import time
from types import SimpleNamespace

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string('wds_traindir', None, 'Training shards: a brace pattern of paths or URLs, e.g. '
                    "'gs://bucket/cifar-train-{000000..000639}.tar'.")
flags.DEFINE_string('wds_testdir', None, 'Test shards, the same way.')
flags.DEFINE_integer('trainsize', None, 'Training samples in the shards (all of them).', lower_bound=1)
flags.DEFINE_integer('testsize', None, 'Test samples in the shards (all of them).', lower_bound=1)
flags.DEFINE_integer('shuffle_buffer', 10000, 'Samples each loader worker shuffles.', lower_bound=1)
flags.DEFINE_bool('fail_on_bad_data', False, 'Stop at a bad shard or sample instead of skipping it.')
flags.DEFINE_string('model', 'resnet18', 'A torchvision ResNet (resnet18, resnet50, resnext50_32x4d, '
                    'wide_resnet50_2, ...), given the CIFAR stem, or a name build_model knows.')
flags.DEFINE_integer('num_classes', 10, 'Number of classes (labels 0..N-1).', lower_bound=2)
flags.DEFINE_integer('num_cores', None, '1: one process, to debug (unset: one per local device).',
                     lower_bound=1, upper_bound=1)
flags.DEFINE_integer('batch_size', 128, 'Training batch size of each replica.', lower_bound=1)
flags.DEFINE_integer('test_set_batch_size', 64, 'Evaluation batch size of each replica.', lower_bound=1)
flags.DEFINE_integer('num_epochs', 30, 'Number of epochs.', lower_bound=1)
flags.DEFINE_integer('num_steps', None, 'Cap on training and evaluation steps per epoch.', lower_bound=1)
flags.DEFINE_integer('log_steps', 20, 'Print a training line every this many steps.', lower_bound=1)
flags.DEFINE_float('lr', 0.1, 'Peak learning rate (SGD).', lower_bound=0.0)
flags.DEFINE_enum('lr_scheduler_type', 'none', ['WarmupAndExponentialDecayScheduler', 'none'],
                  'Linear warm-up, then division every N epochs; or a constant rate.')
flags.DEFINE_float('lr_warmup_epochs', 0.9, 'Epochs of linear warm-up from 0.', lower_bound=0.0)
flags.DEFINE_integer('lr_scheduler_divide_every_n_epochs', 20, 'LR division period.', lower_bound=1)
flags.DEFINE_float('lr_scheduler_divisor', 5, 'What the LR is divided by.', lower_bound=1.0)
flags.DEFINE_float('momentum', 0.9, 'SGD momentum.', lower_bound=0.0)
flags.DEFINE_float('weight_decay', 5e-4, 'SGD weight decay (the usual CIFAR value).', lower_bound=0.0)
flags.DEFINE_integer('seed', 42, 'Seed of the weights, the shard order, the shuffle and the crops.')
flags.DEFINE_integer('num_workers', 4, 'DataLoader worker processes per replica.', lower_bound=0)
flags.DEFINE_integer('prefetch_factor', None, 'Batches each loader worker loads ahead.', lower_bound=1)
flags.DEFINE_integer('loader_prefetch_size', 8, 'Host batches MpDeviceLoader queues.', lower_bound=1)
flags.DEFINE_integer('device_prefetch_size', 4, 'Device batches MpDeviceLoader queues.', lower_bound=1)
flags.DEFINE_integer('host_to_device_transfer_threads', 1, 'Host-to-device copy threads.', lower_bound=1)
flags.DEFINE_bool('bf16', False, 'Train in bfloat16: sets XLA_USE_BF16=1 before the spawn.')
flags.DEFINE_bool('amp', False, 'Mixed precision: forward and loss autocast to bfloat16, weights and '
                  'optimizer in float32 (see docs/tpu.md).')
flags.DEFINE_float('target_accuracy', 0.0, 'Exit with code 21 if the final accuracy (%) is below it.')
flags.DEFINE_string('ckpt_dir', None, 'Save checkpoints here, resume from the newest (pod: gs://...).')
flags.DEFINE_integer('ckpt_every_steps', None, 'Also save every N steps.', lower_bound=1)
flags.DEFINE_integer('keep_checkpoints', 2, 'Checkpoints kept, besides best.pt.', lower_bound=1)
flags.DEFINE_string('resume', None, 'Resume from this checkpoint instead of the newest in --ckpt_dir.')
flags.DEFINE_string('compile_cache_dir', None, "torch_xla's compile cache, on this host's disk: a restart loads graphs, not compiles (TPU).")
flags.DEFINE_string('logdir', None, 'TensorBoard folder for loss, rate, lr and accuracy (master only).')
flags.DEFINE_bool('metrics_debug', False, "Print torch_xla's metrics report after each epoch.")
flags.DEFINE_bool('profile', False, 'Start the profiler server so TensorBoard can capture a trace.')
flags.DEFINE_integer('profiler_port', 9012, 'Profiler port of local replica 0 (replica i: + i).')
flags.DEFINE_string('results_json', None, 'Write accuracy, rates and compile counts here at exit.')

# --help answers here, before torch and torch_xla load (seconds): absl prints it as it parses.
# (In a notebook, %run goes through run(), below.)
if (__name__ == '__main__' and 'IPython' not in sys.modules and
    {'--help', '--helpshort', '--helpfull', '-?'} & set(sys.argv[1:])):
  app.define_help_flags()  # As app.run does.
  try:
    FLAGS(sys.argv, known_only=True)
  except SystemExit:  # absl's, after the help, is 1.
    sys.exit(0)
  except BrokenPipeError:  # --help | head: the reader has what it wanted.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python flushes at exit.
    sys.exit(0)
  except flags.Error:
    pass  # Said in one line by app.run's parse.

import braceexpand
import fsspec
import numpy as np
import PIL.Image
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.debug.profiler as xp
import torch_xla.distributed.parallel_loader as pl
import torch_xla.runtime as xr
import torch_xla.test.test_utils as test_utils
import webdataset as wds
from torch.utils.tensorboard import SummaryWriter

import utils

try:  # Optional: checks before the run starts and a watch over its processes (see its docstring).
  import supervisor
except ModuleNotFoundError as e:
  if e.name != 'supervisor':
    raise
  supervisor = None

# A notebook may import several scripts (the same flag names) or %run one again.
utils.redefinable(FLAGS)

# The shards: each sample is two tar members, KEY.rgb (the image as 3,072 raw bytes, 32x32x3
# uint8, height x width x channel: decoded in about 1 us, a 32x32 PNG in about 50) and
# KEY.cls (the label as ASCII digits), as make_cifar_shards.py writes them; or the image as
# one of the other files a sample may hold, tried in this order: those webdataset's
# ShardWriter writes from a PIL image, and numpy's.
IMAGE_KEYS = ('rgb', 'ppm', 'png', 'jpg', 'jpeg', 'webp', 'npy')
PPM_HEADER = re.compile(rb'P6\s+(\d+)\s+(\d+)\s+255\s')  # 8-bit binary RGB, no comment.
SIDE = 32  # CIFAR images are 32x32 RGB.
# Flags of the image-folder scripts that a user may bring here.
ELSEWHERE = {'img_dim': 'this script trains on 32x32 CIFAR images, as the shards hold them; '
                        '--img_dim belongs to the image-folder scripts',
             'datadir': 'give the shards with --wds_traindir and --wds_testdir (see '
                        'make_cifar_shards.py); --datadir belongs to the image-folder scripts',
             'fake_data': 'this script trains on shards; --fake_data belongs to the '
                          'image-folder scripts'}


# ------------------------------------------------------------------------------ data
class BadSample(ValueError):
  """A sample that cannot be used, saying why."""


class ForeignSample(BadSample):
  """A sample that is not one of a set this script can read (keys, image size)."""


def decode(sample):
  """(image uint8 32x32x3, label) of a sample: the image from its rgb (3,072 raw bytes), ppm,
  png, jpg, jpeg, webp (converted to RGB as PIL does) or npy (uint8 32x32x3) file, the label
  from its cls file (ASCII digits: how ShardWriter writes an int). Shards of another image
  format: add its file extension to IMAGE_KEYS and its decoding here."""
  image_key = next((key for key in IMAGE_KEYS if key in sample), None)
  if image_key is None or 'cls' not in sample:
    found = ', '.join(sorted(key for key in sample if not key.startswith('__'))) or 'no file'
    raise ForeignSample(f'holds {found}, where an image ({", ".join(IMAGE_KEYS)}) and a label '
                        "(cls) are expected: write the shards with such keys, e.g. ShardWriter "
                        "and {'ppm': PIL image, 'cls': int}, or with make_cifar_shards.py")
  data = sample[image_key]
  try:
    if image_key == 'rgb':
      image = np.frombuffer(data, np.uint8).reshape(SIDE, SIDE, 3)
    elif image_key == 'npy':
      image = np.load(io.BytesIO(data), allow_pickle=False)
    elif image_key == 'ppm' and (header := PPM_HEADER.match(data)):  # Raw RGB: no PIL needed.
      width, height = int(header[1]), int(header[2])
      image = np.frombuffer(data, np.uint8, width * height * 3, header.end())
      image = image.reshape(height, width, 3)
    else:
      with PIL.Image.open(io.BytesIO(data)) as pil:
        image = np.asarray(pil.convert('RGB'))
    label = int(sample['cls'])
  except (ValueError, OSError, EOFError, SyntaxError) as e:  # What PIL and numpy raise.
    raise BadSample(f'has no readable {image_key} image and cls label ({e!r})') from None
  if image.shape != (SIDE, SIDE, 3) or image.dtype != np.uint8:
    size = (f'{image.shape[1]}x{image.shape[0]}' if image.ndim == 3 and image.dtype == np.uint8
            else f'a {image.dtype} array of shape {image.shape}')
    raise ForeignSample(f'holds a {image_key} image of {size}: this script trains on 32x32 RGB '
                        'images (uint8 arrays in npy); resize them when writing the shards')
  return image, label


def read_samples(urls, on_bad):
  """(image uint8 HWC, label) of every sample of the shards in turn. A shard that cannot be
  opened or read to the end, or a sample without a readable image and label, is passed
  to on_bad(message), which raises or counts it, and reading goes on."""
  for url in urls:
    try:
      # A pipe: command (e.g. 'pipe:gsutil cat gs://bucket/shard.tar') or an fsspec URL.
      stream = wds.gopen(url) if url.startswith('pipe:') else fsspec.open(url, 'rb').open()
      try:
        whole = WholeTar(stream)
        files = wds.tariterators.tar_file_expander([dict(url=url, stream=whole)])
        for sample in wds.tariterators.group_by_keys(files):
          try:
            yield decode(sample)
          except BadSample as e:
            on_bad(f'sample {sample["__key__"]} of {url} {e}')
        if whole.cut_short():
          on_bad(f'shard {url} cannot be read to the end (it ends inside a tar header, '
                 f'after {whole.size} bytes: the rest of it is lost)')
      finally:
        stream.close()
    except utils.BadDataError:
      raise
    except Exception as e:  # A missing shard, a truncated or corrupt tar.
      on_bad(f'shard {url} cannot be read to the end ({type(e).__name__}: '
             f'{e.args[0] if e.args else e})')


class WholeTar:
  """A shard's bytes as tarfile reads them, which tell at their end whether the tar was whole:
  tarfile takes a header cut short for the end of the archive, and says nothing, but a
  whole tar ends in zero blocks (a compressed one is left to its decompressor)."""

  def __init__(self, stream):
    self.stream, self.size, self.head, self.tail = stream, 0, b'', b''

  def read(self, size=-1):
    data = self.stream.read(size)
    self.head = self.head or data[:6]
    self.size += len(data)
    self.tail = (self.tail + data[-tarfile.BLOCKSIZE:])[-tarfile.BLOCKSIZE:]  # 1 KB, not the read
    return data

  def __repr__(self):  # What webdataset's errors name after "@": where in the shard.
    return f'byte {self.size}'

  def cut_short(self):
    """Whether the stream, read to its end, is not a whole tar."""
    while self.read(1 << 16):
      pass
    compressed = self.head.startswith((b'\x1f\x8b', b'BZh', b'\xfd7zXZ'))
    return not compressed and (self.size % tarfile.BLOCKSIZE != 0 or
                               self.tail != bytes(tarfile.BLOCKSIZE))


class BadData:
  """A missing or corrupt shard or sample: raised (strict), or counted in counts[slot] with a
  warning line for the first few, once however often it is read; counts may be a tensor that
  the loader workers of a replica share (one slot each), so that a million bad samples are
  not a million lines."""
  SHOWN = 5

  def __init__(self, strict, counts=None, slot=0):
    self.strict, self.slot, self.seen = strict, slot, set()
    self.counts = torch.zeros(1, dtype=torch.int64) if counts is None else counts

  @property
  def count(self):
    return int(self.counts[self.slot])

  def __call__(self, message):
    if self.strict:
      raise utils.BadDataError(f'{message}: replace it, or drop --fail_on_bad_data to skip it')
    if message in self.seen:  # Read again, to fill the epoch (see TrainShards.samples).
      return
    self.seen.add(message)
    self.counts[self.slot] += 1
    shown = int(self.counts.sum())
    if shown <= self.SHOWN:
      more = ' (more are counted, not shown: see the count at the end)' if shown == self.SHOWN else ''
      print(f'warning: {message}; skipped{more}', file=sys.stderr, flush=True)


def augment(images, rng):
  """Random 32x32 crops of the images padded by 4 px and random horizontal flips, on a
  whole uint8 batch (N, H, W, C) at once: no per-image PIL work on the host."""
  n = len(images)
  padded = np.pad(images, ((0, 0), (4, 4), (4, 4), (0, 0)))
  top, left = rng.integers(0, 9, (2, n))
  rows = top[:, None] + np.arange(SIDE)
  cols = left[:, None] + np.arange(SIDE)
  cols = np.where(rng.random(n)[:, None] < 0.5, cols[:, ::-1], cols)
  return padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]


def to_tensors(images, labels):
  """uint8 NCHW images from an (N, H, W, C) array, and int64 labels."""
  return (torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2))),
          torch.as_tensor(labels, dtype=torch.int64))


class TrainShards(torch.utils.data.IterableDataset):
  """This replica's shuffled, augmented batches of an epoch, `batches` of them (cfg gives
  batch_size, shuffle_buffer, seed, fail_on_bad_data). A worker whose shards run out reads
  them again until the epoch has its batches: every replica runs the same steps. The loader
  workers live through the run (spawned by a replica, each costs seconds), so the epoch and
  first step, and each worker's counts of bad data and re-read samples, are in shared memory."""

  def __init__(self, urls, rank, world_size, batches, cfg):
    self.urls, self.rank, self.world_size, self.batches, self.cfg = urls, rank, world_size, batches, cfg
    self.epoch_and_step = torch.zeros(2, dtype=torch.int64).share_memory_()
    self.counts = torch.zeros(max(1, cfg.num_workers), 2, dtype=torch.int64).share_memory_()

  def set_epoch(self, epoch, first_step=0):
    self.epoch_and_step[:] = torch.tensor([epoch, first_step])
    self.counts.zero_()

  def read_counts(self):
    """(bad shards or samples skipped, samples read twice) in this epoch so far."""
    return self.counts.sum(0).tolist()

  def shards(self, epoch, worker, num_workers):
    """The shards of one loader worker in an epoch. The list is shuffled the same way on every
    replica (from seed and epoch), then dealt out: replica r takes every world_size-th shard
    from r, and its worker w every num_workers-th of those. Every shard goes to one (replica,
    worker) an epoch. Needs len(urls) >= world_size * num_workers."""
    order = list(self.urls)
    random.Random(f'{self.cfg.seed}/{epoch}').shuffle(order)
    return order[self.rank::self.world_size][worker::num_workers]

  def samples(self, shards, rng, on_bad):
    """(image, label, pass) of the shards, pass after pass, each pass in a new shard order
    and shuffled in a buffer of its own: every sample once before any twice. The buffer
    sends a sample for every two it reads until full, starting once it holds a batch."""
    for pass_number in itertools.count():
      shuffle = wds.shuffle(self.cfg.shuffle_buffer, initial=self.cfg.batch_size, rng=rng)
      read, samples = 0, read_samples(rng.sample(shards, len(shards)), on_bad)
      for image, label in shuffle(samples):
        read += 1
        yield image, label, pass_number
      if read == 0:
        raise utils.BadDataError(f'no readable sample in shards {shards}')

  def __iter__(self):
    info = torch.utils.data.get_worker_info()
    worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
    epoch, first_step = self.epoch_and_step.tolist()
    seed = self.cfg.seed
    bad = BadData(self.cfg.fail_on_bad_data, self.counts[:, 0], worker)
    # The DataLoader takes batch i from worker i % num_workers: this worker makes its share
    # of the epoch and stops, instead of reading on for batches nobody takes. A worker whose
    # first turn falls below first_step (a resumed run) sends None there (the loader drops
    # it), so that the batches after first_step come in their usual order.
    share = len(range(worker, self.batches, num_workers))
    skip = len(range(worker, first_step, num_workers))
    if worker < first_step % num_workers:
      yield None
    rng = random.Random(f'{seed}/{epoch}/{self.rank}/{worker}')  # Shard order and shuffle.
    batches = wds.batched(self.cfg.batch_size, collation_fn=None, partial=False)(
        self.samples(self.shards(epoch, worker, num_workers), rng, bad))
    for number, batch in enumerate(itertools.islice(batches, share), 1):
      images, labels, passes = zip(*batch)
      self.counts[worker, 1] += sum(map(bool, passes))  # Samples of a second pass or later.
      if number <= skip:
        continue  # Trained before the resume: read, for the shuffle, but not sent.
      # Crops from a generator of this batch alone: the same with or without a resume.
      crops = np.random.default_rng([seed, epoch, self.rank, worker, number])
      yield to_tensors(augment(np.stack(images), crops), labels)


def load_data(cfg, rank, world_size):
  """This replica's train loader (counted, capped at the epoch's steps) and test loader.
  Every replica gets the same number of train and test batches."""
  train_urls = list(braceexpand.braceexpand(cfg.wds_traindir))
  test_urls = list(braceexpand.braceexpand(cfg.wds_testdir))
  feeders = world_size * max(1, cfg.num_workers)
  if len(train_urls) < feeders:
    raise utils.UsageError(
        f'{len(train_urls)} training shards cannot feed {world_size} replicas x '
        f'{max(1, cfg.num_workers)} loader workers (each needs a shard of its own): write more, '
        'smaller shards (make_cifar_shards.py --samples_per_shard) or lower --num_workers')
  steps = cfg.trainsize // (cfg.batch_size * world_size)
  if steps == 0:
    raise utils.UsageError(f'--trainsize {cfg.trainsize} makes no batch of {cfg.batch_size} for '
                           f'each of {world_size} replicas: lower --batch_size')
  train_set = TrainShards(train_urls, rank, world_size, min(steps, cfg.num_steps or steps), cfg)
  workers = dict(num_workers=cfg.num_workers, worker_init_fn=utils.ignore_stop_signals)
  if cfg.num_workers:  # torch 2.9 raises on these without workers.
    workers.update(persistent_workers=True, prefetch_factor=cfg.prefetch_factor)
  train_loader = torch.utils.data.DataLoader(train_set, batch_size=None, **workers)
  # The test set is small (10k CIFAR images are 30 MB): every replica reads it all, once,
  # and evaluates its share, as the image-folder scripts do.
  bad = BadData(cfg.fail_on_bad_data)
  samples = list(read_samples(test_urls, bad))
  if not samples:
    raise utils.BadDataError(f'no readable sample in the test shards {cfg.wds_testdir}')
  if bad.count:
    print(f'Replica {rank}: skipped {bad.count} bad shards or samples of the test shards',
          flush=True)
  if len(samples) != cfg.testsize:
    xm.master_print(f'warning: the test shards hold {len(samples)} samples, --testsize is '
                    f'{cfg.testsize}', fd=sys.stderr)
  images, labels = to_tensors(np.stack([image for image, _ in samples]), [l for _, l in samples])
  test_set = utils.eval_share(list(zip(images, labels.tolist())), rank, world_size,
                              cfg.test_set_batch_size)
  test_loader = torch.utils.data.DataLoader(test_set, cfg.test_set_batch_size)
  return (utils.EpochLoader(train_loader, train_set.batches, order=train_set),
          utils.EpochLoader(test_loader, cfg.num_steps or sys.maxsize))


# ------------------------------------------------------------------------ your model
def build_model(cfg, num_classes):
  """The model to train: a torch.nn.Module from a float batch (N, 3, 32, 32) to logits (N,
  num_classes); the shards' uint8 images are normalised in the step, on the device
  (utils.normalize, CIFAR-10's mean and std). Here: the torchvision ResNet --model names,
  with the CIFAR stem. Put yours here; a --model name of your own is then accepted. Images
  of another format or size: the place is decode. Called in main, to check, and in every
  replica."""
  if not cfg.model.startswith(('resnet', 'resnext', 'wide_resnet')):
    raise utils.UsageError(f'--model {cfg.model} is not a torchvision ResNet (resnet18, resnet50, '
                           'resnext50_32x4d, ...): name one, or build yours in build_model')
  return cifar_resnet(cfg.model, num_classes)


def cifar_resnet(name, num_classes):
  """A torchvision ResNet with the usual CIFAR stem: a 3x3 stride-1 first convolution and
  no max-pool. The ImageNet stem (7x7 stride 2, then a max-pool) would shrink 32x32
  images to 8x8 before the first block and cost accuracy."""
  model = utils.create_model(name, num_classes)
  model.conv1 = torch.nn.Conv2d(3, model.conv1.out_channels, 3, 1, 1, bias=False)
  torch.nn.init.kaiming_normal_(model.conv1.weight, mode='fan_out', nonlinearity='relu')
  model.maxpool = torch.nn.Identity()
  return model


# ------------------------------------------------------------------------------ loop
def start_run(cfg, steps_per_epoch, stop_signal):
  """Model, optimizer, LR schedule, log, stop vote and results of this replica, restored from
  the newest checkpoint if there is one; run.epoch and run.step are where training goes on."""
  device = torch_xla.device()
  model = build_model(cfg, cfg.num_classes).to(device)
  xm.broadcast_master_param(model)  # Every replica starts from the master's weights.
  optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                              weight_decay=cfg.weight_decay)
  scheduler = None
  if cfg.lr_scheduler_type == 'WarmupAndExponentialDecayScheduler':
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: utils.warmup_step_decay(
        step, steps_per_epoch, cfg.lr_warmup_epochs, cfg.lr_scheduler_divide_every_n_epochs,
        cfg.lr_scheduler_divisor))
  writer = SummaryWriter(cfg.logdir) if cfg.logdir and xm.is_master_ordinal() else None
  results = utils.new_results(cfg.model, amp=cfg.amp, skipped_bad_data=0, repeated_samples=0)
  run = SimpleNamespace(cfg=cfg, model=model, optimizer=optimizer, scheduler=scheduler,
                        stop=utils.StopVote(device, stop_signal, optimizer, cfg.num_classes),
                        stop_signal=stop_signal, steps_per_epoch=steps_per_epoch,
                        results=results, num_classes=cfg.num_classes, epoch=1, step=0,
                        global_step=0)
  state = utils.resume(cfg.resume, cfg.ckpt_dir, (model, optimizer, scheduler),
                             vars(cfg), run.results['world_size'])
  if state is not None:
    vars(run).update({key: state[key] for key in ('results', 'epoch', 'step', 'global_step')})
  run.log = utils.StepLog(device, writer, run.results['history'])  # After the restore.
  return run


def train_step(model, optimizer, scheduler, images, labels, amp):
  optimizer.zero_grad()
  # --amp: convolutions and matmuls in bfloat16, weights, optimizer and reductions in float32
  # (bfloat16 has float32's range: no gradient scaler).
  with torch.autocast('xla', dtype=torch.bfloat16, enabled=amp):
    # The images come as uint8 and are normalised here, on the device: a quarter of float32's
    # bytes cross from the host.
    loss = F.cross_entropy(model(utils.normalize(images, utils.CIFAR_MEAN, utils.CIFAR_STD)),
                           labels)
  loss.backward()
  xm.optimizer_step(optimizer)  # All-reduces the gradients over every replica, then steps.
  if scheduler is not None:
    scheduler.step()
  return loss


def train_one_epoch(run, loader, epoch, first_step):
  """Trains the epoch from step first_step on; returns (steps run, whether to stop now)."""
  cfg = run.cfg
  tracker = xm.RateTracker()
  run.model.train()
  steps = 0
  for step, (images, labels) in enumerate(loader, first_step):
    with xp.StepTrace('train_step', step_num=step):  # Named steps in a profile; ends in a sync.
      loss = train_step(run.model, run.optimizer, run.scheduler, images, labels, cfg.amp)
      tracker.add(cfg.batch_size)
      if step % cfg.log_steps == 0:
        xm.add_step_closure(run.log.add, args=(epoch, step, run.global_step, loss, tracker,
                                               run.optimizer.param_groups[0]['lr']))
      # The same answer on every replica (and the end of the run if loss or weights run away).
      stopping = run.stop.agreed_after_step(loss, f'epoch {epoch} step {step}')
    steps += 1
    run.global_step += 1
    if stopping:
      return steps, True
    # The epoch's last step is saved at its end, with its evaluation.
    if (cfg.ckpt_dir and cfg.ckpt_every_steps and run.global_step % cfg.ckpt_every_steps == 0
        and step + 1 < run.steps_per_epoch):
      save_checkpoint(run, epoch, step + 1)
  return steps, False


def evaluate(model, loader, amp):
  """(accuracy %, correct, total) over all replicas; padding (label -1) is not counted."""
  model.eval()
  # Counted on the device and read once at the end: an .item() per step would sync.
  counts = torch.zeros(2, dtype=torch.int64, device=torch_xla.device())
  with torch.no_grad(), torch.autocast('xla', dtype=torch.bfloat16, enabled=amp):
    for images, labels in loader:
      logits = model(utils.normalize(images, utils.CIFAR_MEAN, utils.CIFAR_STD))
      hits = (logits.argmax(dim=1) == labels).sum()
      counts += torch.stack([hits, (labels >= 0).sum()])
  # Sums, not a mean of replica accuracies: replicas may hold different numbers of images.
  correct, total = xm.all_reduce(xm.REDUCE_SUM, counts).tolist()
  return 100.0 * correct / max(total, 1), correct, total


def save_checkpoint(run, epoch, step, best=False):
  """Saves the whole training state after `step` steps of `epoch`; returns its path. Every
  replica calls it at the same step; the master writes."""
  torch_xla.sync()  # Runs the step's log closure, ...
  run.log.flush()  # ... and waits for it: the history saved is whole.
  run.stop.check_losses()  # Nothing that ran away is saved.
  state = dict(model=run.model.state_dict(), optimizer=run.optimizer.state_dict(),
               lr_scheduler=run.scheduler.state_dict() if run.scheduler else None, epoch=epoch,
               step=step, global_step=run.global_step, flags=vars(run.cfg),
               rng=dict(torch=torch.get_rng_state(), xla=xm.get_rng_state()), results=run.results)
  return utils.write_checkpoint(state, run.cfg.ckpt_dir, run.cfg.keep_checkpoints, best)


def stop_run(run, epoch, step, saved=None):
  """The end of a run stopped by SIGTERM or Ctrl-C at a step boundary: saves (unless `saved`
  holds this very state), says so."""
  if saved is None and run.cfg.ckpt_dir:
    xm.master_print(f'Stopping at epoch {epoch} step {step}: saving a checkpoint ...', flush=True)
    saved = save_checkpoint(run, epoch, step)
  name, code = utils.record_stop(run.results, run.stop_signal(), run.global_step, saved)
  xm.master_print(f'Stopped by {name} at epoch {epoch} step {step}: ' +
                  (f'saved {saved}; run the same command to resume' if saved else
                   'nothing saved (no --ckpt_dir)') + f' (exit code {code})', flush=True)
  return run.results


def end_epoch(run, epoch, accuracy, counts):
  """Adds an evaluated epoch to the results and saves it; returns (whether to stop now, the
  checkpoint saved or None)."""
  results = run.results
  best = accuracy > results['max_accuracy']
  results['epoch_accuracies'].append(accuracy)
  results.update(epochs=epoch, final_accuracy=accuracy, eval_correct=counts[0],
                 eval_samples=counts[1], max_accuracy=max(results['max_accuracy'], accuracy))
  results['compilations_after_epoch'].append(utils.compile_count())
  test_utils.write_to_summary(run.log.writer, epoch, {'Accuracy/test': accuracy})
  utils.check_learning(results['history'], epoch, run.num_classes, run.cfg.lr,
                       FLAGS['lr'].default)
  if run.cfg.metrics_debug:
    xm.master_print(met.metrics_report(), flush=True)
  saved = save_checkpoint(run, epoch + 1, 0, best=best) if run.cfg.ckpt_dir else None
  # After the last epoch a stop has nothing left to stop: the run ends as done.
  return epoch < run.cfg.num_epochs and run.stop.agreed_at_epoch_end(), saved


def train(cfg, stop_signal):
  """One replica's run (stop_signal(): the signal it got, or 0); returns its results."""
  torch.manual_seed(cfg.seed)
  rank, world_size, device = xr.global_ordinal(), xr.world_size(), torch_xla.device()
  train_loader, test_loader = load_data(cfg, rank, world_size)
  run = start_run(cfg, train_loader.num_batches, stop_signal)
  results = run.results
  # The server lives as long as this reference: keep it until training ends.
  profiler = xp.start_server(cfg.profiler_port + xr.local_ordinal()) if cfg.profile else None
  prefetch = dict(loader_prefetch_size=cfg.loader_prefetch_size,
                  device_prefetch_size=cfg.device_prefetch_size,
                  host_to_device_transfer_threads=cfg.host_to_device_transfer_threads)
  train_device_loader = pl.MpDeviceLoader(train_loader, device, **prefetch)
  test_device_loader = pl.MpDeviceLoader(test_loader, device, **prefetch)
  if run.epoch <= cfg.num_epochs:  # Else: 'Run already finished'.
    xm.master_print(f'Replicas started: {world_size}; compiling the first step ...', flush=True)
  with utils.ends_on_divergence(results, run.log, vars(cfg)):  # Nothing saved after it.
    for epoch in range(run.epoch, cfg.num_epochs + 1):
      first_step = run.step if epoch == run.epoch else 0
      # Shard order, shuffle and crops: a function of (seed, epoch); a resumed run reads the
      # batches it has trained without using them.
      train_loader.set_epoch(epoch, first_step)
      xm.master_print(f'Epoch {epoch} train begin {test_utils.now()}', flush=True)
      start = time.time()
      steps, stopped = train_one_epoch(run, train_device_loader, epoch, first_step)
      train_loader.check()
      xm.wait_device_ops()  # Time the device work, not just the tracing.
      run.log.flush()  # Its lines before the epoch's.
      seconds = time.time() - start
      results['train_seconds'] += seconds
      count_data(results, train_loader.order.read_counts(), epoch, rank)
      if stopped:
        return stop_run(run, epoch, first_step + steps)
      print(f'Epoch {epoch} Replica Train Samples={steps * cfg.batch_size} Device={device}/{rank}',
            flush=True)
      rate = xm.mesh_reduce('epoch_rate', steps * cfg.batch_size / seconds, sum)
      results['epoch_rates'] += [rate] if steps else []
      xm.master_print(f'Epoch {epoch} train end {test_utils.now()}, Reduced GlobalRate={rate:.2f}',
                      flush=True)
      accuracy, *counts = evaluate(run.model, test_device_loader, cfg.amp)
      test_loader.check()
      xm.master_print(f'Epoch {epoch} test end {test_utils.now()}, Accuracy={accuracy:.2f}',
                      flush=True)
      stop, saved = end_epoch(run, epoch, accuracy, counts)
      if stop:
        return stop_run(run, epoch + 1, 0, saved)
  del profiler
  return utils.finish_results(results, run.global_step, cfg.batch_size * world_size,
                              run.log.writer)


def count_data(results, counts, epoch, rank):
  """Adds an epoch's bad data skipped and samples read twice to the results; says so."""
  bad, repeated = counts
  results['skipped_bad_data'] += bad
  results['repeated_samples'] += repeated
  if repeated:
    print(f'Epoch {epoch} Replica {rank}: its shards ran out; {repeated} samples were read a '
          'second time to run the same steps as every replica', flush=True)
  if bad:
    print(f'Epoch {epoch} Replica {rank}: skipped {bad} bad shards or samples', flush=True)


def _mp_fn(index, flag_values):
  """One replica. flag_values is a plain dict: absl's FLAGS do not cross the spawn."""
  del index  # The global ordinal comes from the runtime.
  cfg = SimpleNamespace(**flag_values)
  with utils.replica():  # A replica that fails ends at once, and so the whole run.
    utils.use_compile_cache(cfg.compile_cache_dir, xr.global_ordinal())  # Before any computation.
    results = train(cfg, utils.stop_signal)
    if xm.is_master_ordinal():
      utils.write_results(cfg.results_json, results)
  sys.exit(utils.exit_code(results, cfg.target_accuracy))


def main(argv):
  del argv
  cfg = SimpleNamespace(**FLAGS.flag_values_dict())
  utils.set_precision(cfg.amp, cfg.bf16)  # Before the runtime starts.
  if supervisor:  # Checked here, once, before any replica starts: bad input is one line, not N.
    try:
      cfg.num_workers = supervisor.usable_workers(cfg.num_workers, FLAGS['num_workers'].present)
      shards = [supervisor.check_shards(flag, getattr(cfg, flag), cfg.fail_on_bad_data, decode,
                                        ForeignSample) for flag in ('wds_traindir', 'wds_testdir')]
      print(f'Data: {cfg.trainsize:,} training samples in {shards[0]} shards and {cfg.testsize:,} '
            f'evaluation samples in {shards[1]}, 3x{SIDE}x{SIDE} uint8, {cfg.num_classes} classes')
      print(supervisor.describe_model(cfg.model, build_model(cfg, cfg.num_classes), cfg.num_classes))
      given = {name for name in FLAGS if FLAGS[name].present}
      print(supervisor.describe_recipe(cfg, supervisor.recipe_source(given, None, {})), flush=True)
      supervisor.check_outputs(cfg.ckpt_dir, cfg.logdir, cfg.results_json, cfg.compile_cache_dir)
    except utils.UsageError as e:
      utils.die(e)
  launcher = utils.spawns_replicas(single_process=cfg.num_cores == 1)  # Not under torchrun.
  print('Starting ' + ('one replica per local XLA device' if launcher else 'one replica (--num_cores 1)'
                       if cfg.num_cores == 1 else 'the replica of this torchrun worker') + ' ...',
        flush=True)
  # SIGTERM and Ctrl-C stop every replica after the same step (see utils' stop section).
  with (supervisor.watched(launcher, saving=bool(cfg.ckpt_dir)) if supervisor else
        utils.stop_on_signals(launcher)):
    torch_xla.launch(_mp_fn, args=(vars(cfg),), debug_single_process=cfg.num_cores == 1)


def run(argv):
  """This script from Python or a notebook cell: run(['--flag', value, ...]) returns the
  results (see --results_json) or raises what the exit code means (see command.py)."""
  import command  # Only run() and %run need command.py.
  return command.run(__file__, argv)


if __name__ == '__main__':
  if utils.in_notebook():  # %run in a notebook: a command of its own, as run() starts it.
    run(sys.argv[1:])
  else:
    # Here, not at import: the benchmarks and tests import this file without these flags.
    flags.mark_flags_as_required(['wds_traindir', 'trainsize', 'wds_testdir', 'testsize'])
    app.run(main, flags_parser=lambda argv: utils.parse_flags(argv, ELSEWHERE))
elif __name__ == '__mp_main__':
  # A replica imports this file in its main thread, the only one that may catch a signal.
  utils.stop_on_signals()
