# SPDX-License-Identifier: BSD-3-Clause
"""launch_pod.py over real ssh: an sshd of the test's own on 127.0.0.1 (a free port, a
temporary host key and user key) serves two "workers", both this machine. Every process a
run starts carries a marker (--env TEST_MARK=..., which the command's children inherit), so
the process list shows whatever of it is left, on the "workers" as here."""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from conftest import (REPO, assert_nothing_left, assert_same_training, both, run_processes,
                      run_script, seeded_random, wait_for)

import launch_pod

# The workers' sessions start with sshd's environment: the tests' XLA:CPU flags go as --env.
XLA_FLAGS = os.environ['XLA_FLAGS']


def free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.fixture(scope='module')
def sshd(tmp_path_factory):
  """The flags that reach two workers through a running sshd on 127.0.0.1."""
  program = shutil.which('sshd') or '/usr/sbin/sshd'
  if not os.path.exists(program):
    pytest.fail('sshd not found: install openssh-server (.ci/run does)')
  folder = tmp_path_factory.mktemp('sshd')
  for key in ('host_key', 'user_key'):
    subprocess.run(['ssh-keygen', '-q', '-t', 'ed25519', '-N', '', '-f', folder / key], check=True)
  shutil.copy(folder / 'user_key.pub', folder / 'authorized_keys')
  if os.geteuid() == 0:
    os.makedirs('/run/sshd', exist_ok=True)  # Its privilege-separation folder.
  for _ in range(5):  # Another program may take the free port first.
    port, server = start_sshd(program, folder)
    if server:
      break
  else:
    pytest.fail(f'sshd did not start: {(folder / "sshd-here.log").read_text()}')
  options = [f'IdentityFile={folder}/user_key', 'StrictHostKeyChecking=no',
             'UserKnownHostsFile=/dev/null', 'LogLevel=ERROR']
  yield dict(port=port, program=program, folder=folder,
             flags=[f'--ssh_option={o}' for o in options] +
             [f'--hosts=ssh://127.0.0.1:{port},ssh://127.0.0.1:{port}'])
  server.terminate()
  server.wait()


def start_sshd(program, folder, address='127.0.0.1', port=None, netns=None):
  """(port, server), or (port, None) if it exited (its port taken). In network namespace
  `netns` if given, where it drops a client silent for 2 to 3 s (its host's link went down)."""
  port = port or free_port()
  name = f'sshd-{netns or "here"}'
  (folder / f'{name}.config').write_text(
      f'Port {port}\nListenAddress {address}\nHostKey {folder}/host_key\n'
      f'AuthorizedKeysFile {folder}/authorized_keys\nPidFile {folder}/{name}.pid\n'
      'StrictModes no\nUsePAM no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n'
      'PermitRootLogin prohibit-password\n'
      + ('ClientAliveInterval 1\nClientAliveCountMax 2\n' if netns else ''))
  log_path = folder / f'{name}.log'
  with open(log_path, 'wb') as log:
    server = subprocess.Popen([*(['ip', 'netns', 'exec', netns] if netns else []), program, '-D',
                               '-e', '-f', folder / f'{name}.config'], stderr=log)
  while server.poll() is None:
    with socket.socket() as s:
      s.settimeout(1)
      if s.connect_ex((address, port)) == 0 and b'listening' in log_path.read_bytes():
        return port, server
    time.sleep(0.1)
  return port, None


@pytest.fixture(scope='module')
def netns_hosts(sshd):
  """Two hosts of their own: network namespaces, each with its address on a veth link to
  this machine's namespace and an sshd of its own (the keys of `sshd`). A host is lost when
  its link goes down (`ip link set LINK down`), as a VM that drops off the network."""
  tag = os.getpid() % 100000
  subnet = f'10.{100 + tag % 100}'  # Private addresses, on links inside this machine only.
  started = time.monotonic()
  made, servers, hosts, links = [], [], [], []

  def ip(*args, netns=None):
    command = ['ip', *(['netns', 'exec', netns, 'ip'] if netns else []), *args]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
      pytest.fail(f'{shlex.join(command)}: {done.stderr.strip()} (network namespaces need '
                  'root and iproute2, which .ci/run has)')

  try:
    for host in range(2):
      netns, link, address = f'refs-test-{tag}-h{host}', f'rt{tag}h{host}', f'{subnet}.{host}'
      ip('netns', 'add', netns)
      made.append(netns)
      ip('link', 'add', link, 'type', 'veth', 'peer', 'name', f'{link}p')
      ip('link', 'set', f'{link}p', 'netns', netns)
      ip('addr', 'add', f'{address}.1/30', 'dev', link)
      ip('link', 'set', link, 'up')
      ip('addr', 'add', f'{address}.2/30', 'dev', f'{link}p', netns=netns)
      ip('link', 'set', f'{link}p', 'up', netns=netns)
      ip('link', 'set', 'lo', 'up', netns=netns)  # The command's own localhost.
      _, server = start_sshd(sshd['program'], sshd['folder'], f'{address}.2', 22, netns)
      if server is None:
        pytest.fail(f'sshd did not start in {netns}: '
                    f'{(sshd["folder"] / f"sshd-{netns}.log").read_text()}')
      servers.append(server)
      hosts.append(f'ssh://{address}.2:22')
      links.append(link)
    print(f'two hosts in network namespaces, with their sshd, in '
          f'{time.monotonic() - started:.2f} s')
    yield dict(hosts='--hosts=' + ','.join(hosts), links=links, ip=ip)
  finally:
    for server in servers:
      server.terminate()
      server.wait()
    for netns in made:  # Its end of the link goes with it, and so the other end.
      subprocess.run(['ip', 'netns', 'del', netns], capture_output=True)


