# SPDX-License-Identifier: BSD-3-Clause
"""What only the process the user starts does, around the replicas it launches: optional.

A training script imports this module in one guarded place and runs without it as
upstream's scripts do, through torch_xla.launch, with everything utils.py gives every
replica (checkpoints, the exact resume, the stop on SIGTERM, SIGHUP or Ctrl-C after an agreed
step, the exit codes). With it, a run also gets:
- checks before any replica starts, each a line instead of one traceback per replica: the
  data and the model built once and said ("Data:", "Model:", "Recipe:"), a dataset loader
  workers cannot receive, image folders (their layout, empty classes, links that reach an
  image twice), shards that are missing or of another format, output folders that take no
  file, a bucket or server that does not answer within REMOTE_SECONDS; the loader workers
  capped at the CPUs there are; gcsfs's retries kept quiet;
- the watched run: the line a stop signal prints at once (the step and the save can take a
  minute), a second Ctrl-C that ends the run at once, and a replica that fails or is killed
  ending the others and their loader workers instead of leaving them waiting in a collective
  (torch_xla.launch waits for replica 0 first), so that nothing is left running.

Under torchrun (or a launcher of your own) the launcher does the second part itself: this
module then only checks and says what runs. Not to be confused with launch_pod.py, which
starts a script on every worker of a pod.
"""

import collections
import concurrent.futures
import contextlib
import itertools
import logging
import numbers
import os
import re
import select
import shlex
import signal
import sys
import threading
import time

import braceexpand
import fsspec
import torch

import utils

REMOTE_SECONDS = 20  # The wait at start for a bucket or server (gcsfs alone retries ~35 s).

# gcsfs and google-auth log each retry and credential fallback, tracebacks included, through
# absl's handler: a bucket out of reach was a hundred lines. The checks say it in one.
for _noisy in ('gcsfs', 'google.auth', 'fsspec'):
  logging.getLogger(_noisy).setLevel(logging.CRITICAL)


# ----------------------------------------------------------------- the checks before the start


def check_job(cfg, build_datasets, build_model, fake_classes, given, recipe=None,
              build_optimizer=None):
  """Builds the data and the model once, before any replica starts, and says what they are:
  bad input is one line, not one per replica. Caps cfg.num_workers at the CPUs there are and
  probes the output folders. given: the flags the user gave; recipe: (its name, the settings
  it fills in where not given), for the "Recipe:" line, which names the optimizer that
  build_optimizer(cfg, model) makes, if given (else SGD)."""
  if cfg.fake_data:
    num_classes = fake_classes
    print(f'Data: fake, constant batches of 3x{cfg.img_dim}x{cfg.img_dim}, {num_classes} classes')
  else:
    cfg.num_workers = usable_workers(cfg.num_workers, 'num_workers' in given)
    train_set, test_set, num_classes = build_datasets(cfg)
    print(check_datasets(train_set, test_set, num_classes))
    if cfg.num_workers and getattr(cfg, 'num_cores', None) != 1:  # Workers start by spawn.
      utils.check_picklable(dict(training=train_set, evaluation=test_set))
  model = build_model(cfg, num_classes)
  print(describe_model(cfg.model, model, num_classes))
  if not cfg.fake_data:
    check_model_takes(model, train_set[0][0])
  optimizer = build_optimizer(cfg, model) if build_optimizer else None
  print(describe_recipe(cfg, recipe_source(given, *recipe or (None, {})), optimizer), flush=True)
  check_outputs(cfg.ckpt_dir, cfg.logdir, cfg.results_json, cfg.compile_cache_dir,
                cfg.profile_logdir if cfg.profile_step is not None else None)


