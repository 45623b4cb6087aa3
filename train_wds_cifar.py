# SPDX-License-Identifier: BSD-3-Clause
"""Trains a ResNet on CIFAR-10, or ImageNet, streamed from WebDataset tar shards, on every
XLA device.

The shards (written by make_cifar_shards.py, or public ones with a jpg and a cls file per
sample) are read from a local folder, http(s), gs:// or any fsspec URL, or a pipe: command.
As in the Cloud TPU WebDataset tutorial and article they are dealt out to the replicas of all
hosts and to the loader workers of each replica, read sequentially and shuffled in memory;
unlike them, every replica runs the same number of steps, the shard order changes every
epoch, and every test sample is counted once.

  python make_cifar_shards.py --cifar_dir data/cifar-10-batches-py --output shards/cifar
  python train_wds_cifar.py --trainsize 50000 --testsize 10000 \
      --wds_traindir 'shards/cifar-train-{000000..000049}.tar' \
      --wds_testdir 'shards/cifar-test-{000000..000009}.tar'

ImageNet (its JPEGs as they are, in 640 shards, with ImageNet's recipe; see docs/pods.md
for a pod):
  python make_cifar_shards.py --image_folder imagenet --output gs://my-bucket/imagenet/imagenet \
      --samples_per_shard 2002
  python train_wds_cifar.py --img_dim 224 --model resnet50 --bf16 --trainsize 1281167 --testsize 50000 \
      --wds_traindir 'gs://my-bucket/imagenet/imagenet-train-{000000..000639}.tar' \
      --wds_testdir 'gs://my-bucket/imagenet/imagenet-val-{000000..000024}.tar' \
      --ckpt_dir gs://my-bucket/imagenet-run1

With --ckpt_dir, the same command started again goes on exactly where the last one stopped
(the epoch's stream is rebuilt from (seed, epoch); trained batches are read, not used).
SIGTERM or SIGHUP (Ctrl-C): every replica finishes the same step, the master saves, exit code 75
(130).
"""

import asyncio
import bz2
import contextlib
import gzip
import io
import itertools
import lzma
import math
import os
import random
import re
import socket
import sys
import tarfile
import time
import zlib
from types import SimpleNamespace

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string('wds_traindir', None, 'Training shards: a brace pattern of paths or URLs, e.g. '
                    "'gs://bucket/cifar-train-{000000..000639}.tar'.")
flags.DEFINE_string('wds_testdir', None, 'Test shards, the same way.')
flags.DEFINE_integer('trainsize', None, 'Training samples in the shards (all of them).', lower_bound=1)
flags.DEFINE_integer('testsize', None, 'Test samples in the shards (all of them): checked, a '
                     'warning if the test shards hold another number; a loader worker reads at '
                     'most twice it (unset: twice --trainsize).', lower_bound=1)
REQUIRED_FLAGS = ['wds_traindir', 'trainsize', 'wds_testdir']  # Of a command (see its entry point).
flags.DEFINE_integer('shuffle_buffer', 10000, 'Samples each loader worker shuffles.', lower_bound=1)
flags.DEFINE_bool('fail_on_bad_data', False, 'Stop at a bad shard or sample instead of skipping it.')
flags.DEFINE_float('read_timeout', 20, 'Seconds in which each piece of a remote shard must arrive, '
                   'or the read is tried again (see docs/scripts.md).', lower_bound=0.1)
flags.DEFINE_string('model', 'resnet18', 'A torchvision ResNet (resnet18, resnet50, resnext50_32x4d, '
                    'wide_resnet50_2, ...), given the CIFAR stem, or a name build_model knows.')
flags.DEFINE_integer('num_classes', None, 'Number of classes (labels 0..N-1). Unset: the lines of '
                     'PREFIX-classes.txt beside PREFIX-train-{...}.tar (make_cifar_shards.py '
                     "writes it), else CIFAR-10's 10.", lower_bound=2)
flags.DEFINE_integer('img_dim', 32, 'Side of the images the model gets. Images of this size are '
                     'cropped from them padded by an eighth (CIFAR), others as ImageNet\'s recipe '
                     'crops (RandomResizedCrop; evaluation: resize, centre crop). Up to 32: the '
                     "CIFAR stem and CIFAR-10's mean and std; above (ImageNet: 224): the torchvision "
                     "model as it is and ImageNet's.", lower_bound=8)
flags.DEFINE_integer('num_cores', None, '1: one process, to debug (unset: one per local device).',
                     lower_bound=1, upper_bound=1)
flags.DEFINE_integer('batch_size', 128, 'Training batch size of each replica.', lower_bound=1)
flags.DEFINE_integer('gradient_accumulation_steps', 1, 'Batches of --batch_size whose gradients '
                     'make one optimizer step: a batch this many times larger at the same memory.',
                     lower_bound=1)
flags.DEFINE_integer('test_set_batch_size', 64, 'Evaluation batch size of each replica.', lower_bound=1)
flags.DEFINE_integer('num_epochs', None, 'Number of epochs (default: the recipe\'s, 30 for CIFAR-10, '
                     '18 for ImageNet).', lower_bound=1)
flags.DEFINE_integer('eval_interval', 1, 'Evaluate after every this many epochs, and after the last.',
                     lower_bound=1)
flags.DEFINE_bool('test_only_at_end', False, 'Evaluate after the last epoch only.')
flags.DEFINE_integer('num_steps', None, 'Cap on training (optimizer) and evaluation steps per epoch.',
                     lower_bound=1)
flags.DEFINE_integer('log_steps', 20, 'Print a training line every this many steps.', lower_bound=1)
flags.DEFINE_float('lr', None, 'Peak learning rate (SGD; default: the recipe\'s, 0.5 for resnet50 '
                   'above 32 px, else 0.1).', lower_bound=0.0)
flags.DEFINE_enum('lr_scheduler_type', None, ['WarmupAndExponentialDecayScheduler', 'none'],
                  'Linear warm-up, then division every N epochs; or a constant rate (default: '
                  'the recipe\'s, WarmupAndExponentialDecayScheduler for resnet50 above 32 px).')
flags.DEFINE_float('lr_warmup_epochs', 0.9, 'Epochs of linear warm-up from 0.', lower_bound=0.0)
flags.DEFINE_integer('lr_scheduler_divide_every_n_epochs', 20, 'LR division period.', lower_bound=1)
flags.DEFINE_float('lr_scheduler_divisor', 5, 'What the LR is divided by.', lower_bound=1.0)
flags.DEFINE_float('momentum', 0.9, 'SGD momentum, below 1.', lower_bound=0.0)
flags.register_validator('momentum', lambda m: m < 1, 'give a momentum below 1, such as 0.9: at 1 '
                         'or more each step adds all of the last one, and the weights run away')
flags.DEFINE_float('weight_decay', None, 'SGD weight decay (default: the recipe\'s, 5e-4 for '
                   'CIFAR-10, 1e-4 for ImageNet).', lower_bound=0.0)
flags.DEFINE_integer('seed', 42, 'Seed of the weights, the shard order, the shuffle and the crops.')
flags.DEFINE_integer('num_workers', 4, 'DataLoader worker processes per replica.', lower_bound=0)
flags.DEFINE_integer('prefetch_factor', None, 'Batches each loader worker loads ahead.', lower_bound=1)
flags.DEFINE_integer('loader_prefetch_size', 8, 'Host batches MpDeviceLoader queues.', lower_bound=1)
flags.DEFINE_integer('device_prefetch_size', 4, 'Device batches MpDeviceLoader queues.', lower_bound=1)
flags.DEFINE_integer('host_to_device_transfer_threads', 1, 'Host-to-device copy threads.', lower_bound=1)
flags.DEFINE_bool('bf16', False, 'Train in bfloat16: sets XLA_USE_BF16=1 before the spawn.')
flags.DEFINE_bool('amp', False, 'Mixed precision: forward and loss autocast to bfloat16, weights and '
                  'optimizer in float32 (see docs/tpu.md).')
flags.DEFINE_enum('mat_mul_precision', 'default', ['default', 'high', 'highest'], 'Float32 matrix products and convolutions on a TPU: 1, 3 or 6 bfloat16 passes (docs/tpu.md).')
flags.DEFINE_float('target_accuracy', 0.0, 'Exit with code 21 if the final accuracy (%) is below it.')
flags.DEFINE_string('ckpt_dir', None, 'Save checkpoints here, resume from the newest (pod: gs://...).')
flags.DEFINE_integer('ckpt_every_steps', None, 'Also save every N steps.', lower_bound=1)
flags.DEFINE_integer('keep_checkpoints', 2, 'Checkpoints kept, besides best.pt.', lower_bound=1)
flags.DEFINE_string('resume', None, 'Resume from this checkpoint instead of the newest in --ckpt_dir.')
flags.DEFINE_string('compile_cache_dir', None, "torch_xla's compile cache, on this host's disk: a restart loads graphs, not compiles (TPU).")
flags.DEFINE_string('logdir', None, 'TensorBoard folder for loss, rate, lr and accuracy (master only).')
flags.DEFINE_bool('metrics_debug', False, "Print torch_xla's metrics report after each epoch.")
flags.DEFINE_bool('debug_graphs', False, "Say why each graph compiled after epoch 1 did (torch_xla's analysis).")
flags.DEFINE_bool('profile', False, 'Start the profiler server so TensorBoard can capture a trace.')
flags.DEFINE_integer('profiler_port', 9012, 'Profiler port of local replica 0 (replica i: + i).')
flags.DEFINE_integer('profile_step', None, 'Capture a trace of each host\'s first replica from this '
                     'step on (counted from the run\'s start, as checkpoints count), into '
                     '--profile_logdir.', lower_bound=0)
