# SPDX-License-Identifier: BSD-3-Clause
"""What every process of a training run does, whichever script it runs: one-line errors and
exit codes; the data (the split across replicas, seeded samples, loaders, normalisation on the
device); the log and results; files and buckets; checkpoints; the stop every replica agrees
on. It reads no flag's value: a copied script needs it and nothing else (supervisor.py,
command.py: optional)."""

import asyncio
import collections
import concurrent.futures
import contextlib
import errno
import fcntl
import functools
import io
import itertools
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.resource_tracker
import os
import pickle
import re
import signal
import socket
import struct
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
import types
import warnings
import zipfile

import fsspec.implementations.local
import numpy as np
import torch
import torch_xla
import torch_xla.backends
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.debug.profiler as xp
import torch_xla.runtime as xr
import torch_xla.test.test_utils as test_utils
import torchvision
from absl import flags
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

# PIL warns of an image over its pixel limit as it opens it; decode_image refuses it in its line.
warnings.filterwarnings('ignore', category=Image.DecompressionBombWarning)
EXIT_BELOW_TARGET = 21  # upstream's code for a run below --target_accuracy
EXIT_DIVERGED = 22  # the loss or the weights ran away: nothing was saved after it
EXIT_OUT_OF_MEMORY = 23  # a device could not hold the step (or the host, on XLA:CPU)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by SIGTERM (SIGHUP) after a checkpoint; run it again.
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C.
# The user's SIGINT in the lines about it: a notebook's run() says "Interrupt", after its button.
INTERRUPT = os.environ.get('INTERRUPT_NAME', 'Ctrl-C')
# Seconds a request to a bucket may take (a part of a checkpoint: gcsfs's upload chunk, at most
# 50 MiB, or a block read): 120, at least 0.4 MiB/s; the tests give a few (see url_fs).
BUCKET_SECONDS = float(os.environ.get('BUCKET_TIMEOUT', 120))
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # of pixels 0 to 1
# Flags that decide an epoch's batches: a resume with another value warns (checkpoint_to_resume).
BATCH_FLAGS = ('datadir', 'fake_data', 'batch_size', 'gradient_accumulation_steps', 'seed',
               'num_steps', 'img_dim', 'drop_last')
# SIGHUP: a closed terminal or ssh session. Under nohup it is ignored, and stays so.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


# ------------------------------------------------------------------ errors and exit codes
class UsageError(Exception):
  """A mistake the user can fix: printed as one `error:` line, exit code 2."""


class BadDataError(Exception):
  """An image file, shard or sample that cannot be read."""

  def __str__(self):
    # Raised in a DataLoader worker, it comes back inside the worker's traceback.
    return super().__str__().strip().splitlines()[-1].split('BadDataError: ')[-1]


class BucketTimeout(UsageError):  # A request to a bucket over BUCKET_SECONDS (fs_options)
  def __str__(self):
    return (f'{self.args[0]}: a request to the bucket took over {BUCKET_SECONDS:g} s; check the '
            'network, then run the same command again')


class LoaderWorkerDied(Exception):
  """A DataLoader worker that died: one `error:` line; exit code 128 + N for signal N (as for a
  replica), or 2 for an exit code of its own (its lines above say why)."""

  def __init__(self, message, exit_code):
    super().__init__(message)
    self.exit_code = exit_code


class Diverged(Exception):
  """The loss or the weights ran away at the step this names (every replica agrees on it)."""


class OutOfMemory(Exception):
  """A device that cannot hold what the step needs, from the RuntimeError XLA raises: XLA:CPU's
  `Out of memory allocating N bytes`, a TPU's `RESOURCE_EXHAUSTED ... memory` (at compile or
  run). One `error:` line naming the flags that cut memory, exit code 23."""
  exit_code = EXIT_OUT_OF_MEMORY
  FLAGS = {'batch_size': 'a smaller --batch_size', 'gradient_accumulation_steps':
           '--gradient_accumulation_steps N with --batch_size / N', 'amp': '--amp',
           'use_gradient_checkpointing': '--use_gradient_checkpointing',
           'sharding': '--sharding fsdp'}

  @classmethod
  def of(cls, error):
    """The OutOfMemory error means, or None."""
    text = str(error)
    cpu = re.search(r'Out of memory allocating (\d+) bytes', text)
    tpu = 'RESOURCE_EXHAUSTED' in text and re.search(
        r'(Ran out of memory[^\n]*|Attempting to allocate [^\n]*?\.|[^\n]*memory[^\n]*)', text)
    if not isinstance(error, RuntimeError) or not (cpu or tpu):
      return None
    what = (f'XLA could not allocate {int(cpu[1]) / 1e9:,.1f} GB for a graph' if cpu else
            f'RESOURCE_EXHAUSTED: {tpu[1].strip()[:200]}')
    cuts = [cut for name, cut in cls.FLAGS.items() if name in flags.FLAGS]
    return cls(f'out of device memory ({what}): cut what a device holds with '
               f'{", ".join(cuts[:-1])} or {cuts[-1]}, and run again (see '
               'docs/large_models.md#out-of-device-memory)')


# Said in one `error:` line (exit code 2, or the error's exit_code), not a traceback: a user's
# mistake, bad data, an OSError, a loader worker that died, a device out of memory.
SAID = (UsageError, BadDataError, OSError, LoaderWorkerDied, OutOfMemory)


def said(error):
  """What to say of an error in one `error:` line (see SAID), or None for a bug."""
  return error if isinstance(error, SAID) else OutOfMemory.of(error)


def die_or_raise(error):
  """In an except block: one `error:` line for what SAID holds or a device out of memory (see
  die), the error's traceback for a bug."""
  one_line = said(error)
  if one_line is None:
    raise error
  die(one_line)


def die(message, code=2):
  """Ends this process with one `error:` line, the last it prints (see last_line)."""
  code = getattr(message, 'exit_code', code)
  last_line()
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(code)


def last_line():
  """What this process prints from now on is its `error:` line: the lines its threads print
  later (the log's last steps, say) go nowhere, not after it (into one file, with stderr)."""
  sys.stdout.flush()
  try:
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
  except (AttributeError, ValueError, io.UnsupportedOperation):  # Not a file (pytest's, say).
    pass


def parse_flags(argv, elsewhere=None):
  """Flags parser for app.run: a bad flag is one line and exit code 2, as argparse does.
  elsewhere: {flag of another script, or FLAG=VALUE of another's: what to say instead of absl's
  guess or its list of the values this one takes}."""
  try:
    rest = flags.FLAGS(argv)
  except SystemExit:  # absl's --help (in a --flagfile, say) prints, then exits 1.
    sys.exit(0)
  except flags.Error as e:
    given = isinstance(e, flags.IllegalFlagValueError) and re.match(r'flag --(\S+?): ', str(e))
    name = given[1] if given else getattr(e, 'flagname', None)
    known = (given or isinstance(e, flags.UnrecognizedFlagError)) and name in (elsewhere or {})
    die(f'{"flag " * bool(given)}--{name}: {elsewhere[name]}' if known else
        f'{e} (see --helpshort)')
  if len(rest) > 1:
    die(f'unexpected arguments {rest[1:]}: every option is a --flag (see --helpshort)')
  largest = torch.finfo(torch.float32).max  # A float flag on the device (--lr 1e39: inf there)
  for name in flags.FLAGS:  # absl takes nan and inf for a float, and nan passes any bound.
    value = flags.FLAGS[name].value
    if isinstance(value, float) and not abs(value) <= largest:
      die(f'--{name} {value:g}: give a finite number that float32 holds (at most {largest:.1e}; '
          'see --helpshort)')
  return rest


def redefinable(flag_values):
  """Lets these flags be defined again (a notebook importing several scripts, %run twice)."""
  for name in flag_values:
    flag_values[name].allow_override = True


def in_notebook():  # An IPython kernel or shell: `%run script.py` in a notebook.
  return 'IPython' in sys.modules and sys.modules['IPython'].get_ipython() is not None


def set_precision(amp, bf16):
  """--amp or --bf16, not both; --bf16 sets XLA_USE_BF16=1, which the runtime reads as it starts."""
  if amp and (bf16 or os.environ.get('XLA_USE_BF16') == '1'):
    die('give --amp or --bf16 (XLA_USE_BF16=1), not both: --amp keeps the weights and the '
        'optimizer in float32, --bf16 makes every float tensor bfloat16')
  if bf16:
    os.environ['XLA_USE_BF16'] = '1'


def prepare_process(cfg, process=None):
  """Before this process's first computation: --compile_cache_dir's cache (a folder per process:
  hosts may share a mounted one; see docs/checkpoints.md), --debug_graphs's analysis, and
  --mat_mul_precision (see docs/tpu.md), each a setting of the process, not of its launcher."""
  if cfg.compile_cache_dir:
    xr.initialize_cache(os.path.join(cfg.compile_cache_dir, f'process-{process}')
                        if process is not None else cfg.compile_cache_dir)
  debug_graphs(cfg.debug_graphs)
  if cfg.mat_mul_precision != torch_xla.backends.get_mat_mul_precision():
    # Its warning of a precision set "multiple times" comes at the first time too.
    logging.getLogger(torch_xla.backends.__name__).setLevel(logging.ERROR)
    torch_xla.backends.set_mat_mul_precision(cfg.mat_mul_precision)


