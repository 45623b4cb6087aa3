"""Stops and failures as a TPU user meets them, end to end on XLA:CPU: Ctrl-C (SIGINT to the
process group, as a terminal sends it), a second Ctrl-C, SIGTERM while replicas start, a
replica that fails, a disk that fills up. Each run is started in a session of its own, and
afterwards no process of that session may be left."""

import os
import pickle
import re
import resource
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import (REPO, TRAIN_LINE, finish, make_cifar_python, make_image_folder,
                      run_script, script_env, start_script)


def session_processes(session):
  """Pids of the processes whose session is `session` (the started command's pid)."""
  pids = []
  for entry in filter(str.isdigit, os.listdir('/proc')):
    try:
      with open(f'/proc/{entry}/stat') as f:
        fields = f.read().rsplit(')', 1)[1].split()
    except OSError:
      continue
    if int(fields[3]) == session and fields[0] != 'Z':
      pids.append(int(entry))
  return pids


def cmdline(pid):
  try:
    with open(f'/proc/{pid}/cmdline', 'rb') as f:
      return f.read()
  except OSError:
    return b''


def assert_nothing_left(session):
  """No process of the run is alive a moment after its command ended (killed processes
  are reaped by init within that moment)."""
  for _ in range(50):
    if not session_processes(session):
      return
    time.sleep(0.1)
  raise AssertionError(f'processes of the run still alive: {session_processes(session)}')


@pytest.fixture(scope='module')
def data(tmp_path_factory):
  """A colour image folder: 4 classes of 24 train and 2 val images."""
  root = tmp_path_factory.mktemp('faults')
  make_image_folder(root / 'folder', 'train', 24, size=16, seed=1)
  make_image_folder(root / 'folder', 'val', 2, size=16, seed=2)
  return root


def command(data, tmp_path):
  """Flags of a run long enough to be stopped mid-epoch, with two loader workers."""
  return ['--datadir', data / 'folder', '--model', 'resnet18', '--img_dim', 16, '--batch_size',
          4, '--test_set_batch_size', 4, '--num_epochs', 3, '--log_steps', 1, '--num_workers', 2,
          '--ckpt_dir', tmp_path / 'ckpt']


def start_and_wait_for_steps(script, args, steps):
  """Starts a run; returns (process, output so far) once it has printed `steps` training
  lines."""
  process = start_script(script, *args)
  lines = []
  for line in process.stdout:
    lines.append(line)
    if sum(bool(TRAIN_LINE.match(l.rstrip('\n'))) for l in lines) >= steps:
      return process, lines
  raise AssertionError(''.join(lines))


def test_ctrl_c_stops_every_replica_after_a_step_saves_and_exits_130(data, tmp_path):
  # train_single_core.py gets its Ctrl-C in tests/test_resume.py, and must then resume
  # bitwise equal; train_wds_cifar.py shares this script's launcher and replica code.
  script = 'train_resnet_mp.py'
  process, lines = start_and_wait_for_steps(script, command(data, tmp_path), 2)
  os.killpg(process.pid, signal.SIGINT)  # What a terminal sends on Ctrl-C.
  sent = time.monotonic()
  code, rest = finish(process, timeout=300)
  out = ''.join(lines) + rest
  print(f'stopped {time.monotonic() - sent:.1f} s after Ctrl-C')
  assert code == 130, out
  assert 'Traceback' not in out and 'KeyboardInterrupt' not in out, out
  stopped = re.search(r'^Stopped by Ctrl-C \(SIGINT\) at epoch (\d+) step (\d+): saved (\S+); run '
                      r'the same command to resume \(exit code 130\)$', out, re.M)
  assert stopped, out
  saved = torch.load(stopped.group(3), weights_only=True)
  assert (saved['epoch'], saved['step']) == (int(stopped.group(1)), int(stopped.group(2)))
  # A few steps after the signal: the stop is agreed at a step boundary (the vote of the
  # spawning scripts reads a sum two steps old), not at the end of the run.
  assert saved['global_step'] <= 2 + 4, out
  assert_nothing_left(process.pid)


@pytest.mark.parametrize('script', ['train_single_core.py', 'train_resnet_mp.py'])
def test_second_ctrl_c_ends_everything_at_once(script, data, tmp_path):
  # Loader workers ignore SIGINT (the first Ctrl-C lets the step in flight finish): the
  # second must end them too.
  process, lines = start_and_wait_for_steps(script, command(data, tmp_path), 1)
  os.killpg(process.pid, signal.SIGINT)
  time.sleep(0.05)  # Before the stop after the step could finish.
  os.killpg(process.pid, signal.SIGINT)
  sent = time.monotonic()
  code, rest = finish(process, timeout=60)
  out = ''.join(lines) + rest
  assert code == 130, out
  assert time.monotonic() - sent < 10, out
  assert re.search(r'^Stopped at once by a second Ctrl-C: nothing saved since the last '
                   r'checkpoint \(exit code 130\)$', out, re.M), out
  assert 'Traceback' not in out, out
  assert_nothing_left(process.pid)