flags.DEFINE_integer('profile_duration_ms', 5000, 'How long --profile_step traces.', lower_bound=1)
flags.DEFINE_string('profile_logdir', None, "Folder (or gs://) for --profile_step's trace "
                    '(default: --logdir), which TensorBoard\'s profile tab reads.')
flags.register_multi_flags_validator(
    ['profile_step', 'profile_logdir', 'logdir'],
    lambda f: f['profile_step'] is None or bool(f['profile_logdir'] or f['logdir']),
    '--profile_step needs a folder for its trace: give --profile_logdir DIR (or --logdir)')
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

import aiohttp
import braceexpand
import fsspec
import fsspec.asyn
import fsspec.implementations.local
import numpy as np
import PIL.Image
import requests
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
from torchvision.transforms import v2

import utils

try:  # Optional: checks before the run starts and a watch over its processes (see its docstring).
  import supervisor
except ModuleNotFoundError as e:
  if e.name != 'supervisor':
    raise
  supervisor = None

utils.redefinable(FLAGS)  # A notebook may import several scripts or %run one again.

# What the flags not given come from: CIFAR-10's usual recipe at its 32 px and below; above, the
# image-folder scripts' ImageNet recipe (their defaults), upstream's tuned one for resnet50 (as
# train_resnet_mp.py chooses it).
CIFAR_RECIPE = dict(lr=0.1, lr_scheduler_type='none', weight_decay=5e-4, num_epochs=30)
IMAGENET_RECIPE = dict(lr=0.1, lr_scheduler_type='none', weight_decay=1e-4, num_epochs=18)
MODEL_RECIPES = {'resnet50': dict(lr=0.5, lr_scheduler_type='WarmupAndExponentialDecayScheduler')}
NO_TEST_SAMPLE = 'no test sample was read (see the warnings above): no accuracy'
# Flags that decide an epoch's stream of batches: a resume with another value warns. (The
# loader workers deal the shards among them.)
BATCH_FLAGS = ('wds_traindir', 'trainsize', 'batch_size', 'gradient_accumulation_steps', 'seed',
               'num_steps', 'img_dim', 'shuffle_buffer', 'num_workers')
# Flags of the image-folder scripts that a user may bring here.
ELSEWHERE = {'datadir': 'give the shards with --wds_traindir and --wds_testdir (see '
                        'make_cifar_shards.py); --datadir belongs to the image-folder scripts',
             'fake_data': 'this script trains on shards; --fake_data belongs to the '
                          'image-folder scripts'}


# ------------------------------------------------------------- your data and your model
# The shards: each sample is an image file and KEY.cls (the label as ASCII digits). The image is
# KEY.rgb (CIFAR-10 as make_cifar_shards.py writes it: 3,072 raw bytes, 32x32x3 uint8, height x
# width x channel, decoded in about 1 us where a 32x32 PNG takes 50), or an image file as it was
# (make_cifar_shards.py --image_folder: ImageNet's JPEGs; public WebDataset sets), or one that
# webdataset's ShardWriter writes from a PIL image or a numpy array: tried in this order.
IMAGE_KEYS = ('rgb', 'ppm', 'png', 'jpg', 'jpeg', 'webp', 'npy')
PPM_HEADER = re.compile(rb'P6\s+(\d+)\s+(\d+)\s+255\s')  # 8-bit binary RGB, no comment.
RGB_SIDE = 32  # An rgb file is a 32x32 RGB image.
CIFAR_CLASSES = 10  # Without --num_classes or a classes file beside the shards.
CIFAR_SIDE = 32  # --img_dim up to this trains CIFAR's way (see build_model, mean_std).
# Per-channel mean and std of CIFAR-10's training pixels (0 to 1), for mean_std.
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class BadSample(ValueError):
  """A sample that cannot be used, saying why; at(where) says where it is too."""

  def at(self, where):
    return type(self)(f'{where} {self}')


class ForeignSample(BadSample):
  """A sample that is not one of a set this script can read (its files, its label): one line at
  start, not a warning for each (supervisor.check_format reads `foreign`)."""
  foreign = True


def parse(sample, num_classes):
  """(image file key, its bytes, label) of a sample as the tar holds it: the first file of
  IMAGE_KEYS it has, the label from its cls file. Shards of another image format: add its
  file extension to IMAGE_KEYS (and its decoding to decode). A sample that cannot be used
  raises BadSample saying why: it alone is skipped, with a warning (--fail_on_bad_data: the
  run ends in that line), and the rest of its shard is read; ForeignSample, shards of another
  format, is one line at start. Anything else it raises is a bug: a traceback that ends here."""
  image_key = next((key for key in IMAGE_KEYS if key in sample), None)
  if image_key is None or 'cls' not in sample:
    found = ', '.join(sorted(key for key in sample if not key.startswith('__'))) or 'no file'
    raise ForeignSample(f'holds {found}, where an image ({", ".join(IMAGE_KEYS)}) and a label '
                        "(cls) are expected: write the shards with such keys (ShardWriter and "
                        "{'jpg': image file bytes, 'cls': int}, or make_cifar_shards.py), or "
                        'teach this script theirs: IMAGE_KEYS (the image file\'s extension), parse '
                        '(where the label is) and decode (how the image reads)')
  try:
    label = int(sample['cls'])
  except ValueError:
    raise BadSample(f'has a cls label that is not a number ({sample["cls"][:20]!r})') from None
  if not 0 <= label < num_classes:
    raise ForeignSample(f'has label {label}, past {num_classes} classes (labels 0 to '
                        f'{num_classes - 1}): give --num_classes, the number of the shards\' '
                        'classes (1000 for ImageNet)')
  if image_key == 'rgb' and len(sample['rgb']) != RGB_SIDE * RGB_SIDE * 3:
    raise BadSample(f'holds {len(sample["rgb"])} bytes of rgb, where a 32x32 image has 3,072')
  return image_key, sample[image_key], label


def decode(image_key, data):
  """The image of an image file of a sample as a uint8 tensor (3 x H x W): rgb (raw 32x32x3
  bytes) and npy (uint8 H x W x 3) by numpy, a binary ppm (P6, 8-bit) without PIL, any other as the
  image-folder scripts read files (utils.decode_image: JPEG by libjpeg-turbo; PNG, WebP, GIF,
  BMP, TIFF and the other formats PIL opens): for shards of .bmp or .tiff files, adding the
  extension to IMAGE_KEYS is all it takes. What
  PIL and numpy raise of an image that cannot be decoded, a ValueError, OSError or EOFError
  anywhere in its try, is a BadSample: skipped, its place in the batch taken by another.
  Anything else is a bug: a traceback that ends here."""
  try:
    if image_key == 'rgb':
      image = np.frombuffer(data, np.uint8).reshape(RGB_SIDE, RGB_SIDE, 3)
    elif image_key == 'npy':
      image = np.load(io.BytesIO(data), allow_pickle=False)
      if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f'a {image.dtype} array of shape {image.shape}, not uint8 H x W x 3')
    elif image_key == 'ppm' and (header := PPM_HEADER.match(data)):  # Raw RGB: no PIL needed.
      width, height = int(header[1]), int(header[2])
      utils.check_pixels(width, height)
      image = np.frombuffer(data, np.uint8, width * height * 3, header.end())
      image = image.reshape(height, width, 3)
    else:
      return utils.decode_image(data)
  except (ValueError, OSError, EOFError) as e:  # What PIL and numpy raise.
    raise BadSample(f'has no readable {image_key} image ({e})') from None
  return torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1)))