def start_profiler(cfg, port, global_step, last_step):
  """torch_xla's profiler server for --profile and --profile_step (None without them), on a port
  checked free first (held by another process, torch_xla says only C++ lines, and a trace would
  ask a server that is not this run's), with --profile_step a step this run trains."""
  if not cfg.profile and cfg.profile_step is None:
    return None
  if cfg.profile_step is not None and cfg.profile_step >= last_step:
    raise UsageError(f"--profile_step {cfg.profile_step} is past the run's last step "
                     f"({last_step - 1}: steps count from 0 at the run's start): give a step it "
                     'trains, or more --num_epochs')
  if cfg.profile_step is not None and cfg.profile_step < global_step:
    xm.master_print(f'warning: --profile_step {cfg.profile_step} is before step {global_step}, '
                    'where this run resumes: it takes no trace', fd=sys.stderr, flush=True)
  try:
    socket.create_server(('', port)).close()
  except OSError as e:
    raise UsageError(f'--profiler_port: port {port} is taken ({os.strerror(e.errno)}): another '
                     'process listens there; give another --profiler_port') from None
  return xp.start_server(port)


def capture_trace(cfg):
  """--profile_step's trace of the next --profile_duration_ms into --profile_logdir, by a thread
  as the run trains on, which ends with the run: torch_xla's trace_detached would hold the
  process past its end while a trace it cannot write retries (minutes, for a bucket)."""
  threading.Thread(target=xp.trace, name='trace', daemon=True, args=(
      f'localhost:{cfg.profiler_port}', cfg.profile_logdir or cfg.logdir),
      kwargs=dict(duration_ms=cfg.profile_duration_ms)).start()


def check_picklable(datasets):
  """Each dataset ({name: dataset}) pickled as a replica's loader workers get it: a class defined
  in a function or a lambda transform is one line, not multiprocessing's traceback."""
  for name, dataset in datasets.items():
    pickler = pickle.Pickler(types.SimpleNamespace(write=len))  # Written nowhere.
    pickler.dispatch_table = dict.fromkeys((torch.Tensor, np.ndarray), lambda _: (tuple, ()))
    try:
      pickler.dump(dataset)
    except Exception as e:  # pickle.PicklingError, AttributeError (a local class), TypeError
      raise UsageError(f'build_datasets: the {name} set ({type(dataset).__name__}) cannot be '
                       f'sent to loader worker processes ({e}): define its class (and any '
                       'function it holds) at module level, or give --num_workers 0') from None


def create_model(name, num_classes):  # A torchvision classifier, fresh (nothing downloaded).
  if name not in torchvision.models.list_models(torchvision.models):
    raise UsageError(f'--model {name} is not a torchvision classification model (e.g. resnet18, '
                     "resnet50): name one, or build your own in the script's build_model")
  # Models with auxiliary heads return a tuple in training mode; the loop wants logits.
  aux = dict(aux_logits=False, init_weights=True) if name in ('googlenet', 'inception_v3') else {}
  return torchvision.models.get_model(name, weights=None, num_classes=num_classes, **aux)


def make_optimizer_state(optimizer):
  """Makes before the first step the state torch's SGD (with momentum), Adam and AdamW make in it:
  zeros, each tensor a copy of its weight (sharded as the weight is). The first step then runs
  the graph of every later step, one compile less (on a TPU, the step's compile is most of a
  run's start), with the same results bit for bit. Another optimizer makes its state in its
  first step, which compiles a graph of its own."""
  adam = isinstance(optimizer, torch.optim.Adam)  # AdamW is one.
  if optimizer.state or not (adam or isinstance(optimizer, torch.optim.SGD)):
    return
  for group in optimizer.param_groups:
    if adam and (group['capturable'] or group['fused'] or group['differentiable']):
      continue  # Their step count lives elsewhere: left to the first step.
    names = (('exp_avg', 'exp_avg_sq') + ('max_exp_avg_sq',) * group['amsgrad'] if adam else
             ('momentum_buffer',) * (group['momentum'] != 0))
    for weight in [weight for weight in group['params'] if weight.requires_grad and names]:
      state = optimizer.state[weight]
      if adam:
        state['step'] = torch.tensor(0.0)  # On the host, as Adam's own.
      state.update({name: weight.detach().clone().zero_() for name in names})


# ------------------------------------------------------------------------------ data
def load_image(path):  # decode_image of a file; a BadDataError naming it if it cannot.
  try:
    with open(path, 'rb') as f:
      return decode_image(f.read())
  except (OSError, ValueError) as e:
    raise BadDataError(f'cannot read image {path} ({e}): replace or remove the file') from None


def decode_image(data):
  """The image file's bytes as a uint8 RGB tensor (3 x H x W): a JPEG by libjpeg-turbo
  (torchvision's), any other format the installed PIL opens by PIL (grey, palette and RGBA made
  RGB, 16-bit grey scaled to 8 bits, a GIF's first frame). A ValueError says why it cannot (a
  truncated or unknown file, 32-bit pixels, too many pixels: from the header, before decoding)."""
  if data[:3] == b'\xff\xd8\xff' and (size := jpeg_size(data)):  # Else PIL's header check.
    check_pixels(*size)
    try:
      return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                         mode=ImageReadMode.RGB)
    except RuntimeError:
      pass  # PIL reads some that libjpeg refuses here, and says what is wrong with the rest.
  try:
    with Image.open(io.BytesIO(data)) as image:  # The header only, so far.
      check_pixels(*image.size)
      if image.mode.startswith('I;16') or (image.mode == 'I' and image.format == 'PNG'):
        # PIL's convert('RGB') clips 16-bit values at 255: most pixels would come out white.
        grey = (np.asarray(image).astype(np.uint32) + 128) // 257
        return torch.from_numpy(grey.astype(np.uint8)).expand(3, -1, -1).clone()
      if image.mode in ('I', 'F'):
        raise ValueError(f'{image.mode} mode: 32-bit pixels of no known range; save it with 8- '
                         'or 16-bit pixels')
      return v2.functional.pil_to_tensor(image.convert('RGB'))
  except Image.UnidentifiedImageError:
    raise ValueError('not an image file') from None
  except Image.DecompressionBombError as e:  # Over twice the limit: PIL's open refuses it.
    check_pixels(*(pil_size(data) or (0, 0)))  # Said as for any image over the limit.
    raise ValueError(str(e)) from None
  except OSError as e:  # Truncated files. (A mode PIL cannot make RGB is a ValueError.)
    raise ValueError(str(e)) from None


def check_pixels(width, height):
  """A ValueError for an image of more pixels than PIL's limit (Image.MAX_IMAGE_PIXELS, 89.5M;
  None: no limit): a 30000x30000 JPEG of 10 MB takes 2.7 GB and half a minute to decode."""
  if Image.MAX_IMAGE_PIXELS and width * height > Image.MAX_IMAGE_PIXELS:
    raise ValueError(too_many_pixels(f'{width}x{height} pixels'))


def too_many_pixels(pixels):  # Such as '30000x30000 pixels'.
  return (f"{pixels}, over the limit of {Image.MAX_IMAGE_PIXELS:,} (PIL's Image.MAX_IMAGE_PIXELS: "
          'raise it to read such images)')


def jpeg_size(data):
  """(width, height) from the JPEG frame header that libjpeg reads (3 us; PIL's header: 24), or
  None where libjpeg would stop before one. The markers are walked as libjpeg walks them, so no
  bytes it skips can hide a smaller frame: fill FFs and FF 00 skipped, RST0-7 and TEM without a
  length, a segment's length at least 2."""
  at = 2
  while (at := data.find(b'\xff', at)) >= 0:
    at = JPEG_FILL.match(data, at).end()  # In C: a crafted file may hold megabytes of them.
    marker, at = data[at:at + 1], at + 1
    if not marker:
      return None
    if marker[0] in JPEG_FRAMES:  # length, precision, height, width
      return int.from_bytes(data[at + 5:at + 7], 'big'), int.from_bytes(data[at + 3:at + 5], 'big')
    if marker[0] in JPEG_SEGMENTS:
      at += max(2, int.from_bytes(data[at:at + 2], 'big'))
    elif not (marker[0] == 0 or 0xD0 <= marker[0] <= 0xD7 or marker[0] == 0x01):
      return None  # Another SOI, EOI, scan data before a frame, an unknown marker: libjpeg stops.
  return None


JPEG_FILL = re.compile(rb'\xff+')  # The FFs before a marker
JPEG_FRAMES = {*range(0xC0, 0xD0)} - {0xC4, 0xC8, 0xCC}  # SOF0-15
# What libjpeg reads or skips by its length before a frame: DHT, DAC, DQT, DNL, DRI, APP0-15, COM.
JPEG_SEGMENTS = {0xC4, 0xCC, 0xDB, 0xDC, 0xDD, *range(0xE0, 0xF0), 0xFE}


