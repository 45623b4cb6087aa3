"""Helpers shared by the training scripts of this repo.

Only what is the same in every script lives here: flag errors, data checks, fake data,
batch padding, resumable data order, log lines, TensorBoard, checkpoints, the stop on
SIGTERM and the results file. Nothing here reads FLAGS;
every value comes in as an argument, so a script copied out with this file beside it
still works.
"""

import collections
import concurrent.futures
import datetime
import io
import itertools
import json
import multiprocessing
import os
import pickle
import random
import re
import signal
import sys
import threading

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
  """This replica's share of the training set as an EpochSampler: reshuffled by
  set_epoch(epoch), each index paired with its augmentation seed (use SeededSamples).

  drop_last=True: DistributedSampler would otherwise pad the shares to equal length by
  repeating samples, training some twice an epoch. Dropping the remainder (fewer than
  world_size samples) gives every replica the same share and no sample to two replicas.
  The order is a function of (seed, epoch) alone.
  """
  return EpochSampler(torch.utils.data.DistributedSampler(
      dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True), seed)


def sample_seed(seed, epoch, index):
  """The seed of one sample's augmentation: the same whichever worker loads it, and
  whether or not the run was resumed."""
  return (seed * 1_000_003 + epoch) * 2**32 + index


class EpochSampler(torch.utils.data.Sampler):
  """A sampler's order for one epoch from a given batch on, each index paired with the
  seed of that sample's augmentation (for SeededSamples).

  set_epoch(epoch, skip) starts the epoch after `skip` samples: a resumed run skips what
  was trained on the host, without loading it. The order is the wrapped sampler's, a
  function of (seed, epoch) alone.
  """

  def __init__(self, sampler, seed):
    self.sampler, self.seed = sampler, seed
    self.epoch, self.skip = 0, 0

  def set_epoch(self, epoch, skip=0):
    self.sampler.set_epoch(epoch)
    self.epoch, self.skip = epoch, skip

  def __len__(self):
    return len(self.sampler) - self.skip

  def __iter__(self):
    for index in itertools.islice(self.sampler, self.skip, None):
      yield sample_seed(self.seed, self.epoch, index), index


class SeededSamples(torch.utils.data.Dataset):
  """dataset[index] with torch's RNG seeded for that sample (torchvision's random
  transforms draw from it), keyed by (seed, index) from EpochSampler. Seeding per sample
  rather than per worker makes the crops independent of which worker loads a sample, so a
  resumed run sees the very images an uninterrupted run would."""

  def __init__(self, dataset):
    self.dataset = dataset

  def __len__(self):
    return len(self.dataset)

  def __getitem__(self, key):
    seed, index = key
    with torch.random.fork_rng(devices=[]):
      torch.manual_seed(seed)
      return self.dataset[index]


def ignore_sigterm(worker_id=None):
  """DataLoader worker_init_fn: on a TPU VM shutdown every process gets SIGTERM; the
  workers keep serving batches so the training process can finish its step and save.
  They exit when their loader is done or its process dies; end_loader_workers() ends
  any left at exit."""
  signal.signal(signal.SIGTERM, signal.SIG_IGN)


