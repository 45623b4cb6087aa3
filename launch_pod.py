# SPDX-License-Identifier: BSD-3-Clause
"""Runs one command on every worker of a Cloud TPU pod slice (or of any hosts over ssh),
prints every worker's lines under its name, and stops the command everywhere on Ctrl-C,
SIGTERM or a failing worker: what xla_dist did before it was removed
with XRT, for today's TPU VMs.

  python launch_pod.py --tpu NAME --zone ZONE --env PJRT_DEVICE=TPU -- \
      .venv/bin/python train_resnet_mp.py --datadir /data/imagenet --bf16
  python launch_pod.py --hosts 10.0.0.2,10.0.0.3 -- .venv/bin/python train_resnet_spmd.py --fake_data

The command (the words after --, run as they are, without a shell) runs in --workdir on every
worker (by default the path of the folder the launcher runs in: the code must be there on
every worker) under a small watcher sent along in the ssh command, written for any python3:
it passes the launcher's orders (SIGTERM, SIGKILL) to the command's whole process group and
stops the command if the launcher goes away. Only Python and absl-py are needed where the
launcher runs, plus gcloud for --tpu.

Exit codes: 0 done on every worker; 75 stopped (Ctrl-C, SIGTERM or a preempted worker) and
every worker saved: run the same command to go on; 130 Ctrl-C during a stop, killed at once;
2 a bad flag, or a TPU that cannot be described; any other: the code of the first worker
that failed (255: ssh could not reach it or lost it), which the launcher names.
"""

import base64
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string('tpu', None, 'Cloud TPU VM name: its workers (from gcloud describe) run the command.')
flags.DEFINE_string('zone', None, 'Zone of --tpu (default: gcloud\'s compute/zone).')
flags.DEFINE_string('project', None, 'Project of --tpu (default: gcloud\'s).')
flags.DEFINE_bool('internal_ip', False, 'Reach the --tpu workers at their internal addresses '
                  '(from a VM in their network, worker 0 for instance).')
flags.DEFINE_list('hosts', None, 'Instead of --tpu: the workers, in order, as ssh destinations '
                  '(host, user@host or ssh://user@host:port).')
flags.DEFINE_multi_string('ssh_option', [], 'An ssh -o option for every worker, e.g. '
                          'IdentityFile=~/.ssh/pod_key (repeat the flag for more).')
flags.DEFINE_multi_string('env', [], 'NAME=VALUE in the command\'s environment on every worker '
                          '(repeat the flag for more).')
flags.DEFINE_string('workdir', None, 'Folder the command runs in on every worker (default: the '
                    'path of this one; a relative path starts at the worker\'s home folder).')
flags.DEFINE_float('grace_seconds', 120, 'After a stop\'s SIGTERM, seconds to save a checkpoint '
                   'before SIGKILL.', lower_bound=0)
flags.DEFINE_bool('kill_stale', False, 'First end, on every worker, the processes that hold the '
                  'TPU (left by an earlier run, they make the next one fail with "TPU in use").')
# --log_dir DIR (the flag absl.logging defines): also append each worker's lines to
# DIR/worker-N.log.
flags.DEFINE_list('tpu_devices', ['/dev/accel*', '/dev/vfio/*'],
                  'Device files (globs) whose holders --kill_stale ends.')

STOPPED = 75  # The training scripts' code for "stopped by SIGTERM, saved: run again to go on".
INTERRUPTED = 130
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
HINTS = {255: 'ssh could not reach it or lost the connection',
         75: 'stopped by SIGTERM and saved: maintenance or preemption',
         127: 'command not found there (the command, or python3 for the watcher)'}
SSH_DEFAULTS = ['BatchMode=yes', 'ConnectTimeout=30', 'ServerAliveInterval=15',
                'ServerAliveCountMax=4']  # A worker that goes silent ends its ssh in a minute.