def pil_size(data):
  """(width, height) of an image from its header, by the PIL plugin that reads it, as Image.open
  finds it but without its check of the pixels (which refuses, over twice the limit, in words of
  its own), or None. WebP's plugin checks the pixels itself, before it says the size: a
  ValueError in check_pixels' words."""
  Image.init()
  for name in Image.ID:
    factory, accept = Image.OPEN[name]
    if accept is None or accept(data[:16]) is True:
      try:
        with factory(io.BytesIO(data)) as image:
          return image.size
      except Image.DecompressionBombError:
        raise ValueError(too_many_pixels(f'more than {2 * Image.MAX_IMAGE_PIXELS:,} pixels')
                         ) from None


      except (SyntaxError, IndexError, TypeError, struct.error):
        continue
  return None


def image_folder(root, split, transform=None, splits=('train', 'val')):
  """torchvision's ImageFolder of root/split (IMAGE_FILES, read by load_image), or a UsageError
  when it is not a folder of class folders of images (splits: what root holds, for the line)."""
  folder = os.path.join(root, split)
  if not os.path.isdir(folder):
    raise UsageError(f'{folder} is not a folder: {root} needs {" and ".join(splits)} with one '
                     f'folder of images per class ({folder}/CLASS/x.jpg)')
  try:
    dataset = torchvision.datasets.ImageFolder(  # Which files: not kept, so a lambda pickles.
        folder, transform, loader=load_image, allow_empty=True,
        is_valid_file=lambda path: path.lower().endswith(IMAGE_FILES))
  except FileNotFoundError:
    raise UsageError(f'{folder} has no class folders: put the images of each class in '
                     f'{folder}/CLASS_NAME/') from None
  empty = sorted(set(dataset.classes) - {dataset.classes[label] for label in dataset.targets})
  if empty:
    raise UsageError(f'class folder {os.path.join(folder, empty[0])} has no images '
                     f'({" ".join(IMAGE_FILES)}): add images or remove the folder')
  return dataset


# torchvision's image files, and GIFs (their first frame: PIL's, as decode_image reads them).
IMAGE_FILES = torchvision.datasets.folder.IMG_EXTENSIONS + ('.gif',)


def normalize(images, mean=IMAGENET_MEAN, std=IMAGENET_STD):
  """What the model gets of a batch, in the step's graph: uint8 images as (x / 255 - mean) / std
  per channel (grey: the channels' averages), float images as they are (see docs/adapt.md)."""
  if images.dtype != torch.uint8:
    return images
  channels = images.shape[-3]
  if channels == 1 and len(mean) > 1:
    mean, std = (sum(mean) / len(mean),), (sum(std) / len(std),)
  elif channels != len(mean) and images.shape[-1] in (1, len(mean)):  # A numpy or PIL layout.
    raise UsageError(f"uint8 images of {'x'.join(map(str, images.shape[-3:]))} are height x width "
                     'x channels: the step takes channels x height x width; give each image as '
                     "image.permute(2, 0, 1) in build_datasets, or add v2.ToImage() to the "
                     'transform, which makes a PIL image or numpy array channels-first')
  elif channels != len(mean):
    raise UsageError(f'{channels}-channel uint8 images: utils.normalize takes {len(mean)} channels '
                     "or 1: make them RGB (v2.RGB() in build_datasets' transform), or float "
                     'images normalised as your model wants')
  shift, scale = _channel_constants(mean, std, str(images.device))
  return images.float().sub_(shift).mul_(scale)  # two elementwise ops


@functools.lru_cache
def _channel_constants(mean, std, device):
  """255 x mean and 1 / (255 x std), C x 1 x 1 on the device: made once, not sent every step.
  Shaped on the host: a view made on the device would be an input of another shape in the
  first step's graph than in the later ones' (a graph more)."""
  return (torch.tensor([255 * m for m in mean]).view(-1, 1, 1).to(device),
          torch.tensor([1 / (255 * s) for s in std]).view(-1, 1, 1).to(device))


def check_scores(output, labels, num_classes):
  """The model's output for a batch, if it is a score for each class and the labels a class
  each: else a UsageError naming the shape and the one expected (a shape is known as the step is
  traced: no wait)."""
  if labels.dim() != 1 or labels.dtype.is_floating_point:
    raise UsageError(f'the labels of a batch of {len(labels)} are {labels.dtype} of shape '
                     f'{tuple(labels.shape)}: expected ({len(labels)},), an integer class each; '
                     "fix build_datasets' labels (an int each, or a tensor of shape ())")
  expected = (labels.shape[0], num_classes)
  if tuple(output.shape) != expected:
    raise UsageError(f'the model returns outputs of shape {tuple(output.shape)} for a batch of '
                     f'{labels.shape[0]}: expected {expected}, a score for each of the '
                     f'{num_classes} classes; fix build_model, or the class count build_datasets '
                     'returns')
  return output


class EpochSampler(torch.utils.data.DistributedSampler):
  """This replica's share of an epoch from set_epoch's first batch on, ordered by (seed, epoch),
  each index with its augmentation's seed; a remainder is dropped, not repeated elsewhere."""

  def __init__(self, dataset, rank, world_size, seed, batch_size):
    super().__init__(dataset, world_size, rank, shuffle=True, seed=seed, drop_last=True)
    self.batch_size, self.skip = batch_size, 0

  def set_epoch(self, epoch, first_batch=0):
    super().set_epoch(epoch)
    self.skip = first_batch * self.batch_size

  def __len__(self):
    return super().__len__() - self.skip

  def __iter__(self):
    for index in itertools.islice(super().__iter__(), self.skip, None):
      yield (self.seed * 1_000_003 + self.epoch) * 2**32 + index, index


class SeededSamples(torch.utils.data.Dataset):
  """dataset[index] with torch's RNG (that random transforms use) seeded by the key's seed: a
  resumed run sees the very crops an uninterrupted one would, whatever the loader worker."""

  def __init__(self, dataset):
    self.dataset = dataset

  def __getitem__(self, key):
    with seeded(key[0]):
      return self.dataset[key[1]]


@contextlib.contextmanager
def seeded(seed):
  """Torch's CPU generator, which random transforms draw from, seeded for the block, then as it
  was: fork_rng and torch.manual_seed, at 1 us, not 60 (that seeds every accelerator's too)."""
  state = torch.default_generator.get_state()
  torch.default_generator.manual_seed(seed)
  try:
    yield
  finally:
    torch.default_generator.set_state(state)


