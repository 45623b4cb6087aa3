# SPDX-License-Identifier: BSD-3-Clause
"""Stops and failures of the processes of a run: SIGTERM (a TPU VM's notice of maintenance
or preemption) and Ctrl-C become a stop after the current step, a second Ctrl-C ends the
run at once, and a replica that fails ends the others instead of leaving them waiting in a
collective. Only a script's `main`, `_mp_fn` and `__mp_main__` block use this module.

Under torchrun or a launcher of your own, which passes signals on and ends the other
workers itself, a copied script can do without it: take out its import, the `with
supervision...:` lines (and unindent what they hold) and the `__mp_main__` block, and pass
`lambda: 0` (no stop is ever asked for) where `supervision.stop_signal` is passed.
"""

import collections
import concurrent.futures
import contextlib
import io
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
import traceback

import torch_xla.runtime as xr

import utils

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# The first SIGTERM or SIGINT this process got, or 0. A plain value: a handler takes no
# lock, since a second signal (a launcher passing one on) can run it inside the first.
_stop_signal = 0
_wakeup = None  # In a replica: the pipe's end to read signals from (see stop_on_signals).
_replicas = {}  # pid: multiprocessing.Process of every replica seen, alive or not.
_ending = threading.RLock()  # Held by the thread that ends the run (a handler may re-enter).


def stop_signal():
  """The first stop signal this process got (SIGTERM or SIGINT), or 0."""
  global _stop_signal
  if not _stop_signal and _wakeup is not None:
    try:  # What arrived while the main thread, which runs handlers, was blocked.
      arrived = [signum for signum in os.read(_wakeup, 64) if signum in STOP_SIGNALS]
    except BlockingIOError:
      arrived = []
    _stop_signal = _stop_signal or (arrived[0] if arrived else 0)
  return _stop_signal


def stop_on_signals():
  """In a replica: SIGTERM and SIGINT become a request to stop after the current step. Only
  a main thread may install a handler, so a replica calls this while it imports the script.
  A replica trains in a thread of torch_xla's while its main thread waits in a lock, where a
  handler runs only if the kernel delivered the signal to that very thread: stop_signal
  also reads the wakeup pipe Python writes every signal to, from whichever thread got it."""
  global _wakeup
  whole_lines()
  wakeup_read, wakeup_write = os.pipe()
  os.set_blocking(wakeup_read, False)
  os.set_blocking(wakeup_write, False)
  for signum in STOP_SIGNALS:
    signal.signal(signum, _on_stop_signal)
  signal.set_wakeup_fd(wakeup_write)
  _wakeup = wakeup_read


def whole_lines():
  """Each line this process prints reaches the terminal, log or notebook in one write, so
  that a line of another replica or thread cannot land inside it. With PYTHONUNBUFFERED=1
  (common in containers and notebooks) print writes the text and its newline separately."""
  for stream in (sys.stdout, sys.stderr):
    if isinstance(stream, io.TextIOWrapper):
      stream.reconfigure(line_buffering=True, write_through=False)


def _on_stop_signal(signum, frame):
  global _stop_signal
  _stop_signal = _stop_signal or signum


@contextlib.contextmanager
def run_watched(launcher, saving):
  """In the process the user started, around the run: a thread of its own takes SIGTERM and
  SIGINT, so that it acts at once even while the main thread is busy in XLA (compiling,
  say). The first asks for a stop after the current step, a second Ctrl-C ends the run at
  once. A launcher passes them on to its replicas (`kill PID` reaches it alone), and the
  same thread watches them: torch_xla.launch waits for replica 0 first, and would wait
  forever for a run whose other replica failed, so when one ends with an error or a signal
  (the OOM killer's, say) the thread kills the others and their loader workers and exits
  with that code (128 + N for signal N). saving: whether a stop saves a checkpoint (the
  line the first signal prints at once says so)."""
  whole_lines()
  wakeup_read, wakeup_write = os.pipe()
  os.set_blocking(wakeup_write, False)
  for signum in STOP_SIGNALS:
    signal.signal(signum, lambda signum, frame: None)  # The watch thread acts on them.
  signal.set_wakeup_fd(wakeup_write)
  threading.Thread(target=_watch, args=(wakeup_read, launcher, saving), daemon=True).start()
  try:
    yield
  except concurrent.futures.process.BrokenProcessPool:  # A replica died: the watch says how.
    for _ in range(50):
      _check_replicas()
      time.sleep(0.1)
    _end_run(1, 'error: a replica process ended abruptly; ended the other replicas')
  finally:
    end_loader_workers()