def end_loader_workers():
  """Kills this process's loader workers still alive (after an error, the traceback may
  keep a loader alive). They ignore SIGTERM, which is what multiprocessing's exit would
  send them before waiting for them forever."""
  for process in multiprocessing.active_children():
    process.kill()
    process.join()


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

  Set .start to the steps of the epoch already trained (a resumed run) and it yields
  only the rest; the loader itself must skip those batches too (EpochSampler.set_epoch).
  Capping before MpDeviceLoader (rather than breaking out of its loop) leaves no
  background thread behind. An exception in the loader (a corrupt image) would end
  the device loader's epoch silently early; it is kept here and raised by check().
  """

  def __init__(self, loader, num_batches):
    self.loader = loader
    try:
      self.num_batches = min(len(loader), num_batches)
    except TypeError:  # An iterable dataset has no length: the cap is the epoch.
      self.num_batches = num_batches
    self.start = 0
    self.error = None

  def __len__(self):
    return self.num_batches - self.start

  def __iter__(self):
    self.error = None
    if len(self) <= 0:
      return  # Without starting loader workers for nothing.
    try:
      # islice stops at the cap without asking for one more batch, which would read (and
      # count) data the epoch does not use.
      yield from itertools.islice(self.loader, len(self))
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


# Training lines are printed in order by a thread of their own, started at the first line;
# _LOG_PENDING holds those not printed yet.
_LOG_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='log')
_LOG_PENDING = collections.deque()


def log_training_step(device, ordinal, epoch, step, global_step, loss, tracker, lr, writer):
  """The step closure of every script (xm.add_step_closure). It runs once the step's graph
  is launched; reading the loss waits until the graph has run, so a thread of its own reads
  and prints it while this one traces the next step. Read here, the device would sit idle
  for a whole step's tracing at every logged step."""
  _LOG_PENDING.append(_LOG_THREAD.submit(_print_training_step, device, ordinal, epoch, step,
                                         global_step, loss, tracker, lr, writer))


def _print_training_step(device, ordinal, epoch, step, global_step, loss, tracker, lr, writer):
  loss, rate = loss.item(), tracker.rate()
  print(training_line(device, ordinal, epoch, step, loss, rate, tracker.global_rate()), flush=True)
  write_scalars(writer, global_step, {'Loss/train': loss, 'Rate/train': rate, 'LR': lr})


def flush_training_log():
  """Waits until every training line logged so far is printed (and raises what failed)."""
  while _LOG_PENDING:
    _LOG_PENDING.popleft().result()


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


def execute_seconds():
  """Seconds this process's XLA graphs have spent executing (torch_xla's ExecuteTime)."""
  import torch_xla.debug.metrics as met
  data = met.metric_data('ExecuteTime')
  return data[1] / 1e9 if data else 0.0


def compile_count():
  """XLA graphs compiled so far by this process (torch_xla's CompileTime metric)."""
  import torch_xla.debug.metrics as met  # Here, so that scripts without a device skip it.
  data = met.metric_data('CompileTime')
  return data[0] if data else 0


# ----------------------------------------------------------------------- checkpoints

CHECKPOINT_NAME = re.compile(r'^ckpt-(\d+)\.pt$')
CHECKPOINT_KEYS = ('model', 'optimizer', 'lr_scheduler', 'epoch', 'step', 'global_step', 'rng',
                   'flags', 'results')
# Flags that may change between a run and its resumption without changing what it computes.
RESTART_FLAGS = {'resume', 'ckpt_dir', 'ckpt_every_steps', 'keep_checkpoints', 'num_epochs',
                 'log_steps', 'logdir', 'results_json', 'metrics_debug', 'profile',
                 'profiler_port', 'target_accuracy', 'num_workers', 'persistent_workers',
                 'prefetch_factor', 'loader_prefetch_size', 'device_prefetch_size',
                 'host_to_device_transfer_threads', 'fail_on_bad_data', 'num_cores'}
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by SIGTERM after a checkpoint; run it again.


class CheckpointError(Exception):
  """A checkpoint that cannot be used, with the reason in one line."""


def _url_join(folder, name):
  return f'{folder.rstrip("/")}/{name}'


def checkpoint_path(ckpt_dir, global_step):
  return _url_join(ckpt_dir, f'ckpt-{global_step:08d}.pt')