def eval_share(dataset, rank, world_size, batch_size):
  """Samples rank, rank + world_size, ... padded with (zeros like sample 0, label -1), not counted,
  to every replica's batch count, of one shape: none waits for another (pytorch/xla#2749)."""
  image, label = dataset[0]
  # A tensor label gets a tensor -1: a batch's labels are stacked, and must be of one type.
  blank = (torch.zeros_like(image), torch.full_like(label, -1) if torch.is_tensor(label) else -1)
  steps = -(-len(dataset) // world_size // batch_size)
  share = torch.utils.data.Subset(dataset, range(rank, len(dataset), world_size))
  return torch.utils.data.ConcatDataset([share, [blank] * (steps * batch_size - len(share))])


class EpochLoader:
  """At most `steps` steps of per_step batches of loader an epoch (no early exit from
  MpDeviceLoader's loop, which leaves a thread behind), from set_epoch's first step on (`order`
  skips the batches trained); None batches dropped. check() raises what MpDeviceLoader swallows."""

  def __init__(self, loader, steps, order=None, per_step=1):
    self.loader, self.order, self.first_batch, self.error = loader, order, 0, None
    self.epoch = None  # The training epoch (set_epoch), named if a loader worker dies.
    try:
      self.steps = min(len(loader) // per_step, steps)
    except TypeError:  # An iterable dataset has no length: the cap is the epoch.
      self.steps = steps
    if self.steps == 0 and per_step > 1:
      raise UsageError(f"an epoch's batches make no step of --gradient_accumulation_steps "
                       f'{per_step} batches: lower it or --batch_size')
    self.per_step, self.num_batches = per_step, self.steps * per_step

  def set_epoch(self, epoch, first_step=0):  # first_step: of per_step batches each
    self.first_batch, self.epoch = first_step * self.per_step, epoch
    if self.order is not None:
      self.order.set_epoch(epoch, self.first_batch)

  def __iter__(self):
    self.error = iterator = None
    if self.first_batch >= self.num_batches:
      if self.first_batch > self.num_batches:  # A resume after a flag that decides them changed.
        xm.master_print(f'warning: the run resumed after step {self.first_batch // self.per_step} '
                        f'of an epoch that has {self.steps} step{"s" * (self.steps != 1)} now: it '
                        'trains none of them; the epoch ends here', fd=sys.stderr, flush=True)
      return  # Without starting loader workers for nothing.
    try:  # islice: no batch past the cap is asked for (or read, or counted).
      iterator = self.start()
      batches = (batch for batch in iterator if batch is not None)
      yield from itertools.islice(batches, self.num_batches - self.first_batch)
    except Exception as e:
      said = isinstance(e, (UsageError, BadDataError))  # A worker's own, sent back whole.
      self.error = (not said and self.worker_death(iterator)) or e
      if 'stack expects each tensor to be equal size' in str(e):  # default_collate's words
        detail = str(e).strip().splitlines()[-1]  # From a loader worker: its traceback too.
        self.error = BadDataError(f'samples of different shapes in one batch ({detail}): make '
                                  "every sample one shape (in build_datasets' transform)")

  def start(self):
    """iter(loader), with the stop signals blocked in this thread while loader workers start (for
    seconds), which inherit the mask (loader_start's fork server too): a signal meanwhile waits,
    then is dropped as the worker ignores it (ignore_stop_signals), instead of killing it."""
    multiprocessing.resource_tracker.ensure_running()  # Its start would unblock SIGINT, SIGTERM.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
      return iter(self.loader)
    finally:
      signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

  def worker_death(self, iterator):
    """LoaderWorkerDied for the first of the iterator's loader workers that died, or None (torch
    says only 'exited unexpectedly' outside the main thread, MpDeviceLoader's; a batch cut off by
    the death may come first as another error: a death is waited for 2 s)."""
    workers = getattr(iterator, '_workers', None)
    if not workers:
      return None
    multiprocessing.connection.wait([process.sentinel for process in workers], timeout=2)
    for worker_id, process in enumerate(workers):
      code = process.exitcode  # -N for signal N; None while it runs.
      if code in (None, 0):
        continue
      seen = f'seen in epoch {self.epoch}' if self.epoch else 'seen in an evaluation'
      head = f'loader worker {worker_id} (pid {process.pid})'
      fewer = f'give fewer --num_workers ({self.loader.num_workers} now; 0 loads in this process)'
      here = '--num_workers 0 loads in this process, where the same fault is a traceback'
      if code > 0:
        return LoaderWorkerDied(f'{head} exited with code {code} ({seen}): its lines above say '
                                f'why; {here}', 2)
      name = {signum.value: signum.name for signum in signal.Signals}.get(-code, f'signal {-code}')
      why = {signal.SIGKILL: f'the host may be out of memory (see dmesg); {fewer}',
             signal.SIGBUS: f'shared memory is full (df -h /dev/shm): free it, or {fewer}'}
      return LoaderWorkerDied(f'{head} was killed by {name} ({seen}): ' + why.get(
          -code, f'its lines above may say why; {here}'), 128 - code)
    return None

  def check(self):
    if self.error is not None:
      raise self.error


def in_steps(batches, per_step):  # Lists of per_step batches: one per optimizer step.
  batches = iter(batches)
  return iter(lambda: list(itertools.islice(batches, per_step)), [])


def evaluates(epoch, num_epochs, interval, only_at_end):
  """Whether epoch is evaluated: every interval-th and the last (--eval_interval,
  --test_only_at_end), a function of the epoch alone, so that a resumed run keeps the schedule."""
  return epoch == num_epochs or (not only_at_end and epoch % interval == 0)


def warmup_step_decay(step, steps_per_epoch, warmup_epochs, divide_every_n_epochs, divisor):
  """upstream's WarmupAndExponentialDecayScheduler as the LR factor at a global step (exact on
  resume)."""
  warmup_steps = warmup_epochs * steps_per_epoch
  if step < warmup_steps:
    return (step + 1) / warmup_steps
  return 1.0 / divisor**(step // steps_per_epoch // divide_every_n_epochs)


def loader_start():
  """The DataLoader's multiprocessing_context: in a spawned replica, a fork server that imports
  torch, torch_xla and this module once and forks each worker (a spawned one imports them: 411 MB
  of its own each, benchmarks/input_pipeline.py); elsewhere None (fork)."""
  if multiprocessing.get_start_method(allow_none=True) != 'spawn':
    return None
  context = multiprocessing.get_context('forkserver')
  context.set_forkserver_preload(['torch', 'torch_xla', __name__])
  return context


def ignore_stop_signals(worker_id=None):
  """DataLoader worker_init_fn: workers serve on after a stop signal (blocked as they start,
  EpochLoader.start), so the run can save, and end with their replica (a fork server's worker:
  torch's watchdog watches the server, which lives while a worker holds its pipe)."""
  for signum in STOP_SIGNALS:
    signal.signal(signum, signal.SIG_IGN)
  signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
  replica = multiprocessing.parent_process()
  if replica is not None:
    threading.Thread(target=_end_with, args=(replica,), daemon=True).start()
    sys.stderr = _QuietOnceGone(sys.stderr, replica)


class _QuietOnceGone:
  """A loader worker's sys.stderr: a traceback as its replica dies (a thread handing it a batch)
  ends the worker instead, as _end_with would a moment later; while the replica lives, it prints."""

  def __init__(self, stream, replica):
    self.stream, self.replica = stream, replica

  def write(self, text):
    if text.startswith(('Traceback', 'Exception in thread', 'Exception ignored')):
      self.replica.join(2)
      if not self.replica.is_alive():
        os._exit(128 + signal.SIGKILL)
    return self.stream.write(text)

  def __getattr__(self, name):
    return getattr(self.stream, name)


# ----------------------------------------------------------------- the log and results
class StepLog:
  """Training lines (pytorch/xla's, which TPU users grep for) and TensorBoard scalars, in order,
  from a thread of their own: add() is a step closure; reading the loss in it would hold up the
  next step. A graph compiled after this process's first epoch (a late graph: it stalls a TPU
  run while it compiles) is said at the first line after it, and why with --debug_graphs."""

  def __init__(self, device, writer, results):
    self.device, self.writer, self.results = device, writer, results
    self.history = results['history']  # The run's logged steps: a checkpoint's, then this run's.
    self.restored = len(self.history)
    self.pending = collections.deque()
    self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='log')
    self.graphs = None  # The count a later one is late past: from this process's first epoch end.
    self.evaluated = False  # This process's first evaluation compiles graphs of its own, not late.
    self.analysis = GraphAnalysis()

  def add(self, *line):  # What _print takes; the graphs compiled by then (a host read, no sync).
    self.pending.append(self.thread.submit(self._print, *line, compile_count()))

  def _print(self, epoch, step, global_step, loss, tracker, lr, graphs):
    loss, rate = loss.item(), tracker.rate()
    test_utils.print_training_update(self.device, step, loss, rate, tracker.global_rate(), epoch)
    self.history.append(dict(epoch=epoch, step=step, global_step=global_step, loss=loss,
                             rate=rate, lr=lr))
    test_utils.write_to_summary(self.writer, global_step,
                                {'Loss/train': loss, 'Rate/train': rate, 'LR': lr})
    self.check_graphs(graphs, f'by epoch {epoch} step {step}')
    if len(self.history) == self.restored + 1:  # This process's first line
      self.say_memory()

  def say_memory(self):
    """What the device holds after the first step, and its limit: on a TPU (XLA:CPU keeps no
    allocator statistics; torch_xla raises UNIMPLEMENTED there)."""
    if xr.device_type() != 'TPU':
      return
    try:
      info = xm.get_memory_info(self.device)
    except RuntimeError:  # A device it does not know (not checked on a TPU here): nothing said.
      return
    xm.master_print(f'Device memory after the first step: {info["bytes_used"] / 1e9:.2f} GB of '
                    f'{info["bytes_limit"] / 1e9:.2f} GB (peak {info["peak_bytes_used"] / 1e9:.2f} '
                    'GB)', flush=True)

  def flush(self):
    """Waits until every line added so far is printed (and raises what failed)."""
    while self.pending:
      self.pending.popleft().result()

  def trained(self, epoch):  # After an epoch's last step: its lines, and its last steps' graphs.
    self.flush()
    self.check_graphs(compile_count(), f'in the last steps of epoch {epoch}')

  def end_epoch(self, epoch, evaluated):
    """At an epoch's end, its evaluation's graphs in: the count into the results; from the end of
    this process's first epoch on, each graph compiled is late."""
    count = compile_count()
    if not evaluated or self.evaluated:
      self.check_graphs(count, f"in epoch {epoch}'s evaluation")
    self.evaluated |= evaluated
    self.graphs = count
    self.results['compilations_after_epoch'].append(count)

  def check_graphs(self, count, where):
    graphs = self.analysis.read()  # Those compiled since the last check, with --debug_graphs.
    if self.graphs is None or count <= self.graphs:
      return
    late, self.graphs = count - self.graphs, count
    self.results['late_graphs'] += late
    xm.master_print(f'warning: {late} graph{"s" * (late > 1)} compiled {where} ({count - late} '
                    f'before, {count} now): each graph compiled after the first epoch stalls a '
                    'TPU run while it compiles; ' + (
                        'why:' if graphs else 'give --debug_graphs to see why, and see '
                        'docs/performance.md#a-late-graph'), fd=sys.stderr, flush=True)
    for graph in graphs[-late:]:
      xm.master_print(f'  {graph}', fd=sys.stderr, flush=True)


def debug_graphs(on):
  """--debug_graphs: torch_xla's analysis of each graph it compiles (PT_XLA_DEBUG_LEVEL=1), into a
  file of this process's that StepLog reads. Before the process's first computation: torch_xla
  reads these variables then. The file is unlinked at once: nothing is left behind."""
  if not on:
    return
  if compile_count():  # A notebook's second run: the analysis cannot be turned on now.
    print('warning: --debug_graphs: this process compiled graphs already, and torch_xla turns '
          'its analysis on only before the first; restart the kernel to use it', file=sys.stderr)
    return
  fd, path = tempfile.mkstemp(prefix='xla-graphs-', suffix='.txt')
  os.unlink(path)
  os.environ.update(PT_XLA_DEBUG_LEVEL='1', PT_XLA_DEBUG_FILE=f'/proc/{os.getpid()}/fd/{fd}')


class GraphAnalysis:
  """Each graph in torch_xla's analysis (PT_XLA_DEBUG_FILE, see debug_graphs) as the line a user
  acts on: why it compiled, at which line of their code, and what differs from the graph that
  line compiled before (the inputs' bytes: another shape; the same bytes: another Python value
  or branch in the traced code)."""
  BLOCK = re.compile(r'Compilation Cause\n[^\n]*Analysis: +(?P<cause>[^\n]*)\n[\s\S]*?'
                     r'Graph Hash: (?P<hash>\w+)\n[\s\S]*?Number of Graph Inputs: (?P<inputs>\d+)'
                     r'[\s\S]*?Triggered Execution: *\n(?P<frames>(?:[^\n]*Analysis: +\S[^\n]*\n)*)'
                     r'[\s\S]*?Graph input size: (?P<gb>[\d.]+)')
  FRAME = re.compile(r'Analysis: +(\S+) \((.*):(\d+)\)$', re.M)
  LIBRARIES = tuple({sysconfig.get_path(name) for name in ('stdlib', 'purelib', 'platlib')})

  def __init__(self):
    path = os.environ.get('PT_XLA_DEBUG_FILE') if os.environ.get('PT_XLA_DEBUG_LEVEL') else None
    self.path, self.file, self.text = path, None, ''
    self.before = {}  # The last graph compiled at each line of code: (hash, inputs, GB).

  def read(self):
    """The lines of the graphs compiled since the last read."""
    if self.path and self.file is None and os.path.exists(self.path):
      self.file = open(self.path, errors='replace')  # torch_xla makes it at its first compile.
    if self.file is None:
      return []
    self.text += self.file.read()
    lines, end = [], 0
    for block in self.BLOCK.finditer(self.text):  # A block written in part waits for the next read.
      lines.append(self.describe(block))
      end = block.end()
    self.text = self.text[end:]
    return lines

  def describe(self, block):
    frames = self.FRAME.findall(block['frames'])  # (function, path, line) of each
    ours = next((frame for frame in frames if not frame[1].startswith(self.LIBRARIES)),
                frames[0] if frames else ('?', '?', '?'))
    name, path, line = ours
    where = f'{name} ({os.path.relpath(path) if path.startswith(os.getcwd()) else path}:{line})'
    graph = (block['hash'][:8], int(block['inputs']), float(block['gb']))
    text = f'graph {graph[0]} ({graph[1]} inputs, {graph[2]:g} GB): {block["cause"]}, at {where}'
    earlier = self.before.get(where)
    self.before[where] = graph
    if earlier is None:
      return text + '; the first graph from that line'
    if earlier[1:] != graph[1:]:
      return (text + f'; that line compiled graph {earlier[0]} before, of {earlier[1]} inputs and '
              f'{earlier[2]:g} GB: an input of another shape here (a last partial batch?)')
    return (text + f'; that line compiled graph {earlier[0]} before, of the same inputs and bytes: '
            'a Python value or branch in the code it traced differs')


def compile_count():  # XLA graphs this process compiled so far
  return (met.metric_data('CompileTime') or (0,))[0]


def new_results(model, **extra):
  """The numbers a run adds up as it goes, which --results_json writes (see docs/scripts.md)."""
  return dict(dict(model=model, script=os.path.basename(sys.argv[0]), world_size=xr.world_size(),
                   epochs=0, max_accuracy=0.0, final_accuracy=0.0, eval_correct=0,
                   eval_samples=0, epoch_rates=[], epoch_accuracies=[], eval_epochs=[],
                   compilations_after_epoch=[], late_graphs=0, train_seconds=0.0, history=[],
                   bf16=os.environ.get('XLA_USE_BF16') == '1',
                   mat_mul_precision=torch_xla.backends.get_mat_mul_precision()), **extra)


def add_totals(results, global_step, samples_per_step, log):
  """The run's totals into its results, once its log's lines are out; closes its TensorBoard."""
  log.flush()
  if log.writer is not None:
    log.writer.close()
  results['train_steps'] = global_step
  results['train_samples'] = global_step * samples_per_step
  results['global_rate'] = results['train_samples'] / max(results['train_seconds'], 1e-9)
  results['compilations'] = compile_count()


def say_finished(results, target_accuracy):
  """Says a finished run's totals; returns its exit code: 0, or 21 below target_accuracy."""
  say_time_and_graphs(results)
  xm.master_print(f'Max Accuracy: {results["max_accuracy"]:.2f}%', flush=True)
  if results['final_accuracy'] < target_accuracy:
    xm.master_print(f'Accuracy {results["final_accuracy"]:.2f} is below target '
                    f'{target_accuracy:.2f}', flush=True)
    return EXIT_BELOW_TARGET
  return 0


def say_time_and_graphs(results):
  """A finished run's train time, and its graphs: how many compiled after its first epoch."""
  xm.master_print(f'Total train time: {results["train_seconds"]:.1f} s', flush=True)
  after = results['compilations_after_epoch']  # At each epoch's end, its evaluation's in.
  start = next((epoch for epoch, count in enumerate(after) if count is not None), None)
  if start is not None:  # This process's first epoch: StepLog counted its late graphs after it.
    late = results['late_graphs']
    xm.master_print(f'Graphs compiled: {results["compilations"]}, ' + (f'{late} after epoch '
        f'{start + 1} (see docs/performance.md#a-late-graph)' if late else
        f'none after epoch {start + 1}'), flush=True)


def check_learning(log, epoch, num_classes, lr, default_lr):
  """A warning when the loss stayed at chance level (ln of the class count) through the second
  half of the epoch's steps this run logged at the default --lr: see docs/adapt.md."""
  losses = [entry['loss'] for entry in log.history[log.restored:] if entry['epoch'] == epoch]
  chance = math.log(num_classes)
  if (lr == default_lr and len(losses) >= 4 and num_classes >= 2 and
      min(losses[len(losses) // 2:]) >= 0.95 * chance):
    xm.master_print(f'warning: the loss stayed at chance level (ln {num_classes} = {chance:.2f}) '
                    f'through epoch {epoch} at the default learning rate {lr:g}: the model is '
                    f'not learning; try a lower --lr (such as {lr / 10:g}), as a model without '
                    'BatchNorm often needs', fd=sys.stderr, flush=True)


def write_results(path, results):  # As JSON to a local path or URL, atomically
  if path:
    try:
      write_atomically(json.dumps(results, indent=2).encode() + b'\n', path)
    except asyncio.TimeoutError:
      raise BucketTimeout(f'cannot write --results_json {path}') from None
    except OSError as e:
      raise UsageError(f'cannot write --results_json {path} ({e})') from None


# ------------------------------------------------------------------------ files and buckets
def url_fs(url, seconds=None):  # (file system, path), with fs_options's deadlines
  return fsspec.core.url_to_fs(url, **fs_options(url, seconds))


def fs_options(url, seconds=None):
  """fsspec's options for a URL: each request to a bucket (gs://) has `seconds` (BUCKET_SECONDS
  unless given), so a stalled or trickling bucket is an error, not a hang; given `seconds`, so
  have a server's (http(s)) connection and each read. Others keep their library's limits."""
  protocol = fsspec.utils.get_protocol(url)
  if protocol not in ('gs', 'gcs') and not (seconds and protocol in ('http', 'https')):
    return {}
  from aiohttp import ClientTimeout  # gcsfs's and fsspec's http's own: only for those
  if protocol in ('gs', 'gcs'):
    return dict(requests_timeout=ClientTimeout(total=seconds or BUCKET_SECONDS))
  return dict(client_kwargs=dict(timeout=ClientTimeout(sock_connect=seconds, sock_read=seconds)))


def write_atomically(data, url):
  """Writes bytes that no reader sees half-written: a local file under a temporary name, then
  renamed; to a bucket in one upload, with no rename (see docs/checkpoints.md)."""
  fs, path = url_fs(url)
  if not isinstance(fs, fsspec.implementations.local.LocalFileSystem):
    fs.pipe_file(path, data)
    return
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)  # A new --ckpt_dir, say.
  temporary = f'{path}.tmp{os.getpid()}'
  try:
    with open(temporary, 'wb') as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())  # On disk before the rename, in case the VM goes down.
    os.replace(temporary, path)
  except Exception:
    if os.path.exists(temporary):
      os.remove(temporary)
    raise


# -------------------------------------------------------------------------- checkpoints
# One run per --ckpt_dir: {ckpt_dir: the global steps of its checkpoints this run may replace or
# remove}, those there as it claimed the folder and those it wrote (see claim_folder).
_ours = {}
_locks = {}  # {lock file: its descriptor}, held until this process ends.


def is_master():  # Whether this process writes checkpoints and results (SPMD: process 0).
  return xr.process_index() == 0 if xr.is_spmd() else xm.is_master_ordinal(local=False)


def claim_folder(ckpt_dir, hold=True):
  """Makes ckpt_dir this run's, or raises a UsageError if a live run holds it: an OS lock on
  ckpt_dir/.lock, which ends with the process (SIGKILL too); hold=False only checks. A bucket has
  no lock: write_checkpoint refuses a checkpoint there this run did not write, before it writes
  or removes one (docs/checkpoints.md#one-run-per-folder)."""
  fs, path = fsspec.core.url_to_fs(ckpt_dir)
  if isinstance(fs, fsspec.implementations.local.LocalFileSystem) and path not in _locks:
    try:
      os.makedirs(path, exist_ok=True)
      lock = os.open(os.path.join(path, '.lock'), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
      raise UsageError(f'cannot write to --ckpt_dir {ckpt_dir} ({type(e).__name__}: {e}): give '
                       'a folder or bucket this job can write') from None
    try:  # A POSIX lock: the loader workers forked from this process do not inherit it.
      fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
      if hold:  # Whose it is, for the line of a second run.
        os.ftruncate(lock, 0)
        os.pwrite(lock, f'process {os.getpid()} on {socket.gethostname()}, since '
                        f'{time.strftime("%Y-%m-%d %H:%M:%S")}\n'.encode(), 0)
        _locks[path] = lock
    except OSError as e:  # Else a file system without locks (some network mounts): a bucket's way.
      if e.errno in (errno.EACCES, errno.EAGAIN):
        holder = os.pread(lock, 200, 0).decode(errors='replace').strip() or 'a live process'
        raise UsageError(f'--ckpt_dir {ckpt_dir} is in use by another run ({holder}): let it end '
                         'or stop it, or give this run another --ckpt_dir') from None
    finally:
      if path not in _locks:
        os.close(lock)  # Checked only (hold=False, before the spawn): the replica takes it.
  if hold:
    _ours[ckpt_dir] = set(list_checkpoints(ckpt_dir))


def list_checkpoints(ckpt_dir, suffix='.pt'):
  """{global_step: path} of the checkpoint files in ckpt_dir (suffix '': their folders)."""
  fs, path = url_fs(ckpt_dir)
  try:
    names = [name.rsplit('/', 1)[-1] for name in fs.ls(path, detail=False)
             ] if fs.exists(path) else []
  except asyncio.TimeoutError:
    raise BucketTimeout(f'cannot list --ckpt_dir {ckpt_dir}') from None
  return {int(m.group(1)): f'{ckpt_dir.rstrip("/")}/{m.group(0)}'
          for m in map(re.compile(rf'^ckpt-(\d+){re.escape(suffix)}$').match, names) if m}


def write_checkpoint(state, ckpt_dir, keep, best, shards=None):
  """Saves ckpt_dir/ckpt-GLOBALSTEP.pt (and best.pt), keeping the `keep` newest up to it; returns
  its path. Every replica calls it, the master writes. shards(path) (sharded_checkpoints.py)
  writes each host's shards beside it, once the folder is known to be this run's."""
  torch_xla.sync()  # Runs the step still being traced, so that saving only copies data.
  master = is_master()
  path = f'{ckpt_dir.rstrip("/")}/ckpt-{state["global_step"]:08d}.pt'
  buffer = io.BytesIO() if master else None
  # SPMD: every host holds the whole (replicated) state; process 0 copies it out and writes.
  if master or not xr.is_spmd():
    xm.save(state, buffer, master_only=True, global_master=True)
  if master:
    saved = list_checkpoints(ckpt_dir)
    ours = _ours.setdefault(ckpt_dir, set(saved))
    if set(saved) - ours:  # Another run's, on a bucket, which has no lock (see claim_folder).
      theirs = saved[min(set(saved) - ours)]
      raise UsageError(f'--ckpt_dir {ckpt_dir} holds {theirs.rsplit("/", 1)[-1]}, which this run '
                       'did not write: another run writes there (nothing of it was replaced); '
                       'give each run its own --ckpt_dir')
  if shards:
    shards(path)
  if master:
    try:
      write_atomically(buffer.getvalue(), path)
      if best:
        write_atomically(buffer.getvalue(), f'{ckpt_dir.rstrip("/")}/best.pt')
    except asyncio.TimeoutError:  # (An OSError too, from Python 3.11 on.)
      raise BucketTimeout(f'cannot write checkpoint {path} (the checkpoints already there are '
                          'kept)') from None
    except OSError as e:  # A full disk or quota, a lost permission.
      raise UsageError(f'cannot write checkpoint {path} ({e}): free space in --ckpt_dir or '
                       'give another; the checkpoints already there are kept') from None
    ours.add(state['global_step'])
    # Only older ones: a newer one (a resume passed over it as unreadable) stays until replaced.
    kept = sorted(step for step in ours if step <= state['global_step'])[-keep:]
    for step in sorted(step for step in ours if step < kept[0]):
      if step in saved:
        remove(saved[step])
      ours.discard(step)
    print(f'Saved checkpoint {path}', flush=True)
  if xr.world_size() > 1:
    xm.rendezvous('checkpoint_saved')
  return path


def remove(url):  # A checkpoint's file or folder
  fs, path = url_fs(url)
  try:
    fs.rm(path, recursive=True)
  except FileNotFoundError:
    pass  # Gone already (a folder the listing still named).
  except asyncio.TimeoutError:
    raise BucketTimeout(f'cannot remove the old checkpoint {url}') from None


class UnreadableCheckpoint(UsageError):
  """A checkpoint file read whole that is not one (truncated, corrupt, foreign objects): a
  resume passes over it for the one before (find_checkpoint)."""


def load_checkpoint(path):
  """The checkpoint at path with CPU tensors (weights_only: other objects could run code), read
  whole first: a read that fails (network, permission) is a UsageError that ends the run, never
  taken for a corrupt file (UnreadableCheckpoint), whose older one would be resumed instead."""
  fs, where = url_fs(path)
  try:
    with fs.open(where, 'rb', cache_type='none') as f:
      data = b''.join(iter(functools.partial(f.read, 2**22), b''))
  except asyncio.TimeoutError:  # (Not an OSError before Python 3.11.)
    raise BucketTimeout(f'cannot read checkpoint {path}') from None
  except Exception as e:  # OSError, gcsfs's HttpError after its tries, aiohttp's errors
    raise UsageError(f'cannot read checkpoint {path} ({type(e).__name__}: {e}): nothing was '
                     'changed; make it readable, then run the same command again') from None
  try:
    # torch.save writes a zip archive; random or truncated bytes could look like a pickle.
    buffer = io.BytesIO(data)
    if not zipfile.is_zipfile(buffer):
      raise EOFError('not the whole zip archive that torch.save writes')
    buffer.seek(0)
    state = torch.load(buffer, map_location='cpu', weights_only=True)
  except pickle.UnpicklingError:
    raise UnreadableCheckpoint(f'checkpoint {path} holds objects other than tensors and plain '
                               'values; refused, since loading it could run code') from None
  except Exception as e:  # Truncated or corrupt: EOFError, RuntimeError, ...
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise UnreadableCheckpoint(f'checkpoint {path} cannot be read: it is not a whole, readable '
                               f'checkpoint file ({reason})') from None
  # What this module reads of it; the rest is the script's (its save_checkpoint, restore).
  missing = [key for key in ('model', 'flags', 'results', 'epoch', 'step', 'global_step')
             if not isinstance(state, dict) or key not in state]
  if missing:
    raise UnreadableCheckpoint(f'{path} is not a checkpoint of these scripts (no '
                               f'{", ".join(missing)})')
  if 'shards' in state:  # The folder of its shards, beside it (see write_checkpoint).
    state['shards'] = path[:path.rfind('/') + 1] + state['shards']
  return state


def find_checkpoint(resume, ckpt_dir):
  """(path, state) to resume from, chosen by the master for every replica, or (None, None):
  --resume PATH, else the newest readable one in ckpt_dir (warning of each unreadable one; a
  folder none of whose checkpoints can be read is a UsageError, not a start from step 0)."""
  path, state = None, None
  master = xm.is_master_ordinal(local=False)
  if master and ckpt_dir:
    claim_folder(ckpt_dir)  # A second run on it ends here, before it trains.
  if master and resume:
    try:
      path, state = resume, load_checkpoint(resume)
    except UsageError as e:
      raise UsageError(f'--resume: {e}') from None
    newer = sorted(step for step in _ours.get(ckpt_dir, ()) if step > state['global_step'])
    if newer:  # Its saves and the newer ones would make two runs in one folder.
      raise UsageError(f'--ckpt_dir {ckpt_dir} holds ckpt-{newer[0]:08d}.pt, '
                       f'newer than --resume {resume} (step {state["global_step"]}): a run '
                       'never removes a newer checkpoint, and the next resume would take it '
                       "for this run's; give this run another --ckpt_dir, or move the newer "
                       'checkpoints out of it')
  elif master and ckpt_dir:
    found = sorted(list_checkpoints(ckpt_dir).values(), reverse=True)
    for candidate in found:
      try:
        path, state = candidate, load_checkpoint(candidate)
        break
      except UnreadableCheckpoint as e:
        print(f'warning: {e}; trying the previous one', file=sys.stderr, flush=True)
    if found and state is None:
      raise UsageError(f'none of the {len(found)} checkpoints in --ckpt_dir {ckpt_dir} can be '
                       'read (see the warnings above): move them out of it to start over, or '
                       'give another --ckpt_dir')
  if xr.world_size() > 1:
    path = xm.mesh_reduce('resume_from', path, lambda paths: paths[0])
    state = state or (load_checkpoint(path) if path else None)
  return path, state


def check_same_model(weights, state, path, flag_values):
  """A UsageError naming a weight that differs if the checkpoint is of another model (weights: the
  model's state_dict), and what differs that makes one: the script, the flags that build it."""
  ours, theirs = ({k: list(getattr(v, 'shape', v)) for k, v in named.items()}  # (Or its shapes.)
                  for named in (weights, state['model']))
  differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
  if differ:
    first, script = differ[0], os.path.basename(sys.argv[0])
    saved = state['results'].get('script', script)
    flags_then = [f'--{name} {state["flags"][name]} ({flag_values.get(name)} now)'
                  for name in ('model', 'img_dim', 'num_classes') if name in state['flags']
                  and state['flags'][name] != flag_values.get(name, state['flags'][name])]
    how = ((f' by {saved} (this is {script})' if saved != script else '') +
           (' with ' + ', '.join(flags_then) if flags_then else ''))
    raise UsageError(f'checkpoint {path} holds another model: {first} is '
                     f'{theirs.get(first, "absent")} there, {ours.get(first, "absent")} here '
                     f'({len(differ)} of {len(ours.keys() | theirs.keys())} weights differ)' +
                     (f'; it was saved{how}' if how else '') +
                     ': give the flags of that run, or another --ckpt_dir')


def checkpoint_to_resume(resume_path, ckpt_dir, weights, flag_values, world_size,
                         batch_flags=BATCH_FLAGS, sharded=False):
  """(path, state) of the checkpoint find_checkpoint chose, or (None, None): a UsageError if it
  holds another model (weights: the model's state_dict) or another format (sharded: a folder of
  shards beside each file); warns of other batch_flags or world_size (docs/checkpoints.md)."""
  path, state = find_checkpoint(resume_path, ckpt_dir)
  if state is None:
    return None, None
  if ('shards' in state) != sharded:
    raise UsageError(f'checkpoint {path} is {"sharded" if "shards" in state else "one file"} '
                     f'(by {state["results"].get("script", "another script")}) and '
                     f'{os.path.basename(sys.argv[0])} resumes only '
                     f'{"sharded checkpoints" if sharded else "checkpoints of one file"}: give '
                     'one of a run of this script as it is now, or another --ckpt_dir')
  check_same_model(weights, state, path, flag_values)
  accuracies = state['results'].get('epoch_accuracies', [])  # Before --eval_interval: each epoch.
  # Another process's counts: this one compiles its graphs anew (say_finished counts from here).
  compiled = state['results']['compilations_after_epoch']
  state['results'].update(compilations_after_epoch=[None] * len(compiled), late_graphs=0)
  state['results'].setdefault('eval_epochs', list(range(1, len(accuracies) + 1)))
  where = f'epoch {state["epoch"]} goes on from step {state["step"]}'
  for name in batch_flags:
    if name in state['flags'] and state['flags'][name] != flag_values.get(name):
      xm.master_print(f'warning: --{name} is {flag_values.get(name)} now, {state["flags"][name]} '
                      f'in the run of {path}: {where} with other batches than that run would have '
                      'trained (give its value to train as it would)', fd=sys.stderr, flush=True)
  saved_world = state['results'].get('world_size', world_size)
  if saved_world != world_size:
    batch = flag_values['batch_size']
    xm.master_print(f'warning: resuming {path} on {world_size} devices, saved on {saved_world}: '
                    f'the global batch is {batch * world_size} instead of {batch * saved_world} '
                    f'(--batch_size {batch} per device), so the run will differ from one never '
                    'interrupted (see docs/checkpoints.md)', fd=sys.stderr, flush=True)
  return path, state


def say_resumed(path, state, flag_values, changed):
  """The line of a restored run: where it goes on (with what new_recipe changed), or that the
  checkpoint's run had finished every epoch."""
  epoch, num_epochs = state['epoch'], flag_values['num_epochs']
  where = flag_values.get('ckpt_dir') or os.path.dirname(path)
  xm.master_print(f'Run already finished: {path} is the end of epoch {epoch - 1} (--num_epochs '
                  f'{num_epochs}). To train on, give more --num_epochs; to start over, remove '
                  f'{where} or give another --ckpt_dir' if epoch > num_epochs else
                  f'Resumed from {path} at epoch {epoch} step {state["step"]}' + (
                      f', with {changed}' if changed else ''), flush=True)


def new_recipe(optimizer, scheduler, saved, given):
  """Puts the optimizer's settings given now (flag values) in place of those a checkpoint's
  run had (optimizer.load_state_dict restores those), keeping where the LR schedule is;
  returns what changed, for the "Resumed" line."""
  changed = {name: (saved[name], given[name]) for name in ('lr', 'momentum', 'weight_decay')
             if given.get(name) is not None and saved.get(name, given[name]) != given[name]}
  for group in optimizer.param_groups:
    if 'lr' in changed:
      old, new = changed['lr']
      group['lr'] = group['lr'] * new / old if old else new
      if 'initial_lr' in group:  # LambdaLR's
        group['initial_lr'] = new
    group.update({name: changed[name][1] for name in ('momentum', 'weight_decay')
                  if name in changed})
  if scheduler is not None and 'lr' in changed:
    scheduler.base_lrs = [changed['lr'][1]] * len(scheduler.base_lrs)
  return ', '.join(f'--{name} {new:g} (the checkpoint\'s run had {old:g})'
                   for name, (old, new) in changed.items())


# ----------------------------------------------------------------------------- the stop
# The first stop signal (STOP_SIGNALS) this process got, or 0. A plain value: a handler takes
# no lock, since a second signal (a launcher passing one on) can run it inside the first.
_stop_signal = 0
_wakeup = None  # The end of the pipe that Python writes every signal to (see stop_on_signals).


def stop_signal():
  """The first stop signal this process got (SIGTERM, SIGINT or SIGHUP), or 0."""
  global _stop_signal
  if not _stop_signal and _wakeup is not None:
    try:  # What arrived while the main thread, which runs handlers, was blocked.
      arrived = [signum for signum in os.read(_wakeup, 64) if signum in STOP_SIGNALS]
    except BlockingIOError:
      arrived = []
    _stop_signal = _stop_signal or (arrived[0] if arrived else 0)
  return _stop_signal


def request_stop(signum, frame=None):
  """The handler of the stop signals: a stop after the current step. A second one (a terminal's
  Ctrl-C reaches a torchrun worker from both it and torchrun) changes nothing: the first is kept."""
  global _stop_signal
  _stop_signal = _stop_signal or signum


def stop_on_signals(launcher=False):
  """SIGTERM, SIGINT and SIGHUP become a stop after the current step (docs/checkpoints.md#stopping)
  in every process of a run (a replica: as it imports the script); a launcher passes them on, and
  returns the context to launch in (supervisor.watched's instead, if there). A replica trains in
  a thread where no handler runs: stop_signal also reads the pipe Python writes signals to."""
  global _wakeup
  whole_lines()
  take_stop_signals(_pass_on if launcher else request_stop)
  if not launcher:
    _wakeup, wakeup_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wakeup_write)
  return _replica_death_said() if launcher else contextlib.nullcontext()


def take_stop_signals(handler):
  """handler for the STOP_SIGNALS, but an ignored SIGHUP (nohup) stays so; multiprocessing's
  resource tracker started first, ignoring SIGHUP (a closed terminal would end it)."""
  hangup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
  multiprocessing.resource_tracker.ensure_running()
  for signum in STOP_SIGNALS:
    if signum != signal.SIGHUP or hangup != signal.SIG_IGN:
      signal.signal(signum, handler)


@contextlib.contextmanager
def _replica_death_said():
  """Around torch_xla.launch: a replica that ends with an error or a signal ends the run at once,
  with one line and its code (replica_ended), not the process pool's traceback."""
  threading.Thread(target=_end_the_others, daemon=True).start()
  try:
    yield
  except concurrent.futures.process.BrokenProcessPool:
    for _ in range(50):  # Its exit code, once the pool has reaped it.
      if _first_ended or ended_replicas():
        code, line = replica_ended(_first_ended or ended_replicas())
        if line:
          print(line, file=sys.stderr if line.startswith('error:') else sys.stdout, flush=True)
        sys.exit(code)
      time.sleep(0.1)
    die('a replica process ended abruptly (see its lines above); nothing was saved since the '
        'last checkpoint', 1)


def _end_the_others():
  """Kills the other replicas once one has ended with an error or a signal: the broken pool
  would wait for them while they wait for it in a collective (pytorch/xla#7974)."""
  while not _first_ended:
    _first_ended.extend(ended_replicas())
    time.sleep(0.1)
  for process in multiprocessing.active_children():
    process.kill()


_replicas = {}  # pid: multiprocessing.Process of every replica this launcher started.
_first_ended = []  # What ended_replicas found first: the others are then killed.


def ended_replicas():
  """[(pid, exit code: -N for signal N)] of this launcher's replica processes that ended with
  an error or a signal (supervisor.py's watch asks it too)."""
  for process in multiprocessing.active_children():  # The pool's, started or starting.
    _replicas.setdefault(process.pid, process)
  return [(pid, process.exitcode) for pid, process in _replicas.items()
          if process.exitcode not in (None, 0)]


def replica_ended(ended):
  """(exit code, line or None: the replica said why) of a run whose replicas ended thus, [(pid,
  exit code: -N for signal N)]: first one that said why in its `error:` line, last those the
  broken pool ended with SIGTERM (replicas still importing have no handler for it yet)."""
  def said(code):  # 2, or 128 + N: its loader worker died of signal N.
    return code == 2 or code > 128

  pid, code = min(ended, key=lambda ended: (not said(ended[1]), ended[1] == -signal.SIGTERM))
  if said(code):
    return code, None
  if stop_signal():  # During a stop: one still importing dies of the signal, say.
    name, stop_code = record_stop({}, stop_signal(), 0)
    return stop_code, (f'Stopped by {name}: replica process {pid} ended before it saved anything; '
                       'run the same command to go on from the last checkpoint (exit code '
                       f'{stop_code})')
  cause = f'was killed by {signal.Signals(-code).name}' if code < 0 else f'failed (exit code {code})'
  return (128 - code if code < 0 else code,
          f'error: replica process {pid} {cause}; ended the other replicas')


def _pass_on(signum, frame):
  request_stop(signum)
  replicas = multiprocessing.active_children()  # Started or starting.
  if not replicas:  # None has started: nothing to save, and none may start now.
    os._exit(128 + signum)
  for process in replicas:
    os.kill(process.pid, signum)


def whole_lines():
  """Each line printed in one write, not split by another process's (under PYTHONUNBUFFERED=1
  print writes the text and the newline apart)."""
  for stream in (sys.stdout, sys.stderr):
    if isinstance(stream, io.TextIOWrapper):
      stream.reconfigure(line_buffering=True, write_through=False)


def record_stop(results, signum, global_step, checkpoint=None):
  """Marks results stopped by signum at global_step (checkpoint: its save, or None); returns
  (the signal's name, the exit code)."""
  results.update(train_steps=global_step, checkpoint=checkpoint)
  if signum == signal.SIGINT:
    results['interrupted'] = True
    return f'{INTERRUPT} (SIGINT)', EXIT_INTERRUPTED
  results['preempted'] = True  # SIGTERM, or SIGHUP: stopped from outside, saved
  return signal.Signals(signum).name, EXIT_PREEMPTED


class StopVote:
  """A stop signal on any replica (SPMD: host) as a stop after the same step on all; a loss or
  weights that ran away on any (NaN, infinite, over the bounds below) as the end of the run on all
  (Diverged); a label outside the classes as its replica's failure (BadDataError: on XLA the
  cross entropy trains on it without a word). Read before every save: no checkpoint holds them."""
  LAG = 2
  LOSS_BOUND = 100  # times ln(classes): far above any loss a run that learns has
  WEIGHT_BOUND = 1e4  # A network that learns has its weights mostly below 1.

  def __init__(self, device, stop_signal, optimizer, num_classes):
    # Device buffers copied once: no transfer per step, and no scalar constants (a graph each).
    self.flags = (torch.zeros(1).to(device), torch.ones(1).to(device))
    self.stop_signal, self.votes = stop_signal, collections.deque()
    self.weights = [w for group in optimizer.param_groups for w in group['params']]
    self.loss_bound = self.LOSS_BOUND * math.log(max(num_classes, 2))
    self.num_classes = num_classes

  def tally(self, flag, loss):
    """[share of the replicas asking to stop, their mean loss, the largest weight]."""
    return xm.all_reduce(xm.REDUCE_SUM, torch.cat([flag, self.health(loss)]),
                         scale=1.0 / xr.world_size())

  def health(self, loss):
    """[loss, the largest |weight|, inf if one is NaN] in the step's graph. The weights suffice: a
    NaN or infinite gradient, momentum or batch statistic makes them (or the loss) NaN at once."""
    # XLA's max skips NaN: it counts as inf here.
    largest = torch.stack([torch.where(torch.isnan(w), math.inf, w.abs()).max()
                           for w in self.weights]).max()
    return torch.stack([loss.detach().float(), largest.float()])

  def agreed_after_step(self, loss, labels, where):
    """Whether all stop after this step: the tally, and the count of this replica's labels
    outside the classes, are in the step's graph and read LAG steps on, when long computed.
    Raises Diverged for a loss or weights that ran away, BadDataError for such a label."""
    outside = ((labels < 0) | (labels >= self.num_classes)).sum().float().view(1)
    tally = torch.cat([self.tally(self.flags[self.stop_signal() != 0], loss), outside])
    self.votes.append((where, labels, tally))
    return len(self.votes) > self.LAG and self._read(*self.votes.popleft())

  def _read(self, where, labels, tally):
    stops, loss, largest, outside = tally.tolist()
    if outside:  # Which one: read from the device now, the run ending.
      label = next(label for label in labels.cpu().tolist() if not 0 <= label < self.num_classes)
      raise BadDataError(f'label {label} in the batch of {where} is not one of the '
                         f'{self.num_classes} classes (labels 0 to {self.num_classes - 1}): fix '
                         "the dataset's labels, or the class count build_datasets returns")
    if not loss <= self.loss_bound:  # NaN too
      raise Diverged(f'the loss became {"NaN" if math.isnan(loss) else "infinite"} at {where}'
                     if not math.isfinite(loss) else f'the loss reached {loss:.3g} at {where} '
                     f'(over {self.loss_bound:.0f}, {self.LOSS_BOUND} times chance level)')
    if not largest <= self.WEIGHT_BOUND:
      raise Diverged(f'the weights reached {largest:.3g} at {where} (a network that learns '
                     'holds them near 1)' if math.isfinite(largest) else
                     f'the weights became NaN or infinite at {where}')
    return stops > 0

  def check_losses(self):
    """Before a save (after a sync): raises Diverged if a step not yet read ran away."""
    for vote in self.votes:
      self._read(*vote)

  def agreed_at_epoch_end(self):
    """True when any replica asked to stop during the last steps or since."""
    pending = [self._read(*vote) for vote in self.votes]  # Every one: one that ran away too.
    self.votes.clear()
    return self.agree(any(pending) or self.stop_signal() != 0)

  def agree(self, pending):
    return pending if xr.world_size() == 1 else xm.mesh_reduce('stop_request', pending, any)


def say_diverged(error, flag_values):
  """Says why the run diverged (StopVote's error) after every replica's step lines, and the way
  out (docs/checkpoints.md#a-run-that-diverges); returns the exit code, 22."""
  if xr.world_size() > 1:
    xm.rendezvous('diverged')  # Every replica's step lines before the error.
  resume_from = flag_values.get('resume') or (flag_values.get('ckpt_dir') and max(
      list_checkpoints(flag_values['ckpt_dir']).items(), default=(0, None))[1])
  lr, decay = flag_values['lr'], flag_values.get('weight_decay') or 0.0
  # SGD and AdamW scale the weights by 1 - lr x weight decay a step: at 0 or below they run away.
  # A decay of 1 or more is far past any recipe's (1e-4 to 0.1): then it did, not the --lr.
  flag, value = ('--weight_decay', decay) if decay >= 1 and lr * decay >= 1 else ('--lr', lr)
  lower = f'lower {flag} (it is {value:g}) and run again'
  xm.master_print(f'error: {error}: training diverged; ' + (
      f'{lower}: the same command resumes from {resume_from} with the new {flag} (no checkpoint '
      'holds a step that ran away), or give another --ckpt_dir to start over' if resume_from
      else f'{lower}: nothing was saved, so it starts over' if flag_values.get('ckpt_dir') else
      lower) + f' (exit code {EXIT_DIVERGED})', fd=sys.stderr, flush=True)
  return EXIT_DIVERGED


@contextlib.contextmanager
def replica():
  """Around a replica's work (in _mp_fn): an exception ends it at once after one `error:` line
  (exit code 2) or, for a bug, a traceback (exit code 1), so that the launcher ends the run;
  and the replica exits when its launcher is gone (docs/checkpoints.md#a-replica-that-fails)."""
  launcher = multiprocessing.parent_process()
  if launcher is not None:
    threading.Thread(target=_end_with, args=(launcher,), daemon=True).start()
  try:
    yield
  except Exception as error:
    replica_failed(error)
  finally:
    end_loader_workers()


def _end_with(launcher):
  """Ends this process and its loader workers once its launcher (a worker's: its replica) is
  gone: killed, or ended the run for another replica, which this one may be waiting for."""
  launcher.join()
  end_loader_workers()
  os._exit(128 + signal.SIGKILL)


def replica_failed(error):
  """Ends this replica at once, saying why (see replica). A replica alone in its run exits
  through SystemExit, which torch_xla.launch hands to the launcher: its code is the run's."""
  one_line = said(error)
  last_line()  # Its log thread may still be printing the last steps' lines.
  if one_line:
    where = f'replica {xr.global_ordinal()}: ' if xr.world_size() > 1 else ''
    print(f'error: {where}{one_line}', file=sys.stderr, flush=True)
  else:
    traceback.print_exception(error)
  end_loader_workers()
  sys.stdout.flush()
  sys.stderr.flush()
  code = getattr(one_line, 'exit_code', 2) if one_line else 1
  if xr.world_size() == 1 and os.environ.get('PJRT_LOCAL_PROCESS_COUNT') == '1':
    sys.exit(code)  # torch_xla.launch's own process count: no other waits for it.
  os._exit(code)


def end_loader_workers():
  """Kills this process's loader workers: they ignore the SIGTERM multiprocessing's exit sends."""
  for process in multiprocessing.active_children():
    process.kill()
    process.join()