@pytest.fixture
def mark():
  """A marker for the processes of one test's run; what is left of them is killed after it."""
  mark = uuid.uuid4().hex
  yield mark
  for pid in run_processes(mark=mark):
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass


def start(sshd, *args, mark, hosts=None, nohup=False):
  """Starts launch_pod.py in a session of its own (as a terminal starts a command)."""
  flags = sshd['flags'][:-1] + [hosts or sshd['flags'][-1]]
  command = [sys.executable, REPO / 'launch_pod.py', *flags, f'--env=TEST_MARK={mark}', *args]

  def as_a_terminal_starts_it():
    # A shell started from a terminal leaves SIGINT to its commands (a test run in the
    # background may have it ignored, which the launcher would respect); nohup ignores SIGHUP.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_IGN if nohup else signal.SIG_DFL)

  process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, bufsize=1, start_new_session=True,
                             preexec_fn=as_a_terminal_starts_it)
  # A launcher that hangs ends the test (its output closes) instead of the suite.
  timer = threading.Timer(300, lambda: process.poll() is None and os.killpg(process.pid, 9))
  timer.daemon = True
  timer.start()
  return process


def launch(sshd, *args, mark):
  process = start(sshd, *args, mark=mark)
  output, _ = process.communicate(timeout=300)
  return process.returncode, output


def python(code):
  return [sys.executable, '-c', code]


def test_every_worker_runs_the_command_in_its_folder_with_env_and_named_lines(sshd, tmp_path, mark):
  code, out = launch(sshd, '--env=GREETING=a b', f'--workdir={tmp_path}',
                     f'--log_dir={tmp_path}/logs', '--', *python(
                         'import os, subprocess, sys; print(os.environ["GREETING"], os.getcwd(), '
                         'sys.argv[1:]); print("to stderr", file=sys.stderr);'
                         'subprocess.Popen(["sleep", "600"])'),  # Left behind: must not stay.
                     "it's", '"quoted" $HOME', mark=mark)
  assert code == 0, out
  for worker in (0, 1):
    assert f'[worker {worker}] a b {tmp_path} ["it\'s", \'"quoted" $HOME\']\n' in out, out
    assert f'[worker {worker}] to stderr\n' in out, out
    log = (tmp_path / 'logs' / f'worker-{worker}.log').read_text()
    assert log.splitlines()[1:] == [f'a b {tmp_path} ["it\'s", \'"quoted" $HOME\']',
                                    'to stderr'], log
  assert 'launch_pod: done on 2 workers' in out, out
  assert_nothing_left(mark=mark, seconds=10)


@pytest.mark.parametrize('code, last_line', [
    (3, r'worker \d \(\S+\) failed with exit code 3; every worker has ended'),
    (75, r'stopped on every worker: run the same command to go on \(exit code 75\)')])
def test_a_failing_or_preempted_worker_stops_the_others(sshd, tmp_path, mark, code, last_line):
  # The first worker to create the file ends with the code (75: a training script stopped by
  # its VM's SIGTERM); the other would wait forever, as a replica waits in a collective for
  # one that is gone, but saves and exits 75 on SIGTERM.
  process = start(sshd, '--', *python(
      'import os, signal, sys, time\n'
      'signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))\n'
      f'try:\n  os.close(os.open("{tmp_path}/first", os.O_CREAT | os.O_EXCL))\n'
      'except FileExistsError:\n  print("waiting", flush=True); time.sleep(600)\n'
      f'time.sleep(1); print("ending", flush=True); sys.exit({code})'), mark=mark)
  output, _ = process.communicate(timeout=120)
  assert process.returncode == code, output
  first = re.search(r'^\[worker (\d)\] ending$', output, re.M).group(1)
  assert re.search(rf'^launch_pod: worker {first} \(ssh://127.0.0.1:\d+\) exited with code '
                   rf'{code}( \(.*\))?: stopping the others$', output, re.M), output
  assert f'[worker {1 - int(first)}] waiting' in output, output
  assert re.search(rf'^launch_pod: {last_line}$', output, re.M), output
  assert_nothing_left(mark=mark, seconds=10)


