"""Helpers shared by the training scripts of this repo.

Only what is the same in every script lives here: flag errors, data checks, fake data,
batch padding, log lines, TensorBoard and the results file. Nothing here reads FLAGS;
every value comes in as an argument, so a script copied out with this file beside it
still works.
"""

import datetime
import itertools
import json
import os
import random
import sys

import torch
import torchvision
from absl import flags
from PIL import Image

IMG_EXTENSIONS = torchvision.datasets.folder.IMG_EXTENSIONS
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Models whose auxiliary heads return a tuple in training mode; the loop wants logits.
_MODEL_KWARGS = {
    'googlenet': dict(aux_logits=False, init_weights=True),
    'inception_v3': dict(aux_logits=False, init_weights=True),
}


class UsageError(Exception):
  """A mistake the user can fix: the script prints it as one line and exits 2."""


def die(message, code=2):
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(code)


def parse_flags(argv):
  """Flags parser for app.run: a bad flag is one line and exit code 2, as argparse does."""
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    die(f'{e} (see --helpshort)')
  if len(rest) > 1:
    die(f'unexpected arguments {rest[1:]}: every option is a --flag (see --helpshort)')
  return rest


# ---------------------------------------------------------------------------- models


def model_names():
  """Every torchvision classification model, e.g. resnet50, vit_b_16, mobilenet_v3_small."""
  return torchvision.models.list_models(module=torchvision.models)


def create_model(name, num_classes):
  """A torchvision classifier with fresh weights (nothing is downloaded)."""
  if name not in model_names():
    raise UsageError(f'unknown --model {name!r}: use a torchvision classification model '
                     'such as resnet18, resnet50 or mobilenet_v3_small')
  return torchvision.models.get_model(
      name, weights=None, num_classes=num_classes, **_MODEL_KWARGS.get(name, {}))


# ------------------------------------------------------------------------------ data


class BadDataError(Exception):
  """An image file, shard or sample that cannot be read."""

  def __str__(self):
    # Raised in a DataLoader worker, the message comes back wrapped in the worker's
    # traceback, whose last line is the one we wrote.
    return super().__str__().strip().splitlines()[-1].split('BadDataError: ')[-1]


def load_image(path):
  """ImageFolder's loader, but a corrupt file names itself instead of a PIL traceback."""
  try:
    with open(path, 'rb') as f:
      return Image.open(f).convert('RGB')
  except OSError as e:  # PIL.UnidentifiedImageError and truncated files are OSErrors.
    raise BadDataError(f'cannot read image {path} ({e}): replace or remove the file') from None


def check_image_folder(root):
  """Class names of an ImageFolder split (root/CLASS/*.jpg), or a UsageError saying what is wrong."""
  if not os.path.isdir(root):
    raise UsageError(f'{root} is not a folder: --datadir needs train/ and val/ with one '
                     'folder of images per class (DIR/train/CLASS/x.jpg), or use --fake_data')
  classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
  if not classes:
    raise UsageError(f'{root} has no class folders: put the images of each class in '
                     f'{root}/CLASS_NAME/')
  for name in classes:
    with os.scandir(os.path.join(root, name)) as entries:
      if not any(e.is_file() and e.name.lower().endswith(IMG_EXTENSIONS) for e in entries):
        raise UsageError(f'class folder {os.path.join(root, name)} has no images '
                         f'({" ".join(IMG_EXTENSIONS)}): add images or remove the folder')
  return classes