def check_datasets(train_set, eval_set, num_classes):
  """What a script's build_datasets made, checked at start on the first and last sample of
  each set: (C x H x W uint8 or float tensor, integer label below num_classes), one shape and
  dtype in both. Returns a line that says what the data is."""
  shapes = {}
  for name, dataset in (('training', train_set), ('evaluation', eval_set)):
    if not hasattr(dataset, '__len__') or len(dataset) == 0:
      raise utils.UsageError(f'build_datasets: the {name} set is empty or has no len(): give a '
                             'map-style dataset (len() and [index]) of samples')
    for index in sorted({0, len(dataset) - 1}):
      where, sample = f'{name} sample {index}', dataset[index]
      image, label = sample if isinstance(sample, (tuple, list)) and len(sample) == 2 else (0, 0)
      if not (torch.is_tensor(image) and image.dim() == 3 and
              (image.is_floating_point() or image.dtype == torch.uint8)):
        raise utils.UsageError(f'build_datasets: {where} is {_kind(sample)}: give (C x H x W uint8 '
                               'or float tensor, label)')
      label = label.item() if torch.is_tensor(label) and label.dim() == 0 else label
      if not (isinstance(label, numbers.Integral) and 0 <= label < num_classes):
        raise utils.UsageError(f'build_datasets: {where} has label {_kind(label)}: give integers '
                               f'from 0 to {num_classes - 1} (the class count it returned)')
      kind = 'x'.join(map(str, image.shape)) + ' ' + str(image.dtype).removeprefix('torch.')
      shapes.setdefault(kind, where)
  if len(shapes) > 1:
    (shape, where), (other, other_where) = list(shapes.items())[:2]
    raise utils.UsageError(f'build_datasets: {other_where} is {other}, {where} is {shape}: give samples '
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


def describe_model(name, model, num_classes):
  """The line that says which model a run trains, as build_model made it."""
  parameters = sum(parameter.numel() for parameter in model.parameters())
  return (f'Model: {name} ({type(model).__name__}, {parameters / 1e6:.2f}M parameters, '
          f'{num_classes} classes)')


def check_model_takes(model, image):
  """A UsageError if the model cannot take a batch of this sample's image as the step gives
  it (utils.normalize): a grey image for a model of RGB input, say, is one line here instead
  of a traceback from every replica."""
  try:
    with torch.no_grad():
      model.eval()(utils.normalize(image[None]))
  except utils.UsageError as e:
    raise utils.UsageError(f'build_datasets: {e}') from None
  except Exception as e:
    shape = 'x'.join(map(str, image.shape)) + ' ' + str(image.dtype).removeprefix('torch.')
    fix = (f'give 3-channel images (v2.RGB() in the transform) or a model whose first layer '
           f'takes {image.shape[0]}' if image.shape[0] != 3 else 'give images the model takes')
    reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    raise utils.UsageError(f'build_model\'s model cannot take build_datasets\' samples ({shape}): '
                           f'{reason}; {fix}') from None


RECIPE_FLAGS = ('lr', 'lr_scheduler_type', 'momentum', 'weight_decay')


def recipe_source(given, recipe, filled):
  """Where the "Recipe:" line's settings come from: the flags given, a recipe (named) for
  those it fills in, the flags' defaults for the rest."""
  def names(kept):
    kept = [f'--{name}' for name in RECIPE_FLAGS if kept(name)]
    return ', '.join(kept[:-1]) + ' and ' * (len(kept) > 1) + ''.join(kept[-1:])
  parts = [f'{names(lambda name: name in given)} as given',
           f'{names(lambda name: name in filled and name not in given)} from {recipe}']
  parts = [part for part in parts if part.startswith('--')]
  if any(name not in given and name not in filled for name in RECIPE_FLAGS):
    parts.append("the rest the flags' defaults" if parts else "the flags' defaults")
  return ', '.join(parts)


def describe_recipe(cfg, source, optimizer=None):
  """The line that says which optimiser settings a run uses (the optimizer's own, if given),
  and where they came from."""
  schedule = 'constant'
  if cfg.lr_scheduler_type == 'WarmupAndExponentialDecayScheduler':
    schedule = (f'linear warm-up over {cfg.lr_warmup_epochs:g} epochs, then divided by '
                f'{cfg.lr_scheduler_divisor:g} every {cfg.lr_scheduler_divide_every_n_epochs} epochs')
  settings = (optimizer.defaults if optimizer else
              dict(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay))
  momentum = f', momentum {settings["momentum"]:g}' if 'momentum' in settings else ''
  return (f'Recipe: {type(optimizer).__name__ if optimizer else "SGD"}, lr {settings["lr"]:g} '
          f'{schedule}{momentum}, weight decay {settings.get("weight_decay", 0):g} ({source}); '
          f'float32 mat-mul precision {cfg.mat_mul_precision}')


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


def check_outputs(ckpt_dir, logdir, results_json, compile_cache_dir=None, profile_logdir=None):
  """A probe file into each output folder given: a place that takes none fails before training,
  not after it. First refuses a ckpt_dir another run holds, then frees what a killed save left
  in it."""
  if compile_cache_dir and '://' in compile_cache_dir:
    raise utils.UsageError(f'--compile_cache_dir {compile_cache_dir}: torch_xla writes its compile '
                           "cache with plain file I/O: give a folder on this host's disk or a "
                           'mounted one')
  folders = dict(ckpt_dir=ckpt_dir, logdir=logdir, compile_cache_dir=compile_cache_dir,
                 profile_logdir=profile_logdir,
                 results_json=results_json and (os.path.dirname(results_json) or '.'))
  for flag, folder in ((flag, folder) for flag, folder in folders.items() if folder):
    try:
      reach(folder, lambda: _write_probe(folder, leftovers=flag == 'ckpt_dir'))
      if flag == 'results_json' and reach(results_json, lambda: _is_folder(results_json)):
        raise utils.UsageError(f'--results_json {results_json} is a folder: give a file name, such '
                               f'as {results_json.rstrip("/")}/results.json')
    except utils.UsageError:
      raise
    except Exception as e:  # PermissionError, NotADirectoryError, a bucket's auth error, ...
      raise utils.UsageError(f'cannot write to --{flag} {folder} ({type(e).__name__}: {e}): give a '
                             'folder or bucket this job can write') from None


def _is_folder(url):
  fs, path = fsspec.core.url_to_fs(url)
  return fs.isdir(path)


def _write_probe(folder, leftovers):
  fs, path = fsspec.core.url_to_fs(folder)
  if leftovers:
    utils.claim_folder(folder, hold=False)  # Another run's save in progress is not a leftover.
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
  network, a server that hangs) is a utils.UsageError then, not a minute of retries."""
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
    raise utils.UsageError(f'{url} did not answer within {REMOTE_SECONDS} s: check the network, the '
                           'address and the credentials')
  if 'error' in outcome:
    raise outcome['error']
  return outcome.get('value')


# -------------------------------------------------------------------------- image folders


def check_image_folders(root, splits):
  """ImageFolder datasets of root/SPLIT for each split (no transform), or a UsageError when a
  split is not a folder of class folders of images, or the splits' classes differ."""
  datasets = []
  for split in splits:
    dataset, folder = utils.image_folder(root, split, splits=splits), os.path.join(root, split)
    if _links(folder):  # ImageFolder follows them: an image must still count once.
      _check_one_path_each(dataset.samples, folder)
    if datasets and dataset.classes != datasets[0].classes:
      raise utils.UsageError(f'{folder} and {os.path.join(root, splits[0])} must hold the same '
                             'class folders')
    datasets.append(dataset)
  return datasets


