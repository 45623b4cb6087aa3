"""What the training loops share: one-line errors, image folders, the split of work across
replicas, the training log and results, checkpoints, and the stop agreed by every replica.
Nothing here reads FLAGS or holds a script's choices: a script copied out with this file
beside it still works (with supervision.py, or without it: see there)."""

import collections
import concurrent.futures
import io
import itertools
import json
import os
import pickle
import re
import signal
import sys
import zipfile

import fsspec
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
import torch_xla.test.test_utils as test_utils
import torchvision
from absl import flags
from PIL import Image

EXIT_BELOW_TARGET = 21  # upstream's code for a run below --target_accuracy
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by SIGTERM after a checkpoint; run it again.
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C.
IMG_EXTENSIONS = torchvision.datasets.folder.IMG_EXTENSIONS
CHECKPOINT_NAME = re.compile(r'^ckpt-(\d+)\.pt$')
CHECKPOINT_KEYS = ('model', 'optimizer', 'lr_scheduler', 'epoch', 'step', 'global_step', 'rng',
                   'flags', 'results')


class UsageError(Exception):
  """A mistake the user can fix: printed as one `error:` line, exit code 2."""


class CheckpointError(UsageError):
  """A checkpoint that cannot be used."""


class BadDataError(Exception):
  """An image file, shard or sample that cannot be read."""

  def __str__(self):
    # Raised in a DataLoader worker, it comes back inside the worker's traceback.
    return super().__str__().strip().splitlines()[-1].split('BadDataError: ')[-1]


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


def create_model(name, num_classes):
  """A torchvision classifier with fresh weights (nothing is downloaded)."""
  # Models with auxiliary heads return a tuple in training mode; the loop wants logits.
  aux = dict(aux_logits=False, init_weights=True) if name in ('googlenet', 'inception_v3') else {}
  return torchvision.models.get_model(name, weights=None, num_classes=num_classes, **aux)


# ---------------------------------------------------------------------- image folders
def load_image(path):
  """ImageFolder's loader, but a corrupt file names itself instead of a PIL traceback."""
  try:
    with open(path, 'rb') as f:
      return Image.open(f).convert('RGB')
  except OSError as e:  # PIL.UnidentifiedImageError and truncated files are OSErrors.
    raise BadDataError(f'cannot read image {path} ({e}): replace or remove the file') from None


def check_image_folders(root, splits):
  """The class names of root/SPLIT/CLASS/*.jpg, the same in every split, or a UsageError
  saying what is wrong. Prints the images and classes of each split as ImageFolder will
  find them (links followed), so that a folder that is not what the user thinks shows."""
  found = None
  for folder in (os.path.join(root, split) for split in splits):
    if not os.path.isdir(folder):
      raise UsageError(f'{folder} is not a folder: {root} needs {" and ".join(splits)} with '
                       f'one folder of images per class ({folder}/CLASS/x.jpg)')
    try:
      classes, class_to_idx = torchvision.datasets.folder.find_classes(folder)
    except FileNotFoundError:
      raise UsageError(f'{folder} has no class folders: put the images of each class in '
                       f'{folder}/CLASS_NAME/') from None
    images = torchvision.datasets.folder.make_dataset(folder, class_to_idx, IMG_EXTENSIONS,
                                                      allow_empty=True)
    empty = sorted(set(classes) - {classes[label] for _, label in images})
    if empty:
      raise UsageError(f'class folder {os.path.join(folder, empty[0])} has no images '
                       f'({" ".join(IMG_EXTENSIONS)}): add images or remove the folder')
    if found is not None and classes != found:
      raise UsageError(f'{folder} and {os.path.join(root, splits[0])} must hold the same '
                       'class folders')
    found = classes
    print(f'{folder}: {len(images):,} images in {len(classes)} classes', flush=True)
  return found