def test_sigterm_before_and_while_replicas_start_is_a_stop_not_a_traceback(data, tmp_path):
  args = command(data, tmp_path)
  # Before any replica: the launcher is still importing; SIGTERM ends it as it would any
  # command (exit 143 in a shell), with nothing to save.
  process = start_script('train_resnet_mp.py', *args)
  time.sleep(0.5)
  os.killpg(process.pid, signal.SIGTERM)
  code, out = finish(process, timeout=60)
  assert code in (-signal.SIGTERM, 128 + signal.SIGTERM), out
  assert 'Traceback' not in out, out
  assert_nothing_left(process.pid)
  # Once the replica process exists, still importing: a stop, exit code 75.
  process = start_script('train_resnet_mp.py', *args)
  while not any(b'spawn_main' in cmdline(pid) for pid in session_processes(process.pid)):
    time.sleep(0.05)
  time.sleep(1)  # It imports torch for several seconds more.
  os.killpg(process.pid, signal.SIGTERM)  # As a VM going down signals every process.
  code, out = finish(process, timeout=300)
  assert code == 75, out
  assert 'Traceback' not in out and 'BrokenProcessPool' not in out, out
  assert re.search(r'^Stopped by SIGTERM\b.*\(exit code 75\)$', out, re.M), out
  assert_nothing_left(process.pid)


def test_failing_replica_ends_the_run_with_its_code(data, tmp_path):
  folder = tmp_path / 'folder'
  make_image_folder(folder, 'train', 8, size=16)
  make_image_folder(folder, 'val', 1, size=16)
  (folder / 'train' / 'red' / 'broken.png').write_bytes(b'\x89PNG\r\n\x1a\n not an image')
  process = start_script('train_resnet_mp.py', '--datadir', folder, '--model', 'resnet18',
                         '--img_dim', 16, '--batch_size', 33, '--num_workers', 2,
                         '--num_epochs', 1)
  code, out = finish(process, timeout=300)
  assert code == 2, out
  assert 'Traceback' not in out, out
  errors = [l for l in out.splitlines() if l.startswith('error: ')]
  assert len(errors) == 1 and re.search(r'cannot read image \S*train/red/broken\.png', errors[0])
  assert_nothing_left(process.pid)


def limit_file_size(megabytes):
  """preexec_fn: files of this process and its children stop growing at the limit, as on a
  full disk (write fails with EFBIG instead of the signal SIGXFSZ)."""
  def limit():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (megabytes << 20, megabytes << 20))
  return limit


def test_failed_checkpoint_write_is_one_line_and_keeps_the_earlier_ones(data, tmp_path):
  ckpt_dir = tmp_path / 'ckpt'
  args = ['--datadir', data / 'folder', '--model', 'resnet18', '--img_dim', 16, '--batch_size',
          8, '--num_steps', 3, '--num_workers', 0, '--ckpt_dir', ckpt_dir]
  cmd = [sys.executable, str(REPO / 'train_single_core.py'), *map(str, args)]
  first = subprocess.run([*cmd, '--num_epochs', '1'], cwd=REPO, env=script_env(),
                         capture_output=True, text=True, timeout=300)
  assert first.returncode == 0, first.stderr
  kept = (ckpt_dir / 'ckpt-00000003.pt').read_bytes()
  # The next save (of epoch 2) does not fit: a resnet18 checkpoint is about 90 MB.
  full = subprocess.run([*cmd, '--num_epochs', '2'], cwd=REPO, env=script_env(),
                        capture_output=True, text=True, timeout=300,
                        preexec_fn=limit_file_size(20))
  assert full.returncode == 2, full.stdout + full.stderr
  assert 'Traceback' not in full.stderr
  errors = [l for l in full.stderr.splitlines() if l.startswith('error: ')]
  assert len(errors) == 1 and re.search(r'cannot write checkpoint \S+ckpt-00000006\.pt \(.*File '
                                        r'too large.*\): free space', errors[0]), full.stderr
  assert sorted(p.name for p in ckpt_dir.iterdir()) == ['best.pt', 'ckpt-00000003.pt']
  # Bitwise the checkpoint the next run resumes from (resuming is tested in test_resume.py).
  assert (ckpt_dir / 'ckpt-00000003.pt').read_bytes() == kept