def check_checkpoint_dir(ckpt_dir):
  """Creates ckpt_dir and writes a probe file in it, so that a folder or bucket that cannot
  take checkpoints fails before any training; removes temporary files of a save that
  was killed. Raises UsageError."""
  import fsspec
  try:
    fs, path = fsspec.core.url_to_fs(ckpt_dir)
    fs.makedirs(path, exist_ok=True)
    probe = _url_join(path, f'.write-test-{os.getpid()}')
    with fs.open(probe, 'wb') as f:
      f.write(b'ok')
    fs.rm(probe)
    for name in fs.ls(path, detail=False):
      if '.pt.tmp' in name.rsplit('/', 1)[-1]:
        fs.rm(name)
  except Exception as e:  # PermissionError, NotADirectoryError, a bucket's auth error, ...
    raise UsageError(f'cannot write checkpoints to --ckpt_dir {ckpt_dir} ({type(e).__name__}: '
                     f'{e}): give a folder or bucket this job can write') from None


def list_checkpoints(ckpt_dir):
  """{global_step: path} of the checkpoints in ckpt_dir."""
  import fsspec
  fs, path = fsspec.core.url_to_fs(ckpt_dir)
  if not fs.exists(path):
    return {}
  found = {}
  for name in fs.ls(path, detail=False):
    match = CHECKPOINT_NAME.match(name.rsplit('/', 1)[-1])
    if match:
      found[int(match.group(1))] = _url_join(ckpt_dir, match.group(0))
  return found


def _write_atomically(data, url):
  """Writes bytes under a temporary name and renames: a kill mid-write leaves the old file."""
  import fsspec
  fs, path = fsspec.core.url_to_fs(url)
  tmp = f'{path}.tmp{os.getpid()}'
  with fs.open(tmp, 'wb') as f:
    f.write(data)
    try:  # A local file: on disk before the rename, in case the VM goes down.
      f.flush()
      os.fsync(f.fileno())
    except (AttributeError, OSError, ValueError):  # Not a local file: the store commits it.
      pass
  fs.mv(tmp, path)


def save_to_url(obj, url):
  """torch.save to a local path or any fsspec URL (gs://...), atomically."""
  import fsspec
  fs, path = fsspec.core.url_to_fs(url)
  fs.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  buffer = io.BytesIO()
  torch.save(obj, buffer)
  _write_atomically(buffer.getvalue(), url)


def save_checkpoint(state, ckpt_dir, keep, best):
  """Saves the training state as ckpt_dir/ckpt-GLOBALSTEP.pt (and best.pt if best) and
  returns the path. Called by every replica at the same step: all copy their tensors to
  the host, only the global master writes, and none goes on before the file is complete.
  Keeps the newest `keep` checkpoints; removes any newer than this one (left by a run that
  was rolled back to an older checkpoint)."""
  import fsspec
  import torch_xla
  import torch_xla.core.xla_model as xm
  import torch_xla.runtime as xr
  torch_xla.sync()  # Runs the step still being traced, so that saving only copies data.
  master = xm.is_master_ordinal(local=False)
  buffer = io.BytesIO() if master else None
  xm.save(state, buffer, master_only=True, global_master=True)
  path = checkpoint_path(ckpt_dir, state['global_step'])
  if master:
    data = buffer.getvalue()
    _write_atomically(data, path)
    if best:
      _write_atomically(data, _url_join(ckpt_dir, 'best.pt'))
    fs, _ = fsspec.core.url_to_fs(ckpt_dir)
    saved = list_checkpoints(ckpt_dir)
    kept = sorted(step for step in saved if step <= state['global_step'])[-keep:]
    for step, old in saved.items():
      if step not in kept:
        fs.rm(fsspec.core.url_to_fs(old)[1])
    print(f'Saved checkpoint {path}', flush=True)
  if xr.world_size() > 1:
    xm.rendezvous('checkpoint_saved')
  return path