# Runs on every worker: `python3 -c WATCHER WORKDIR GRACE DEVICES NAME=VALUE... -- COMMAND...`,
# with the launcher's orders (a signal name a line) on its standard input.
WATCHER = r'''
import glob, os, signal, subprocess, sys, threading, time
workdir, grace, devices, split = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv.index('--')

def holders(paths):
  found = {}
  for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
      fds = os.listdir(f'/proc/{pid}/fd')
    except OSError:  # Gone, or another user's.
      continue
    for fd in fds:
      try:
        if os.readlink(f'/proc/{pid}/fd/{fd}') in paths and int(pid) != os.getpid():
          found[int(pid)] = os.readlink(f'/proc/{pid}/fd/{fd}')
      except OSError:
        pass
  return found

def end_stale(paths):
  for sig in (signal.SIGTERM, signal.SIGKILL):
    for pid, device in holders(paths).items():
      try:  # It may end meanwhile (the children of one that did).
        with open(f'/proc/{pid}/cmdline', 'rb') as f:
          name = f.read().replace(b'\0', b' ').decode(errors='replace').strip()[:80]
        os.kill(pid, sig)
        print(f'kill_stale: {sig.name} to process {pid} ({name}), which held {device}', flush=True)
      except OSError:
        pass
    for _ in range(50):
      if not holders(paths):
        return
      time.sleep(0.1)
  sys.exit(f'kill_stale: {sorted(holders(paths))} still hold the TPU: end them as their owner')

def signal_job(sig):
  try:
    os.killpg(job.pid, sig)
  except (ProcessLookupError, PermissionError):
    pass

def obey():  # End of input: the launcher is gone; stop as it would have.
  for line in sys.stdin:
    signal_job(getattr(signal, line.strip()))
  signal_job(signal.SIGTERM)
  time.sleep(grace)
  signal_job(signal.SIGKILL)

def relay(out=sys.stdout.buffer):  # Keeps draining if ssh is gone, so the job can still save.
  for chunk in iter(lambda: os.read(job.stdout.fileno(), 65536), b''):
    try:
      out.write(chunk)
      out.flush()
    except OSError:
      pass

try:
  os.chdir(workdir)
except OSError as e:
  sys.exit(f'cannot enter {workdir} on this worker ({e.strerror}): put the code there, or give --workdir')
if devices:
  end_stale({path for pattern in devices.split(',') for path in glob.glob(pattern)})
env = dict(os.environ, PYTHONUNBUFFERED='1')
env.update(item.split('=', 1) for item in sys.argv[4:split])
try:
  job = subprocess.Popen(sys.argv[split + 1:], env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
except OSError as e:
  print(f'cannot run {sys.argv[split + 1]}: {e.strerror}', flush=True)
  sys.exit(127)
threading.Thread(target=obey, daemon=True).start()
output = threading.Thread(target=relay)
output.start()
code = job.wait()
signal_job(signal.SIGKILL)  # What the command left behind ends with it.
output.join(timeout=5)  # Unless a process that left the group holds the output open.
os._exit(code if code >= 0 else 128 - code)
'''


class UsageError(Exception):
  """A mistake the user can fix: one `error:` line, exit code 2."""


