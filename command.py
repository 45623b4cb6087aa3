# SPDX-License-Identifier: BSD-3-Clause
"""A training script called from Python or a notebook cell as a command of its own:
`train_resnet_mp.run(['--fake_data', ...])`, or `%run train_resnet_mp.py --fake_data ...`.

Nothing of the run stays in the caller: absl parses the given flags (not the kernel's
argv), the replicas start from the script's file, the XLA runtime and the signal handlers
are the command's, so calling again (other flags, another script) works and the kernel is
as before when it returns. The output streams into the cell. "Interrupt kernel" is the
run's Ctrl-C: it stops after the current step with a checkpoint (interrupt again: at once)
and run() raises Stopped; the same call resumes. If the caller dies, the command gets
SIGTERM: a stop with a checkpoint, not a run going on unseen. The exceptions show as one
line in IPython, not a traceback.

Only the scripts' run() (and so %run) uses this module: copy it to call them so.
"""

import codecs
import collections
import ctypes
import json
import os
import selectors
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import fsspec

import utils

_prctl = ctypes.CDLL(None, use_errno=True).prctl  # Looked up here, not in the forked child.
PR_SET_PDEATHSIG = 1


class _OneLine:
  def _render_traceback_(self):  # What IPython shows instead of a traceback.
    return [f'{type(self).__name__}: {self}']


class UsageError(_OneLine, utils.UsageError):
  """Exit code 2: a bad flag or bad input, with the command's `error:` line."""


class Stopped(_OneLine, Exception):
  """Exit code 75 (SIGTERM) or 130 (Ctrl-C, an interrupted kernel): the run stopped after a
  step. .checkpoint is what it saved (None without --ckpt_dir or after a second interrupt):
  run the same call to go on. .results is what it wrote, if anything."""

  def __init__(self, message, code, checkpoint=None, results=None):
    super().__init__(message)
    self.code, self.checkpoint, self.results = code, checkpoint, results


class Failed(_OneLine, Exception):
  """Any other exit code (see the README): 21 below --target_accuracy (.results holds the
  run's), 22 diverged, 23 out of device memory, 1 a bug (its traceback is in the output above),
  128 + N killed by signal N."""

  def __init__(self, message, code, results=None):
    super().__init__(message)
    self.code, self.results = code, results


def run(script, argv):
  """Runs `python script *argv` (argv: a list of flags, or one string split as a shell would)
  with its output in this process's stdout and stderr; returns the results it wrote (see
  --results_json: a temporary file unless argv names one) or raises one of the above."""
  argv = shlex.split(argv) if isinstance(argv, str) else [str(arg) for arg in argv]
  with tempfile.TemporaryDirectory(prefix='run-') as temporary:
    results_json = _flag_value(argv, 'results_json')
    if results_json is None:
      results_json = os.path.join(temporary, 'results.json')
      argv += ['--results_json', results_json]
    started = time.time()
    code, lines = _stream([sys.executable, os.path.abspath(script), *argv])
    results = _read_results(results_json, started) if code in (0, 21, 75, 130) else None
  name = os.path.basename(script)
  said = [line for line in lines if line.startswith(('error: ', 'Stopped ', 'Accuracy '))]
  message = said[-1].removeprefix('error: ') if said else f'{name} ended before it said why'
  if code == 0:
    return results
  if code == 2:
    raise UsageError(message)
  if code in (utils.EXIT_PREEMPTED, utils.EXIT_INTERRUPTED):
    if not said:  # Stopped while it started: no step ran.
      message = f'{name} stopped before its first step (exit code {code}): nothing saved'
    raise Stopped(message, code, (results or {}).get('checkpoint'), results)
  raise Failed(f'{name} exited with code {code}: {message}', code, results)


def _flag_value(argv, name):
  """The value of --name in argv (the last one given, as absl takes it), or None."""
  value = None
  for index, arg in enumerate(argv):
    if arg == f'--{name}' and index + 1 < len(argv):
      value = argv[index + 1]
    elif arg.startswith(f'--{name}='):
      value = arg.split('=', 1)[1]
  return value


def _read_results(url, since):
  """The results file the run wrote, or None if it wrote none (an older one is not it)."""
  try:
    fs, path = fsspec.core.url_to_fs(url)
    try:
      if fs.modified(path).timestamp() < since - 1:
        return None
    except (NotImplementedError, AttributeError):
      pass  # A store without modification times: trust the file.
    with fs.open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _die_with_parent():
  """In the child before exec: SIGTERM when the caller's thread ends (a kernel killed or
  restarted), so that the run stops with a checkpoint instead of running on, unseen."""
  _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _stream(command):
  """Runs command in a session of its own, copying its output here as it comes; a
  KeyboardInterrupt here is a Ctrl-C there. Returns (exit code, the output's lines)."""
  process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True, preexec_fn=_die_with_parent,
                             env=dict(os.environ, PYTHONUNBUFFERED='1', **_interrupt_name()))
  selector = selectors.DefaultSelector()
  for pipe, out in ((process.stdout, sys.stdout), (process.stderr, sys.stderr)):
    decoder = codecs.getincrementaldecoder('utf-8')(errors='replace')
    selector.register(pipe, selectors.EVENT_READ, [out, decoder, ''])  # '': a partial line
  lines = collections.deque(maxlen=50)  # The last ones: what the exception says.
  try:
    return _copy_output(process, selector, lines), list(lines)
  finally:
    for pipe in (process.stdout, process.stderr):
      pipe.close()
    try:  # Whatever of the run is left (nothing, when it ended as it should).
      os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass


def _interrupt_name():
  """In a notebook the run's lines name the SIGINT after the kernel's Interrupt button."""
  return {'INTERRUPT_NAME': 'Interrupt'} if utils.in_notebook() else {}


def _copy_output(process, selector, lines):
  """Copies the command's output until it ends; returns its exit code."""
  while True:
    try:
      while selector.get_map():
        for key, _ in selector.select():
          out, decoder, partial = key.data
          data = os.read(key.fd, 1 << 16)
          if not data:
            lines.extend([partial] if partial else [])
            selector.unregister(key.fileobj)
            continue
          chunk = decoder.decode(data)
          out.write(chunk)
          out.flush()
          *done, key.data[2] = (partial + chunk).split('\n')
          lines.extend(line.rstrip('\r') for line in done)
      return process.wait()
    except KeyboardInterrupt:  # As a terminal does: SIGINT to the command's whole group,
      try:  # which says at once what it does.
        os.killpg(process.pid, signal.SIGINT)
      except ProcessLookupError:
        pass