class Views:
  """What the model gets of an image (uint8, 3 x H x W): side x side uint8, the images of a
  batch all one shape. In training a random view: an image of that size already (CIFAR's
  32x32) is cropped from it padded by an eighth (4 px at 32), any other is cropped and
  resized as torchvision's ImageNet recipe does (RandomResizedCrop); then flipped or not. In
  evaluation an image of that size as it is, any other resized to 256/224 of it and its
  centre cropped (as the image-folder scripts do)."""

  def __init__(self, side):
    self.side, self.pad = side, side // 8
    self.resized_crop = v2.RandomResizedCrop(side)
    self.centre = v2.Compose([v2.Resize(side * 256 // 224), v2.CenterCrop(side)])

  def train(self, image, draws):
    """The view that draws (3 numbers in [0, 1) of this sample alone) choose: the same with or
    without a resume, in any loader worker."""
    if image.shape[-2:] == (self.side, self.side):
      top, left = (int(draw * (2 * self.pad + 1)) for draw in draws[:2])  # A few us, in numpy.
      view = F.pad(image, [self.pad] * 4)[:, top:top + self.side, left:left + self.side]
    else:
      with utils.seeded(int(draws[0] * 2**53)):  # v2's transforms draw from torch's RNG.
        view = self.resized_crop(image)
    return view.flip(-1) if draws[2] < 0.5 else view

  def eval(self, image):
    return image if image.shape[-2:] == (self.side, self.side) else self.centre(image)


def build_optimizer(cfg, model):
  """The optimizer of the model's parameters: SGD with --lr, --momentum and --weight_decay. Put
  yours here (docs/adapt.md shows AdamW); a restore gives back its state_dict whatever it holds.
  A flag value it cannot take: raise utils.UsageError (one `error:` line, exit code 2)."""
  return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                         weight_decay=cfg.weight_decay)


def build_model(cfg, num_classes):
  """The model to train: a torch.nn.Module from a float batch (N, 3, img_dim, img_dim) to
  logits (N, num_classes); the shards' uint8 images are normalised in the step, on the
  device (see mean_std). Here: the torchvision ResNet --model names, at CIFAR's 32 px and
  below with the CIFAR stem. Put yours here; a --model name of your own is then accepted.
  Images of another format: the place is parse and decode. Called in main, to check, and in
  every replica. A --model it cannot build: raise utils.UsageError saying what to give (one
  `error:` line, exit code 2); anything else it raises is a bug: a traceback."""
  if not cfg.model.startswith(('resnet', 'resnext', 'wide_resnet')):
    raise utils.UsageError(f'--model {cfg.model} is not a torchvision ResNet (resnet18, resnet50, '
                           'resnext50_32x4d, ...): name one, or build yours in build_model')
  model = utils.create_model(cfg.model, num_classes)
  return cifar_stem(model) if cfg.img_dim <= CIFAR_SIDE else model


def cifar_stem(model):
  """A torchvision ResNet with the usual CIFAR stem: a 3x3 stride-1 first convolution and
  no max-pool. The ImageNet stem (7x7 stride 2, then a max-pool) would shrink 32x32
  images to 8x8 before the first block and cost accuracy."""
  model.conv1 = torch.nn.Conv2d(3, model.conv1.out_channels, 3, 1, 1, bias=False)
  torch.nn.init.kaiming_normal_(model.conv1.weight, mode='fan_out', nonlinearity='relu')
  model.maxpool = torch.nn.Identity()
  return model


def mean_std(img_dim):
  """The per-channel mean and std (of pixels 0 to 1) that the step normalises the shards'
  uint8 images by, on the device (utils.normalize): CIFAR-10's at its 32 px and below,
  ImageNet's above."""
  if img_dim <= CIFAR_SIDE:
    return CIFAR_MEAN, CIFAR_STD
  return utils.IMAGENET_MEAN, utils.IMAGENET_STD


# ------------------------------------------------------------------------- the pipeline
class BadData:
  """The error policy that read_samples hands each failure to (as webdataset's handler=): a
  missing or corrupt shard or sample is raised (strict), or counted in counts[slot] with a
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

  def __call__(self, error):
    message = str(error)
    if self.strict:
      raise utils.BadDataError(f'{message}: replace it, or drop --fail_on_bad_data to skip it')
    if message in self.seen:  # Read again, to fill the epoch (see TrainShards.samples).
      return
    self.seen.add(message)
    self.counts[self.slot] += 1
    shown = int(self.counts.sum())
    if shown <= self.SHOWN:
      more = ' (more are counted, not shown: see the count at the end)' if shown == self.SHOWN else ''
      # One write: the loader workers share stderr, and print's two (text, newline) could
      # interleave with another worker's into one line.
      sys.stderr.write(f'warning: {message}; skipped{more}\n')
      sys.stderr.flush()


def worker_share():
  """(this loader worker, the number of them): (0, 1) without workers."""
  info = torch.utils.data.get_worker_info()
  return (info.id, info.num_workers) if info else (0, 1)


class TrainShards(torch.utils.data.IterableDataset):
  """This replica's shuffled training batches of an epoch, `batches` of them (cfg gives
  batch_size, shuffle_buffer, img_dim, num_classes, seed, fail_on_bad_data). A worker whose
  shards run out reads them again until the epoch has its batches: every replica runs the
  same steps. The loader workers live through the run (persistent_workers), so the epoch and
  first batch, and each worker's counts of bad data, re-read samples and samples its shards
  lack, are in shared memory."""

  def __init__(self, urls, rank, world_size, batches, cfg):
    self.urls, self.rank, self.world_size, self.batches, self.cfg = urls, rank, world_size, batches, cfg
    self.views = Views(cfg.img_dim)
    self.epoch_and_batch = torch.zeros(2, dtype=torch.int64).share_memory_()
    self.counts = torch.zeros(max(1, cfg.num_workers), 3, dtype=torch.int64).share_memory_()

  def set_epoch(self, epoch, first_batch=0):
    self.epoch_and_batch[:] = torch.tensor([epoch, first_batch])
    self.counts.zero_()

  def read_counts(self):
    """(bad shards or samples skipped, samples read twice, samples the shards lack of what
    --trainsize says) in this epoch so far."""
    return self.counts.sum(0).tolist()

  def shards(self, epoch, worker, num_workers):
    """The shards of one loader worker in an epoch. The list is shuffled the same way on every
    replica (from seed and epoch), then dealt out: replica r takes every world_size-th shard
    from r, and its worker w every num_workers-th of those. Every shard goes to one (replica,
    worker) an epoch. Needs len(urls) >= world_size * num_workers."""
    order = list(self.urls)
    random.Random(f'{self.cfg.seed}/{epoch}').shuffle(order)
    return order[self.rank::self.world_size][worker::num_workers]

  def samples(self, shards, rng, on_bad, worker):
    """The samples of the shards (see read_samples) with the pass, pass after pass, each pass
    in a new shard order and shuffled in a buffer of its own: every sample once before any
    twice. The buffer holds them undecoded (ImageNet's JPEGs: 110 KB each, a tenth of their
    pixels); it sends one for every two it reads until full, starting once it holds a batch.
    Shards that hold a shard's worth less than their share of --trainsize are counted: a
    short last shard is the writer's way, fewer is a wrong --trainsize or lost data."""
    for pass_number in itertools.count():
      shuffle = wds.shuffle(self.cfg.shuffle_buffer, initial=self.cfg.batch_size, rng=rng)
      read = 0
      for sample in shuffle(read_samples(rng.sample(shards, len(shards)), parse,
                                         self.cfg.num_classes, on_bad, self.cfg.read_timeout)):
        read += 1
        yield *sample, pass_number
      if read == 0:
        raise utils.BadDataError(f'no readable sample in {plural(len(shards), "shard")} '
                                 f'({shards[0]}, ...): see the warnings above')
      lacking = self.cfg.trainsize * len(shards) / len(self.urls) - read
      if pass_number == 0 and lacking > self.cfg.trainsize / len(self.urls):
        self.counts[worker, 2] = round(lacking)

  def __iter__(self):
    worker, num_workers = worker_share()
    epoch, first_batch = self.epoch_and_batch.tolist()
    seed = self.cfg.seed
    bad = BadData(self.cfg.fail_on_bad_data, self.counts[:, 0], worker)
    # The DataLoader takes batch i from worker i % num_workers: this worker makes its share
    # of the epoch and stops, instead of reading on for batches nobody takes. A worker whose
    # first turn falls below first_batch (a resumed run) sends None there (the loader drops
    # it), so that the batches after first_batch come in their usual order.
    share = len(range(worker, self.batches, num_workers))
    skip = len(range(worker, first_batch, num_workers))
    if worker < first_batch % num_workers:
      yield None
    rng = random.Random(f'{seed}/{epoch}/{self.rank}/{worker}')  # Shard order and shuffle.
    batches = wds.batched(self.cfg.batch_size, collation_fn=None, partial=False)(
        self.samples(self.shards(epoch, worker, num_workers), rng, bad, worker))
    for number, batch in enumerate(itertools.islice(batches, share), 1):
      self.counts[worker, 1] += sum(sample[-1] > 0 for sample in batch)  # Read a second time.
      if number <= skip:
        continue  # Trained before the resume: read, for the shuffle, but not decoded or sent.
      # Views drawn from a generator of this batch alone: the same with or without a resume.
      draws = np.random.default_rng([seed, epoch, self.rank, worker, number]).random((len(batch), 3))
      yield self.decoded(batch, draws, bad)

  def decoded(self, batch, draws, on_bad):
    """(images, labels) of a batch of samples, each image the training view of its draws. An
    image that cannot be decoded goes to on_bad, and the batch's next readable sample takes
    its place: a batch's samples, fixed before any decoding, are the same in a resumed run."""
    views = []
    for (where, image_key, data, label, _), sample_draws in zip(batch, draws):
      try:
        views.append((self.views.train(decode(image_key, data), sample_draws), label))
      except BadSample as e:
        on_bad(e.at(where))
        views.append(None)
    readable = [view for view in views if view is not None]
    if not readable:
      raise utils.BadDataError(f'no image of a batch of {len(batch)} can be read (the first: '
                               f'{batch[0][0]}): check the shards')
    return collate([view or next((later for later in views[i + 1:] if later), readable[0])
                    for i, view in enumerate(views)])


class TestShards(torch.utils.data.IterableDataset):
  """This replica's evaluation batches: the test shards dealt out to the replicas (replica r
  takes every world_size-th from r) and on to their loader workers, each sample once, in
  batches of test_set_batch_size; a worker's last batch is filled up with blank images of
  label -1, which are not counted. A replica may run fewer batches than another: evaluation
  waits for no other replica until its sums. A worker given twice --testsize (or, without it,
  --trainsize) samples reads no further: a shard that never ends is a BadDataError."""

  def __init__(self, urls, rank, world_size, cfg):
    self.urls, self.cfg, self.views = urls[rank::world_size], cfg, Views(cfg.img_dim)
    self.counts = torch.zeros(max(1, cfg.num_workers), dtype=torch.int64).share_memory_()

  def __iter__(self):
    worker, num_workers = worker_share()
    size = self.cfg.test_set_batch_size
    bad = BadData(self.cfg.fail_on_bad_data, self.counts, worker)
    batch, limit = [], 2 * (self.cfg.testsize or self.cfg.trainsize)
    samples = read_samples(self.urls[worker::num_workers], parse, self.cfg.num_classes, bad,
                           self.cfg.read_timeout)
    for number, (where, image_key, data, label) in enumerate(samples, 1):
      if number > limit:  # The pace limits cannot see a server that sends samples without end.
        raise utils.BadDataError(
            f'the test shards gave a loader worker over {limit:,} samples, twice --'
            f'{"testsize" if self.cfg.testsize else "trainsize"} (the last: {where}): a shard that '
            'does not end, or give the right --testsize; check the shards and their server')
      try:
        batch.append((self.views.eval(decode(image_key, data)), label))
      except BadSample as e:
        bad(e.at(where))
      if len(batch) == size:
        yield collate(batch)
        batch = []
    if batch:
      yield collate(batch + [(torch.zeros_like(batch[0][0]), -1)] * (size - len(batch)))


def collate(samples):
  """(images, labels) of a batch from its (image, label) samples, by torch's default_collate:
  in a loader worker it stacks the images into shared memory, and the batch goes to the
  replica without a copy (torch.stack's would be copied there: 19 MB a batch of ImageNet)."""
  images, labels = torch.utils.data.default_collate(samples)
  return images, labels


def load_data(cfg, rank, world_size):
  """This replica's train loader (counted, capped at the epoch's steps) and test loader, and
  the class count. Every replica gets the same number of train batches."""
  train_urls = list(braceexpand.braceexpand(cfg.wds_traindir))
  test_urls = list(braceexpand.braceexpand(cfg.wds_testdir))
  feeders = world_size * max(1, cfg.num_workers)
  if len(train_urls) < feeders:
    raise utils.UsageError(
        f'{plural(len(train_urls), "training shard")} cannot feed {plural(world_size, "replica")} '
        f'x {plural(max(1, cfg.num_workers), "loader worker")} (each needs a shard of its own): '
        'write more, '
        'smaller shards (make_cifar_shards.py --samples_per_shard) or lower --num_workers')
  per_step = cfg.gradient_accumulation_steps
  steps = cfg.trainsize // (cfg.batch_size * per_step * world_size)
  if steps == 0:
    step = (f'batch of {cfg.batch_size}' if per_step == 1 else
            f'step of {per_step} batches of {cfg.batch_size}')
    raise utils.UsageError(f'--trainsize {cfg.trainsize} makes no {step} for each of {world_size} '
                           'replicas: lower --batch_size' +
                           (' or --gradient_accumulation_steps' if per_step > 1 else ''))
  train_set = TrainShards(train_urls, rank, world_size,
                          min(steps, cfg.num_steps or steps) * per_step, cfg)
  test_set = TestShards(test_urls, rank, world_size, cfg)

  def loader(dataset, workers):
    options = dict(num_workers=workers, worker_init_fn=utils.ignore_stop_signals)
    if workers:  # torch 2.9 raises on these without workers.
      options.update(persistent_workers=True, prefetch_factor=cfg.prefetch_factor,
                     multiprocessing_context=utils.loader_start())
    return torch.utils.data.DataLoader(dataset, batch_size=None, **options)

  # Test shards are fewer: a worker for each of this replica's, up to --num_workers.
  return (utils.EpochLoader(loader(train_set, cfg.num_workers), train_set.batches // per_step,
                            train_set, per_step),
          utils.EpochLoader(loader(test_set, min(cfg.num_workers, len(test_set.urls))),
                            cfg.num_steps or sys.maxsize), cfg.num_classes)


def device_loaders(loaders, cfg):
  """An MpDeviceLoader of each loader: its batches copied to the device by threads of its own,
  ahead of the steps that take them (--loader_prefetch_size and the next two flags)."""
  prefetch = {name: getattr(cfg, name) for name in (
      'loader_prefetch_size', 'device_prefetch_size', 'host_to_device_transfer_threads')}
  return [pl.MpDeviceLoader(loader, torch_xla.device(), **prefetch) for loader in loaders]


# ------------------------------------------------------------------------------ loop
def start_run(cfg, num_classes, steps_per_epoch, stop_signal):
  """Model, optimizer, LR schedule, log, stop vote and results of this replica, restored from
  the newest checkpoint if there is one; run.epoch and run.step are where training goes on."""
  device = torch_xla.device()
  cfg.num_classes = num_classes  # train_step checks the model's output against it.
  model = build_model(cfg, num_classes).to(device)
  xm.broadcast_master_param(model)  # Every replica starts from the master's weights.
  optimizer = build_optimizer(cfg, model)
  utils.make_optimizer_state(optimizer)  # Before the first step: one graph less.
  scheduler = None
  if cfg.lr_scheduler_type == 'WarmupAndExponentialDecayScheduler':
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: utils.warmup_step_decay(
        step, steps_per_epoch, cfg.lr_warmup_epochs, cfg.lr_scheduler_divide_every_n_epochs,
        cfg.lr_scheduler_divisor))
  writer = SummaryWriter(cfg.logdir) if cfg.logdir and xm.is_master_ordinal() else None
  run = SimpleNamespace(cfg=cfg, model=model, optimizer=optimizer, scheduler=scheduler,
                        stop=utils.StopVote(device, stop_signal, optimizer, num_classes),
                        stop_signal=stop_signal, steps_per_epoch=steps_per_epoch,
                        results=utils.new_results(cfg.model, amp=cfg.amp, skipped_bad_data=0,
                                                  repeated_samples=0),
                        num_classes=num_classes, epoch=1, step=0, global_step=0)
  path, state = utils.checkpoint_to_resume(cfg.resume, cfg.ckpt_dir, model.state_dict(),
                                           vars(cfg), run.results['world_size'], BATCH_FLAGS)
  if state is not None:
    utils.say_resumed(path, state, vars(cfg), restore_checkpoint(run, state))
  run.log = utils.StepLog(device, writer, run.results)  # After the restore.
  # The profiler serves TensorBoard's captures, and --profile_step's, while this run is held.
  run.profiler = utils.start_profiler(cfg, cfg.profiler_port + xr.local_ordinal(),
                                      run.global_step, steps_per_epoch * cfg.num_epochs)
  return run