def image_folder(root, img_dim, train):
  """An ImageFolder split with the usual ImageNet augmentation (train) or centre crop (val)."""
  T = torchvision.transforms
  if train:
    transform = [T.RandomResizedCrop(img_dim), T.RandomHorizontalFlip()]
  else:
    # Resize to 256/224 of the crop, as torchvision's references do at 224 px.
    transform = [T.Resize(img_dim * 256 // 224), T.CenterCrop(img_dim)]
  transform += [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
  return torchvision.datasets.ImageFolder(root, T.Compose(transform), loader=load_image)


class FakeBatches:
  """The same batch of constant tensors num_batches times: no host work at all, so a run
  measures the device (as upstream's SampleGenerator does)."""

  def __init__(self, batch_size, img_dim, num_batches):
    self.batch = (torch.zeros(batch_size, 3, img_dim, img_dim),
                  torch.zeros(batch_size, dtype=torch.int64))
    self.num_batches = num_batches

  def __len__(self):
    return self.num_batches

  def __iter__(self):
    for _ in range(self.num_batches):
      yield self.batch


class PaddedSubset(torch.utils.data.Dataset):
  """dataset[i] for each i of indices; an index of -1 gives (blank, -1), a padding sample
  that evaluation does not count (see eval_indices)."""

  def __init__(self, dataset, indices, blank):
    self.dataset, self.indices, self.blank = dataset, indices, blank

  def __len__(self):
    return len(self.indices)

  def __getitem__(self, i):
    index = self.indices[i]
    return (self.blank, -1) if index < 0 else self.dataset[index]


# ------------------------------------------------- splitting work across replicas


def train_sampler(dataset, rank, world_size, seed):
  """This replica's share of the training set, reshuffled by set_epoch(epoch).

  drop_last=True: DistributedSampler would otherwise pad the shares to equal length by
  repeating samples, training some twice an epoch. Dropping the remainder (fewer than
  world_size samples) gives every replica the same share and no sample to two replicas.
  The order is a function of (seed, epoch) alone.
  """
  return torch.utils.data.DistributedSampler(
      dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)


def train_steps_per_epoch(num_samples, world_size, batch_size):
  """Steps every replica runs an epoch: whole batches of its equal share."""
  return num_samples // world_size // batch_size


def eval_indices(num_samples, rank, world_size, batch_size):
  """This replica's evaluation samples, padded with -1 to a whole number of batches.

  Replica r takes samples r, r + world_size, ...: every sample is evaluated exactly
  once in all. Every replica runs the same number of steps (a replica that stopped
  early would leave the others waiting in the next collective, pytorch/xla#2749), and
  every batch has the same shape (one compiled graph); padding has label -1.
  """
  share = -(-num_samples // world_size)
  steps = -(-share // batch_size)
  indices = list(range(rank, num_samples, world_size))
  return indices + [-1] * (steps * batch_size - len(indices))


def shards_for(urls, rank, world_size, worker, num_workers, seed, epoch):
  """The shards one loader worker of one replica reads in an epoch.

  The list is shuffled the same way on every replica (from seed and epoch), then dealt
  out: replica r takes every world_size-th shard from r, and its worker w every
  num_workers-th of those. Every shard is read by exactly one (replica, worker) per
  epoch, and the order differs every epoch. Needs len(urls) >= world_size * num_workers.
  """
  order = list(urls)
  random.Random(f'{seed}/{epoch}').shuffle(order)
  return order[rank::world_size][worker::num_workers]


def warmup_step_decay(step, steps_per_epoch, warmup_epochs, divide_every_n_epochs, divisor):
  """Learning-rate factor at a global step: linear warm-up from 0, then divide by divisor
  every divide_every_n_epochs epochs (upstream's WarmupAndExponentialDecayScheduler).

  A function of the step alone, so a resumed run picks up the exact value.
  """
  warmup_steps = warmup_epochs * steps_per_epoch
  if step < warmup_steps:
    return (step + 1) / warmup_steps
  return 1.0 / divisor**(step // steps_per_epoch // divide_every_n_epochs)


class CappedLoader:
  """Yields at most num_batches batches of loader per epoch, on the host.

  Capping before MpDeviceLoader (rather than breaking out of its loop) leaves no
  background thread behind. An exception in the loader (a corrupt image) would end
  the device loader's epoch silently early; it is kept here and raised by check().
  """

  def __init__(self, loader, num_batches):
    self.loader = loader
    try:
      self.num_batches = min(len(loader), num_batches)
    except TypeError:  # An endless stream: the cap is the epoch.
      self.num_batches = num_batches
    self.error = None

  def __len__(self):
    return self.num_batches

  def __iter__(self):
    self.error = None
    try:
      # islice stops at the cap without asking for one more batch, which would read (and
      # count) data the epoch does not use.
      yield from itertools.islice(self.loader, self.num_batches)
    except Exception as e:  # Raised in the main thread by check().
      self.error = e

  def check(self):
    if self.error is not None:
      raise self.error


# --------------------------------------------------------------------------- logging


def now():
  return datetime.datetime.now().strftime('%H:%M:%S')


def training_line(device, ordinal, epoch, step, loss, rate, global_rate):
  """The per-step line of pytorch/xla's test scripts, which TPU users grep for."""
  return (f'| Training Device={device}/{ordinal} Epoch={epoch} Step={step} '
          f'Loss={loss:.5f} Rate={rate:.2f} GlobalRate={global_rate:.2f} Time={now()}')


def log_training_step(device, ordinal, epoch, step, global_step, loss, tracker, lr, writer):
  """The step closure of every script (xm.add_step_closure): it runs after the step's graph
  has executed, so reading the loss here costs no extra sync."""
  loss, rate = loss.item(), tracker.rate()
  print(training_line(device, ordinal, epoch, step, loss, rate, tracker.global_rate()), flush=True)
  write_scalars(writer, global_step, {'Loss/train': loss, 'Rate/train': rate, 'LR': lr})


def summary_writer(logdir):
  """A TensorBoard writer for logdir, or None when no --logdir was given."""
  if not logdir:
    return None
  from torch.utils.tensorboard import SummaryWriter
  return SummaryWriter(logdir)


def write_scalars(writer, step, scalars):
  if writer is not None:
    for name, value in scalars.items():
      writer.add_scalar(name, value, step)


def compile_count():
  """XLA graphs compiled so far by this process (torch_xla's CompileTime metric)."""
  import torch_xla.debug.metrics as met  # Here, so that scripts without a device skip it.
  data = met.metric_data('CompileTime')
  return data[0] if data else 0


def save_to_url(obj, url):
  """torch.save to a local path or any fsspec URL (gs://...), atomically: written under a
  temporary name and moved, so a reader never sees half a file."""
  import fsspec
  fs, path = fsspec.core.url_to_fs(url)
  fs.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  tmp = f'{path}.tmp{os.getpid()}'
  with fs.open(tmp, 'wb') as f:
    torch.save(obj, f)
  fs.mv(tmp, path)


def write_results(path, results):
  """Writes results as JSON, atomically: a reader never sees half a file."""
  if not path:
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f'{path}.tmp{os.getpid()}'
  with open(tmp, 'w') as f:
    json.dump(results, f, indent=2)
    f.write('\n')
  os.replace(tmp, path)