def test_ctrl_c_stops_training_on_every_worker_with_a_checkpoint_and_exit_75(sshd, tmp_path,
                                                                             mark):
  # Each worker its own checkpoint folder: both "workers" are this machine.
  train = ('exec "$0" train_resnet_mp.py --fake_data --model resnet18 --img_dim 16 '
           '--batch_size 4 --num_epochs 1 --num_steps 500 --log_steps 1 --num_workers 0 '
           f'--ckpt_dir {tmp_path}/ckpt-$$')
  process = start(sshd, '--env=PJRT_DEVICE=CPU', f'--env=XLA_FLAGS={XLA_FLAGS}', '--', 'sh', '-c',
                  train, sys.executable, mark=mark)
  lines = ''
  for worker in (0, 1):  # Each training (one may be steps ahead of the other).
    if f'[worker {worker}] | Training' not in lines:
      lines += wait_for(process, rf'^\[worker {worker}\] \| Training Device')
  os.killpg(process.pid, signal.SIGINT)  # What a terminal sends on Ctrl-C.
  rest, _ = process.communicate(timeout=300)
  out = lines + rest
  assert process.returncode == 75, out
  for worker in (0, 1):
    assert re.search(rf'^\[worker {worker}\] Stopped by SIGTERM at epoch 1 step \d+: saved \S+; '
                     r'run the same command to resume \(exit code 75\)$', out, re.M), out
  assert len(list(tmp_path.glob('ckpt-*/ckpt-*.pt'))) == 2, out
  assert 'launch_pod: stopped on every worker: run the same command to go on (exit code 75)' in out
  assert 'Traceback' not in out, out
  assert_nothing_left(mark=mark, seconds=10)


HOLD_ON = ('import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); '
           'print("started", flush=True); time.sleep(600)')


def test_a_second_ctrl_c_kills_at_once(sshd, mark):
  process = start(sshd, '--grace_seconds=600', '--', *python(HOLD_ON), mark=mark)
  out = wait_for(process, r'^\[worker \d\] started', count=2)
  os.killpg(process.pid, signal.SIGINT)
  out += wait_for(process, r'SIGTERM to the command on every worker')
  os.killpg(process.pid, signal.SIGINT)
  rest, _ = process.communicate(timeout=60)
  assert process.returncode == 130, out + rest
  assert 'launch_pod: SIGINT during the stop: SIGKILL to the command on every worker' in rest, \
      out + rest
  assert_nothing_left(mark=mark, seconds=10)


def test_sigterm_to_the_launcher_kills_what_does_not_stop_within_the_grace_period(sshd, mark):
  process = start(sshd, '--grace_seconds=1', '--', *python(HOLD_ON), mark=mark)
  out = wait_for(process, r'^\[worker \d\] started', count=2)
  process.terminate()  # `kill PID`: the launcher alone.
  out += wait_for(process, r'^launch_pod: SIGTERM: SIGTERM to the command on every worker')
  process.terminate()  # Again (a supervisor that repeats it): the grace period still holds.
  rest, _ = process.communicate(timeout=60)
  assert 'launch_pod: SIGTERM: already stopping (Ctrl-C: SIGKILL at once)' in rest, out + rest
  assert process.returncode == 128 + signal.SIGKILL, out + rest
  assert 'launch_pod: workers 0, 1 still running 1 s after SIGTERM: SIGKILL' in rest, out + rest
  assert_nothing_left(mark=mark, seconds=10)


@pytest.mark.parametrize('nohup, code', [(False, 75), (True, 0)])
def test_a_closed_terminal_is_a_stop_unless_under_nohup(sshd, mark, nohup, code):
  process = start(sshd, '--', *python(
      'import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(75)); '
      'print("started", flush=True); time.sleep(3)'), mark=mark, nohup=nohup)
  out = wait_for(process, r'^\[worker \d\] started', count=2)
  os.killpg(process.pid, signal.SIGHUP)
  rest, _ = process.communicate(timeout=60)
  assert process.returncode == code, out + rest
  assert ('launch_pod: SIGHUP: SIGTERM to the command on every worker' in rest) != nohup, rest
  assert_nothing_left(mark=mark, seconds=10)