def _links(folder):
  """The symbolic links below folder, not followed (scandir reads this without a stat)."""
  found, todo = [], [folder]
  while todo:
    with os.scandir(todo.pop()) as entries:
      for entry in entries:
        if entry.is_symlink():
          found.append(entry.path)
        elif entry.is_dir():
          todo.append(entry.path)
  return found


def _check_one_path_each(samples, folder):
  """A utils.UsageError naming the link when a link makes folder reach one image twice (a loop
  such as CLASS/loop -> ., or a link into another class, which mislabels that image)."""
  seen = {}
  for path, _ in samples:
    real = os.path.realpath(path)
    if real in seen:
      link = _link_in(path, folder) or _link_in(seen[real], folder)
      raise utils.UsageError(f'{folder} reaches {real} twice, as {seen[real]} and as {path}, through '
                             f'the symbolic link {link}: remove the link, or keep each image in one '
                             'class folder only')
    seen[real] = path


def _link_in(path, folder):
  """The first symbolic link on the way from folder to path, or None."""
  parts = os.path.relpath(path, folder).split(os.sep)
  return next((link for link in (os.path.join(folder, *parts[:i])
                                 for i in range(1, len(parts) + 1)) if os.path.islink(link)), None)


# -------------------------------------------------------------------------------- shards


