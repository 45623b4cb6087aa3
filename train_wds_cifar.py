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

With --ckpt_dir the run saves its whole state and, started again with the same command,
goes on from the newest checkpoint exactly where it stopped: the stream of the epoch is
rebuilt from (seed, epoch) and the trained batches are read but not used. On SIGTERM
every replica finishes the same step, the master saves, and the command exits with 75.
"""

import functools
import itertools
import math
import os
import sys
import time
from types import SimpleNamespace

import braceexpand
import fsspec
import numpy as np
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.debug.profiler as xp
import torch_xla.distributed.parallel_loader as pl
import torch_xla.runtime as xr
import torchvision
import webdataset as wds
from absl import app, flags

import utils

FLAGS = flags.FLAGS
flags.DEFINE_string('wds_traindir', None, 'Training shards: a brace pattern of paths or URLs, e.g. '
                    "'gs://bucket/cifar-train-{000000..000639}.tar'.")
flags.DEFINE_string('wds_testdir', None, 'Test shards, the same way.')
flags.DEFINE_integer('trainsize', None, 'Training samples in the shards (all of them).', lower_bound=1)
flags.DEFINE_integer('testsize', None, 'Test samples in the shards (all of them).', lower_bound=1)
flags.DEFINE_integer('shuffle_buffer', 10000, 'Samples each loader worker shuffles in memory.',
                     lower_bound=1)
flags.DEFINE_bool('fail_on_bad_data', False, 'Stop at a missing or corrupt shard or sample '
                  'instead of skipping it with a warning.')
flags.DEFINE_string('model', 'resnet18', 'A torchvision ResNet (resnet18, resnet50, resnext50_32x4d, '
                    'wide_resnet50_2, ...), given the CIFAR stem.')
flags.DEFINE_integer('num_classes', 10, 'Number of classes (labels 0..N-1).', lower_bound=2)
flags.DEFINE_integer('num_cores', None, 'Unset: one process per local device. 1: a single process, '
                     'for debugging.', lower_bound=1, upper_bound=1)
flags.DEFINE_integer('batch_size', 128, 'Training batch size of each replica.', lower_bound=1)
flags.DEFINE_integer('test_set_batch_size', 64, 'Evaluation batch size of each replica.', lower_bound=1)
flags.DEFINE_integer('num_epochs', 30, 'Number of epochs.', lower_bound=1)
flags.DEFINE_integer('num_steps', None, 'Cap on training and evaluation steps per epoch.', lower_bound=1)
flags.DEFINE_integer('log_steps', 20, 'Print a training line every this many steps.', lower_bound=1)
flags.DEFINE_float('lr', 0.1, 'Peak learning rate (SGD).', lower_bound=0.0)
flags.DEFINE_enum('lr_scheduler_type', 'none', ['WarmupAndExponentialDecayScheduler', 'none'],
                  'Linear warm-up, then division every N epochs; or a constant rate.')
flags.DEFINE_float('lr_warmup_epochs', 0.9, 'Linear warm-up from 0 over this many epochs.',
                   lower_bound=0.0)
flags.DEFINE_integer('lr_scheduler_divide_every_n_epochs', 20, 'Divide the LR every N epochs.',
                     lower_bound=1)
flags.DEFINE_float('lr_scheduler_divisor', 5, 'What the LR is divided by.', lower_bound=1.0)
flags.DEFINE_float('momentum', 0.9, 'SGD momentum.', lower_bound=0.0)
flags.DEFINE_float('weight_decay', 5e-4, 'SGD weight decay (5e-4 is the usual CIFAR value).',
                   lower_bound=0.0)
flags.DEFINE_integer('seed', 42, 'Seed of the weights, the shard order, the shuffle and the crops.')
flags.DEFINE_integer('num_workers', 4, 'DataLoader worker processes per replica.', lower_bound=0)
flags.DEFINE_integer('prefetch_factor', None, 'Batches each worker loads ahead (needs workers).',
                     lower_bound=1)
flags.DEFINE_integer('loader_prefetch_size', 8, 'Host batches MpDeviceLoader queues.', lower_bound=1)
flags.DEFINE_integer('device_prefetch_size', 4, 'Device batches MpDeviceLoader queues.', lower_bound=1)
flags.DEFINE_integer('host_to_device_transfer_threads', 1, 'Threads copying batches to the device.',
                     lower_bound=1)
flags.DEFINE_bool('bf16', False, 'Train in bfloat16: sets XLA_USE_BF16=1 before the spawn.')
flags.DEFINE_float('target_accuracy', 0.0, 'Exit with code 21 if the final accuracy (%) is below it.')
flags.DEFINE_string('ckpt_dir', None, 'Save checkpoints here and resume from the newest one when '
                    'started again: a local path, or on a pod a URL every host reads (gs://...).')
flags.DEFINE_integer('ckpt_every_steps', None, 'Also save every N steps (always at each epoch end).',
                     lower_bound=1)
flags.DEFINE_integer('keep_checkpoints', 2, 'Checkpoints kept, besides best.pt.', lower_bound=1)
flags.DEFINE_string('resume', None, 'Resume from this checkpoint instead of the newest in --ckpt_dir.')
flags.DEFINE_string('logdir', None, 'TensorBoard folder for loss, rate, lr and accuracy (master only).')
flags.DEFINE_bool('metrics_debug', False, "Print torch_xla's metrics report after each epoch.")
flags.DEFINE_bool('profile', False, 'Start the profiler server so TensorBoard can capture a trace.')
flags.DEFINE_integer('profiler_port', 9012, 'Profiler server port of the first local replica; '
                     'replica i of a host listens on port + i.')
flags.DEFINE_string('results_json', None, 'Write accuracy, rates and compile counts here at exit.')
flags.register_validator('model', lambda name: name.startswith(('resnet', 'resnext', 'wide_resnet'))
                         and name in utils.model_names(),
                         'is not a torchvision ResNet (resnet18, resnet50, resnext50_32x4d, ...)')

REQUIRED_FLAGS = ('wds_traindir', 'trainsize', 'wds_testdir', 'testsize')
EXIT_BELOW_TARGET = 21  # upstream's code for a run below --target_accuracy
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
SIDE = 32  # CIFAR images are 32x32 RGB, stored as 3072 raw bytes (see make_cifar_shards.py)


# ------------------------------------------------------------------------------ data


def expand_urls(pattern):
  return list(braceexpand.braceexpand(pattern))


def missing_shards(urls):
  """The URLs that do not exist (pipe: commands are not checked)."""
  missing = []
  for url in urls:
    if url.startswith('pipe:'):
      continue
    fs, path = fsspec.core.url_to_fs(url)
    if not fs.exists(path):
      missing.append(url)
  return missing


def open_shard(url):
  if url.startswith('pipe:'):
    return wds.gopen(url)  # e.g. 'pipe:gsutil cat gs://bucket/shard.tar'
  return fsspec.open(url, 'rb').open()


def read_samples(urls, on_bad):
  """(image uint8 HWC, label) of every sample of the shards in turn. A shard that cannot be
  opened or read to the end, or a sample without a readable image and label, is passed
  to on_bad(message), which raises or counts it, and reading goes on."""
  for url in urls:
    try:
      stream = open_shard(url)
      try:
        files = wds.tariterators.tar_file_expander([dict(url=url, stream=stream)])
        for sample in wds.tariterators.group_by_keys(files):
          try:
            image = np.frombuffer(sample['rgb'], np.uint8).reshape(SIDE, SIDE, 3)
            label = int(sample['cls'])
          except (KeyError, ValueError) as e:
            on_bad(f'sample {sample["__key__"]} of {url} has no readable image and label ({e!r})')
            continue
          yield image, label
      finally:
        stream.close()
    except utils.BadDataError:
      raise
    except Exception as e:  # A missing shard, a truncated or corrupt tar.
      on_bad(f'shard {url} cannot be read to the end ({type(e).__name__}: '
             f'{e.args[0] if e.args else e})')


def bad_data_handler(strict, counter):
  def on_bad(message):
    if strict:
      raise utils.BadDataError(f'{message}: replace it, or drop --fail_on_bad_data to skip it')
    print(f'warning: {message}; skipped', file=sys.stderr, flush=True)
    counter[0] += 1
  return on_bad


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
  """uint8 NCHW images from an (N, H, W, C) array (a quarter of float32 on the
  host-to-device link) and int64 labels."""
  return (torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2))),
          torch.as_tensor(labels, dtype=torch.int64))


class TrainShards(torch.utils.data.IterableDataset):
  """This replica's shuffled, augmented batches of the epoch: `batches` of them.

  Each batch comes with counts: bad data skipped since the previous batch, and samples
  read a second time because the worker's shards ran out (the stream goes on over them
  until the epoch has its batches, so every replica runs the same number of steps). Call
  set_epoch before each epoch's iteration.
  """

  def __init__(self, urls, rank, world_size, batch_size, batches, shuffle_buffer, seed, strict):
    self.urls, self.rank, self.world_size = urls, rank, world_size
    self.batch_size, self.batches, self.shuffle_buffer = batch_size, batches, shuffle_buffer
    self.seed, self.strict = seed, strict
    # Epoch and skip in shared memory: loader workers live through the run (started by
    # spawn in a replica, each costs seconds) and read them when each epoch begins.
    self.epoch_and_skip = torch.zeros(2, dtype=torch.int64).share_memory_()

  def set_epoch(self, epoch, skip=0):
    """The epoch to make next, and the batches of it a resumed run has trained."""
    self.epoch_and_skip[:] = torch.tensor([epoch, skip])

  def __iter__(self):
    info = torch.utils.data.get_worker_info()
    worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
    epoch, skip_to = self.epoch_and_skip.tolist()
    shards = utils.shards_for(self.urls, self.rank, self.world_size, worker, num_workers,
                              self.seed, epoch)
    rng = np.random.default_rng([self.seed, epoch, self.rank, worker])  # Order, shuffle.
    # The DataLoader takes batch i from worker i % num_workers: this worker makes its share
    # of the epoch and stops, instead of reading on for batches nobody takes (and keeping
    # the loader from shutting down until it has). Of the batches a resumed run has
    # trained, it made those below skip_to in its turn: it reads their samples (the shuffle
    # must go on the same) but does not augment or send them. A worker whose first turn
    # falls below skip_to sends None there, which CountedBatches drops, so that the batches
    # after skip_to come in their uninterrupted order.
    share = len(range(worker, self.batches, num_workers))
    skip = len(range(worker, skip_to, num_workers))
    if worker < skip_to % num_workers:
      yield None
    bad = [0]
    on_bad = bad_data_handler(self.strict, bad)
    buffer, batch, repeated, made = [], [], 0, 0
    if share == 0:
      return

    def emit(sample, pass_number):
      nonlocal batch, repeated, made
      batch.append(sample)
      repeated += pass_number > 0
      if len(batch) < self.batch_size:
        return None
      made += 1
      if made <= skip:
        batch = []
        return None  # Trained before the resume; its counts go with the next batch.
      images, labels = zip(*batch)
      batch = []
      # Crops from a generator of this batch alone: the same with or without a resume.
      crops = np.random.default_rng([self.seed, epoch, self.rank, worker, made])
      out = to_tensors(augment(np.stack(images), crops), labels) + (torch.tensor([bad[0],
                                                                                 repeated]),)
      repeated, bad[0] = 0, 0
      return out

    def take(index):  # Buffer sample `index` out, in O(1).
      buffer[index], buffer[-1] = buffer[-1], buffer[index]
      return buffer.pop()

    for pass_number in itertools.count():
      read = 0
      for sample in read_samples(rng.permutation(shards).tolist(), on_bad):
        read += 1
        buffer.append(sample)
        # A full buffer sends a sample for each one read. Until then it sends one for every
        # second one read, once it holds a batch: the first batch of an epoch does not wait
        # for a whole buffer to be read.
        if len(buffer) > self.shuffle_buffer or (read % 2 == 0 and len(buffer) > self.batch_size):
          if (out := emit(take(rng.integers(len(buffer))), pass_number)) is not None:
            yield out
          if made == share:
            return
      if read == 0:
        raise utils.BadDataError(f'no readable sample in shards {shards}')
      for index in rng.permutation(len(buffer)):  # The end of the shards: drain the buffer.
        if (out := emit(buffer[index], pass_number)) is not None:
          yield out
        if made == share:
          return
      buffer = []


class CountedBatches:
  """Adds up the counts that come with each batch and passes on (images, labels); drops
  the None a worker sends in place of a batch trained before a resume."""

  def __init__(self, loader):
    self.loader = loader
    self.bad = self.repeated = 0

  def __iter__(self):
    self.bad = self.repeated = 0
    for item in self.loader:
      if item is None:
        continue
      images, labels, counts = item
      self.bad += int(counts[0])
      self.repeated += int(counts[1])
      yield images, labels


def load_test_share(urls, rank, world_size, strict):
  """This replica's test samples as tensors: shard r, r + world_size, ... of the list.

  Read once and kept in host memory (10k CIFAR images are 30 MB), so that each replica
  knows its count and all can agree on one number of evaluation steps.
  """
  bad = [0]
  samples = list(read_samples(urls[rank::world_size], bad_data_handler(strict, bad)))
  if not samples:
    return torch.zeros(0, 3, SIDE, SIDE, dtype=torch.uint8), torch.zeros(0, dtype=torch.int64)
  images, labels = zip(*samples)
  return to_tensors(np.stack(images), labels)


def load_data(cfg, rank, world_size):
  """The train loader (counted, capped at the epoch's steps), its dataset, the test loader
  and its sample count. Every replica gets the same number of train and test batches."""
  train_urls, test_urls = expand_urls(cfg.wds_traindir), expand_urls(cfg.wds_testdir)
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
  steps = min(steps, cfg.num_steps or sys.maxsize)
  train_set = TrainShards(train_urls, rank, world_size, cfg.batch_size, steps,
                          cfg.shuffle_buffer, cfg.seed, cfg.fail_on_bad_data)
  workers = dict(num_workers=cfg.num_workers, worker_init_fn=utils.ignore_sigterm)
  if cfg.num_workers:  # torch 2.9 raises on these without workers.
    workers.update(persistent_workers=True, prefetch_factor=cfg.prefetch_factor)
  train_loader = CountedBatches(torch.utils.data.DataLoader(train_set, batch_size=None, **workers))

  images, labels = load_test_share(test_urls, rank, world_size, cfg.fail_on_bad_data)
  # The replica with the most test samples sets the steps; the others pad (label -1).
  most = xm.mesh_reduce('test_share', len(labels), max)
  pad = math.ceil(most / cfg.test_set_batch_size) * cfg.test_set_batch_size - len(labels)
  test_set = torch.utils.data.TensorDataset(
      torch.cat([images, torch.zeros(pad, 3, SIDE, SIDE, dtype=torch.uint8)]),
      torch.cat([labels, torch.full((pad,), -1, dtype=torch.int64)]))
  test_loader = torch.utils.data.DataLoader(test_set, cfg.test_set_batch_size)
  return (utils.CappedLoader(train_loader, steps), train_set,
          utils.CappedLoader(test_loader, cfg.num_steps or sys.maxsize))


# ----------------------------------------------------------------------------- model


class Normalize(torch.nn.Module):
  """uint8 images to normalised floats, on the device: the host sends a quarter of the bytes."""

  def __init__(self, mean, std):
    super().__init__()
    self.register_buffer('mean', torch.tensor(mean).view(1, 3, 1, 1) * 255)
    self.register_buffer('std', torch.tensor(std).view(1, 3, 1, 1) * 255)

  def forward(self, images):
    return (images.float() - self.mean) / self.std


def cifar_resnet(name, num_classes):
  """A torchvision ResNet with the usual CIFAR stem: a 3x3 stride-1 first convolution and
  no max-pool. The ImageNet stem (7x7 stride 2, then a max-pool) would shrink 32x32
  images to 8x8 before the first block and cost accuracy."""
  model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
  model.conv1 = torch.nn.Conv2d(3, model.conv1.out_channels, 3, 1, 1, bias=False)
  torch.nn.init.kaiming_normal_(model.conv1.weight, mode='fan_out', nonlinearity='relu')
  model.maxpool = torch.nn.Identity()
  return torch.nn.Sequential(Normalize(CIFAR_MEAN, CIFAR_STD), model)


# ------------------------------------------------------------------------------ loop


def train_step(model, optimizer, scheduler, images, labels):
  optimizer.zero_grad()
  loss = F.cross_entropy(model(images), labels)
  loss.backward()
  xm.optimizer_step(optimizer)  # All-reduces the gradients over every replica, then steps.
  if scheduler is not None:
    scheduler.step()
  return loss


def train_one_epoch(model, optimizer, scheduler, loader, epoch, first_step, global_step, cfg,
                    writer, stop, checkpoint):
  """Trains the epoch from step first_step on; returns (steps run, whether SIGTERM stopped it)."""
  device, ordinal = torch_xla.device(), xr.global_ordinal()
  tracker = xm.RateTracker()
  model.train()
  steps = 0
  for step, (images, labels) in enumerate(loader, first_step):
    with xp.StepTrace('train_step', step_num=step):  # Named steps in a profile; ends in a sync.
      loss = train_step(model, optimizer, scheduler, images, labels)
      tracker.add(cfg.batch_size)
      if step % cfg.log_steps == 0:
        lr = optimizer.param_groups[0]['lr']
        xm.add_step_closure(utils.log_training_step, args=(
            device, ordinal, epoch, step, global_step + steps, loss, tracker, lr, writer))
      stopping = stop.agreed_after_step(device)  # The same answer on every replica.
    steps += 1
    if stopping:
      return steps, True
    if cfg.ckpt_dir and cfg.ckpt_every_steps and (global_step + steps) % cfg.ckpt_every_steps == 0:
      checkpoint(epoch, step + 1, global_step + steps)
  return steps, False


def evaluate(model, loader):
  """(accuracy %, correct, total) over all replicas; padding (label -1) is not counted."""
  device = torch_xla.device()
  model.eval()
  # Counted on the device and read once at the end: an .item() per step would sync.
  counts = torch.zeros(2, dtype=torch.int64, device=device)
  with torch.no_grad():
    for images, labels in loader:
      hits = (model(images).argmax(dim=1) == labels).sum()
      counts += torch.stack([hits, (labels >= 0).sum()])
  # Sums, not a mean of replica accuracies: replicas may hold different numbers of images.
  correct, total = xm.all_reduce(xm.REDUCE_SUM, counts).tolist()
  return 100.0 * correct / max(total, 1), correct, total


def save_checkpoint(cfg, model, optimizer, scheduler, results, epoch, step, global_step,
                    best=False):
  """Saves the whole training state after `step` steps of `epoch`; returns its path. Every
  replica calls it at the same step; the master writes."""
  state = dict(model=model.state_dict(), optimizer=optimizer.state_dict(),
               lr_scheduler=scheduler.state_dict() if scheduler else None, epoch=epoch,
               step=step, global_step=global_step, rng=utils.rng_state(), flags=vars(cfg),
               results=results)
  return utils.save_checkpoint(state, cfg.ckpt_dir, cfg.keep_checkpoints, best)


def train(cfg):
  """The whole run of one replica; returns the results dict that --results_json writes."""
  stop = utils.StopRequest()
  torch.manual_seed(cfg.seed)
  rank, world_size, device = xr.global_ordinal(), xr.world_size(), torch_xla.device()
  train_loader, train_set, test_loader = load_data(cfg, rank, world_size)
  steps_per_epoch = train_loader.num_batches
  model = cifar_resnet(cfg.model, cfg.num_classes).to(device)
  xm.broadcast_master_param(model)  # Every replica starts from the master's weights.
  optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                              weight_decay=cfg.weight_decay)
  scheduler = None
  if cfg.lr_scheduler_type == 'WarmupAndExponentialDecayScheduler':
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: utils.warmup_step_decay(
        step, steps_per_epoch, cfg.lr_warmup_epochs, cfg.lr_scheduler_divide_every_n_epochs,
        cfg.lr_scheduler_divisor))
  writer = utils.summary_writer(cfg.logdir) if xm.is_master_ordinal() else None
  # The server lives as long as this reference: keep it until training ends.
  profiler = xp.start_server(cfg.profiler_port + xr.local_ordinal()) if cfg.profile else None
  prefetch = dict(loader_prefetch_size=cfg.loader_prefetch_size,
                  device_prefetch_size=cfg.device_prefetch_size,
                  host_to_device_transfer_threads=cfg.host_to_device_transfer_threads)
  train_device_loader = pl.MpDeviceLoader(train_loader, device, **prefetch)
  test_device_loader = pl.MpDeviceLoader(test_loader, device, **prefetch)

  results = dict(model=cfg.model, world_size=world_size, epochs=0, train_steps=0,
                 max_accuracy=0.0, final_accuracy=0.0, eval_correct=0, eval_samples=0,
                 epoch_rates=[], epoch_device_busy=[], compilations_after_epoch=[],
                 skipped_bad_data=0, repeated_samples=0, train_seconds=0.0,
                 bf16=os.environ.get('XLA_USE_BF16') == '1')
  first_epoch, first_step = 1, 0
  path, state = utils.replica_checkpoint(cfg.resume, cfg.ckpt_dir)
  if state is not None:
    first_epoch, first_step, results = utils.restore(
        state, path, model, optimizer, scheduler, vars(cfg), cfg.num_classes,
        report=xm.is_master_ordinal())
    if first_epoch > cfg.num_epochs:
      xm.master_print(f'Run already finished: {path} is the end of epoch {first_epoch - 1} '
                      f'(--num_epochs {cfg.num_epochs})')
      return results
    xm.master_print(f'Resumed from {path} at epoch {first_epoch} step {first_step}')
  checkpoint = functools.partial(save_checkpoint, cfg, model, optimizer, scheduler, results)

  for epoch in range(first_epoch, cfg.num_epochs + 1):
    # Shard order, shuffle and crops: a function of (seed, epoch); a resumed run reads the
    # batches it has trained without using them.
    train_set.set_epoch(epoch, skip=first_step)
    train_loader.start = first_step
    xm.master_print(f'Epoch {epoch} train begin {utils.now()}')
    start, executed = time.time(), utils.execute_seconds()
    steps, stopped = train_one_epoch(model, optimizer, scheduler, train_device_loader, epoch,
                                     first_step, results['train_steps'], cfg, writer, stop,
                                     checkpoint)
    train_loader.check()
    xm.wait_device_ops()  # Time the device work, not just the tracing.
    utils.flush_training_log()  # Its lines before the epoch's.
    seconds = time.time() - start
    busy = (utils.execute_seconds() - executed) / seconds  # Device time / wall time.
    counted = train_loader.loader
    results['train_steps'] += steps
    results['train_seconds'] += seconds
    results['skipped_bad_data'] += counted.bad
    results['repeated_samples'] += counted.repeated
    if stopped:
      return stop_run(cfg, checkpoint, results, epoch, first_step + steps)
    print(f'Epoch {epoch} Replica Train Samples={steps * cfg.batch_size} '
          f'Device={device}/{rank}', flush=True)
    if counted.repeated:
      print(f'Epoch {epoch} Replica {rank}: its shards ran out; {counted.repeated} samples were '
            'read a second time to run the same steps as every replica', flush=True)
    if counted.bad:
      print(f'Epoch {epoch} Replica {rank}: skipped {counted.bad} bad shards or samples',
            flush=True)
    rate = xm.mesh_reduce('epoch_rate', steps * cfg.batch_size / seconds, sum)
    xm.master_print(f'Epoch {epoch} train end {utils.now()}, Reduced GlobalRate={rate:.2f}')

    accuracy, correct, total = evaluate(model, test_device_loader)
    test_loader.check()
    xm.master_print(f'Epoch {epoch} test end {utils.now()}, Accuracy={accuracy:.2f}')
    if epoch == 1 and not cfg.num_steps and total != cfg.testsize:
      xm.master_print(f'warning: evaluated {total} test samples but --testsize is {cfg.testsize}')
    utils.write_scalars(writer, epoch, {'Accuracy/test': accuracy})
    if cfg.metrics_debug:
      xm.master_print(met.metrics_report())

    best = accuracy > results['max_accuracy']
    results.update(epochs=epoch, final_accuracy=accuracy, eval_correct=correct,
                   eval_samples=total, max_accuracy=max(results['max_accuracy'], accuracy))
    if steps:
      results['epoch_rates'].append(rate)
      results['epoch_device_busy'].append(busy)
    results['compilations_after_epoch'].append(utils.compile_count())
    if cfg.ckpt_dir:
      checkpoint(epoch + 1, 0, results['train_steps'], best=best)
    if stop.agreed_at_epoch_end():
      return stop_run(cfg, checkpoint, results, epoch + 1, 0)
    first_step = 0

  if writer is not None:
    writer.close()
  del profiler
  results['train_samples'] = results['train_steps'] * cfg.batch_size * world_size
  results['global_rate'] = results['train_samples'] / max(results['train_seconds'], 1e-9)
  results['compilations'] = utils.compile_count()
  xm.master_print(f'Total train time: {results["train_seconds"]:.1f} s')
  xm.master_print(f'Max Accuracy: {results["max_accuracy"]:.2f}%')
  return results


def stop_run(cfg, checkpoint, results, epoch, step):
  """The end of a run stopped by SIGTERM at a step boundary: saves, says so."""
  saved = checkpoint(epoch, step, results['train_steps']) if cfg.ckpt_dir else None
  xm.master_print(f'Stopped by SIGTERM at epoch {epoch} step {step}: ' +
                  (f'saved {saved}; run the same command to resume' if saved else
                   'nothing saved (no --ckpt_dir)') + f' (exit code {utils.EXIT_PREEMPTED})')
  results['preempted'] = True
  return results


def _mp_fn(index, flag_values):
  """One replica. flag_values is a plain dict: absl's FLAGS do not cross the spawn."""
  del index  # The global ordinal comes from the runtime.
  utils.exit_with_launcher()
  cfg = SimpleNamespace(**flag_values)
  try:
    results = train(cfg)
  except (utils.UsageError, utils.BadDataError) as e:
    utils.die(e)
  finally:
    utils.end_loader_workers()
  if xm.is_master_ordinal():
    utils.write_results(cfg.results_json, results)
  if results.get('preempted'):
    sys.exit(utils.EXIT_PREEMPTED)
  if results['final_accuracy'] < cfg.target_accuracy:
    xm.master_print(f'Accuracy {results["final_accuracy"]:.2f} is below target '
                    f'{cfg.target_accuracy:.2f}')
    sys.exit(EXIT_BELOW_TARGET)


def main(argv):
  del argv
  missing = [f'--{name}' for name in REQUIRED_FLAGS if FLAGS[name].value is None]
  if missing:
    utils.die(f'{" ".join(missing)} must be given (see --helpshort)')
  if FLAGS.bf16:
    os.environ['XLA_USE_BF16'] = '1'  # Inherited by the spawned replicas.
  # Check the shards here, once, before any replica starts: bad input is one line, not N.
  for flag in ('wds_traindir', 'wds_testdir'):
    urls = expand_urls(FLAGS[flag].value)
    missing = missing_shards(urls)
    if len(missing) == len(urls):
      utils.die(f'--{flag}: no shard found at {FLAGS[flag].value} (first: {urls[0]}); check the '
                'path or URL and the {first..last} range')
    if missing:
      message = f'--{flag}: {len(missing)} of {len(urls)} shards do not exist, e.g. {missing[0]}'
      if FLAGS.fail_on_bad_data:
        utils.die(f'{message}: fix the pattern, or drop --fail_on_bad_data to skip them')
      print(f'warning: {message}; they will be skipped', file=sys.stderr, flush=True)
  if FLAGS.ckpt_dir:
    try:
      utils.check_checkpoint_dir(FLAGS.ckpt_dir)
    except utils.UsageError as e:
      utils.die(e)
  utils.forward_sigterm_to_replicas(single_process=FLAGS.num_cores == 1)
  torch_xla.launch(_mp_fn, args=(FLAGS.flag_values_dict(),),
                   debug_single_process=FLAGS.num_cores == 1)


if __name__ == '__main__':
  app.run(main, flags_parser=utils.parse_flags)
elif __name__ == '__mp_main__':
  # A replica process of torch_xla.launch imports this file in its main thread, the only
  # one that may catch a signal; train() runs in another thread.
  utils.stop_on_sigterm()
