# SPDX-License-Identifier: BSD-3-Clause
"""What the training loops share: one-line errors, the split of work across replicas, the
training log, results and outputs, and the stop agreed by every replica. Nothing here reads
FLAGS or holds a script's choices."""

import collections
import concurrent.futures
import contextlib
import functools
import io
import itertools
import json
import logging
import math
import numbers
import os
import pickle
import signal
import sys
import threading
import types

import fsspec
import numpy as np
import torch
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.runtime as xr
import torch_xla.test.test_utils as test_utils
import torchvision
from absl import flags

EXIT_BELOW_TARGET = 21  # upstream's code for a run below --target_accuracy
EXIT_DIVERGED = 22  # the loss became NaN: nothing was saved after it
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by SIGTERM after a checkpoint; run it again.
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C.
# What the user's SIGINT is called in the lines about it: a notebook's run() says "Interrupt",
# after the button that sends it.
INTERRUPT = os.environ.get('INTERRUPT_NAME', 'Ctrl-C')
REMOTE_SECONDS = 20  # The wait at start for a bucket or server (gcsfs alone retries ~35 s).
# Per-channel mean and std of the pixels (0 to 1) that normalize() uses for uint8 images.
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # as torchvision's
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # CIFAR-10's train

# gcsfs and google-auth log each retry and credential fallback, tracebacks included, through
# absl's handler: a bucket out of reach was a hundred lines. The scripts say it in one.
for _noisy in ('gcsfs', 'google.auth', 'fsspec'):
  logging.getLogger(_noisy).setLevel(logging.CRITICAL)


class UsageError(Exception):
  """A mistake the user can fix: printed as one `error:` line, exit code 2."""


class BadDataError(Exception):
  """An image file, shard or sample that cannot be read."""

  def __str__(self):
    # Raised in a DataLoader worker, it comes back inside the worker's traceback.
    return super().__str__().strip().splitlines()[-1].split('BadDataError: ')[-1]


class Diverged(Exception):
  """The loss became NaN at the step this names (every replica agrees on it)."""


def die(message, code=2):
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(code)


def parse_flags(argv, elsewhere=None):
  """Flags parser for app.run: a bad flag is one line and exit code 2, as argparse does.
  elsewhere: {flag of another script: what to say instead of absl's guess}."""
  try:
    rest = flags.FLAGS(argv)
  except SystemExit:  # absl's --help, --helpshort and --helpfull print, then exit 1.
    sys.exit(0)
  except flags.UnrecognizedFlagError as e:
    die(f'--{e.flagname}: {elsewhere[e.flagname]}' if e.flagname in (elsewhere or {}) else
        f'{e} (see --helpshort)')
  except flags.Error as e:
    die(f'{e} (see --helpshort)')
  if len(rest) > 1:
    die(f'unexpected arguments {rest[1:]}: every option is a --flag (see --helpshort)')
  return rest


def redefinable(flag_values):
  """Lets these flags be defined again (a notebook importing several scripts, %run twice)."""
  for name in flag_values:
    flag_values[name].allow_override = True


def in_notebook():
  """Whether this process is an IPython kernel or shell (`%run script.py` in a notebook)."""
  return 'IPython' in sys.modules and sys.modules['IPython'].get_ipython() is not None


def set_precision(amp, bf16):
  """--amp or --bf16, not both; --bf16 sets XLA_USE_BF16=1, which the runtime reads when it
  starts and spawned replicas inherit."""
  if amp and (bf16 or os.environ.get('XLA_USE_BF16') == '1'):
    die('give --amp or --bf16 (XLA_USE_BF16=1), not both: --amp keeps the weights and the '
        'optimizer in float32, --bf16 makes every float tensor bfloat16')
  if bf16:
    os.environ['XLA_USE_BF16'] = '1'