def load_checkpoint(path):
  """The checkpoint at path (local or fsspec URL) with CPU tensors, or CheckpointError.

  weights_only=True: a checkpoint holds tensors and plain values only; one holding any
  other object is refused, since unpickling it could run code."""
  import fsspec
  try:
    fs, local = fsspec.core.url_to_fs(path)
    with fs.open(local, 'rb') as f:
      state = torch.load(f, map_location='cpu', weights_only=True)
  except pickle.UnpicklingError:
    raise CheckpointError(f'checkpoint {path} holds objects other than tensors and plain '
                          'values; refused, since loading it could run code') from None
  except Exception as e:  # Truncated or corrupt: RuntimeError, EOFError, ...
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise CheckpointError(f'checkpoint {path} cannot be read ({reason})') from None
  missing = [key for key in CHECKPOINT_KEYS if not isinstance(state, dict) or key not in state]
  if missing:
    raise CheckpointError(f'{path} is not a checkpoint of these scripts (no '
                          f'{", ".join(missing)})')
  return state


def find_checkpoint(resume, ckpt_dir):
  """(path, state) to resume from: --resume PATH if given (a bad one is a UsageError),
  else the newest readable checkpoint of ckpt_dir, reporting each unreadable newer one in
  a line; (None, None) when there is none."""
  if resume:
    try:
      return resume, load_checkpoint(resume)
    except CheckpointError as e:
      raise UsageError(f'--resume: {e}') from None
  if not ckpt_dir:
    return None, None
  for _, path in sorted(list_checkpoints(ckpt_dir).items(), reverse=True):
    try:
      return path, load_checkpoint(path)
    except CheckpointError as e:
      print(f'warning: {e}; trying the previous one', file=sys.stderr, flush=True)
  return None, None


def replica_checkpoint(resume, ckpt_dir):
  """find_checkpoint for the replicas of a run: the same (path, state) on every one. The
  master chooses (reporting unreadable ones), the others load what it chose."""
  import torch_xla.core.xla_model as xm
  path, state = find_checkpoint(resume, ckpt_dir) if xm.is_master_ordinal() else (None, None)
  path = xm.mesh_reduce('resume_from', path, lambda paths: paths[0])
  if path is not None and state is None:
    try:
      state = load_checkpoint(path)
    except CheckpointError as e:
      raise UsageError(f'{e}: on a pod, --ckpt_dir must be one place every host reads '
                       '(e.g. gs://bucket/run)') from None
  return path, state


def load_model_state(model, state_dict, path, model_name, num_classes):
  """Loads a checkpoint's weights, or a UsageError naming what differs, not a wall of keys."""
  ours = model.state_dict()
  theirs_shapes = {k: tuple(v.shape) for k, v in state_dict.items()}
  ours_shapes = {k: tuple(v.shape) for k, v in ours.items()}
  if theirs_shapes != ours_shapes:
    missing = sorted(set(ours_shapes) - set(theirs_shapes))
    reshaped = [k for k in ours_shapes if k in theirs_shapes and ours_shapes[k] != theirs_shapes[k]]
    detail = (f'{len(missing)} of its weights are missing, e.g. {missing[0]}' if missing else
              f'{reshaped[0]} is {list(theirs_shapes[reshaped[0]])} there, '
              f'{list(ours_shapes[reshaped[0]])} here')
    raise UsageError(f'checkpoint {path} was made for another model or number of classes than '
                     f'--model {model_name} with {num_classes} classes ({detail}): use another '
                     '--ckpt_dir or the flags of that run')
  model.load_state_dict(state_dict)


def changed_flags(saved, current):
  """'--name old -> new' for each flag that changes what a resumed run computes."""
  return [f'--{name} {saved[name]!r} -> {current[name]!r}' for name in sorted(current)
          if name in saved and name not in RESTART_FLAGS and saved[name] != current[name]]