def shard_missing(url):
  """Whether the shard does not exist; a UsageError if its server or bucket cannot be asked, or
  answers with an error of its own (a 5xx, a 403)."""
  try:
    reach(url, lambda: _info(url))
    return False
  except utils.UsageError:
    raise
  except FileNotFoundError as e:
    # fsspec's http also says this for an answer other than 404, and for a server it cannot
    # reach (the cause: the answer, or the connection's error).
    status = getattr(e.__cause__, 'status', None)
    if e.__cause__ is None or isinstance(e.__cause__, FileNotFoundError) or status == 404:
      return True
    error = e.__cause__
  except Exception as e:  # A name that does not resolve, a bucket without credentials, ...
    error = e
  status = getattr(error, 'status', None) or getattr(error, 'code', None)  # aiohttp's, gcsfs's
  if isinstance(status, int) and 400 <= status < 600:
    reason = str(getattr(error, 'message', '') or '').split('\n')[0]
    raise utils.UsageError(
        f'{url}: the server failed (HTTP {status} {reason}); check that it is up, then run '
        'again' if status >= 500 else f'{url}: HTTP {status} {reason}: check the URL and that '
        'this host may read it (credentials, permissions)')
  raise utils.UsageError(f'cannot reach {url} ({type(error).__name__}: {error}): check that '
                         'the server or bucket is up and the address is right')


def _info(url):
  fs, path = fsspec.core.url_to_fs(url)
  return fs.info(path)


MOSTLY_MISSING = 0.1  # More shards of a range missing than this share: the range is wrong.
PROGRESS_SECONDS = 10  # A long check of the shards says how far it is, this often.


def check_shards(flag, pattern, strict):
  """A UsageError if no shard of the pattern exists (pipe: commands are not checked), or more
  than MOSTLY_MISSING of them do not (a {first..last} range past the shards), or any does not
  and strict; else a warning line naming those that will be skipped. A check that takes long
  (a bucket, a server: a request a shard) says how far it is. Returns the shards found (pipe:
  commands left out)."""
  urls = list(braceexpand.braceexpand(pattern))
  missing, checked, said = [], 0, time.monotonic()
  for url in (url for url in urls if not url.startswith('pipe:')):
    if shard_missing(url):
      missing.append(url)
    checked += 1
    if time.monotonic() - said > PROGRESS_SECONDS:
      print(f'Checking --{flag}: {checked:,} of {len(urls):,} shards ({len(missing):,} missing) '
            '...', flush=True)
      said = time.monotonic()
    if len(missing) > MOSTLY_MISSING * len(urls) and checked < len(urls):
      break  # Said below, without asking for the rest.
  among = f' among the first {checked:,} of {len(urls):,}' if checked < len(urls) else ''
  if missing and len(missing) == checked:
    raise utils.UsageError(f'--{flag}: no shard found at {pattern}{among} (first: {urls[0]}); '
                           'check the path or URL and the {first..last} range')
  if len(missing) > MOSTLY_MISSING * len(urls):
    raise utils.UsageError(
        f'--{flag}: {len(missing):,} shards do not exist{among or f" of {len(urls):,}"} (e.g. '
        f'{missing[0]}): check the {{first..last}} range of {pattern}')
  if missing:
    message = f'--{flag}: {len(missing)} of {len(urls)} shards do not exist, e.g. {missing[0]}'
    if strict:
      raise utils.UsageError(f'{message}: fix the pattern, or drop --fail_on_bad_data to skip them')
    print(f'warning: {message}; they will be skipped', file=sys.stderr, flush=True)
  missing = set(missing)  # Up to a tenth of 100,000 shards: a set, not a list, to look in.
  return [url for url in urls if url not in missing and not url.startswith('pipe:')]