def use_compile_cache(cache_dir, process=None):
  """--compile_cache_dir: torch_xla's persistent compile cache there, in a folder of its own
  for each `process` (its index in the whole run, so that hosts may share a mounted folder:
  one writer per folder); called before the first computation. A restarted run on a TPU
  loads its graphs instead of compiling them; XLA:CPU writes them but cannot read them
  back (it compiles again, with a warning per graph)."""
  if cache_dir:
    xr.initialize_cache(cache_dir if process is None else os.path.join(cache_dir,
                                                                        f'process-{process}'))


def create_model(name, num_classes):
  """A torchvision classifier with fresh weights (nothing is downloaded)."""
  if name not in torchvision.models.list_models(torchvision.models):
    raise UsageError(f'--model {name} is not a torchvision classification model (e.g. resnet18, '
                     "resnet50): name one, or build your own in the script's build_model")
  # Models with auxiliary heads return a tuple in training mode; the loop wants logits.
  aux = dict(aux_logits=False, init_weights=True) if name in ('googlenet', 'inception_v3') else {}
  return torchvision.models.get_model(name, weights=None, num_classes=num_classes, **aux)


def normalize(images, mean=IMAGENET_MEAN, std=IMAGENET_STD):
  """What the model gets of a batch, inside the step on the device: uint8 images (0 to 255)
  as floats normalised per channel, (x / 255 - mean) / std, in the step's graph; float images
  as they are (a dataset that normalises its own)."""
  if images.dtype != torch.uint8:
    return images
  shift, scale = _channel_constants(mean, std, str(images.device))
  return images.float().sub_(shift).mul_(scale)  # two elementwise ops


@functools.lru_cache
def _channel_constants(mean, std, device):
  """255 x mean and 1 / (255 x std) as C x 1 x 1 tensors on the device, made once (not sent
  at every step)."""
  return (torch.tensor([255 * m for m in mean], device=device).view(-1, 1, 1),
          torch.tensor([1 / (255 * s) for s in std], device=device).view(-1, 1, 1))


def check_datasets(train_set, eval_set, num_classes):
  """What a script's build_datasets made, checked at start on the first and last sample of
  each set: (C x H x W uint8 or float tensor, integer label below num_classes), one shape and
  dtype in both. Returns a line that says what the data is."""
  shapes = {}
  for name, dataset in (('training', train_set), ('evaluation', eval_set)):
    if not hasattr(dataset, '__len__') or len(dataset) == 0:
      raise UsageError(f'build_datasets: the {name} set is empty or has no len(): give a '
                       'map-style dataset (len() and [index]) of samples')
    for index in sorted({0, len(dataset) - 1}):
      where, sample = f'{name} sample {index}', dataset[index]
      image, label = sample if isinstance(sample, (tuple, list)) and len(sample) == 2 else (0, 0)
      if not (torch.is_tensor(image) and image.dim() == 3 and
              (image.is_floating_point() or image.dtype == torch.uint8)):
        raise UsageError(f'build_datasets: {where} is {_kind(sample)}: give (C x H x W uint8 '
                         'or float tensor, label)')
      label = label.item() if torch.is_tensor(label) and label.dim() == 0 else label
      if not (isinstance(label, numbers.Integral) and 0 <= label < num_classes):
        raise UsageError(f'build_datasets: {where} has label {_kind(label)}: give integers '
                         f'from 0 to {num_classes - 1} (the class count it returned)')
      kind = 'x'.join(map(str, image.shape)) + ' ' + str(image.dtype).removeprefix('torch.')
      shapes.setdefault(kind, where)
  if len(shapes) > 1:
    (shape, where), (other, other_where) = list(shapes.items())[:2]
    raise UsageError(f'build_datasets: {other_where} is {other}, {where} is {shape}: give samples '
                     'of one shape and dtype (batches stack them; a new shape compiles a new '
                     'graph)')
  return (f'Data: {len(train_set):,} training and {len(eval_set):,} evaluation samples of '
          f'{next(iter(shapes))}, {num_classes} classes')


def _kind(value):
  if torch.is_tensor(value):
    return f'a {"x".join(map(str, value.shape)) or "0-d"} {value.dtype} tensor'
  if isinstance(value, (tuple, list)):
    return f'a {type(value).__name__} of {", ".join(map(_kind, value))}'
  return repr(value) if isinstance(value, (int, float, str)) else f'a {type(value).__name__}'