def restore(state, path, model, optimizer, scheduler, flag_values, num_classes, report=True):
  """Loads a checkpoint's training state into this run; returns (epoch, step, results)
  to go on from: `step` steps of `epoch` are done. report: warn of changed flags."""
  load_model_state(model, state['model'], path, flag_values['model'], num_classes)
  optimizer.load_state_dict(state['optimizer'])
  if scheduler is not None and state['lr_scheduler'] is not None:
    scheduler.load_state_dict(state['lr_scheduler'])
  set_rng_state(state['rng'])
  changed = changed_flags(state['flags'], flag_values)
  if changed and report:
    print(f'warning: resuming {path} with other flags ({"; ".join(changed)}): the run will '
          'differ from one never interrupted', file=sys.stderr, flush=True)
  results = dict(state['results'], train_steps=state['global_step'])
  return state['epoch'], state['step'], results


def rng_state():
  """The RNG states a step may draw from: torch's CPU generator and the XLA device's."""
  import torch_xla.core.xla_model as xm
  return dict(torch=torch.get_rng_state(), xla=xm.get_rng_state())


def set_rng_state(state):
  import torch_xla.core.xla_model as xm
  torch.set_rng_state(state['torch'])
  xm.set_rng_state(state['xla'])


# -------------------------------------------------------------------------- stopping


# A plain flag: a handler must take no lock, since a second SIGTERM (the launcher passing
# one on after the VM sent one) can run it while the first is still inside it.
_SIGTERM = [False]


def stop_on_sigterm():
  """Makes SIGTERM (what a TPU VM gets before maintenance or a preemption) a request to stop
  that StopRequest reads, instead of the end of the process. Python lets only the main
  thread install a handler, so call it there (torch_xla.launch trains in another thread)."""
  signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame):
  _SIGTERM[0] = True


def forward_sigterm_to_replicas(single_process):
  """In the launching process: pass SIGTERM on to the replica processes, so that `kill PID`
  of the command stops them at a step boundary too; with single_process the replica is
  this process and takes it itself."""
  signal.signal(signal.SIGTERM, _on_sigterm if single_process else _forward_sigterm)


def _forward_sigterm(signum, frame):
  replicas = multiprocessing.active_children()
  if not replicas:
    sys.exit(128 + signum)  # No replica has started: nothing to save.
  for process in replicas:
    os.kill(process.pid, signum)


def exit_with_launcher():
  """In a replica process started by torch_xla.launch (not while it imports the script:
  the launcher is known from then on): exit as soon as the launching process is gone. A launcher killed with SIGKILL cannot stop its replicas, which would
  otherwise train on, holding the TPU, with nobody to read their output."""
  launcher = multiprocessing.parent_process()
  if launcher is not None:
    threading.Thread(target=_exit_when_gone, args=(launcher,), daemon=True).start()


def _exit_when_gone(launcher):
  launcher.join()
  os._exit(128 + signal.SIGKILL)


class StopRequest:
  """A SIGTERM seen as a stop at a step boundary, the same one on every replica.

  Each step all-reduces this replica's flag inside the step's graph, and reads the sum
  computed LAG steps earlier, which is long done: no wait for the device, no extra graph
  execution, and every replica reads the same number after the same step.
  """
  LAG = 2

  def __init__(self):
    self.votes = collections.deque()
    self.flags = None

  @property
  def requested(self):
    """Whether this process got SIGTERM (see stop_on_sigterm)."""
    return _SIGTERM[0]

  def agreed_after_step(self, device):
    """True when every replica stops after this step; call it once per step."""
    import torch_xla.core.xla_model as xm
    if self.flags is None:  # Two device buffers: a step passes one, no transfer per step.
      self.flags = (torch.zeros((), device=device), torch.ones((), device=device))
    self.votes.append(xm.all_reduce(xm.REDUCE_SUM, self.flags[self.requested]))
    return len(self.votes) > self.LAG and self.votes.popleft().item() > 0

  def agreed_at_epoch_end(self):
    """True when any replica asked to stop during the last steps or since."""
    import torch_xla.core.xla_model as xm
    pending = any(vote.item() > 0 for vote in self.votes)
    self.votes.clear()
    return xm.mesh_reduce('stop_request', pending or self.requested, any)


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