def check_format(flag, url, read_samples, count=16):
  """A UsageError if one of the shard's first `count` samples is not of a kind the script reads:
  read_samples(urls, on_bad) is the script's reader, as training reads shards, which hands each
  failure to on_bad; one that is `foreign` (shards of another format, labels past the classes)
  is one line at start, not a warning for every sample. Any other is left to training (a
  sample or shard skipped with a warning, or fatal with --fail_on_bad_data). Returns the labels
  of the samples read (the last of what read_samples gives for each)."""
  def on_bad(error):
    if getattr(error, 'foreign', False):
      raise utils.UsageError(f'--{flag}: {error}')

  return [sample[-1] for sample in itertools.islice(read_samples([url], on_bad), count)]


def unquoted_patterns(argv, names):
  """argv, once no shard pattern of the flags named is left unquoted: the shell expands one into
  many arguments, and absl would say `unexpected arguments`, or keep the last of many
  --wds_traindir=... without a word. Else one line that gives it quoted."""
  given, flag = {name: [] for name in names}, None
  for arg in argv[1:argv.index('--') if '--' in argv else len(argv)]:
    name, equals, value = arg.lstrip('-').partition('=')
    if arg.startswith('-'):
      flag = name if name in given and not equals else None  # Its value: the next argument(s).
      given.get(name, []).extend([value] if equals else [])
    elif flag:
      given[flag].append(arg)
  for name, values in given.items():
    shards = [value for value in values if re.search(r'\.(tar|tgz|tar\.gz)$', value)]
    if len(set(shards)) > 1:
      utils.die(f'--{name}: the shell expanded its shard pattern into {len(shards)} names ('
                f'{shards[0]} ... {shards[-1]}): quote it, as in --{name} '
                f'{shlex.quote(brace_pattern(shards))}')
  return argv


def brace_pattern(names):
  """The {first..last} pattern (or {a,b,...}) that the shell expands to these names."""
  prefix = re.sub(r'\d+$', '', os.path.commonprefix(names))
  suffix = re.sub(r'^\d+', '', os.path.commonprefix([name[::-1] for name in names])[::-1])
  middles = [name[len(prefix):len(name) - len(suffix)] for name in names]
  if all(middle.isdigit() for middle in middles) and [int(middle) for middle in middles] == list(
      range(int(middles[0]), int(middles[0]) + len(middles))):
    return f'{prefix}{{{middles[0]}..{middles[-1]}}}{suffix}'
  return f'{prefix}{{{",".join(middles)}}}{suffix}'


def describe_shards(cfg, classes, seen, classes_given):
  """train_wds_cifar.py's Data line: what the run trains on; seen: {flag: the labels of the
  samples check_format read}, said if all lie below a count of classes that nothing gave."""
  train, test = (len(list(braceexpand.braceexpand(pattern)))
                 for pattern in (cfg.wds_traindir, cfg.wds_testdir))
  test_samples = f'{cfg.testsize:,} evaluation samples' if cfg.testsize else 'the evaluation samples'
  source = ('--num_classes' if classes_given else
            'the classes file beside the training shards' if classes else
            "CIFAR-10's; give --num_classes for other shards")
  labels = [label for split in seen.values() for label in split]
  if source.startswith('CIFAR') and labels and max(labels) < cfg.num_classes - 1:
    source += (f'; the labels seen are {min(labels)} to {max(labels)}, in the first ' + ' and '.join(
        f'{len(split)} {"training" if flag == "wds_traindir" else "evaluation"}'
        for flag, split in seen.items() if split) + ' samples')
  return (f'Data: {cfg.trainsize:,} training samples in {train} shard{"s" * (train != 1)} and '
          f'{test_samples} in {test}, at 3x{cfg.img_dim}x{cfg.img_dim} uint8, {cfg.num_classes} '
          f'classes ({source})')