def test_a_killed_launcher_leaves_nothing_running(sshd, tmp_path, mark):
  # Its command hears of it as of a stop: SIGTERM, which the training scripts save on, and
  # SIGKILL after the grace period (this one notes the SIGTERM and goes on).
  process = start(sshd, '--grace_seconds=2', '--', *python(
      'import os, signal, time\n'
      f'def note(*_):\n  open("{tmp_path}/" + str(os.getpid()), "w").close()\n'
      'signal.signal(signal.SIGTERM, note); print("started", flush=True)\n'
      'while True: time.sleep(1)'), mark=mark)
  wait_for(process, r'^\[worker \d\] started', count=2)
  process.kill()
  process.wait()
  assert_nothing_left(mark=mark, seconds=10)
  assert len(list(tmp_path.iterdir())) == 2  # Both had SIGTERM first.


def test_an_unreachable_worker_ends_the_run_with_code_255(sshd, mark):
  with socket.socket() as closed:  # Bound, not listening: connections to it are refused.
    closed.bind(('127.0.0.1', 0))
    hosts = f'--hosts=ssh://127.0.0.1:{sshd["port"]},ssh://127.0.0.1:{closed.getsockname()[1]}'
    process = start(sshd, '--', *python('import time; time.sleep(600)'), mark=mark, hosts=hosts)
    output, _ = process.communicate(timeout=120)
  assert process.returncode == 255, output
  assert re.search(r'^launch_pod: worker 1 \(ssh://127.0.0.1:\d+\) exited with code 255 \(ssh '
                   r'could not reach it or lost the connection\): stopping the others$',
                   output, re.M), output
  assert_nothing_left(mark=mark, seconds=10)


def sigterm_pending(pid):
  """Whether SIGTERM waits, sent to its process group, for a process (stopped, say)."""
  with open(f'/proc/{pid}/status') as f:
    pending = next(line for line in f if line.startswith('ShdPnd:')).split()[1]
  return bool(int(pending, 16) & 1 << (signal.SIGTERM - 1))


def job_of(mark, worker):
  """The pid of the command the watcher started on a worker (the leader of its session)."""
  for pid in run_processes(mark=mark):
    try:
      with open(f'/proc/{pid}/environ', 'rb') as f:
        environ = f.read().split(b'\0')
      if f'LAUNCH_POD_WORKER={worker}'.encode() in environ and os.getsid(pid) == pid:
        return pid
    except OSError:
      continue
  raise AssertionError(f'no command of worker {worker} runs')