def train_step(run, images, labels, part=(1, 1)):
  """Adds the gradients of the batch's loss to the weights'; on the last batch of a step (part: i
  of n, n --gradient_accumulation_steps), steps. Returns the loss / n."""
  (i, n), cfg, optimizer = part, run.cfg, run.optimizer
  # --amp: bfloat16 has float32's range, so no gradient scaler (see docs/tpu.md).
  with torch.autocast('xla', dtype=torch.bfloat16, enabled=cfg.amp):
    output = run.model(utils.normalize(images, *mean_std(cfg.img_dim)))
    loss = F.cross_entropy(utils.check_scores(output, labels, cfg.num_classes), labels) / n
  loss.backward()  # Added to the gradients of the step's batches before.
  if i == n:
    xm.optimizer_step(optimizer)  # All-reduces the gradients over every replica, then steps.
    optimizer.zero_grad()  # For the next step's first batch.
    if run.scheduler is not None:
      run.scheduler.step()
  return loss


def train_one_epoch(run, loader, epoch, first_step):
  """Trains the epoch from step first_step on; returns (steps run, whether to stop now)."""
  cfg = run.cfg
  tracker = xm.RateTracker()
  run.model.train()
  steps = 0
  for step, batches in enumerate(utils.in_steps(loader, cfg.gradient_accumulation_steps),
                                 first_step):
    if run.global_step == cfg.profile_step and xm.is_master_ordinal():
      utils.capture_trace(cfg)  # Of the next --profile_duration_ms, as the run trains on.
    loss = 0
    for i, (images, labels) in enumerate(batches, 1):
      # Named steps in a profile; each batch ends in a sync, so that a step of several holds one
      # batch's activations at a time, and compiles at most three graphs however many there are.
      with xp.StepTrace('train_step', step_num=step):
        loss = loss + train_step(run, images, labels, (i, len(batches)))
        if i < len(batches):
          continue
        labels = torch.cat([labels for _, labels in batches])
        tracker.add(len(labels))
        if step % cfg.log_steps == 0:
          xm.add_step_closure(run.log.add, args=(epoch, step, run.global_step, loss, tracker,
                                                 run.optimizer.param_groups[0]['lr']))
        # The same answer on every process; the end of the run if loss or weights run away, or a
        # label is none of the classes.
        stopping = run.stop.agreed_after_step(loss, labels, f'epoch {epoch} step {step}')
    steps += 1
    run.global_step += 1
    if stopping:
      return steps, True
    # The epoch's last step is saved at its end, with its evaluation.
    if (cfg.ckpt_dir and cfg.ckpt_every_steps and run.global_step % cfg.ckpt_every_steps == 0
        and step + 1 < run.steps_per_epoch):
      save_checkpoint(run, epoch, step + 1)
  return steps, False