# ------------------------------------------------------------------ the watch over the run


_ending = threading.RLock()  # Held by the thread that ends the run (a handler may re-enter).


@contextlib.contextmanager
def watched(launcher, saving):
  """In the process the user started, around the run: a thread of its own takes SIGTERM, SIGINT and
  SIGHUP (utils.take_stop_signals), so that it acts at once even while the main thread is busy
  in XLA (compiling, say). The first asks for a stop after the current step
  (utils.request_stop), a second Ctrl-C ends the run at once. A launcher (where torch_xla.launch
  spawns the replicas) passes them on to its replicas (`kill PID` reaches it alone), and the
  same thread watches them: torch_xla.launch waits for replica 0 first, and would wait forever
  for a run whose other replica failed, so when one ends with an error or a signal (the OOM
  killer's, say) the thread kills the others and their loader workers and exits with that code
  (128 + N for signal N). saving: whether a stop saves a checkpoint (the line the first signal
  prints at once says so). Under torchrun a Ctrl-C reaches this process twice, from the terminal
  and from torchrun, and torchrun ends its workers itself: a second signal changes nothing
  there."""
  utils.whole_lines()
  wakeup_read, wakeup_write = os.pipe()
  os.set_blocking(wakeup_write, False)
  utils.take_stop_signals(lambda signum, frame: None)  # The watch thread acts on them.
  signal.set_wakeup_fd(wakeup_write)
  at_once = not torch.distributed.is_torchelastic_launched()
  threading.Thread(target=_watch, args=(wakeup_read, launcher, saving, at_once),
                   daemon=True).start()
  try:
    yield
  except concurrent.futures.process.BrokenProcessPool:  # A replica died: the watch says how.
    for _ in range(50):
      _check_replicas()
      time.sleep(0.1)
    _end_run(1, 'error: a replica process ended abruptly; ended the other replicas')
  finally:
    utils.end_loader_workers()


def _watch(wakeup, launcher, saving, at_once):
  while True:
    if select.select([wakeup], [], [], 0.2)[0]:
      for signum in os.read(wakeup, 64):
        if signum == signal.SIGINT and utils.stop_signal() and at_once:
          _end_run(utils.EXIT_INTERRUPTED, f'Stopped at once by a second {utils.INTERRUPT}: nothing '
                   f'saved since the last checkpoint (exit code {utils.EXIT_INTERRUPTED})')
        first = not utils.stop_signal()
        utils.request_stop(signum)
        if launcher:  # To the replicas, started or starting; multiprocessing's resource
          # tracker, the other child, ignores both.
          replicas = _children_of()[os.getpid()]
          if not replicas:  # None has started: nothing to save, and none may start now.
            _end_run(128 + signum, None)
          for pid in replicas:
            os.kill(pid, signum)
        if first:  # At once: the step and the save can take a minute, said or not.
          sys.stdout.write(_stop_line(signum, saving, at_once) + '\n')  # One write: a whole line.
          sys.stdout.flush()
    if launcher:
      _check_replicas()


def _stop_line(signum, saving, at_once):
  """What the first stop signal prints. A second SIGTERM (a supervisor's) changes nothing: only
  a second Ctrl-C ends the run at once."""
  again = signum == signal.SIGINT and at_once
  if saving:
    return 'Stopping after this step and saving' + (
        f' ({utils.INTERRUPT} again to end at once without saving)' if again else
        f' ({signal.Signals(signum).name})' if signum != signal.SIGINT else '')
  return 'Stopping after this step (nothing is saved without --ckpt_dir' + (
      f'; {utils.INTERRUPT} again to end at once)' if again else ')')


def _check_replicas():
  ended = utils.ended_replicas()
  if ended:  # The line and the code are the kit's own (the launcher's watch in utils.py).
    _end_run(*utils.replica_ended(ended))


def _end_run(code, message):
  """Kills every process this one started (replicas, loader workers), says why, exits."""
  with _ending:  # The first caller ends the process while holding it.
    for pid in _descendants(os.getpid()):
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    if message:
      print(message, file=sys.stderr if message.startswith('error:') else sys.stdout, flush=True)
    os._exit(code)