def test_restarts_survive_a_preemption_and_a_lost_host_and_end_as_an_uninterrupted_run(
    sshd, netns_hosts, tmp_path, mark):
  rng = seeded_random()
  preempted_at = rng.randint(1, 3)
  # 30 steps an epoch: after the restart, each worker compiles again and has most of its run
  # left while the other's lost host is found out (2 to 3 s). Each worker's command is its
  # replica (--num_cores 1): the restarts are the subject; a spawned replica stopped under
  # launch_pod is the Ctrl-C test's.
  train = ['train_resnet_mp.py', '--fake_data', '--model', 'resnet18', '--img_dim', '16',
           '--batch_size', '4', '--test_set_batch_size', '4', '--num_epochs', '2', '--num_steps',
           '30', '--log_steps', '1', '--num_workers', '0', '--seed', str(rng.randint(0, 99)),
           '--num_cores', '1']
  # The uninterrupted run: the same command, with no launcher.
  reference = run_script(*train, '--ckpt_dir', tmp_path / 'reference', timeout=300)
  assert reference.returncode == 0, both(reference)
  # Two hosts of their own (network namespaces, the same disk: a folder each, by the
  # {worker} placeholder); ssh gives up on a silent host after 2 to 3 s.
  process = start(sshd, '--ssh_option=ServerAliveInterval=1', '--ssh_option=ServerAliveCountMax=2',
                  '--ssh_option=ConnectTimeout=5', '--restarts=3', '--restart_wait=120',
                  f'--tpu_devices={tmp_path}/accel*', f'--tpu_lockfile={tmp_path}/lockfile',
                  '--env=PJRT_DEVICE=CPU', f'--env=XLA_FLAGS={XLA_FLAGS}', '--', sys.executable,
                  *train, '--ckpt_dir', f'{tmp_path}/ck/w{{worker}}', mark=mark,
                  hosts=netns_hosts['hosts'])
  # Each worker's command is frozen (SIGSTOP) early in epoch 1, whichever comes first, so
  # that neither can end its run before the stop reaches it.
  out, frozen = '', set()
  while len(frozen) < 2:
    out += wait_for(process, rf'^\[worker (0\] .* Epoch=1 Step={preempted_at}|1\] .* Epoch=1 '
                             r'Step=1) ')
    worker = int(out.splitlines()[-1][8])
    os.killpg(job_of(mark, worker), signal.SIGSTOP)
    frozen.add(worker)
  # A maintenance event on worker 0: SIGTERM to its command's processes, which go on. Worker
  # 1 goes on once the launcher's stop (SIGTERM) is waiting for it.
  os.killpg(job_of(mark, 0), signal.SIGTERM)
  os.killpg(job_of(mark, 0), signal.SIGCONT)
  out += wait_for(process, r'^launch_pod: worker 0 \(\S+\) exited with code 75\b.*: stopping the '
                           r'others$')
  while not sigterm_pending(job_of(mark, 1)):
    time.sleep(0.01)
  os.killpg(job_of(mark, 1), signal.SIGCONT)
  out += wait_for(process, r'^launch_pod: restart 1 of 3 \(worker 0 \(\S+\) exited 75: stopped '
                           r'and saved\)$')
  # Worker 1's host drops off the network as its command resumes after the restart, while it
  # compiles (the rest of its run takes longer than sshd's 2 to 3 s): its link goes down.
  # ssh on this side gives up (255); on that side sshd drops the session and the watcher,
  # cut off, stops the command (which saves). The launcher waits for the host to answer
  # again, and its link comes back.
  out += wait_for(process, r'^\[worker 1\] Resumed from ')
  link = netns_hosts['links'][1]
  netns_hosts['ip']('link', 'set', link, 'down')
  lost = time.monotonic()
  out += wait_for(process, r'^launch_pod: worker 1 \(\S+\) exited with code 255 ')
  print(f'the link went down; ssh gave worker 1 up {time.monotonic() - lost:.1f} s later')
  out += wait_for(process, r'^launch_pod: restart 2 of 3 \(worker 1 \(\S+\) exited 255: lost\)$')
  out += wait_for(process, r'^launch_pod: waiting until every worker answers')
  netns_hosts['ip']('link', 'set', link, 'up')
  rest, _ = process.communicate(timeout=300)
  out += rest
  assert process.returncode == 0, out
  assert out.count('Resumed from') == 4 and 'restart 3 of 3' not in out, out
  assert re.search(r'^launch_pod: done on 2 workers$', out, re.M), out
  for worker in (0, 1):
    assert_same_training(tmp_path / 'ck' / f'w{worker}', tmp_path / 'reference')
  assert_nothing_left(mark=mark, seconds=10)


@pytest.mark.parametrize('case, args, code, starts', [
    # Preempted at every start: the first and one restart, then its code.
    ('preempted', ['--restarts=1'], 75, 2),
    # A mistake is not retried, nor a stop the user asked for.
    ('exit 2', ['--restarts=3'], 2, 1),
    ('ctrl-c', ['--restarts=3'], 75, 1)])
def test_only_a_stop_of_its_own_or_a_lost_worker_is_restarted(sshd, tmp_path, mark, case, args,
                                                               code, starts):
  # Each worker notes that it started (and saves on SIGTERM from then on); the one that ends
  # does so once the other has started.
  program = {'preempted': 'if worker == "0":\n  wait_for("1"); sys.exit(75)\n',
             'exit 2': 'if worker == "1":\n  wait_for("0"); sys.exit(2)\n',
             'ctrl-c': ''}[case]
  process = start(sshd, '--grace_seconds=60', *args, '--', *python(
      'import os, signal, sys, time\n'
      'signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))\n'
      'worker, run = os.environ["LAUNCH_POD_WORKER"], os.environ["LAUNCH_POD_RUN"]\n'
      f'note = lambda who: f"{tmp_path}/{{run}}-{{who}}"\n'
      'open(note(worker), "w").close()\n'
      'print("started", run, flush=True)\n'
      'def wait_for(other):\n'
      '  while not os.path.exists(note(other)): time.sleep(0.05)\n'
      + program + 'time.sleep(600)\n'), mark=mark)
  out = ''
  if case == 'ctrl-c':
    out = wait_for(process, r'^\[worker \d\] started', count=2)
    os.killpg(process.pid, signal.SIGINT)
  out += process.communicate(timeout=120)[0]
  assert process.returncode == code, out
  runs = set(re.findall(r'^\[worker \d\] started (\S+)$', out, re.M))
  assert len(runs) == starts, out
  assert out.count('launch_pod: restart ') == starts - 1, out
  assert_nothing_left(mark=mark, seconds=10)