def image_folder(root, img_dim, train):
  """An ImageFolder split with the usual ImageNet augmentation (train) or centre crop (val)."""
  T = torchvision.transforms
  if train:
    transform = [T.RandomResizedCrop(img_dim), T.RandomHorizontalFlip()]
  else:  # Resize to 256/224 of the crop, as torchvision's references do at 224 px.
    transform = [T.Resize(img_dim * 256 // 224), T.CenterCrop(img_dim)]
  transform += [T.ToTensor(), T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))]
  return torchvision.datasets.ImageFolder(root, T.Compose(transform), loader=load_image)


# ------------------------------------------------- splitting work across replicas
class EpochSampler(torch.utils.data.DistributedSampler):
  """This replica's share of an epoch, ordered by (seed, epoch), from set_epoch's first step
  on; each index comes with its augmentation's seed (for SeededSamples). drop_last=True:
  the remainder (under world_size samples) is left out, not repeated on another replica."""

  def __init__(self, dataset, rank, world_size, seed, batch_size):
    super().__init__(dataset, world_size, rank, shuffle=True, seed=seed, drop_last=True)
    self.batch_size, self.skip = batch_size, 0

  def set_epoch(self, epoch, first_step=0):
    super().set_epoch(epoch)
    self.skip = first_step * self.batch_size

  def __len__(self):
    return super().__len__() - self.skip

  def __iter__(self):
    for index in itertools.islice(super().__iter__(), self.skip, None):
      yield (self.seed * 1_000_003 + self.epoch) * 2**32 + index, index


class SeededSamples(torch.utils.data.Dataset):
  """dataset[index] with torch's RNG (torchvision's random transforms draw from it) seeded
  by the key's seed: a crop does not depend on the loader worker, so a resumed run sees the
  very images an uninterrupted one would."""

  def __init__(self, dataset):
    self.dataset = dataset

  def __len__(self):
    return len(self.dataset)

  def __getitem__(self, key):
    with torch.random.fork_rng(devices=[]):
      torch.manual_seed(key[0])
      return self.dataset[key[1]]