def _children_of():
  """{pid: [its child processes]} from Linux's /proc."""
  children = collections.defaultdict(list)
  for entry in filter(str.isdigit, os.listdir('/proc')):
    try:
      with open(f'/proc/{entry}/stat') as f:
        children[int(f.read().rsplit(')', 1)[1].split()[1])].append(int(entry))
    except (OSError, IndexError, ValueError):
      pass  # Gone meanwhile.
  return children


def _descendants(pid):
  """The processes below pid."""
  children = _children_of()
  found, todo = [], [pid]
  while todo:
    below = children[todo.pop()]
    found += below
    todo += below
  return found


# ------------------------------------------------------------------------- upstream's flags
# The flags of pytorch/xla's training scripts (test/args_parse.py, test/test_train_mp_imagenet*.py,
# test/spmd/test_train_spmd_imagenet.py, test/test_profile_mp_mnist.py, test/test_train_mp_mnist*.py,
# the accumulation test test/utils/train_spmd_linear_model_grad_acc.py,
# test/pjrt/test_train_hf_transformer.py and examples/train_decoder_only_base.py, at v2.9.0)
# that a script here does not have, each with what does its job here: said in one line instead
# of absl's guess (docs/scripts.md#from-upstreams-scripts).
_FSDP = ("upstream's FSDP is train_resnet_spmd.py --sharding fsdp here (FSDPv2 over a mesh: each "
         "weight sharded along its largest dimension, each block in BLOCKS a unit of its own)")
_DECODER = ("examples/train_decoder_only_base.py's model: train_decoder_spmd.py trains a decoder "
            '(--{}); these scripts train image classifiers')