def test_workers_know_their_index_and_progress_lines_show_at_once_with_times(sshd, tmp_path,
                                                                              mark):
  process = start(sshd, '--timestamps', '--', *python(
      'import os, sys, time\n'
      'print(os.environ["LAUNCH_POD_WORKER"], os.environ["LAUNCH_POD_NUM_WORKERS"], sys.argv[1:])\n'
      'sys.stdout.write("10%\\r"); sys.stdout.flush()\n'
      f'while not os.path.exists("{tmp_path}/go"): time.sleep(0.05)\n'
      'print("done")'), 'ck/w{worker}', '--seed={worker}{worker}', mark=mark)
  # A progress update ended by \r is a line as soon as it is written.
  out = wait_for(process, r'^\[worker \d\] \d\d:\d\d:\d\d 10%$', count=2)
  (tmp_path / 'go').touch()
  rest, _ = process.communicate(timeout=60)
  assert process.returncode == 0, out + rest
  for worker in (0, 1):
    assert re.search(rf"^\[worker {worker}\] \d\d:\d\d:\d\d {worker} 2 \['ck/w{worker}', "
                     rf"'--seed={worker}{worker}'\]$", out, re.M), out
    assert re.search(rf'^\[worker {worker}\] \d\d:\d\d:\d\d done$', rest, re.M), rest


@pytest.mark.parametrize('ending', ['ctrl-c', 'gives up'])
def test_a_restart_waits_for_a_lost_worker_until_ctrl_c_or_restart_wait(sshd, mark, ending):
  with socket.socket() as closed:  # Worker 1 is unreachable: lost, and it does not come back.
    closed.bind(('127.0.0.1', 0))
    hosts = f'--hosts=ssh://127.0.0.1:{sshd["port"]},ssh://127.0.0.1:{closed.getsockname()[1]}'
    wait = '--restart_wait=600' if ending == 'ctrl-c' else '--restart_wait=1'
    process = start(sshd, '--restarts=2', wait, '--', *python('import time; time.sleep(600)'),
                    mark=mark, hosts=hosts)
    out = wait_for(process, r'^launch_pod: restart 1 of 2 \(worker 1 \(\S+\) exited 255: lost\)$')
    if ending == 'ctrl-c':
      out += wait_for(process, r'^launch_pod: waiting until every worker answers')
      os.killpg(process.pid, signal.SIGINT)
    out += process.communicate(timeout=120)[0]
  expected = {'ctrl-c': (130, r'^launch_pod: SIGINT while waiting to restart: nothing started '
                              r'\(exit code 130\)$'),
              'gives up': (255, r'^launch_pod: gave up restarting after 1 s: worker 1 \(\S+\): ')}
  code, line = expected[ending]
  assert process.returncode == code, out
  assert re.search(line, out, re.M), out
  assert 'restart 2 of 2' not in out, out
  assert_nothing_left(mark=mark, seconds=10)


def test_helpshort_lists_the_log_dir():
  done = subprocess.run([sys.executable, REPO / 'launch_pod.py', '--helpshort'],
                        capture_output=True, text=True, timeout=60)
  assert done.returncode == 0, done
  assert re.search(r'^  --log_dir: Also append each worker.s lines to DIR/worker-N\.log\.$',
                   done.stdout, re.M), done.stdout
  # Its example commands are whole: the code's folder on every worker is named.
  examples = re.findall(r'launch_pod\.py .*', done.stdout)
  assert examples and all('--workdir' in line for line in examples), done.stdout


def test_a_python_without_absl_is_one_line():
  # -S: no site-packages, as a system python3 without the project's packages.
  done = subprocess.run([sys.executable, '-S', REPO / 'launch_pod.py', '--helpshort'],
                        capture_output=True, text=True, timeout=60)
  assert done.returncode == 2 and 'Traceback' not in done.stderr, done
  assert re.fullmatch(r'error: launch_pod\.py needs absl-py, which \S+ does not have: run \S+ '
                      r"-m pip install absl-py, or run it with the venv's python\n", done.stderr)