def evaluate(model, loader, cfg):
  """(accuracy %, correct, total) over every image once; padding (label -1) is not counted."""
  model.eval()
  # Counted on the device and read once at the end: an .item() per step would sync.
  counts = torch.zeros(2, dtype=torch.int64, device=torch_xla.device())
  with torch.no_grad(), torch.autocast('xla', dtype=torch.bfloat16, enabled=cfg.amp):
    for images, labels in loader:
      hits = (model(utils.normalize(images, *mean_std(cfg.img_dim))).argmax(dim=1) == labels).sum()
      counts += torch.stack([hits, (labels >= 0).sum()])
  # Sums, not a mean of replica accuracies: replicas may hold different numbers of images.
  correct, total = xm.all_reduce(xm.REDUCE_SUM, counts).tolist()
  return 100.0 * correct / max(total, 1), correct, total


def save_checkpoint(run, epoch, step, best=False):
  """Saves the run after `step` steps of `epoch` (every process calls it); returns its path."""
  torch_xla.sync()  # Runs the step's log closure, ...
  run.log.flush()  # ... and waits for it: the history saved is whole.
  run.stop.check_losses()  # Nothing that ran away is saved.
  state = dict(model=run.model.state_dict(), optimizer=run.optimizer.state_dict(),
               lr_scheduler=run.scheduler.state_dict() if run.scheduler else None, epoch=epoch,
               step=step, global_step=run.global_step, flags=vars(run.cfg),
               rng=dict(torch=torch.get_rng_state(), xla=xm.get_rng_state()), results=run.results)
  return utils.write_checkpoint(state, run.cfg.ckpt_dir, run.cfg.keep_checkpoints, best)


def restore_checkpoint(run, state):
  """Puts save_checkpoint's state back into the run, with the --lr, --momentum and
  --weight_decay given now (utils.new_recipe); returns what those changed."""
  run.model.load_state_dict(state['model'])
  run.optimizer.load_state_dict(state['optimizer'])
  if run.scheduler is not None and state['lr_scheduler'] is not None:
    run.scheduler.load_state_dict(state['lr_scheduler'])
  torch.set_rng_state(state['rng']['torch'])
  xm.set_rng_state(state['rng']['xla'])
  vars(run).update({key: state[key] for key in ('epoch', 'step', 'global_step', 'results')})
  return utils.new_recipe(run.optimizer, run.scheduler, state['flags'], vars(run.cfg))


def stop_run(run, epoch, step, saved=None):
  """The end of a run stopped at a step boundary: saves (unless `saved` holds this very state),
  says so; returns the exit code (75 for SIGTERM or SIGHUP, 130 for Ctrl-C)."""
  if saved is None and run.cfg.ckpt_dir:
    xm.master_print(f'Stopping at epoch {epoch} step {step}: saving a checkpoint ...', flush=True)
    saved = save_checkpoint(run, epoch, step)
  name, code = utils.record_stop(run.results, run.stop_signal(), run.global_step, saved)
  xm.master_print(f'Stopped by {name} at epoch {epoch} step {step}: ' +
                  (f'saved {saved}; run the same command to resume' if saved else
                   'nothing saved (no --ckpt_dir)') + f' (exit code {code})', flush=True)
  return code


def end_epoch(run, epoch, accuracy, counts):
  """Records and saves an epoch, evaluated or not (accuracy None); returns (whether to stop now,
  its checkpoint or None)."""
  results = run.results
  results['epochs'] = epoch
  best = accuracy is not None and accuracy > results['max_accuracy']
  if accuracy is not None:  # Only evaluated epochs count for best.pt, the target and the results.
    results['epoch_accuracies'].append(accuracy)
    results['eval_epochs'].append(epoch)
    results.update(final_accuracy=accuracy, eval_correct=counts[0], eval_samples=counts[1],
                   max_accuracy=max(results['max_accuracy'], accuracy))
    test_utils.write_to_summary(run.log.writer, epoch, {'Accuracy/test': accuracy})
  run.log.end_epoch(epoch, evaluated=accuracy is not None)  # The graphs compiled by now.
  utils.check_learning(run.log, epoch, run.num_classes, run.cfg.lr,
                       recipe(run.cfg)[1]['lr'])
  if run.cfg.metrics_debug:
    xm.master_print(met.metrics_report(), flush=True)
  saved = save_checkpoint(run, epoch + 1, 0, best=best) if run.cfg.ckpt_dir else None
  # Every vote read, the last epoch's too (a last step that ran away: Diverged); after the last
  # epoch a stop has nothing left to stop, and the run ends as done.
  stop = run.stop.agreed_at_epoch_end()
  return epoch < run.cfg.num_epochs and stop, saved


def train(cfg, stop_signal):
  """This process's run; returns (its results, the exit code) where it finishes, stops (when
  stop_signal() says) or diverges. A replica that fails raises (utils.replica ends the run)."""
  torch.manual_seed(cfg.seed)
  rank, world_size, device = xr.global_ordinal(), xr.world_size(), torch_xla.device()
  train_loader, test_loader, num_classes = load_data(cfg, rank, world_size)
  run = start_run(cfg, num_classes, train_loader.steps, stop_signal)
  results = run.results
  train_device_loader, test_device_loader = device_loaders((train_loader, test_loader), cfg)
  if run.epoch <= cfg.num_epochs:  # Else: 'Run already finished'.
    xm.master_print(f'Replicas started: {world_size}; compiling the first step ...', flush=True)
  try:
    for epoch in range(run.epoch, cfg.num_epochs + 1):
      first_step = run.step if epoch == run.epoch else 0
      train_loader.set_epoch(epoch, first_step)  # Skips, on the host, what a resumed run trained.
      xm.master_print(f'Epoch {epoch} train begin {test_utils.now()}', flush=True)
      start = time.time()
      steps, stopped = train_one_epoch(run, train_device_loader, epoch, first_step)
      train_loader.check()
      xm.wait_device_ops()  # Time the device work, not just the tracing.
      run.log.trained(epoch)  # Its lines before the epoch's, and a graph its last steps compiled.
      seconds = time.time() - start
      results['train_seconds'] += seconds
      count_data(results, train_loader.order.read_counts(), epoch, rank, cfg.trainsize)
      if stopped:  # By SIGTERM, SIGHUP or Ctrl-C: saved here (--ckpt_dir); exit code 75 or 130.
        return results, stop_run(run, epoch, first_step + steps)
      samples = steps * cfg.batch_size * cfg.gradient_accumulation_steps
      print(f'Epoch {epoch} Replica Train Samples={samples} Device={device}/{rank}', flush=True)
      rate = xm.mesh_reduce('epoch_rate', samples / seconds, sum)
      results['epoch_rates'] += [rate] if steps else []
      xm.master_print(f'Epoch {epoch} train end {test_utils.now()}, Reduced GlobalRate={rate:.2f}',
                      flush=True)
      accuracy = counts = None  # Unless evaluated (--eval_interval, --test_only_at_end).
      if utils.evaluates(epoch, cfg.num_epochs, cfg.eval_interval, cfg.test_only_at_end):
        accuracy, *counts = evaluate(run.model, test_device_loader, cfg)
        test_loader.check()
        count_test_data(cfg, int(test_loader.loader.dataset.counts.sum()), counts[1], epoch, rank)
        xm.master_print(f'Epoch {epoch} test end {test_utils.now()}, ' + (
            f'Accuracy={accuracy:.2f}' if counts[1] else NO_TEST_SAMPLE), flush=True)
      stop, saved = end_epoch(run, epoch, accuracy, counts)
      if stop:  # The same, asked for as the epoch ended: its checkpoint holds this state.
        return results, stop_run(run, epoch + 1, 0, saved)
  except utils.Diverged as error:  # From run.stop: the loss or weights ran away (see StopVote).
    results['diverged'] = str(error)  # Nothing is saved after it.
  utils.add_totals(results, run.global_step,
                   cfg.batch_size * cfg.gradient_accumulation_steps * world_size, run.log)
  if 'diverged' in results:
    return results, utils.say_diverged(results['diverged'], vars(cfg))  # Exit code 22
  return results, utils.say_finished(results, cfg.target_accuracy)  # Done: 0, or 21 below target


