# SPDX-License-Identifier: BSD-3-Clause
r"""Runs one command on every worker of a Cloud TPU pod slice (or of any hosts over ssh),
prints every worker's lines under its name, and stops the command everywhere on Ctrl-C,
SIGTERM or a failing worker: what xla_dist did before it was removed
with XRT, for today's TPU VMs.

  python3 launch_pod.py --tpu NAME --zone ZONE --workdir refs --env PJRT_DEVICE=TPU -- \
      .venv/bin/python train_resnet_mp.py --datadir /data/imagenet --bf16
  python3 launch_pod.py --hosts 10.0.0.2,10.0.0.3 --workdir refs -- \
      .venv/bin/python train_resnet_spmd.py --fake_data

The command (the words after --, run as they are, without a shell) runs in --workdir on every
worker (by default the path of the folder the launcher runs in: the code must be there on
every worker) under a small watcher sent along in the ssh command, written for any python3:
it passes the launcher's orders (SIGTERM, SIGKILL) to the command's whole process group and
stops the command if the launcher goes away. Each worker's command knows its index
(LAUNCH_POD_WORKER, and {worker} in its words). With --restarts N, a worker's own stop (75:
maintenance, preemption) or a lost worker (255) starts the command again everywhere, up to
N times, once every worker answers again. Only Python and absl-py are needed where the
launcher runs, plus gcloud for --tpu.

Exit codes (with --restarts, the last start's): 0 done on every worker; 75 stopped (Ctrl-C,
SIGTERM or a preempted worker) and every worker saved: run the same command to go on; 130
Ctrl-C during a stop, killed at once; 2 a bad flag, absl-py missing, or a TPU that cannot be
described; any other: the code of the first worker that failed (255: ssh could not reach it
or lost it), which the launcher names.
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

try:
  from absl import app, flags
except ImportError:  # Run by a Python other than the project's venv, say.
  print(f'error: launch_pod.py needs absl-py, which {sys.executable} does not have: run '
        f'{sys.executable} -m pip install absl-py, or run it with the venv\'s python',
        file=sys.stderr)
  sys.exit(2)

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
                  'TPU (left by an earlier run, they make the next one fail with "TPU in use"), '
                  'and remove the TPU runtime\'s lock file if nothing holds it.')
flags.DEFINE_integer('restarts', 0, 'Start the command again on every worker, up to N times, when '
                     'a worker stopped and saved on its own (exit 75: maintenance, preemption) or '
                     'was lost (255).', lower_bound=0)
flags.DEFINE_float('restart_wait', 600, 'Before a restart, seconds to wait for every worker to '
                   'answer ssh (--tpu: to be READY) with nothing of the last run left.',
                   lower_bound=0)
flags.DEFINE_bool('timestamps', False, 'Also show the local time each line arrived.')
# absl.logging defines --log_dir; here it means: also append each worker's lines to
# DIR/worker-N.log. Declared a key flag of this file, so that --helpshort lists it.
flags.declare_key_flag('log_dir')
FLAGS['log_dir'].help = 'Also append each worker\'s lines to DIR/worker-N.log.'
flags.DEFINE_list('tpu_devices', ['/dev/accel*', '/dev/vfio/*'],
                  'Device files (globs) whose holders --kill_stale ends.')
flags.DEFINE_string('tpu_lockfile', '/tmp/libtpu_lockfile', 'The TPU runtime\'s lock file, which '
                    '--kill_stale removes when no process holds it.')

STOPPED = 75  # The training scripts' code for "stopped by SIGTERM, saved: run again to go on".
LOST = 255  # ssh's code when it cannot reach a host or loses the connection.
INTERRUPTED = 130
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
HINTS = {LOST: 'ssh could not reach it or lost the connection',
         75: 'stopped by SIGTERM and saved: maintenance or preemption',
         127: 'command not found there (the command, or python3 for the watcher)'}
SSH_DEFAULTS = ['BatchMode=yes', 'ConnectTimeout=30', 'ServerAliveInterval=15',
                'ServerAliveCountMax=4']  # A worker that goes silent ends its ssh in a minute.

# Runs on every worker: `python3 -c WATCHER WORKDIR GRACE DEVICES LOCKFILE NAME=VALUE... --
# COMMAND...`, with the launcher's orders (a signal name a line) on its standard input.
WATCHER = r'''
import glob, os, signal, subprocess, sys, threading, time
workdir, grace, devices, lockfile = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
split = sys.argv.index('--')

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

def command_line(pid):
  with open(f'/proc/{pid}/cmdline', 'rb') as f:
    return f.read().replace(b'\0', b' ').decode(errors='replace').strip()[:80]

def end_stale(paths):
  for sig in (signal.SIGTERM, signal.SIGKILL):
    for pid, device in holders(paths).items():
      try:  # It may end meanwhile (the children of one that did).
        name = command_line(pid)
        os.kill(pid, sig)
        print(f'kill_stale: {sig.name} to process {pid} ({name}), which held {device}', flush=True)
      except OSError:
        pass
    for _ in range(50):
      if not holders(paths):
        return
      time.sleep(0.1)
  sys.exit(f'kill_stale: {sorted(holders(paths))} still hold the TPU: end them as their owner')

def free_lockfile(path):  # Left by a run that died, it makes the next one fail to start.
  held = holders({os.path.realpath(path)}) if os.path.exists(path) else None
  if held:
    pid = min(held)
    print(f'kill_stale: kept {path}: process {pid} ({command_line(pid)}) holds it', flush=True)
  elif held is not None:
    try:
      os.remove(path)
      print(f'kill_stale: removed {path}, which no process held', flush=True)
    except FileNotFoundError:  # Another worker on the same machine was first.
      pass

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
if lockfile:
  free_lockfile(lockfile)
env = dict(os.environ, PYTHONUNBUFFERED='1')
env.update(item.split('=', 1) for item in sys.argv[5:split])
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

# Runs on every worker before a restart: `python3 -c WAITER MARK SECONDS` waits until no
# process of the last start (MARK=LAUNCH_POD_RUN=id in its environment) is left, such as
# the command of a worker whose connection was lost, which its watcher stops on its own.
WAITER = r'''
import os, sys, time
mark, deadline = sys.argv[1].encode(), time.time() + float(sys.argv[2])
def left():
  pids = []
  for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
      with open(f'/proc/{pid}/environ', 'rb') as f:
        if mark in f.read().split(b'\0'):
          pids.append(pid)
    except OSError:
      pass
  return pids
while left() and time.time() < deadline:
  time.sleep(0.5)
if left():
  sys.exit(f'processes {" ".join(left())} of the last start still run')
'''


class UsageError(Exception):
  """A mistake the user can fix: one `error:` line, exit code 2."""


class Worker:
  """One worker: the ssh (or gcloud) command that reaches it, and what became of it."""

  def __init__(self, index, address, ssh):
    self.index, self.address, self.ssh = index, address, ssh
    self.process = self.code = None
    self.unknown_host_key = False

  def __str__(self):
    return f'worker {self.index} ({self.address})'

  def start(self, remote, log, lock, events, timestamps):
    # A session of its own: the terminal's Ctrl-C reaches the launcher alone, which decides.
    self.process = subprocess.Popen(self.ssh + [remote], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    self.code, self.unknown_host_key = None, False
    threading.Thread(target=self._print, args=(log, lock, events, timestamps), daemon=True).start()

  def _print(self, log, lock, events, timestamps):
    # Signals go to the main thread, which they wake: delivered here, they would wait for
    # its next timeout, and two Ctrl-C within it would count as one.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
      for line in lines_of(self.process.stdout):
        self.unknown_host_key |= line.startswith(b'Host key verification failed')
        stamp = time.strftime('%H:%M:%S ').encode() if timestamps else b''
        with lock:
          try:
            sys.stdout.buffer.write(f'[worker {self.index}] '.encode() + stamp + line)
            sys.stdout.flush()
          except OSError:  # Our output is gone (a closed pipe): the workers go on.
            pass
        try:
          if log:
            log.write(stamp + line)
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


def lines_of(stream):
  """The lines of a byte stream as they come, each ending in a newline. A piece that ends in
  a carriage return (a progress bar's update) is a line of its own, shown at once."""
  pending, after_return = b'', False
  for chunk in iter(lambda: stream.read1(65536), b''):
    if after_return and chunk.startswith(b'\n'):  # The rest of a \r\n.
      chunk = chunk[1:]
    pieces = re.split(rb'(\r\n|\n|\r)', pending + chunk)
    for text in pieces[0:-1:2]:
      yield text + b'\n'
    pending, after_return = pieces[-1], len(pieces) > 1 and pieces[-2] == b'\r' and not pieces[-1]
  if pending:
    yield pending + b'\n'


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
  for host in hosts:
    if host.startswith('-'):  # ssh would read it as an option of its own.
      raise UsageError(f'--hosts names {host!r}, not a host: give host, user@host or '
                       'ssh://user@host:port')
  if not shutil.which('ssh'):
    raise UsageError('ssh not found: install the OpenSSH client')
  options = [arg for option in ssh_options + SSH_DEFAULTS for arg in ('-o', option)]
  return [Worker(index, host, ['ssh'] + options + [host]) for index, host in enumerate(hosts)]


def remote_python(program, *args):
  """A shell command line that runs program with python3 on a worker: one line, in base64,
  which any login shell (csh too) passes on unchanged."""
  code = f'import base64; exec(base64.b64decode("{base64.b64encode(program.encode()).decode()}"))'
  return 'exec ' + shlex.join(['python3', '-c', code, *map(str, args)])


def remote_commands(workers, start_id, stale, env, command):
  """{worker: the command line that runs the command on it, under the watcher}. Each worker
  knows its index (LAUNCH_POD_WORKER, and {worker} in the command's words) and the start it
  belongs to (LAUNCH_POD_RUN). stale: (device globs, lock file) to free first, or None."""
  devices, lockfile = stale or ([], '')
  identity = [f'LAUNCH_POD_NUM_WORKERS={len(workers)}', f'LAUNCH_POD_RUN={start_id}']
  return {worker: remote_python(
      WATCHER, FLAGS.workdir or os.getcwd(), FLAGS.grace_seconds, ','.join(devices), lockfile,
      *env, *identity, f'LAUNCH_POD_WORKER={worker.index}', '--',
      *(word.replace('{worker}', str(worker.index)) for word in command)) for worker in workers}


def check_flags(command):
  if bool(FLAGS.tpu) == bool(FLAGS.hosts):
    raise UsageError('give the workers: --tpu NAME (with --zone) or --hosts HOST,HOST,...')
  if not command:
    raise UsageError('give the command after --, e.g. launch_pod.py --hosts h1,h2 -- python3 '
                     'train_resnet_mp.py --fake_data')
  for item in FLAGS.env:
    if not re.fullmatch(r'[A-Za-z_]\w*=.*', item, re.S):
      raise UsageError(f'--env {item!r} is not NAME=VALUE')
  for option in FLAGS.ssh_option:
    if option.startswith('-'):  # ssh refuses it, on every worker: one line here instead.
      raise UsageError(f'--ssh_option {option!r} is not an ssh -o option: give KEY=VALUE, e.g. '
                       'IdentityFile=~/.ssh/pod_key')


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


def start_all(workers, remotes, logs):
  """Starts the command on every worker; returns the queue of what the watch acts on: each
  worker that ended, and each stop signal's number (put() is signal-safe)."""
  events = queue.SimpleQueue()
  for signum in STOP_SIGNALS:
    if signal.getsignal(signum) != signal.SIG_IGN:  # Under nohup a closed terminal is no stop.
      signal.signal(signum, lambda signum, frame: events.put(signum))
  lock = threading.Lock()
  for worker, log in zip(workers, logs):
    worker.start(remotes[worker], log, lock, events, FLAGS.timestamps)
  return events


def run(workers, remotes, logs, grace):
  """Starts the command on every worker and watches it; returns the launcher's exit code and
  the worker whose end may be retried (stopped and saved on its own, or lost), or None."""
  events = start_all(workers, remotes, logs)
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
        if event.unknown_host_key:
          say(f'ssh does not know the host key of {event}: pass --ssh_option '
              'StrictHostKeyChecking=accept-new, or connect to it once by hand')
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
  code = outcome(workers, failed, at_once)
  retry = (failed and not signalled and not at_once and code in (STOPPED, LOST) and
           not failed.unknown_host_key)
  return code, failed if retry else None


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


class Interrupted(Exception):
  """A stop signal while no command runs: args[0] is its number."""


def interrupt(signum, frame):
  raise Interrupted(signum)


def find_workers():
  if FLAGS.tpu:
    output = describe(FLAGS.tpu, FLAGS.zone, FLAGS.project)
    check_gcloud_key()
    return tpu_workers(output, FLAGS.tpu, FLAGS.zone, FLAGS.project, FLAGS.internal_ip,
                       FLAGS.ssh_option)
  return host_workers(FLAGS.hosts, FLAGS.ssh_option)


def unready(workers, last_start, seconds):
  """{worker: why} of the workers that do not answer ssh, or still run something of the last
  start after up to `seconds` (a lost worker's command, which its watcher is stopping)."""
  probes = {worker: subprocess.Popen(
      worker.ssh + [remote_python(WAITER, f'LAUNCH_POD_RUN={last_start}', seconds)],
      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      start_new_session=True) for worker in workers}
  try:
    answers = {worker: probe.communicate()[0] for worker, probe in probes.items()}
  finally:  # Interrupted: no probe outlives the launcher.
    for probe in probes.values():
      if probe.poll() is None:
        os.killpg(probe.pid, signal.SIGKILL)
  return {worker: (answers[worker].decode(errors='replace').strip().splitlines() or ['no answer'])[-1]
          for worker, probe in probes.items() if probe.returncode}


def ready_workers(workers, last_start, seconds):
  """The workers to start again on, once every one answers ssh with nothing of the last start
  left on it (--tpu: once the TPU is READY, its workers described anew), or None after
  `seconds`. A stop signal meanwhile raises Interrupted."""
  for signum in STOP_SIGNALS:
    if signal.getsignal(signum) != signal.SIG_IGN:  # nohup's SIGHUP stays ignored.
      signal.signal(signum, interrupt)
  deadline, said = time.monotonic() + seconds, False
  while True:
    try:
      workers = find_workers() if FLAGS.tpu else workers
      waiting = unready(workers, last_start, max(0, min(deadline - time.monotonic(), 60)))
      problem = '; '.join(f'{worker}: {why}' for worker, why in waiting.items())
    except UsageError as e:  # The TPU is not READY, or gcloud cannot say.
      problem = str(e)
    if not problem:
      return workers
    if time.monotonic() >= deadline:
      say(f'gave up restarting after {seconds:g} s: {problem}')
      return None
    if not said:
      say(f'waiting until every worker answers with nothing of the last start left (up to '
          f'{seconds:g} s): {problem}')
      said = True
    time.sleep(min(5, max(0, deadline - time.monotonic())))


def main(argv):
  command = argv[1:]
  try:
    check_flags(command)
    try:
      workers = find_workers()
    except KeyboardInterrupt:
      say(f'Ctrl-C while describing {FLAGS.tpu}: nothing started')
      return INTERRUPTED
    logs = open_logs(FLAGS.log_dir, len(workers), command)
  except UsageError as e:
    print(f'error: {e}', file=sys.stderr, flush=True)
    return 2
  say(f'{shlex.join(command)} on {len(workers)} workers: '
      + ', '.join(f'{w.index}={w.address}' for w in workers))
  stale = (FLAGS.tpu_devices, FLAGS.tpu_lockfile)
  starts = [f'{os.getpid()}.{time.time_ns()}.{n}' for n in range(FLAGS.restarts + 1)]
  code, cause = run(workers, remote_commands(workers, starts[0], stale if FLAGS.kill_stale else None,
                                             FLAGS.env, command), logs, FLAGS.grace_seconds)
  for restart in range(1, FLAGS.restarts + 1):
    if cause is None:
      break
    say(f'restart {restart} of {FLAGS.restarts} ({cause} exited {cause.code}: '
        f'{"stopped and saved" if cause.code == STOPPED else "lost"})')
    try:
      workers = ready_workers(workers, starts[restart - 1], FLAGS.restart_wait)
    except Interrupted as e:
      say(f'{signal.Signals(e.args[0]).name} while waiting to restart: nothing started (exit '
          f'code {128 + e.args[0]})')
      return 128 + e.args[0]
    if workers is None:
      return code
    # What the last start left (a lost worker's TPU, say) would fail this one: freed first.
    code, cause = run(workers, remote_commands(workers, starts[restart], stale, FLAGS.env, command),
                      logs, FLAGS.grace_seconds)
  return code


def check_values_given(argv):
  """An unquoted empty variable (`--hosts $HOSTS`, HOSTS unset) leaves no word: absl would
  take the next one, a flag or the `--` before the command, for the flag's value."""
  for word, value in zip(argv[1:], argv[2:]):
    if word == '--':
      return
    name = re.fullmatch(r'--?([^=]+)', word)
    if (name and name[1] in FLAGS and not FLAGS[name[1]].boolean and value.startswith('-')
        and not re.match(r'-\.?\d', value)):  # A negative number is a value.
      raise UsageError(f'--{name[1]} is followed by {value}, not by a value (an unquoted variable '
                       f'that is empty leaves none): set the variable and quote it, --{name[1]} '
                       f'"$VAR", or write --{name[1]}=VALUE')


def parse_flags(argv):
  try:
    check_values_given(argv)
    return FLAGS(argv)
  except SystemExit:  # absl's --help, --helpshort and --helpfull print, then exit 1.
    sys.exit(0)
  except flags.Error as e:
    print(f'error: {e} (see --helpshort)', file=sys.stderr, flush=True)
    sys.exit(2)
  except UsageError as e:
    print(f'error: {e}', file=sys.stderr, flush=True)
    sys.exit(2)


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