class Worker:
  """One worker: the ssh (or gcloud) command that reaches it, and what became of it."""

  def __init__(self, index, address, ssh):
    self.index, self.address, self.ssh = index, address, ssh
    self.process = self.code = None

  def __str__(self):
    return f'worker {self.index} ({self.address})'

  def start(self, remote, log, lock, events):
    # A session of its own: the terminal's Ctrl-C reaches the launcher alone, which decides.
    self.process = subprocess.Popen(self.ssh + [remote], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    threading.Thread(target=self._print, args=(log, lock, events), daemon=True).start()

  def _print(self, log, lock, events):
    # Signals go to the main thread, which they wake: delivered here, they would wait for
    # its next timeout, and two Ctrl-C within it would count as one.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    prefix = f'[worker {self.index}] '.encode()
    try:
      for line in self.process.stdout:
        line = line if line.endswith(b'\n') else line + b'\n'
        with lock:
          try:
            sys.stdout.buffer.write(prefix + line)
            sys.stdout.flush()
          except OSError:  # Our output is gone (a closed pipe): the workers go on.
            pass
        try:
          if log:
            log.write(line)
            log.flush()
        except OSError as e:  # A full disk: the run goes on, printed only.
          say(f'cannot write {log.name} ({e.strerror}): worker {self.index} no longer logged')
          log = None
    finally:
      code = self.process.wait()
      self.code = code if code >= 0 else 128 - code  # Its ssh killed by signal -code.
      events.put(self)

  def order(self, signal_name):
    try:
      self.process.stdin.write(f'{signal_name}\n'.encode())
      self.process.stdin.flush()
    except OSError:  # Its ssh has ended.
      pass

  def kill_ssh(self):
    try:
      os.killpg(self.process.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass


def gcloud_tpu(tpu, zone, project):
  return (['gcloud', 'compute', 'tpus', 'tpu-vm'], [tpu] + (['--zone', zone] if zone else []) +
          (['--project', project] if project else []))


def describe_command(tpu, zone, project):
  command, where = gcloud_tpu(tpu, zone, project)
  return command + ['describe'] + where + ['--format', 'json']


def tpu_workers(describe_output, tpu, zone, project, internal_ip, ssh_options):
  """The workers of a `describe --format json` output, each reached by `gcloud ... ssh
  --worker=N`, which knows the keys (and OS Login) of the project."""
  try:
    info = json.loads(describe_output)
  except ValueError:
    raise UsageError(f'gcloud describe of TPU {tpu} printed no JSON: '
                     f'{describe_output[:200]!r}') from None
  if info.get('state', 'READY') != 'READY':
    raise UsageError(f'TPU {tpu} is {info["state"]}, not READY: wait for it, or recreate it')
  endpoints = info.get('networkEndpoints') or []
  if not endpoints:
    raise UsageError(f'TPU {tpu} lists no workers (networkEndpoints): is it still being created?')
  command, where = gcloud_tpu(tpu, zone, project)
  options = [f'--ssh-flag=-o {option}' for option in ssh_options + SSH_DEFAULTS[2:]]
  workers = []
  for index, endpoint in enumerate(endpoints):
    external = endpoint.get('accessConfig', {}).get('externalIp')
    address = endpoint['ipAddress'] if internal_ip or not external else external
    ssh = command + ['ssh'] + where + [f'--worker={index}', '--quiet'] + options
    workers.append(Worker(index, address, ssh + ['--internal-ip'] * internal_ip + ['--command']))
  return workers


def check_gcloud_key():
  # N gclouds started at once would each try to create and propagate it.
  if not os.path.exists(os.path.expanduser('~/.ssh/google_compute_engine')):
    raise UsageError('no gcloud ssh key yet (~/.ssh/google_compute_engine): run gcloud compute '
                     'tpus tpu-vm ssh NAME --zone ZONE --worker=all --command true once first')


def describe(tpu, zone, project):
  try:
    done = subprocess.run(describe_command(tpu, zone, project), capture_output=True, text=True,
                          timeout=300)
  except FileNotFoundError:
    raise UsageError('gcloud not found: install the Google Cloud CLI, or name the workers with '
                     '--hosts') from None
  except subprocess.TimeoutExpired:
    raise UsageError(f'gcloud did not describe TPU {tpu} within 300 s: check the network and '
                     'gcloud auth list') from None
  if done.returncode:
    last = (done.stderr.strip().splitlines() or ['no message'])[-1]
    raise UsageError(f'cannot describe TPU {tpu}: {last}')
  return done.stdout


def host_workers(hosts, ssh_options):
  if not all(hosts):
    raise UsageError(f'--hosts {",".join(hosts)} has an empty name')
  if not shutil.which('ssh'):
    raise UsageError('ssh not found: install the OpenSSH client')
  options = [arg for option in ssh_options + SSH_DEFAULTS for arg in ('-o', option)]
  return [Worker(index, host, ['ssh'] + options + [host]) for index, host in enumerate(hosts)]


def remote_command(workdir, grace, devices, env, command):
  # One line, in base64: any login shell (csh too) passes it on unchanged.
  code = f'import base64; exec(base64.b64decode("{base64.b64encode(WATCHER.encode()).decode()}"))'
  watcher = ['python3', '-c', code, workdir, str(grace), ','.join(devices), *env, '--', *command]
  return 'exec ' + shlex.join(watcher)


def check_flags(command):
  if bool(FLAGS.tpu) == bool(FLAGS.hosts):
    raise UsageError('give the workers: --tpu NAME (with --zone) or --hosts HOST,HOST,...')
  if not command:
    raise UsageError('give the command after --, e.g. launch_pod.py --hosts h1,h2 -- python3 '
                     'train_resnet_mp.py --fake_data')
  for item in FLAGS.env:
    if not re.fullmatch(r'[A-Za-z_]\w*=.*', item, re.S):
      raise UsageError(f'--env {item!r} is not NAME=VALUE')


def open_logs(log_dir, count, command):
  if not log_dir:
    return [None] * count
  try:
    os.makedirs(log_dir, exist_ok=True)
    logs = [open(os.path.join(log_dir, f'worker-{index}.log'), 'ab') for index in range(count)]
  except OSError as e:
    raise UsageError(f'cannot write worker logs in --log_dir {log_dir} ({e.strerror}): give a '
                     'writable folder') from None
  started = f'=== {time.strftime("%Y-%m-%d %H:%M:%S")} launch_pod: {shlex.join(command)}\n'
  for log in logs:
    log.write(started.encode())
  return logs


def say(message):
  try:
    print(f'launch_pod: {message}', file=sys.stderr, flush=True)
  except OSError:  # A closed terminal or pipe: the workers matter more than the message.
    pass


def names(workers):
  return ', '.join(str(worker.index) for worker in sorted(workers, key=lambda w: w.index))


def run(workers, remote, logs, grace):
  """Starts the command on every worker and watches it; returns the launcher's exit code."""
  events = queue.SimpleQueue()  # Worker that ended, or signal number; put() is signal-safe.
  for signum in STOP_SIGNALS:
    if signal.getsignal(signum) != signal.SIG_IGN:  # Under nohup a closed terminal is no stop.
      signal.signal(signum, lambda signum, frame: events.put(signum))
  lock = threading.Lock()
  for worker, log in zip(workers, logs):
    worker.start(remote, log, lock, events)
  running, failed, signalled, at_once = set(workers), None, None, False
  stop_at = kill_at = end_ssh_at = None
  while running:
    now = time.monotonic()
    if kill_at and now >= kill_at:
      say(f'workers {names(running)} still running {grace:g} s after SIGTERM: SIGKILL')
      order(running, 'SIGKILL')
      kill_at, end_ssh_at = None, now + 10
    if end_ssh_at and now >= end_ssh_at:  # Orders no longer arrive: cut the connections.
      for worker in running:
        worker.kill_ssh()
      end_ssh_at = None
    try:
      event = events.get(timeout=min([t for t in (kill_at, end_ssh_at) if t] + [now + 1]) - now)
    except queue.Empty:
      continue
    if isinstance(event, Worker):
      running.discard(event)
      if event.code and not failed and not stop_at:
        failed = event
        hint = f' ({HINTS[event.code]})' if event.code in HINTS else ''
        say(f'{event} exited with code {event.code}{hint}: stopping the others')
    elif stop_at and event == signal.SIGINT:  # Ctrl-C during a stop: no more waiting.
      say('SIGINT during the stop: SIGKILL to the command on every worker')
      order(running, 'SIGKILL')
      at_once, kill_at, end_ssh_at = True, None, now + 5
    elif stop_at:
      say(f'{signal.Signals(event).name}: already stopping (Ctrl-C: SIGKILL at once)')
    else:
      signalled = event
      say(f'{signal.Signals(event).name}: SIGTERM to the command on every worker, SIGKILL in '
          f'{grace:g} s (Ctrl-C again: at once)')
    if (failed or signalled) and not stop_at:
      order(running, 'SIGTERM')
      stop_at, kill_at = now, now + grace
  return outcome(workers, failed, at_once)


def order(workers, signal_name):
  for worker in workers:
    worker.order(signal_name)


def outcome(workers, failed, at_once):
  """The launcher's exit code, said in a line. A worker's own 75 (its VM's maintenance or
  preemption) is a stop like the launcher's."""
  if at_once:
    code = failed.code if failed and failed.code != STOPPED else INTERRUPTED
    say(f'killed at once (exit code {code})')
    return code
  if failed and failed.code != STOPPED:
    say(f'{failed} failed with exit code {failed.code}; every worker has ended')
    return failed.code
  for worker in workers:
    if worker.code not in (0, STOPPED):
      say(f'{worker} exited with code {worker.code} after the stop')
      return worker.code
  if any(worker.code == STOPPED for worker in workers):
    say(f'stopped on every worker: run the same command to go on (exit code {STOPPED})')
    return STOPPED
  say(f'done on {len(workers)} workers')
  return 0


def main(argv):
  command = argv[1:]
  try:
    check_flags(command)
    if FLAGS.tpu:
      try:
        output = describe(FLAGS.tpu, FLAGS.zone, FLAGS.project)
      except KeyboardInterrupt:
        say(f'Ctrl-C while describing {FLAGS.tpu}: nothing started')
        return INTERRUPTED
      check_gcloud_key()
      workers = tpu_workers(output, FLAGS.tpu, FLAGS.zone, FLAGS.project, FLAGS.internal_ip,
                            FLAGS.ssh_option)
    else:
      workers = host_workers(FLAGS.hosts, FLAGS.ssh_option)
    logs = open_logs(FLAGS.log_dir, len(workers), command)
  except UsageError as e:
    print(f'error: {e}', file=sys.stderr, flush=True)
    return 2
  devices = FLAGS.tpu_devices if FLAGS.kill_stale else []
  remote = remote_command(FLAGS.workdir or os.getcwd(), FLAGS.grace_seconds, devices,
                          FLAGS.env, command)
  say(f'{shlex.join(command)} on {len(workers)} workers: '
      + ', '.join(f'{w.index}={w.address}' for w in workers))
  return run(workers, remote, logs, FLAGS.grace_seconds)


def parse_flags(argv):
  try:
    return FLAGS(argv)
  except flags.Error as e:
    print(f'error: {e} (see --helpshort)', file=sys.stderr, flush=True)
    sys.exit(2)


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