def test_an_unknown_host_key_says_what_to_do_and_is_not_retried(sshd, tmp_path, mark):
  identity = next(f for f in sshd['flags'] if 'IdentityFile' in f)
  hosts = sshd['flags'][-1]
  base = [sys.executable, REPO / 'launch_pod.py', identity, hosts,
          f'--ssh_option=UserKnownHostsFile={tmp_path}/known_hosts', '--ssh_option=LogLevel=ERROR']
  done = subprocess.run([*base, '--ssh_option=StrictHostKeyChecking=yes', '--restarts=2', '--',
                         'true'], capture_output=True, text=True, timeout=120)
  assert done.returncode == 255, done
  assert re.search(r'^launch_pod: ssh does not know the host key of worker \d \(\S+\): pass '
                   r'--ssh_option StrictHostKeyChecking=accept-new, or connect to it once by '
                   r'hand$', done.stderr, re.M), done.stderr
  assert 'restart' not in done.stderr, done.stderr
  # What the line says to do works.
  done = subprocess.run([*base, '--ssh_option=StrictHostKeyChecking=accept-new', '--', 'true'],
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done


def hold_open(path):
  """A process (in a session of its own) that holds path open, as a TPU runtime holds its
  device and lock file, once it has opened it."""
  holder = subprocess.Popen(python(f'f = open("{path}"); print("held", flush=True); '
                                   'import time; time.sleep(600)'),
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
  assert holder.stdout.readline() == 'held\n'
  return holder


def test_kill_stale_ends_what_holds_the_tpu_first(sshd, tmp_path, mark):
  device = tmp_path / 'accel0'
  device.touch()
  holder = hold_open(device)
  ended = []  # Reaped at once, as a stale process is: gone from /proc while both workers look.
  threading.Thread(target=lambda: ended.append(holder.wait())).start()
  code, out = launch(sshd, '--kill_stale', f'--tpu_devices={tmp_path}/accel*', '--',
                     *python('print("training")'), mark=mark)
  assert code == 0, out
  assert re.search(rf'^\[worker \d\] kill_stale: SIGTERM to process {holder.pid} \(\S+ -c f = '
                   rf'open.*\), which held {device}$', out, re.M), out
  holder.wait(timeout=10)
  assert ended == [-signal.SIGTERM]
  assert '[worker 0] training' in out and '[worker 1] training' in out, out


def test_kill_stale_removes_the_tpu_lockfile_unless_a_process_holds_it(sshd, tmp_path, mark):
  lockfile = tmp_path / 'libtpu_lockfile'
  lockfile.touch()
  holder = hold_open(lockfile)
  flags = ['--kill_stale', f'--tpu_devices={tmp_path}/accel*', f'--tpu_lockfile={lockfile}', '--',
           *python('print("training")')]
  try:
    code, out = launch(sshd, *flags, mark=mark)
    assert code == 0, out
    assert re.search(rf'^\[worker \d\] kill_stale: kept {lockfile}: process {holder.pid} \(\S+ -c '
                     r'f = open.*\) holds it$', out, re.M), out
    assert lockfile.exists()
  finally:
    holder.kill()
    holder.wait()
  code, out = launch(sshd, *flags, mark=mark)  # Its holder gone, it is stale.
  assert code == 0, out
  assert re.search(rf'^\[worker \d\] kill_stale: removed {lockfile}, which no process held$', out,
                   re.M), out
  assert not lockfile.exists()


def test_a_missing_workdir_names_the_worker_and_the_folder(sshd, tmp_path, mark):
  code, out = launch(sshd, f'--workdir={tmp_path}/nowhere', '--', 'true', mark=mark)
  assert code == 1, out
  assert re.search(rf'^\[worker \d\] cannot enter {tmp_path}/nowhere on this worker \(No such '
                   r'file or directory\): put the code there, or give --workdir$', out, re.M), out
  assert 'Traceback' not in out, out


@pytest.mark.parametrize('args, line', [
    (['--', 'true'], 'give the workers: --tpu NAME (with --zone) or --hosts HOST,HOST,...'),
    (['--hosts=a', '--tpu=t', '--', 'true'], 'give the workers: --tpu NAME'),
    (['--hosts=a,b'], 'give the command after --'),
    (['--hosts=a', '--env=1X=2', '--', 'true'], "--env '1X=2' is not NAME=VALUE"),
    (['--hosts=a,,b', '--', 'true'], '--hosts a,,b has an empty name'),
    (['--hosts=a,-oProxyCommand=x', '--', 'true'], "--hosts names '-oProxyCommand=x', not a "
                                                   'host: give host, user@host or ssh://'),
    (['--hosts=a', '--ssh_option=-i', '--', 'true'], "--ssh_option '-i' is not an ssh -o option"),
    # A negative number is a value, not a flag: its own check refuses it.
    (['--hosts=a', '--grace_seconds', '-1', '--', 'true'], 'flag --grace_seconds=-1: '),
    (['--hosts=a', '--grace_seconds=-1', '--', 'true'], 'flag --grace_seconds=-1: '),
    (['--hosts=a', '--log_dir=/dev/null', '--', 'true'], 'cannot write worker logs in --log_dir '
                                                         '/dev/null (File exists): give a writable'),
    # A PATH without them:
    (['--tpu=t', '--zone=z', '--', 'true'], 'gcloud not found: install the Google Cloud CLI'),
    (['--hosts=a', '--', 'true'], 'ssh not found: install the OpenSSH client'),
])
def test_bad_flags_are_one_line_and_exit_2(args, line):
  path = os.path.dirname(sys.executable) if 'not found' in line else os.environ['PATH']
  done = subprocess.run([sys.executable, REPO / 'launch_pod.py', *args], capture_output=True,
                        text=True, env=dict(os.environ, PATH=path), timeout=60)
  assert done.returncode == 2, done
  assert done.stderr.startswith(f'error: {line}') and done.stderr.count('\n') == 1, done.stderr
  assert not done.stdout


@pytest.mark.parametrize('words, flag, taken', [
    ('--hosts $HOSTS --workdir refs -- python3 -c pass', '--hosts', '--workdir'),
    ('--hosts $HOSTS -- python3 train_resnet_mp.py --fake_data', '--hosts', '--'),
    ('--tpu $TPU --zone z --workdir refs -- true', '--tpu', '--zone'),
    ('--hosts h1,h2 --ssh_option $OPTION --workdir refs -- true', '--ssh_option', '--workdir'),
    ('--hosts h1,h2 --workdir $WORKDIR -- true', '--workdir', '--')])
def test_an_empty_unquoted_variable_before_a_flag_is_one_line(words, flag, taken):
  # The shell drops the empty word; the flag would take the next one for its value (a host
  # named --workdir: ssh's usage text and 255).
  done = subprocess.run(['sh', '-c', f'exec "$0" launch_pod.py {words}', sys.executable],
                        cwd=REPO, capture_output=True, text=True, timeout=60,
                        env=dict(os.environ, HOSTS='', TPU='', OPTION='', WORKDIR=''))
  assert done.returncode == 2, done
  assert done.stderr == (f'error: {flag} is followed by {taken}, not by a value (an unquoted '
                         f'variable that is empty leaves none): set the variable and quote it, '
                         f'{flag} "$VAR", or write {flag}=VALUE\n'), done.stderr
  assert not done.stdout and 'usage: ssh' not in done.stderr, done


DESCRIBE = {  # The fields of `gcloud compute tpus tpu-vm describe --format json` it reads.
    'name': 'projects/p/locations/us-central2-b/nodes/pod', 'state': 'READY',
    'acceleratorType': 'v4-16',
    'networkEndpoints': [
        {'ipAddress': '10.130.0.2', 'port': 8470, 'accessConfig': {'externalIp': '34.1.2.3'}},
        {'ipAddress': '10.130.0.3', 'port': 8470, 'accessConfig': {'externalIp': '34.1.2.4'}}]}


def test_tpu_workers_come_from_describe_and_are_reached_with_gcloud_ssh():
  assert launch_pod.describe_command('pod', 'us-central2-b', 'p') == [
      'gcloud', 'compute', 'tpus', 'tpu-vm', 'describe', 'pod', '--zone', 'us-central2-b',
      '--project', 'p', '--format', 'json']
  workers = launch_pod.tpu_workers(json.dumps(DESCRIBE), 'pod', 'us-central2-b', None, False,
                                   ['IdentityFile=k'])
  assert [str(w) for w in workers] == ['worker 0 (34.1.2.3)', 'worker 1 (34.1.2.4)']
  assert workers[1].ssh == [
      'gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', 'pod', '--zone', 'us-central2-b',
      '--worker=1', '--quiet', '--ssh-flag=-o IdentityFile=k',
      '--ssh-flag=-o ServerAliveInterval=15', '--ssh-flag=-o ServerAliveCountMax=4', '--command']
  internal = launch_pod.tpu_workers(json.dumps(DESCRIBE), 'pod', None, None, True, [])
  assert [w.address for w in internal] == ['10.130.0.2', '10.130.0.3']
  assert internal[0].ssh[-2:] == ['--internal-ip', '--command']
  assert '--zone' not in internal[0].ssh
  for change, message in [({'state': 'CREATING'}, 'TPU pod is CREATING, not READY'),
                          ({'networkEndpoints': []}, 'TPU pod lists no workers')]:
    with pytest.raises(launch_pod.UsageError, match=message):
      launch_pod.tpu_workers(json.dumps({**DESCRIBE, **change}), 'pod', 'z', None, False, [])
  with pytest.raises(launch_pod.UsageError, match='describe of TPU pod printed no JSON'):
    launch_pod.tpu_workers('Listed 0 items.', 'pod', 'z', None, False, [])