def test_random_bytes_are_not_a_readable_checkpoint(tmp_path):
  path = tmp_path / 'ckpt-00000001.pt'
  path.write_bytes(np.random.default_rng(7).bytes(4096))
  result = run_script('train_single_core.py', '--fake_data', '--model', 'resnet18', '--img_dim',
                      16, '--resume', path, timeout=120)
  assert result.returncode == 2, result.stdout + result.stderr
  assert 'Traceback' not in result.stderr
  errors = [l for l in result.stderr.splitlines() if l.startswith('error: ')]
  assert len(errors) == 1 and re.search(r'--resume: checkpoint \S+ckpt-00000001\.pt cannot be read: '
                                        r'it is not a whole, readable checkpoint file', errors[0])


def bad_pickle(folder, content):
  make_cifar_python(folder, per_batch=4, test_count=4)
  with open(folder / 'data_batch_3', 'wb') as f:
    pickle.dump(content, f)
  return ['--cifar_dir', folder]


SHARD_WRITER_MISTAKES = {
    'a pickle of a list': (lambda tmp: [*bad_pickle(tmp / 'c', [1, 2, 3]), '--output', tmp / 's'],
                           r'data_batch_3 is not a CIFAR-10 batch'),
    'rows of the wrong size': (
        lambda tmp: [*bad_pickle(tmp / 'c', {b'data': np.zeros((4, 3000), np.uint8),
                                             b'labels': [0, 1, 2, 3]}), '--output', tmp / 's'],
        r'data_batch_3 is not a CIFAR-10 batch'),
    'unwritable output': (lambda tmp: ['--cifar_dir', make_cifar_python(tmp / 'c', 4, 4),
                                       '--output', REPO / 'README.md' / 'cifar'],
                          r'cannot write shards to --output \S+README.md/cifar'),
    'output is a folder': (lambda tmp: ['--cifar_dir', make_cifar_python(tmp / 'c', 4, 4),
                                        '--output', f'{tmp}/shards/'],
                           r'give --output PREFIX.*\(not a folder\)'),
    'image folder without test': (
        lambda tmp: ['--image_folder', make_image_folder(tmp / 'f', 'train', 1),
                     '--output', tmp / 's'],
        r'\S+/f/test is not a folder: \S+/f needs train and test'),
}


@pytest.mark.parametrize('case', SHARD_WRITER_MISTAKES)
def test_shard_writer_mistakes_are_one_line(tmp_path, case):
  make_args, message = SHARD_WRITER_MISTAKES[case]
  result = run_script('make_cifar_shards.py', *make_args(tmp_path), timeout=120)
  assert result.returncode == 2, result.stdout + result.stderr
  assert 'Traceback' not in result.stderr
  errors = [l for l in result.stderr.splitlines() if l.startswith('error: ')]
  assert len(errors) == 1 and re.search(message, errors[0]), result.stderr


# Four replica processes in the pool torch_xla.launch uses on a TPU host (a
# ProcessPoolExecutor with spawn, waited for in order), which XLA:CPU cannot start: one
# fails while the others wait, as they would in their next collective.
POOL = '''
import concurrent.futures, multiprocessing, os, signal, sys, time
sys.path.insert(0, sys.argv[1])
import utils

def replica(index):
  if index == 2:
    time.sleep(3)
    with open('failed_at', 'w') as f:
      f.write(str(time.time()))
    if sys.argv[2] == 'fails':
      utils.replica_failed(utils.BadDataError('cannot read image x.png: replace the file'))
    os.kill(os.getpid(), signal.SIGKILL)  # As the OOM killer does.
  time.sleep(600)

if __name__ == '__main__':
  with utils.run_watched(launcher=True):
    with concurrent.futures.ProcessPoolExecutor(4, multiprocessing.get_context('spawn')) as pool:
      print(list(pool.map(replica, range(4))))
'''


@pytest.mark.parametrize('how,code,line', [
    ('fails', 2, r'^error: cannot read image x\.png: replace the file$'),
    ('is killed', 128 + 9, r'^error: replica process \d+ was killed by SIGKILL; ended the other '
                           r'replicas$')])
def test_one_of_four_replica_processes_ending_ends_them_all(tmp_path, how, code, line):
  (tmp_path / 'pool.py').write_text(POOL)
  process = subprocess.Popen([sys.executable, str(tmp_path / 'pool.py'), str(REPO), how.split()[-1]],
                             cwd=tmp_path, env=script_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
  while len([p for p in session_processes(process.pid) if b'spawn_main' in cmdline(p)]) < 4:
    assert process.poll() is None, process.stdout.read()
    time.sleep(0.1)
  out, _ = process.communicate(timeout=120)
  assert process.returncode == code, out
  # At once (not after the others' sleep), however long the replicas took to import.
  assert time.time() - float((tmp_path / 'failed_at').read_text()) < 20, out
  errors = [l for l in out.splitlines() if l.startswith('error: ')]
  assert len(errors) == 1 and re.search(line, errors[0]), out
  assert 'Traceback' not in out
  assert_nothing_left(process.pid)