def _watch(wakeup, launcher, saving):
  global _stop_signal
  while True:
    if select.select([wakeup], [], [], 0.2)[0]:
      for signum in os.read(wakeup, 64):
        if signum == signal.SIGINT and _stop_signal:
          _end_run(utils.EXIT_INTERRUPTED, f'Stopped at once by a second {utils.INTERRUPT}: nothing '
                   f'saved since the last checkpoint (exit code {utils.EXIT_INTERRUPTED})')
        first, _stop_signal = not _stop_signal, _stop_signal or signum
        if launcher:  # To the replicas, started or starting; multiprocessing's resource
          # tracker, the other child, ignores both.
          replicas = _children_of()[os.getpid()]
          if not replicas:  # None has started: nothing to save, and none may start now.
            _end_run(128 + signum, None)
          for pid in replicas:
            os.kill(pid, signum)
        if first:  # At once: the step and the save can take a minute, said or not.
          again = f'{utils.INTERRUPT} again to end at once'
          sys.stdout.write('Stopping after this step ' + (  # One write: a whole line.
              f'and saving ({again} without saving)\n' if saving
              else f'(nothing is saved without --ckpt_dir; {again})\n'))
          sys.stdout.flush()
    if launcher:
      _check_replicas()


@contextlib.contextmanager
def replica():
  """Around a replica's work (in _mp_fn): the replica exits when its launcher is gone (one
  killed by SIGKILL cannot stop its replicas, which would hold the TPU), and an exception
  ends it at once after one `error:` line (exit code 2) or, for a bug, a traceback (exit
  code 1), so that the launcher sees it and ends the others, which would wait in their
  next collective forever (pytorch/xla#7974)."""
  launcher = multiprocessing.parent_process()
  if launcher is not None:
    threading.Thread(target=lambda: launcher.join() or os._exit(128 + signal.SIGKILL),
                     daemon=True).start()
  try:
    yield
  except Exception as error:
    replica_failed(error)
  finally:
    end_loader_workers()


def replica_failed(error):
  """Ends this replica at once, saying why (see replica)."""
  said = isinstance(error, (utils.UsageError, utils.BadDataError))
  # The error is the last thing of this replica a user reads: its log thread may still be
  # printing the last steps' lines.
  sys.stdout.flush()
  os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
  if said:
    where = f'replica {xr.global_ordinal()}: ' if xr.world_size() > 1 else ''
    print(f'error: {where}{error}', file=sys.stderr, flush=True)
  else:
    traceback.print_exception(error)
  end_loader_workers()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(2 if said else 1)


def _check_replicas():
  for process in multiprocessing.active_children():
    _replicas.setdefault(process.pid, process)
  ended = [(pid, process.exitcode) for pid, process in _replicas.items()
           if process.exitcode not in (None, 0)]
  # First one that said why in its `error:` line, last those that the pool, once broken,
  # ended with SIGTERM (replicas still importing have no handler for it yet).
  for pid, code in sorted(ended, key=lambda ended: (ended[1] != 2, ended[1] == -signal.SIGTERM)):
    if code == 2:
      _end_run(2, None)
    if _stop_signal:  # During a stop: one still importing dies of the signal, say.
      name, stop_code = utils.record_stop({}, _stop_signal, 0)
      _end_run(stop_code, f'Stopped by {name}: replica process {pid} ended before it saved '
               f'anything; run the same command to go on from the last checkpoint (exit code '
               f'{stop_code})')
    cause = f'was killed by {signal.Signals(-code).name}' if code < 0 else f'failed (exit code {code})'
    _end_run(128 - code if code < 0 else code,
             f'error: replica process {pid} {cause}; ended the other replicas')


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


def end_loader_workers():
  """Kills this process's loader workers still alive: they ignore the SIGTERM that
  multiprocessing's exit sends before waiting for them (see utils.ignore_stop_signals)."""
  for process in multiprocessing.active_children():
    process.kill()
    process.join()