def count_data(results, counts, epoch, rank, trainsize):
  """Adds an epoch's bad data skipped and samples read twice to the results; says so, and
  shards that lack samples of what --trainsize says."""
  bad, repeated, lacking = counts
  results['skipped_bad_data'] += bad
  results['repeated_samples'] += repeated
  if lacking:
    print(f'warning: epoch {epoch} replica {rank}: its shards lack about {lacking} samples of its '
          f'share of --trainsize {trainsize} (bad shards, or fewer samples than it says); '
          f'{repeated} were read a second time to run the same steps as every replica',
          file=sys.stderr, flush=True)
  if bad:
    print(f'Epoch {epoch} Replica {rank}: skipped {bad} bad shards or samples', flush=True)


def count_test_data(cfg, bad, total, epoch, rank):
  """Says the bad test data skipped in an epoch, and a --testsize that is not what was read."""
  if bad:  # Not in the results: they count training data.
    print(f'Epoch {epoch} Replica {rank}: skipped {bad} bad shards or samples of the test shards',
          flush=True)
  first = not any(utils.evaluates(before, cfg.num_epochs, cfg.eval_interval, cfg.test_only_at_end)
                  for before in range(1, epoch))  # This run's first evaluation, unless resumed.
  if cfg.testsize and total != cfg.testsize and not cfg.num_steps and first:
    xm.master_print(f'warning: the test shards hold {total} readable samples, --testsize is '
                    f'{cfg.testsize}', fd=sys.stderr)


def _mp_fn(index, flag_values):
  """One replica. flag_values is a plain dict: absl's FLAGS do not cross the spawn."""
  del index  # The global ordinal comes from the runtime.
  cfg = SimpleNamespace(**flag_values)
  with utils.replica():  # A replica that fails ends at once, and so the whole run.
    utils.prepare_process(cfg, xr.global_ordinal())  # Before any computation.
    results, code = train(cfg, utils.stop_signal)
    if xm.is_master_ordinal():
      utils.write_results(cfg.results_json, results)
  sys.exit(code)


def main(argv):
  del argv
  cfg = SimpleNamespace(**FLAGS.flag_values_dict())
  recipe_name, settings = recipe(cfg)
  for name, value in settings.items():
    if getattr(cfg, name) is None:
      setattr(cfg, name, value)
  utils.set_precision(cfg.amp, cfg.bf16)  # Before the runtime starts.
  try:
    if supervisor:  # Checked here, once, before any replica starts: bad input is one line, not N.
      cfg.num_workers = supervisor.usable_workers(cfg.num_workers, FLAGS['num_workers'].present)
      found = {flag: supervisor.check_shards(flag, getattr(cfg, flag), cfg.fail_on_bad_data)
               for flag in ('wds_traindir', 'wds_testdir')}
    classes = shard_classes(cfg.wds_traindir)
    if classes and cfg.num_classes and cfg.num_classes > len(classes):  # Fewer: labels past it.
      print(f'warning: --num_classes {cfg.num_classes} is more than the {len(classes)} classes of '
            'the classes file beside the training shards: the model gets outputs that no label '
            'asks for', file=sys.stderr, flush=True)
    cfg.num_classes = cfg.num_classes or (len(classes) if classes else CIFAR_CLASSES)
    if supervisor:
      seen = {flag: supervisor.check_format(flag, urls[0], lambda urls, on_bad: read_samples(
                  urls, parse, cfg.num_classes, on_bad, cfg.read_timeout)) if urls else []
              for flag, urls in found.items()}
      print(supervisor.describe_shards(cfg, classes, seen, FLAGS['num_classes'].present))
      model = build_model(cfg, cfg.num_classes)
      print(supervisor.describe_model(cfg.model, model, cfg.num_classes))
      given = {name for name in FLAGS if FLAGS[name].present}
      print(supervisor.describe_recipe(cfg, supervisor.recipe_source(given, recipe_name, settings),
                                       build_optimizer(cfg, model)), flush=True)
      supervisor.check_outputs(cfg.ckpt_dir, cfg.logdir, cfg.results_json, cfg.compile_cache_dir,
                               cfg.profile_logdir if cfg.profile_step is not None else None)
  except utils.UsageError as e:
    utils.die(e)
  # Replica processes start here, but with --num_cores 1 or under torchrun (its worker is one).
  launcher = cfg.num_cores != 1 and not torch.distributed.is_torchelastic_launched()
  print('Starting ' + ('one replica per local XLA device' if launcher else 'one replica (--num_cores 1)'
                       if cfg.num_cores == 1 else 'the replica of this torchrun worker') + ' ...',
        flush=True)
  with (supervisor.watched(launcher, saving=bool(cfg.ckpt_dir)) if supervisor else
        utils.stop_on_signals(launcher)):
    torch_xla.launch(_mp_fn, args=(vars(cfg),), debug_single_process=cfg.num_cores == 1)


def recipe(cfg):
  """(name, settings) of the recipe that the flags not given come from (see CIFAR_RECIPE)."""
  if cfg.img_dim <= CIFAR_SIDE:
    return "CIFAR-10's recipe", CIFAR_RECIPE
  if cfg.model in MODEL_RECIPES:
    return f"{cfg.model}'s tuned ImageNet recipe", {**IMAGENET_RECIPE, **MODEL_RECIPES[cfg.model]}
  return 'the ImageNet recipe', IMAGENET_RECIPE


def shard_classes(pattern):
  """The class names of the classes file that make_cifar_shards.py writes beside the shards
  (PREFIX-classes.txt for PREFIX-train-{...}.tar, a name a line), or None if there is none."""
  name, found = re.subn(r'-train-[^/]*$', '-classes.txt', pattern)
  if not found or name.startswith('pipe:'):
    return None
  try:
    with fsspec.open(name, 'r') as f:
      return [line.strip() for line in f if line.strip()]
  except FileNotFoundError:
    return None
  except OSError as e:
    raise utils.UsageError(f'cannot read {name} ({e}): check it, or give --num_classes') from None


def plural(count, noun):
  return f'{count} {noun}' + ('' if count == 1 else 's')


def run(argv):
  """This script from Python or a notebook cell: run(['--flag', value, ...]) returns the
  results (see --results_json) or raises what the exit code means (see command.py)."""
  import command  # Only run() and %run need command.py.
  return command.run(__file__, argv)


# ==================================================================== the shard reading
# Nothing below this rule needs editing to adapt the script: the shards' bytes from a disk, a
# server, a bucket or a pipe, on deadlines and tried again where a server fails, and the tar
# reader. The pipeline reaches it through read_samples, which hands every failure to one
# callable (BadData, above). The file then ends, as every script does, with its entry point.
READ_PIECE = 4 << 20  # A piece of a remote shard (or its rest), to arrive within --read_timeout s
READ_TRIES = 3  # of a read that fails for the server's sake (see RetriedReads)
DOWN_AFTER = 2  # shards in a row that their server failed: it is down, and the run ends
ZERO_BLOCK = bytes(tarfile.BLOCKSIZE)  # Two end a tar.
KEY_AND_EXTENSION = re.compile(r'^((?:.*/|)[^.]+)[.]([^/]*)$')  # webdataset's
SKIPPED_NAME = re.compile(r'__[^/]*__($|/)')  # webdataset's metadata, passed over
# What a shard that cannot be read raises, and what a server's failure raises (see failure):
# anything else is a bug in the code, and a traceback.
DATA_ERRORS = (tarfile.TarError, ValueError, EOFError, OSError, lzma.LZMAError, zlib.error)
RETRIED = (TimeoutError, asyncio.TimeoutError, ConnectionError, aiohttp.ClientError,
           requests.exceptions.ConnectionError, requests.exceptions.Timeout)  # gcsfs: a 502