class _WorkerPickle(pickle.Pickler):
  """What a loader worker started by spawn is sent of a dataset, but for its tensors and arrays
  (taken as they are: only whether it can be sent is asked, not what it weighs)."""
  dispatch_table = {torch.Tensor: lambda tensor: (tuple, ()), np.ndarray: lambda array: (tuple, ())}


def check_picklable(datasets):
  """Loader workers that a replica starts by spawn get each dataset pickled: a class defined
  inside a function (or a lambda transform) cannot be, which would be a traceback from the
  replica after start-up. Said here in one line instead."""
  for name, dataset in datasets.items():
    try:
      _WorkerPickle(types.SimpleNamespace(write=len)).dump(dataset)  # Written nowhere.
    except Exception as e:  # pickle.PicklingError, AttributeError (a local class), TypeError
      raise UsageError(f'build_datasets: the {name} set ({type(dataset).__name__}) cannot be '
                       f'sent to loader worker processes ({e}): define its class (and any '
                       'function it holds) at module level, or give --num_workers 0') from None


def describe_model(name, model, num_classes):
  """The line that says which model a run trains, as build_model made it."""
  parameters = sum(parameter.numel() for parameter in model.parameters())
  return (f'Model: {name} ({type(model).__name__}, {parameters / 1e6:.2f}M parameters, '
          f'{num_classes} classes)')


def describe_recipe(cfg, source):
  """The line that says which optimiser settings a run uses, and where they came from."""
  schedule = 'constant'
  if cfg.lr_scheduler_type == 'WarmupAndExponentialDecayScheduler':
    schedule = (f'linear warm-up over {cfg.lr_warmup_epochs:g} epochs, then divided by '
                f'{cfg.lr_scheduler_divisor:g} every {cfg.lr_scheduler_divide_every_n_epochs} epochs')
  return (f'Recipe: SGD, lr {cfg.lr:g} {schedule}, momentum {cfg.momentum:g}, weight decay '
          f'{cfg.weight_decay:g} ({source})')


def usable_workers(num_workers, given):
  """num_workers, at most the CPUs this process may use: more loader workers only add start-up
  time and memory (on 2 cores, 8 workers made a 1-minute run take 4.5). given: the user asked
  for this number (a default is lowered without a word)."""
  cpus = len(os.sched_getaffinity(0))
  if num_workers <= cpus:
    return num_workers
  if given:
    print(f'--num_workers {num_workers} is more than the {cpus} CPUs this process may use: '
          f'using {cpus}', flush=True)
  return cpus


class EpochSampler(torch.utils.data.DistributedSampler):
  """This replica's share of an epoch from set_epoch's first step on, ordered by (seed, epoch),
  each index with its augmentation's seed; a remainder is dropped, not repeated elsewhere."""

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
  """dataset[index] with torch's RNG (that random transforms use) seeded by the key's seed: a
  resumed run sees the very crops an uninterrupted one would, whatever the loader worker."""

  def __init__(self, dataset):
    self.dataset = dataset

  def __len__(self):
    return len(self.dataset)

  def __getitem__(self, key):
    with torch.random.fork_rng(devices=[]):
      torch.manual_seed(key[0])
      return self.dataset[key[1]]