UPSTREAM_FLAGS = {
    'async_closures': 'needs nothing: the training lines here are printed by a thread of their '
                      'own (utils.StepLog), so no step waits for them',
    'auto_spmd': "not here: torch_xla's auto-sharding is experimental and TPU-only; "
                 'train_resnet_spmd.py shards by --sharding batch, fsdp or hybrid',
    'auto_wrap_min_num_params': f'{_FSDP}, by block type, not by size',
    'auto_wrap_policy': f'{_FSDP}: the type-based policy; edit BLOCKS for your model',
    'ckpt_prefix': 'give --ckpt_dir DIR: checkpoints are saved there as the run trains, and '
                   'train_resnet_spmd.py saves shards that load on any mesh, unconsolidated',
    'compute_dtype': 'give --amp (the forward in bfloat16, weights in float32) or --bf16 '
                     '(every float tensor bfloat16)',
    'ddp': "train_resnet_mp.py's (torch's DistributedDataParallel, for torch.distributed code): "
           'this script needs no wrapper to reduce its gradients',
    'debug': 'needs nothing: upstream parses it and never reads it; train_resnet_mp.py '
             '--num_cores 1 runs one process, to debug',
    'drop_last': 'needs nothing: a shard stream always drops its last partial batch '
                 '(--trainsize sets the epoch)',
    'flatten_parameters': f'{_FSDP}: nothing to flatten',
    'fp32_reduce_scatter': 'needs nothing: under --amp the weights and gradients are float32; '
                           'under --bf16 everything is bfloat16',
    'hidden-size': _DECODER.format('hidden_size'),
    'input_dim': "the linear model's width in upstream's accumulation test: the model here is "
                 "build_model's (--model)",
    'intermediate-size': _DECODER.format('intermediate_size'),
    'is-decoder-layer-pure': "examples/train_decoder_only_base.py's cache of its scan: "
                             'train_decoder_spmd.py runs its layers in a loop, no scan; these '
                             'scripts train image classifiers',
    'no_ckpt_consolidation': 'needs nothing: no checkpoint here needs consolidating; without '
                             '--ckpt_dir nothing is saved',
    'no_pin_layout_in_collective_ops': f'{_FSDP}: the compiler lays out its collectives',
    'num-attention-heads': _DECODER.format('num_attention_heads'),
    'num-key-value-heads': _DECODER.format('num_key_value_heads'),
    'num-layers': _DECODER.format('num_hidden_layers'),
    'num-steps': 'give --num_steps (with an underscore): a cap on the steps of each epoch',
    'num_cores': "train_resnet_mp.py's and train_wds_cifar.py's (1: one replica, to debug): "
                 'train_single_core.py runs one device, train_resnet_spmd.py every device of '
                 'the host in one process',
    'num_warmup_epochs': 'give --lr_warmup_epochs (epochs of linear warm-up; 0.9 by default)',
    'persistent_workers': 'needs nothing: the shard loader keeps its workers (each holds its '
                          "shards' stream)",
    'pjrt_distributed': "train_resnet_mp.py's (torch.distributed's 'xla' process group for code "
                        'of your own)',
    'print-metrics': 'give --metrics_debug',
    'profile_epoch': "give --profile_step alone: it counts the run's steps from its start (epoch "
                     "E's step S is (E - 1) x an epoch's steps + S)",
    'shard_param_on_dim_0': f'{_FSDP}',
    'short_data': 'give --num_steps N: a cap on the steps of each epoch (upstream keeps the '
                  'first 1,000 samples of each set)',
    'sharding': "train_resnet_spmd.py's (batch, fsdp, hybrid): this script holds the whole model "
                'on each device',
    **{f'sharding={mode}': "upstream's spatial, conv and linear shard one layer's activations as "
                           'demonstrations; a model larger than one chip trains with --sharding '
                           'fsdp (hybrid across slices)' for mode in ('spatial', 'conv', 'linear')},
    'tidy': 'needs nothing: upstream deletes the MNIST it downloaded into --datadir; these '
            'scripts download nothing and never delete your data',
    'train_dataset_len': 'give --num_steps (a cap on the steps of each epoch)',
    'use_gradient_accumulation_loop': 'not here: --gradient_accumulation_steps runs each batch as '
                                      'a graph of its own (at most three for any count); '
                                      "torch_xla's experimental loop (an XLA While) counted one "
                                      "batch of two in a BatchNorm's num_batches_tracked here",
    'use_gradient_checkpointing': "train_resnet_spmd.py's (each block of BLOCKS recomputed in "
                                  'the backward, under any --sharding)',
    'use_nested_fsdp': f'{_FSDP}, nested in the outer one',
    'use_optimized_kwargs': "train_resnet_mp.py's (upstream's input pipeline for a TPU v4, with "
                            'persistent workers, the default): here give --batch_size 128 '
                            '--test_set_batch_size 128 --num_workers 16 --prefetch_factor 32 '
                            '--loader_prefetch_size 128 --device_prefetch_size 1 '
                            '--host_to_device_transfer_threads 4 (1 keeps the exact resume)',
    'use_small_fake_sample': 'give --num_steps N: a cap on the steps of each epoch (upstream '
                             'makes its fake epoch 50,000 samples)',
    'use_syncfree_optim': "needs nothing: torch_xla's syncfree optimizers serve float16's "
                          'gradient scaler; --amp here is bfloat16, which needs none (docs/tpu.md)',
    'use_zero_grad': 'needs nothing: upstream parses it and never reads it; every step here '
                     'zeroes the gradients',
}
# The same for train_decoder_spmd.py, whose own flags are upstream's decoder flags under the
# names of its config (examples/decoder_only_model.py's DecoderOnlyConfig).
DECODER_FLAGS = {
    **UPSTREAM_FLAGS,
    **{flag: f'give --{ours} (as upstream\'s DecoderOnlyConfig names it)' for flag, ours in (
        ('hidden-size', 'hidden_size'), ('num-layers', 'num_hidden_layers'),
        ('num-attention-heads', 'num_attention_heads'),
        ('num-key-value-heads', 'num_key_value_heads'),
        ('intermediate-size', 'intermediate_size'))},
    'is-decoder-layer-pure': "examples/train_decoder_only_base.py's cache of its scan: this script "
                             'runs its layers in a loop, no scan',
}