class BadShard(Exception):
  """A shard that is missing or cannot be read to the end, saying which and why."""


def read_samples(urls, parser, num_classes, on_bad, read_timeout):
  """(where, *parser(sample, num_classes)) of every sample of the shards in turn, `where` naming
  it in a message; parser: the script's parse, or a copier's. Each failure is handed to on_bad
  as an exception that says what and where (BadShard; parser's BadSample or ForeignSample),
  which raises or counts it, and reading goes on: a bad sample is skipped, the rest of its
  shard read. But a server that failed DOWN_AFTER shards in a row is down, and ends the run.
  Whose failure it is, the data's or the server's: failure(). Anything else that parser raises
  is a bug of its code, raised as it is, as is one of this code."""
  failed = []  # Shards in a row that their server failed.
  for url in urls:
    shard = Shard(url, read_timeout)
    held = None  # What is wrong with the sample just read, said once the next one comes.
    with contextlib.closing(iter(shard)) as samples:  # Its stream closed, however this ends.
      for sample in samples:
        if held:
          on_bad(held)
        where, held = f'sample {sample["__key__"]} of {url}', None
        try:
          parsed = parser(sample, num_classes)  # Outside the shard's reading: not its errors.
        except BadSample as e:
          held = e.at(where)
          continue
        yield (where, *parsed)
    if held and not shard.cut_short:  # The last sample of a tar cut short lacks a file: ...
      on_bad(held)
    if shard.cut_short:  # ... the cut is said, not that.
      on_bad(BadShard(f'shard {url} cannot be read to the end (it ends inside a tar header, '
                      f'after {shard.size} bytes: the rest of it is lost)'))
    e = shard.error
    server = isinstance(e, ServerFailed)
    failed = failed + [url] if server else []
    if len(failed) == DOWN_AFTER:
      raise utils.BadDataError(
          f'{e.server} failed: {e.reason}, {e.tries} each, for shard {failed[0]} and then '
          f'{url}; check that it is up and that this host ({socket.gethostname()}) reaches '
          'it, then run the same command again (with --ckpt_dir it resumes from the last '
          'checkpoint)') from None
    if e is not None:
      on_bad(BadShard(f'shard {url} is missing' if failure(e) == 'missing' else
                      f'shard {url} cannot be read: {e.reason} ({e.tries})' if server else
                      f'shard {url} cannot be read: {http_answer(e)}' if http_status(e) else
                      f'shard {url} cannot be read to the end ({type(e).__name__}: '
                      f'{e.args[0] if e.args else e})'))


class Shard:
  """The samples of one shard as the tar reader groups them (see tar_samples), read to its end
  or to a failure of its data or its server, which `error` then holds (see failure); a bug's
  is raised. cut_short: it ends inside a tar header, after `size` bytes."""

  def __init__(self, url, read_timeout):
    self.url, self.read_timeout = url, read_timeout
    self.error, self.cut_short, self.size = None, False, 0

  def __iter__(self):
    try:
      stream = (wds.gopen(self.url) if self.url.startswith('pipe:') else
                open_shard(self.url, self.read_timeout))
      with contextlib.closing(stream):
        tar = TarFiles(stream)
        yield from tar_samples(tar, self.url)
      self.cut_short, self.size = tar.cut_short, tar.size
    except Exception as e:
      if failure(e) is None:
        raise  # A bug of the code: a traceback.
      self.error = e


def open_shard(url, read_timeout):
  """A shard to read from start to end: a local file as it is; a remote one read in pieces of
  READ_PIECE, each within read_timeout s, so that a server that stops or trickles fails the
  read, and read again where a server fails (see RetriedReads). Over http(s) one stream (a
  server may not answer range requests); from gs://, a request for each piece."""
  fs, path = utils.url_fs(url, read_timeout)  # Each request on its deadline.
  if isinstance(fs, fsspec.implementations.local.LocalFileSystem):
    return open(path, 'rb')  # Python's own: fsspec's wrapper adds a call to every read.
  if url.startswith(('http:', 'https:')):  # fsspec's async stream: each read, on a deadline.
    # Its size given (unknown) spares a HEAD request before each GET, made by the first read.
    def open_stream():
      return fsspec.asyn.sync(fs.loop, fs.open_async, path, 'rb', size=-1)
  else:  # gcsfs: each read a request of its own, on its deadline
    def open_stream():
      return fs.open(path, 'rb', cache_type='none')
  return io.BufferedReader(RetriedReads(open_stream, url, read_timeout), READ_PIECE)


def server_of(url):
  """Who serves url, for a line: the host of http(s), Cloud Storage's for gs:// (the
  emulator's, with STORAGE_EMULATOR_HOST), else the URL's first part."""
  if fsspec.utils.get_protocol(url) in ('gs', 'gcs'):
    return os.environ.get('STORAGE_EMULATOR_HOST', 'storage.googleapis.com').split('//')[-1]
  return url.split('/')[2]


class ServerFailed(Exception):
  """A remote shard whose server failed the read in every try (see RetriedReads)."""

  def __init__(self, server, reason, tries):
    super().__init__(f'{server}: {reason} ({tries})')
    self.server, self.reason, self.tries = server, reason, tries


class RetriedReads(io.RawIOBase):
  """A remote shard's bytes, a piece (READ_PIECE) at a time within read_timeout s, opened again
  and read on from where they stopped when a read fails for the server's sake (too slow or
  silent, a connection refused or dropped, a 5xx answer): READ_TRIES tries, 1 s and then 2 s
  apart, then ServerFailed. gs://: gcsfs has tried all but a deadline 6 times, so only that
  is tried here. A stream that cannot seek (http) is read again up to that point."""

  def __init__(self, open_stream, url, read_timeout):
    self.open_stream, self.url, self.read_timeout = open_stream, url, read_timeout
    self.stream, self.position = None, 0
    self.gcs = fsspec.utils.get_protocol(url) in ('gs', 'gcs')
    self.http = url.startswith(('http:', 'https:'))

  def readable(self):
    return True

  def readinto(self, buffer):
    for attempt in range(READ_TRIES):
      try:
        if self.stream is None:
          self.stream = self.reopened()
        data = self.piece(min(len(buffer), READ_PIECE))
        break
      except Exception as e:
        self.close_stream()
        if failure(e) != 'server':
          raise
        if isinstance(e, FileNotFoundError):
          e = e.__cause__  # fsspec's http says so of a file it could not ask about.
        late = isinstance(e, (TimeoutError, asyncio.TimeoutError))
        if attempt + 1 == READ_TRIES or (self.gcs and not late):
          tries = f'{READ_TRIES} tries' if late or not self.gcs else "gcsfs's 6 tries"
          raise ServerFailed(server_of(self.url), self.describe(e), tries) from None
        time.sleep(2**attempt)
    buffer[:len(data)] = data
    self.position += len(data)
    return len(data)

  def piece(self, size):
    """size bytes, fewer only where the shard ends, within read_timeout s. An http stream's
    read gives what has come (a trickle: a byte), so it is read until the piece is whole,
    its first read (the request, the answer's start) within the deadline too."""
    if not self.http:
      return self.stream.read(size)  # gs://: one request, on its deadline (see utils.url_fs).
    data, deadline = bytearray(), time.monotonic() + self.read_timeout
    while len(data) < size:
      left = deadline - time.monotonic()
      if left <= 0:
        raise TimeoutError(f'less than {size} bytes in {self.read_timeout:g} s')
      more = fsspec.asyn.sync(self.stream.fs.loop, self.stream.read, size - len(data),
                              timeout=left)
      if not more:
        break
      data += more
    return bytes(data)

  def reopened(self):
    self.stream = self.open_stream()
    if not self.http:
      self.stream.seek(self.position)
      return self.stream
    left = self.position
    while left:  # A stream cannot seek: read up to there again, each piece on its deadline.
      read = len(self.piece(min(left, READ_PIECE)))
      if not read:
        raise EOFError(f'the shard is shorter than before ({self.position - left} bytes)')
      left -= read
    return self.stream

  def describe(self, error):
    if isinstance(error, (TimeoutError, asyncio.TimeoutError)):
      return f'less than {READ_PIECE >> 20} MiB in {self.read_timeout:g} s'
    if isinstance(error, (ConnectionRefusedError, aiohttp.ClientConnectorError)):
      return 'the server refuses connections'
    if http_status(error):
      return http_answer(error)
    return f'the server failed the read ({type(error).__name__}: {error})'

  def close_stream(self):
    if self.stream is not None:
      with contextlib.suppress(Exception):
        if self.http:  # Its answer's connection, at once: nothing to wait for from the server.
          self.stream.closed = True  # Its response still closed; __del__ then makes no coroutine.
          fsspec.asyn.sync(self.stream.fs.loop, self.stream.close, timeout=1)
        else:
          self.stream.close()
      self.stream = None

  def close(self):
    self.close_stream()
    super().close()