def eval_share(dataset, rank, world_size, batch_size):
  """Samples rank, rank + world_size, ... padded with (zeros shaped like sample 0, label -1),
  not counted, to as many batches as every replica's: none waits for another
  (pytorch/xla#2749), and every batch has one shape."""
  image, label = dataset[0]
  # A tensor label gets a tensor -1: a batch's labels are stacked, and must be of one type.
  blank = (torch.zeros_like(image), torch.full_like(label, -1) if torch.is_tensor(label) else -1)
  steps = -(-len(dataset) // world_size // batch_size)
  share = torch.utils.data.Subset(dataset, range(rank, len(dataset), world_size))
  return torch.utils.data.ConcatDataset([share, [blank] * (steps * batch_size - len(share))])


class EpochLoader:
  """At most num_batches batches of loader an epoch, from set_epoch's first_step on (`order`
  skips the trained ones; None batches are dropped): leaving MpDeviceLoader's loop early
  would leave a thread behind. check() raises the loader error MpDeviceLoader swallows."""

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
      if 'stack expects each tensor to be equal size' in str(e):  # default_collate's words
        detail = str(e).strip().splitlines()[-1]  # From a loader worker: its traceback too.
        self.error = BadDataError(f'samples of different shapes in one batch ({detail}): make '
                                  "every sample one shape (in build_datasets' transform)")

  def check(self):
    if self.error is not None:
      raise self.error


def warmup_step_decay(step, steps_per_epoch, warmup_epochs, divide_every_n_epochs, divisor):
  """upstream's WarmupAndExponentialDecayScheduler as the LR factor at a global step (exact on
  resume): linear warm-up from 0, then a division every n epochs."""
  warmup_steps = warmup_epochs * steps_per_epoch
  if step < warmup_steps:
    return (step + 1) / warmup_steps
  return 1.0 / divisor**(step // steps_per_epoch // divide_every_n_epochs)


class StepLog:
  """Training lines (pytorch/xla's, which TPU users grep for) and TensorBoard scalars, in order,
  from a thread of their own: add() is a step closure, and reading the loss in the training
  thread would hold up the next step (a run_async closure's lines could trail the epoch's)."""

  def __init__(self, device, writer, history):
    self.device, self.writer, self.history = device, writer, history  # history: results'
    self.pending = collections.deque()
    self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='log')

  def add(self, *line):  # What _print takes.
    self.pending.append(self.thread.submit(self._print, *line))

  def _print(self, epoch, step, global_step, loss, tracker, lr):
    loss, rate = loss.item(), tracker.rate()
    test_utils.print_training_update(self.device, step, loss, rate, tracker.global_rate(), epoch)
    self.history.append(dict(epoch=epoch, step=step, global_step=global_step, loss=loss,
                             rate=rate, lr=lr))
    test_utils.write_to_summary(self.writer, global_step,
                                {'Loss/train': loss, 'Rate/train': rate, 'LR': lr})

  def flush(self):
    """Waits until every line added so far is printed (and raises what failed)."""
    while self.pending:
      self.pending.popleft().result()


def execute_seconds():
  """Seconds this process's XLA graphs have spent executing (SPMD: ExecuteReplicatedTime)."""
  return sum((met.metric_data(name) or (0, 0))[1] for name in
             ('ExecuteTime', 'ExecuteReplicatedTime')) / 1e9


def compile_count():
  """XLA graphs compiled so far by this process (torch_xla's CompileTime metric)."""
  return (met.metric_data('CompileTime') or (0,))[0]


def new_results(model, **extra):
  """The numbers a run adds up as it goes, which --results_json writes (see docs/scripts.md)."""
  return dict(dict(model=model, world_size=xr.world_size(), epochs=0, max_accuracy=0.0,
                   final_accuracy=0.0, eval_correct=0, eval_samples=0, epoch_rates=[],
                   epoch_accuracies=[], epoch_device_busy=[], compilations_after_epoch=[],
                   train_seconds=0.0, history=[], bf16=os.environ.get('XLA_USE_BF16') == '1'),
              **extra)  # extra overrides.


def finish_results(results, global_step, samples_per_step, writer):
  """Adds the run's totals to its results, closes the TensorBoard writer, says the totals."""
  if writer is not None:
    writer.close()
  results['train_steps'] = global_step
  results['train_samples'] = global_step * samples_per_step
  results['global_rate'] = results['train_samples'] / max(results['train_seconds'], 1e-9)
  results['compilations'] = compile_count()
  xm.master_print(f'Total train time: {results["train_seconds"]:.1f} s', flush=True)
  after = results['compilations_after_epoch']
  if after:  # Each graph compiled after epoch 1 would stall a TPU run for its compile time.
    late = max(after[-1] - after[0], 0)  # A resumed run's first epoch compiles again.
    xm.master_print(f'Graphs compiled: {results["compilations"]}, ' + (
        'none after epoch 1' if not late else f'{late} after epoch 1 (a new shape each: see '
        'docs/performance.md)'), flush=True)
  xm.master_print(f'Max Accuracy: {results["max_accuracy"]:.2f}%', flush=True)
  return results


def exit_code(results, target_accuracy):
  """The exit code of a run with these results (see the README)."""
  if results.get('preempted') or results.get('interrupted'):
    return EXIT_INTERRUPTED if results.get('interrupted') else EXIT_PREEMPTED
  if results.get('diverged'):
    xm.master_print(f'error: the loss became NaN at {results["diverged"]}: training diverged; '
                    'lower --lr and run again (nothing was saved after that step; exit code '
                    f'{EXIT_DIVERGED})', fd=sys.stderr, flush=True)
    return EXIT_DIVERGED
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


def check_outputs(ckpt_dir, logdir, results_json, compile_cache_dir=None):
  """A probe file into each output folder given: a place that takes none fails before training,
  not after it. First frees what a killed save left in ckpt_dir."""
  if compile_cache_dir and '://' in compile_cache_dir:
    raise UsageError(f'--compile_cache_dir {compile_cache_dir}: torch_xla writes its compile '
                     "cache with plain file I/O: give a folder on this host's disk or a "
                     'mounted one')
  folders = dict(ckpt_dir=ckpt_dir, logdir=logdir, compile_cache_dir=compile_cache_dir,
                 results_json=results_json and (os.path.dirname(results_json) or '.'))
  for flag, folder in ((flag, folder) for flag, folder in folders.items() if folder):
    try:
      reach(folder, lambda: _write_probe(folder, leftovers=flag == 'ckpt_dir'))
    except UsageError:
      raise
    except Exception as e:  # PermissionError, NotADirectoryError, a bucket's auth error, ...
      raise UsageError(f'cannot write to --{flag} {folder} ({type(e).__name__}: {e}): give a '
                       'folder or bucket this job can write') from None


def _write_probe(folder, leftovers):
  fs, path = fsspec.core.url_to_fs(folder)
  if leftovers:
    try:
      for name in fs.glob(f'{path.rstrip("/")}/*.pt.tmp*'):
        fs.rm(name)
    except OSError:
      pass  # Said by the probe.
  fs.makedirs(path, exist_ok=True)
  fs.pipe_file(f'{path.rstrip("/")}/.write-test-{os.getpid()}', b'ok')
  fs.rm(f'{path.rstrip("/")}/.write-test-{os.getpid()}')


_reached = set()


def reach(url, call):
  """call(), which asks url's file system something. For a URL of the network (gs://, http://,
  ...) a line says so first, and one that does not answer within REMOTE_SECONDS (no
  network, a server that hangs) is a UsageError then, not a minute of retries."""
  if fsspec.utils.get_protocol(url) in ('file', 'local', 'memory'):
    return call()
  place = '/'.join(url.split('/')[:3])  # scheme://bucket or scheme://host: said once each
  if place not in _reached:
    print(f'Reaching {place} (up to {REMOTE_SECONDS} s) ...', flush=True)
    _reached.add(place)
  outcome = {}

  def attempt():
    try:
      outcome['value'] = call()
    except BaseException as e:  # noqa: B036 (raised again below, in the caller's thread)
      outcome['error'] = e

  thread = threading.Thread(target=attempt, name='reach', daemon=True)  # Left behind if hung.
  thread.start()
  thread.join(REMOTE_SECONDS)
  if thread.is_alive():
    raise UsageError(f'{url} did not answer within {REMOTE_SECONDS} s: check the network, the '
                     'address and the credentials')
  if 'error' in outcome:
    raise outcome['error']
  return outcome.get('value')


def is_master():
  """Whether this process writes checkpoints and results: replica 0, or process 0 (SPMD)."""
  return xr.process_index() == 0 if xr.is_spmd() else xm.is_master_ordinal(local=False)


def record_stop(results, signum, global_step, checkpoint=None):
  """Marks results stopped by signum after global_step steps, and the checkpoint it saved (or
  None); returns (the signal's name, the exit code)."""
  results.update(train_steps=global_step, checkpoint=checkpoint)
  if signum == signal.SIGINT:
    results['interrupted'] = True
    return f'{INTERRUPT} (SIGINT)', EXIT_INTERRUPTED
  results['preempted'] = True
  return 'SIGTERM', EXIT_PREEMPTED


class StopVote:
  """A stop signal on any replica (SPMD: host) as a stop after the same step on all of them;
  and a NaN loss on any as the end of the run on all (Diverged), an infinite one as a warning."""
  LAG = 2

  def __init__(self, device, stop_signal, lr):
    # Device buffers copied once: no transfer per step, and no scalar constants (a graph each).
    self.flags = (torch.zeros(1).to(device), torch.ones(1).to(device))
    self.stop_signal, self.lr, self.votes, self.warned = stop_signal, lr, collections.deque(), False

  def tally(self, flag, loss):
    """[replicas asking to stop, replicas whose loss is infinite, whose loss is NaN]."""
    return xm.all_reduce(xm.REDUCE_SUM, torch.cat([flag, self.not_finite(loss)]))

  @staticmethod
  def not_finite(loss):
    return torch.stack([torch.isinf(loss), torch.isnan(loss)]).to(torch.float32)

  def agreed_after_step(self, loss, where):
    """Whether all stop after this step: the tally is in the step's graph and read LAG steps
    on, when it is long computed. Raises Diverged for a NaN loss."""
    self.votes.append((where, self.tally(self.flags[self.stop_signal() != 0], loss)))
    return len(self.votes) > self.LAG and self._read(*self.votes.popleft())

  def _read(self, where, tally):
    stops, infinite, nan = tally.tolist()
    if nan:
      raise Diverged(where)
    if infinite and not self.warned:
      self.warned = True
      xm.master_print(f'warning: the loss is infinite at {where}: lower --lr (it is {self.lr:g}) '
                      'if it does not come back', fd=sys.stderr, flush=True)
    return stops > 0

  def check_losses(self):
    """Before a save (after a sync): raises Diverged if a step not yet read had a NaN loss."""
    for vote in self.votes:
      self._read(*vote)

  def agreed_at_epoch_end(self):
    """True when any replica asked to stop during the last steps or since."""
    pending = [self._read(*vote) for vote in self.votes]  # Every one: a NaN among them too.
    self.votes.clear()
    return self.agree(any(pending) or self.stop_signal() != 0)

  def agree(self, pending):
    return pending if xr.world_size() == 1 else xm.mesh_reduce('stop_request', pending, any)


@contextlib.contextmanager
def ends_on_nan(results):
  """Around the epochs: a NaN loss (Diverged) ends them, with nothing saved after it (the
  checkpoints already saved are as they were); exit_code says so."""
  try:
    yield
  except Diverged as e:
    results['diverged'] = str(e)


def check_learning(history, epoch, num_classes, lr, default_lr):
  """A warning when the loss stayed at chance level (ln of the class count, or above) through
  the second half of the epoch's logged steps while --lr is the default: a model without
  BatchNorm often does not learn at the ResNets' rate, and the run would end with exit 0."""
  losses = [entry['loss'] for entry in history if entry['epoch'] == epoch]
  chance = math.log(num_classes)
  if lr != default_lr or len(losses) < 4 or num_classes < 2:
    return
  if min(losses[len(losses) // 2:]) >= 0.95 * chance:
    xm.master_print(f'warning: the loss stayed at chance level (ln {num_classes} = {chance:.2f}) '
                    f'through epoch {epoch} at the default learning rate {lr:g}: the model is '
                    f'not learning; try a lower --lr (such as {lr / 10:g}), as a model without '
                    'BatchNorm often needs', fd=sys.stderr, flush=True)


def ignore_stop_signals(worker_id=None):
  """DataLoader worker_init_fn: workers serve on after a stop signal, so the run can save."""
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  signal.signal(signal.SIGINT, signal.SIG_IGN)