def eval_share(dataset, rank, world_size, batch_size, blank):
  """Samples rank, rank + world_size, ... padded with (blank, -1), not counted, to the same
  whole number of batches on every replica: every sample counts once, no replica waits in
  a collective for one that stopped (pytorch/xla#2749), and every batch has one shape."""
  steps = -(-len(dataset) // world_size // batch_size)
  share = torch.utils.data.Subset(dataset, range(rank, len(dataset), world_size))
  return torch.utils.data.ConcatDataset([share, [(blank, -1)] * (steps * batch_size - len(share))])


class EpochLoader:
  """At most num_batches batches of loader an epoch, from set_epoch's first_step on (`order`,
  a sampler or dataset, skips the trained ones; a None it sends is dropped). Capping here,
  not by leaving MpDeviceLoader's loop, leaves no thread behind. MpDeviceLoader ends the
  epoch silently on a loader error: check() raises it."""

  def __init__(self, loader, num_batches, order=None):
    self.loader, self.order, self.first_step, self.error = loader, order, 0, None
    try:
      self.num_batches = min(len(loader), num_batches)
    except TypeError:  # An iterable dataset has no length: the cap is the epoch.
      self.num_batches = num_batches

  def set_epoch(self, epoch, first_step=0):
    if self.order is not None:
      self.order.set_epoch(epoch, first_step)
    self.first_step = first_step

  def __iter__(self):
    self.error = None
    if self.first_step >= self.num_batches:
      return  # Without starting loader workers for nothing.
    try:  # islice: no batch past the cap is asked for (or read, or counted).
      batches = (batch for batch in self.loader if batch is not None)
      yield from itertools.islice(batches, self.num_batches - self.first_step)
    except Exception as e:
      self.error = e

  def check(self):
    if self.error is not None:
      raise self.error


def warmup_step_decay(step, steps_per_epoch, warmup_epochs, divide_every_n_epochs, divisor):
  """LR factor at a global step (upstream's WarmupAndExponentialDecayScheduler): linear
  warm-up from 0, then a division every n epochs; a resumed run gets the exact value."""
  warmup_steps = warmup_epochs * steps_per_epoch
  if step < warmup_steps:
    return (step + 1) / warmup_steps
  return 1.0 / divisor**(step // steps_per_epoch // divide_every_n_epochs)


# ---------------------------------------------------------------- logging and results
class StepLog:
  """Training lines (pytorch/xla's, which TPU users grep for) and TensorBoard scalars from a
  thread of their own, in order. add() is a step closure: reading the loss waits for the
  step, and in the training thread that would hold up the next step's tracing. (run_async
  closures cannot be waited for: their lines could trail the epoch's.)"""

  def __init__(self, device, writer):
    self.device, self.writer, self.pending = device, writer, collections.deque()
    self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='log')

  def add(self, epoch, step, global_step, loss, tracker, lr):
    self.pending.append(self.thread.submit(self._print, epoch, step, global_step, loss,
                                           tracker, lr))

  def _print(self, epoch, step, global_step, loss, tracker, lr):
    loss, rate = loss.item(), tracker.rate()
    test_utils.print_training_update(self.device, step, loss, rate, tracker.global_rate(), epoch)
    test_utils.write_to_summary(self.writer, global_step,
                                {'Loss/train': loss, 'Rate/train': rate, 'LR': lr})

  def flush(self):
    """Waits until every line added so far is printed (and raises what failed)."""
    while self.pending:
      self.pending.popleft().result()


def execute_seconds():
  """Seconds this process's XLA graphs have spent executing (torch_xla's ExecuteTime, or
  ExecuteReplicatedTime under SPMD)."""
  return sum((met.metric_data(name) or (0, 0))[1] for name in
             ('ExecuteTime', 'ExecuteReplicatedTime')) / 1e9


def compile_count():
  """XLA graphs compiled so far by this process (torch_xla's CompileTime metric)."""
  return (met.metric_data('CompileTime') or (0,))[0]


def new_results(model, **extra):
  """The numbers a run adds up as it goes, which --results_json writes (see the README)."""
  return dict(dict(model=model, world_size=xr.world_size(), epochs=0, max_accuracy=0.0,
                   final_accuracy=0.0, eval_correct=0, eval_samples=0, epoch_rates=[], epoch_device_busy=[], compilations_after_epoch=[],
                   train_seconds=0.0, bf16=os.environ.get('XLA_USE_BF16') == '1'), **extra)


def finish_results(results, global_step, samples_per_step, writer):
  """Adds the run's totals to its results and closes the TensorBoard writer (if any); the
  master prints the last two lines."""
  if writer is not None:
    writer.close()
  results['train_steps'] = global_step
  results['train_samples'] = global_step * samples_per_step
  results['global_rate'] = results['train_samples'] / max(results['train_seconds'], 1e-9)
  results['compilations'] = compile_count()
  xm.master_print(f'Total train time: {results["train_seconds"]:.1f} s', flush=True)
  xm.master_print(f'Max Accuracy: {results["max_accuracy"]:.2f}%', flush=True)
  return results


def exit_code(results, target_accuracy):
  """EXIT_PREEMPTED or EXIT_INTERRUPTED after a stop by SIGTERM or Ctrl-C, EXIT_BELOW_TARGET
  (said in a line) when the final accuracy is below the target, else 0."""
  if results.get('preempted') or results.get('interrupted'):
    return EXIT_INTERRUPTED if results.get('interrupted') else EXIT_PREEMPTED
  if results['final_accuracy'] < target_accuracy:
    xm.master_print(f'Accuracy {results["final_accuracy"]:.2f} is below target '
                    f'{target_accuracy:.2f}', flush=True)
    return EXIT_BELOW_TARGET
  return 0


def write_results(path, results):
  """Writes results as JSON to a local path or URL, atomically."""
  if path:
    try:
      write_atomically(json.dumps(results, indent=2).encode() + b'\n', path)
    except OSError as e:
      raise UsageError(f'cannot write --results_json {path} ({e})') from None


def write_atomically(data, url):
  """Writes bytes under a temporary name and renames: a kill mid-write leaves the old file,
  and a failed write (a full disk) removes its temporary."""
  fs, path = fsspec.core.url_to_fs(url)
  temporary = f'{path}.tmp{os.getpid()}'
  try:
    with fs.open(temporary, 'wb') as f:
      f.write(data)
      try:  # A local file: on disk before the rename, in case the VM goes down.
        f.flush()
        os.fsync(f.fileno())
      except (AttributeError, io.UnsupportedOperation):  # Not a local file: the store commits it.
        pass
    fs.mv(temporary, path)
  except Exception:
    if fs.exists(temporary):
      fs.rm(temporary)
    raise


def check_writable(flag, folder):
  """Creates folder (a path or URL) and writes a probe file there: a place that takes no
  output fails before training, not after it."""
  try:
    fs, path = fsspec.core.url_to_fs(folder)
    fs.makedirs(path, exist_ok=True)
    fs.pipe_file(f'{path.rstrip("/")}/.write-test-{os.getpid()}', b'ok')
    fs.rm(f'{path.rstrip("/")}/.write-test-{os.getpid()}')
  except Exception as e:  # PermissionError, NotADirectoryError, a bucket's auth error, ...
    raise UsageError(f'cannot write to --{flag} {folder} ({type(e).__name__}: {e}): give a '
                     'folder or bucket this job can write') from None


# ----------------------------------------------------------------------- checkpoints
def check_outputs(ckpt_dir, logdir, results_json):
  """Checks at start that every output place given takes files; in ckpt_dir, first removes
  what a killed save left (freeing its space)."""
  if ckpt_dir:
    try:
      fs, path = fsspec.core.url_to_fs(ckpt_dir)
      for name in fs.ls(path, detail=False) if fs.isdir(path) else []:
        if '.pt.tmp' in name.rsplit('/', 1)[-1]:
          fs.rm(name)
    except OSError:
      pass  # Said below.
    check_writable('ckpt_dir', ckpt_dir)
  if logdir:
    check_writable('logdir', logdir)
  if results_json:
    check_writable('results_json', os.path.dirname(results_json) or '.')


def is_master():
  """Whether this process writes checkpoints and results: replica 0 of the run or, under
  SPMD (one process per host, each of them ordinal 0), process 0."""
  return xr.process_index() == 0 if xr.is_spmd() else xm.is_master_ordinal(local=False)


def list_checkpoints(ckpt_dir):
  """{global_step: path} of the checkpoints in ckpt_dir."""
  fs, path = fsspec.core.url_to_fs(ckpt_dir)
  names = [name.rsplit('/', 1)[-1] for name in fs.ls(path, detail=False)] if fs.exists(path) else []
  return {int(m.group(1)): f'{ckpt_dir.rstrip("/")}/{m.group(0)}'
          for m in map(CHECKPOINT_NAME.match, names) if m}


def save_checkpoint(state, ckpt_dir, keep, best):
  """Saves ckpt_dir/ckpt-GLOBALSTEP.pt (and best.pt) and returns its path. Every replica
  calls it at the same step; the master writes, and none goes on before the file is whole.
  Keeps the newest `keep` up to this one (newer ones are from a rolled-back run)."""
  torch_xla.sync()  # Runs the step still being traced, so that saving only copies data.
  master = is_master()
  buffer = io.BytesIO() if master else None
  # SPMD: every host holds the whole (replicated) state; process 0 copies it out and writes.
  if master or not xr.is_spmd():
    xm.save(state, buffer, master_only=True, global_master=True)
  path = f'{ckpt_dir.rstrip("/")}/ckpt-{state["global_step"]:08d}.pt'
  if master:
    try:
      write_atomically(buffer.getvalue(), path)
      if best:
        write_atomically(buffer.getvalue(), f'{ckpt_dir.rstrip("/")}/best.pt')
    except OSError as e:  # A full disk or quota, a lost permission.
      raise UsageError(f'cannot write checkpoint {path} ({e}): free space in --ckpt_dir or '
                       'give another; the checkpoints already there are kept') from None
    saved = list_checkpoints(ckpt_dir)
    kept = sorted(step for step in saved if step <= state['global_step'])[-keep:]
    for old in (saved[step] for step in saved if step not in kept):
      fsspec.core.url_to_fs(old)[0].rm(fsspec.core.url_to_fs(old)[1])
    print(f'Saved checkpoint {path}', flush=True)
  if xr.world_size() > 1:
    xm.rendezvous('checkpoint_saved')
  return path


def load_checkpoint(path):
  """The checkpoint at path (local or URL) with CPU tensors, or CheckpointError. Only
  tensors and plain values load (weights_only): unpickling other objects could run code."""
  try:
    with fsspec.open(path, 'rb') as f:
      # torch.save writes a zip archive; random or truncated bytes are not one (and could
      # look like a pickle that weights_only refuses).
      if not zipfile.is_zipfile(f):
        raise EOFError('not the whole zip archive that torch.save writes')
      f.seek(0)
      state = torch.load(f, map_location='cpu', weights_only=True)
  except pickle.UnpicklingError:
    raise CheckpointError(f'checkpoint {path} holds objects other than tensors and plain '
                          'values; refused, since loading it could run code') from None
  except Exception as e:  # Truncated or corrupt: EOFError, RuntimeError, ...
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise CheckpointError(f'checkpoint {path} cannot be read: it is not a whole, readable '
                          f'checkpoint file ({reason})') from None
  missing = [key for key in CHECKPOINT_KEYS if not isinstance(state, dict) or key not in state]
  if missing:
    raise CheckpointError(f'{path} is not a checkpoint of these scripts (no '
                          f'{", ".join(missing)})')
  return state


def find_checkpoint(resume, ckpt_dir):
  """(path, state) to resume from, the same on every replica, or (None, None): --resume
  PATH, else the newest readable checkpoint in ckpt_dir (with a warning line for each
  unreadable newer one). The master chooses; the others follow."""
  path, state = None, None
  if xm.is_master_ordinal(local=False) and resume:
    try:
      path, state = resume, load_checkpoint(resume)
    except CheckpointError as e:
      raise UsageError(f'--resume: {e}') from None
  elif xm.is_master_ordinal(local=False) and ckpt_dir:
    for _, found in sorted(list_checkpoints(ckpt_dir).items(), reverse=True):
      try:
        path, state = found, load_checkpoint(found)
        break
      except CheckpointError as e:
        print(f'warning: {e}; trying the previous one', file=sys.stderr, flush=True)
  if xr.world_size() > 1:
    path = xm.mesh_reduce('resume_from', path, lambda paths: paths[0])
    state = state or (load_checkpoint(path) if path else None)
  return path, state


def check_same_model(model, state, path):
  """A UsageError naming a weight that differs if the checkpoint is of another model."""
  ours = {k: list(v.shape) for k, v in model.state_dict().items()}
  theirs = {k: list(v.shape) for k, v in state['model'].items()}
  differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
  if differ:
    raise UsageError(f'checkpoint {path} was made for another model or number of classes '
                     f'({len(differ)} weight(s) differ, e.g. {differ[0]}: '
                     f'{theirs.get(differ[0], "absent")} there, {ours.get(differ[0], "absent")} '
                     f'here; it was saved with --model {state["flags"].get("model")}): use the '
                     'flags of that run, or another --ckpt_dir')


def resume(resume_path, ckpt_dir, training, flag_values, restart_flags):
  """Restores training = (model, optimizer, scheduler or None) and the RNGs from resume_path,
  else from the newest readable checkpoint in ckpt_dir; returns that checkpoint, or None,
  and says which. Flags that differ from the checkpoint's, but for restart_flags (which do
  not change what is computed), are named in a warning line."""
  path, state = find_checkpoint(resume_path, ckpt_dir)
  if state is None:
    return None
  model, optimizer, scheduler = training
  check_same_model(model, state, path)
  model.load_state_dict(state['model'])
  optimizer.load_state_dict(state['optimizer'])
  if scheduler is not None and state['lr_scheduler'] is not None:
    scheduler.load_state_dict(state['lr_scheduler'])
  torch.set_rng_state(state['rng']['torch'])
  xm.set_rng_state(state['rng']['xla'])
  saved = state['flags']
  changed = [f'--{name} {saved[name]!r} -> {value!r}' for name, value in sorted(flag_values.items())
             if name in saved and name not in restart_flags and saved[name] != value]
  if changed:
    xm.master_print(f'warning: resuming {path} with other flags ({"; ".join(changed)}): the '
                    'run will differ from one never interrupted', fd=sys.stderr, flush=True)
  epoch, num_epochs = state['epoch'], flag_values['num_epochs']
  xm.master_print(f'Run already finished: {path} is the end of epoch {epoch - 1} (--num_epochs '
                  f'{num_epochs})' if epoch > num_epochs else
                  f'Resumed from {path} at epoch {epoch} step {state["step"]}', flush=True)
  return state


# ------------------------------------------------------------------------- stopping
def record_stop(results, signum, global_step=None):
  """Marks results as stopped by the stop signal this process got (SIGTERM here or on another
  replica, or SIGINT) after global_step steps; returns (what stopped it, the exit code)."""
  if global_step is not None:
    results['train_steps'] = global_step
  if signum == signal.SIGINT:
    results['interrupted'] = True
    return 'Ctrl-C (SIGINT)', EXIT_INTERRUPTED
  results['preempted'] = True
  return 'SIGTERM', EXIT_PREEMPTED


class StopVote:
  """A stop signal as a stop after the same step on every replica (or, under SPMD, host):
  each step sums the flags inside its graph and reads the sum of LAG steps earlier, long
  computed."""
  LAG = 2

  def __init__(self, device, stop_signal, mesh=None):
    # Two device buffers, copied once: a step passes one, with no transfer per step. Not
    # scalars, which torch_xla would turn into constants, a graph of their own.
    if mesh is None:  # One process per device: the replicas all-reduce their flags.
      self.flags = (torch.zeros(1).to(device), torch.ones(1).to(device))
      self.sum = lambda flag: xm.all_reduce(xm.REDUCE_SUM, flag)
    else:  # SPMD: one global tensor, a host's flag on each of its devices; XLA sums it.
      local = torch.ones(xr.addressable_runtime_device_count())
      spec = xs.ShardingSpec(mesh, ('data',), minibatch=True)
      self.flags = tuple(xm.send_cpu_data_to_device(local * flag, device, spec)[0]
                         for flag in (0, 1))
      self.sum = torch.sum
      self.sum(self.flags[0]).item()  # Compiles the epoch end's vote before epoch 1 ends.
    self.stop_signal, self.mesh, self.votes = stop_signal, mesh, collections.deque()

  def agreed_after_step(self):
    """True when every replica stops after this step; call it once per step."""
    self.votes.append(self.sum(self.flags[self.stop_signal() != 0]))
    return len(self.votes) > self.LAG and self.votes.popleft().item() > 0

  def agreed_at_epoch_end(self):
    """True when any replica asked to stop during the last steps or since."""
    pending = any(vote.item() > 0 for vote in self.votes) or self.stop_signal() != 0
    self.votes.clear()
    if self.mesh is not None:
      return self.sum(self.flags[pending]).item() > 0
    return xm.mesh_reduce('stop_request', pending, any)


def ignore_stop_signals(worker_id=None):
  """DataLoader worker_init_fn: workers go on serving batches after a SIGTERM or Ctrl-C to
  all processes, so that the step in flight can finish and save."""
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  signal.signal(signal.SIGINT, signal.SIG_IGN)