def failure(error):
  """Whose failure a read's exception is, decided here alone: 'server' (no answer in time, a
  connection refused or dropped, a 5xx, 408 or 429 answer: RetriedReads tries the read again,
  then raises ServerFailed), 'missing', 'data' (a truncated or corrupt tar or compression, a
  disk error, a pipe: command that failed, a shard or credentials refused: 401, 403, ...), or
  None: a bug of the code."""
  if isinstance(error, FileNotFoundError) and failure(error.__cause__) == 'server':
    return 'server'  # fsspec's http says so of a file it could not ask about.
  status = http_status(error)
  if status is not None:
    return 'server' if status >= 500 or status in (408, 429) else 'data'
  if isinstance(error, FileNotFoundError):
    return 'missing'
  if isinstance(error, (ServerFailed, *RETRIED)):
    return 'server'
  if isinstance(error, DATA_ERRORS) or type(error).__module__.startswith('google.auth'):
    return 'data'
  return None


def http_status(error):
  """The HTTP status of an answer that a file system raised (aiohttp's, gcsfs's), or None."""
  status = getattr(error, 'status', None) or getattr(error, 'code', None)
  return status if isinstance(status, int) and 400 <= status < 600 else None


def http_answer(error):
  """'HTTP 403 Forbidden': an answer that a file system raised, in a line's words."""
  reason = getattr(error, 'message', None) or ''
  return f'HTTP {http_status(error)} {str(reason).splitlines()[0] if reason else ""}'.strip()


class TarFiles:
  """(name, bytes) of each regular file of a tar stream, in order, as webdataset's reader gives
  them (tarfile's stream mode: ustar, pax and GNU long names; gzip, bzip2 or xz compressed),
  at a fraction of its cost a file: tarfile and webdataset's layers over it took most of the
  time a sample took to read (docs/performance.md). As in tarfile, a header cut short ends
  the files; here it also sets cut_short (a whole tar ends in zero blocks). A header with a
  bad checksum (tarfile takes one past the first for the end), or a file cut short, raises
  tarfile.ReadError."""
  COMPRESSED = {b'\x1f\x8b': lambda f: gzip.GzipFile(fileobj=f), b'BZh': bz2.BZ2File,
                b'\xfd7zXZ': lzma.LZMAFile}

  def __init__(self, stream):
    self.stream, self.size, self.cut_short = stream, 0, False
    # A file is read whole: one of gigabytes (zeros in a .tar.gz of 2 MB) would cost a worker
    # as much. The most a sample's file takes is an image at PIL's pixel limit, uncompressed,
    # 4 bytes a pixel (RGBA): 358 MB; checked from the header, before the file is read.
    pixels = PIL.Image.MAX_IMAGE_PIXELS
    self.limit = 4 * pixels if pixels else math.inf

  def read(self, size):
    data = self.stream.read(size)
    self.size += len(data)
    return data

  def __iter__(self):
    header = self.read(tarfile.BLOCKSIZE)
    opener = next((self.COMPRESSED[magic] for magic in self.COMPRESSED if header.startswith(magic)),
                  None)
    if opener:
      self.stream, self.size = opener(Prefixed(header, self.stream)), 0
      header = self.read(tarfile.BLOCKSIZE)
    if not header:
      raise tarfile.ReadError('empty file')
    names = {}  # What pax and GNU headers say of the file that follows them.
    while len(header) == tarfile.BLOCKSIZE and header != ZERO_BLOCK:
      if not checksum_ok(header):
        raise tarfile.ReadError(
            f"a tar header with a bad checksum @ byte {self.size - tarfile.BLOCKSIZE}")
      kind, size = header[156:157], int(names.pop('size', 0)) or tar_number(header[124:136])
      if size > self.limit:
        raise tarfile.ReadError(
            f'a file of {size:,} bytes @ byte {self.size - tarfile.BLOCKSIZE}, over the '
            f"{self.limit:,} that a sample's file may hold (4 bytes a pixel at PIL's "
            'Image.MAX_IMAGE_PIXELS)')
      data = self.read(size)
      if len(data) < size:
        raise tarfile.ReadError(f'unexpected end of data @ byte {self.size}')
      self.read(-size % tarfile.BLOCKSIZE)  # The padding to a whole block.
      if kind in (b'x', b'g'):  # pax ('g': for every file after it; rare, taken as 'x')
        names.update(pax_records(data))
      elif kind == b'L':  # GNU's long name
        names['path'] = data.split(b'\0', 1)[0].decode('utf-8', 'surrogateescape')
      elif kind == b'S':
        raise tarfile.ReadError(f'a sparse file, which a shard does not hold @ byte {self.size}')
      elif kind != b'K':  # A file, a folder, a link: the names before it were its own.
        name = names.pop('path', None) or ustar_name(header)
        names = {}
        if kind in (b'0', b'\0', b'7') and not name.endswith('/'):
          yield name, data
      header = self.read(tarfile.BLOCKSIZE)
    tail = header
    while data := self.read(1 << 16):  # What follows the end: zero blocks, in a whole tar.
      tail = (tail + data[-tarfile.BLOCKSIZE:])[-tarfile.BLOCKSIZE:]
    self.cut_short = self.size % tarfile.BLOCKSIZE != 0 or tail != ZERO_BLOCK


class Prefixed:
  """A stream whose first bytes were read already, for a decompressor to read from the start."""

  def __init__(self, first, stream):
    self.first, self.stream = first, stream

  def read(self, size=-1):
    if not self.first:
      return self.stream.read(size)
    data = self.first if size < 0 else self.first[:size]
    self.first = self.first[len(data):]
    return data


def checksum_ok(header):
  """Whether a tar header's checksum is right (as tarfile takes it: of unsigned or signed bytes,
  its own 8 counted as spaces)."""
  try:
    stored = tar_number(header[148:156])
  except ValueError:
    return False
  unsigned = sum(header) - sum(header[148:156]) + 8 * 32
  return stored == unsigned or stored == unsigned - 256 * sum(
      byte >= 128 for byte in header[:148] + header[156:])


def tar_number(field):
  """A tar header's number: octal digits, or base 256 (a first byte with its high bit)."""
  if field[0] & 0x80:
    return int.from_bytes(field[1:], 'big')
  return int(field.split(b'\0', 1)[0].strip() or b'0', 8)


def ustar_name(header):
  name, prefix = (field.split(b'\0', 1)[0] for field in (header[:100], header[345:500]))
  return (prefix + b'/' + name if prefix else name).decode('utf-8', 'surrogateescape')


def pax_records(data):
  """{key: value} of a pax header's records ("LENGTH KEY=VALUE\n" each)."""
  records, start = {}, 0
  while start < len(data) and data[start]:
    length = int(data[start:data.index(b' ', start)])
    if length <= 0:
      raise tarfile.ReadError('a pax header of a record 0 bytes long')
    key, _, value = data[data.index(b' ', start) + 1:start + length - 1].partition(b'=')
    records[key.decode('utf-8', 'surrogateescape')] = value.decode('utf-8', 'surrogateescape')
    start += length
  return records


def tar_samples(files, url):
  """The samples of a tar's files as webdataset groups them: by key (the name up to the first
  dot of its last part), each file under its extension in lower case; __...__ names passed
  over."""
  sample = None
  for name, data in files:
    match = KEY_AND_EXTENSION.match(name)
    if not match or SKIPPED_NAME.match(name):
      continue
    key, extension = match[1], match[2].lower()
    if sample is None or key != sample['__key__']:
      if sample is not None:
        yield sample
      sample = dict(__key__=key, __url__=url)
    if extension in sample:
      raise ValueError(f'{name}: duplicate file name in tar file {extension} {sample.keys()}')
    sample[extension] = data
  if sample is not None:
    yield sample


if __name__ == '__main__':
  if utils.in_notebook():  # %run in a notebook: a command of its own, as run() starts it.
    run(sys.argv[1:])
  else:
    flags.mark_flags_as_required(REQUIRED_FLAGS)  # Not at import: benchmarks and tests import it.
    # A shard pattern left unquoted, which the shell expanded, is said first (supervisor.py).
    app.run(main, flags_parser=lambda argv: utils.parse_flags(
        supervisor.unquoted_patterns(argv, ('wds_traindir', 'wds_testdir')) if supervisor else argv,
        {**(supervisor.UPSTREAM_FLAGS if supervisor else {}), **ELSEWHERE}))
elif __name__ == '__mp_main__':
  # A replica imports this file in its main thread, the only one that may catch a signal.
  utils.stop_on_signals()
