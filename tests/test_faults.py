# SPDX-License-Identifier: BSD-3-Clause
"""Stops and failures as a TPU user meets them, end to end on XLA:CPU: Ctrl-C (SIGINT to the
process group, as a terminal sends it), a second Ctrl-C, SIGTERM while replicas start, a
replica that fails, a disk that fills up. Each run is started in a session of its own, and
afterwards no process of that session may be left."""

import functools
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import (REPO, TRAIN_LINE, assert_nothing_left, assert_one_error, both, crafted_jpeg,
                      finish, limit_file_size, loader_processes, make_cifar_python, make_image_folder,
                      run_processes, run_script, script_env, start_script, wait_for)


def replicas(session):
  """Pids of the replica processes (started by multiprocessing's spawn) of a run."""
  return [pid for pid in run_processes(session=session) if b'spawn_main' in cmdline(pid)]


def cmdline(pid):
  try:
    with open(f'/proc/{pid}/cmdline', 'rb') as f:
      return f.read()
  except OSError:
    return b''


def signal_pending(pid, signum):
  """Whether signal signum, sent to process pid, is still waiting to be delivered to it."""
  try:
    with open(f'/proc/{pid}/status') as f:
      status = dict(line.split(':', 1) for line in f if ':' in line)
  except OSError:
    return False  # Ended.
  # ShdPnd: signals sent to the process (kill, killpg); SigPnd: to its main thread alone.
  return any(int(status[field], 16) >> (signum - 1) & 1 for field in ('ShdPnd', 'SigPnd'))


# A line that Python prints (to stderr) under PYTHONPROFILEIMPORTTIME=1 once a process has
# imported torch; nested imports are indented. Such lines hold no 'Traceback'.
TORCH_IMPORTED = r'^import time: .*\| +torch$'


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
  return process, wait_for(process, TRAIN_LINE, count=steps)


def test_ctrl_c_while_loader_workers_start_stops_after_a_step_saves_and_exits_130(data, tmp_path):
  # train_single_core.py gets its Ctrl-C mid-epoch in tests/test_resume.py, and must then resume
  # bitwise equal; train_wds_cifar.py shares this script's launcher and replica code. Here the
  # Ctrl-C comes as the replica's loader starts: its fork server imports the script, torch and
  # torch_xla for seconds, and its workers then ignore a stop only once up. It stops the run as
  # any other, where it once killed them and the run saved nothing.
  script = 'train_resnet_mp.py'
  process = start_script(script, *command(data, tmp_path))
  so_far = wait_for(process, r'^Epoch 1 train begin ')
  loader_processes(process.pid, serving=False, replicas_spawned=True)
  os.killpg(process.pid, signal.SIGINT)  # What a terminal sends on Ctrl-C.
  sent = time.monotonic()
  # Said at once, before the step and the save that the stop waits for.
  heard = wait_for(process, r'^Stopping after this step and saving \(Ctrl-C again to end at '
                   r'once without saving\)$')
  assert 'Saved checkpoint' not in heard and 'Stopped by' not in heard, heard
  code, rest = finish(process, timeout=300)
  out = so_far + heard + rest
  print(f'stopped {time.monotonic() - sent:.1f} s after Ctrl-C')
  assert code == 130, out
  assert 'Traceback' not in out and 'KeyboardInterrupt' not in out, out
  stopped = re.search(r'^Stopped by Ctrl-C \(SIGINT\) at epoch (\d+) step (\d+): saved (\S+); run '
                      r'the same command to resume \(exit code 130\)$', out, re.M)
  assert stopped, out
  saved = torch.load(stopped.group(3), weights_only=True)
  assert (saved['epoch'], saved['step']) == (int(stopped.group(1)), int(stopped.group(2)))
  # Where it stops, said before the save (a minute on a CPU for a large model).
  assert re.search(rf'^Stopping at epoch {saved["epoch"]} step {saved["step"]}: saving a '
                   r'checkpoint \.\.\.\n(?:.*\n)*?Saved checkpoint ', out, re.M), out
  # A few steps after the signal: the stop is agreed at a step boundary (the vote of the
  # spawning scripts reads a sum two steps old), not at the end of the run.
  assert saved['global_step'] <= 2 + 4, out
  assert_nothing_left(session=process.pid)


def test_sighup_as_the_first_evaluation_starts_its_loader_saves_and_exits_75(data, tmp_path):
  # A closed terminal's SIGHUP as epoch 1's training ends, while the fork server (a process below
  # the replica that does not ignore it) lives on to fork the evaluation loader's workers: with
  # persistent workers, the loader's other start after epoch 1's (without them, every epoch's).
  # The server started with the stop signals blocked and keeps them so; were it not, the signal
  # would end it, and the evaluation could start no worker.
  process = start_script('train_resnet_mp.py', *command(data, tmp_path))
  out = wait_for(process, r'^Epoch 1 train end ')
  loader_processes(process.pid, serving=False, replicas_spawned=True)
  os.killpg(process.pid, signal.SIGHUP)
  code, rest = finish(process, timeout=300)
  out += rest
  assert code == 75, out
  assert re.search(r'^Epoch 1 test end .*, Accuracy=', out, re.M), out  # Evaluated, then saved.
  stopped = re.search(r'^Stopped by SIGHUP at epoch 2 step 0: saved (\S+); run the same command '
                      r'to resume \(exit code 75\)$', out, re.M)
  assert stopped and 'Traceback' not in out, out
  saved = torch.load(stopped.group(1), weights_only=True)
  assert (saved['epoch'], saved['step'], saved['global_step']) == (2, 0, 24), out
  assert_nothing_left(session=process.pid)


@pytest.mark.parametrize('script', ['train_resnet_mp.py'])
def test_second_ctrl_c_ends_everything_at_once(script, data, tmp_path):
  # Loader workers ignore SIGINT (the first Ctrl-C lets the step in flight finish): the
  # second must end them too. train_resnet_mp.py's tree is the deepest (the command, its
  # replica, the replica's fork server and loader workers); train_single_core.py's (the command
  # and its loader workers) ends through the same supervisor._watch and _end_run.
  process, so_far = start_and_wait_for_steps(script, command(data, tmp_path), 1)
  os.killpg(process.pid, signal.SIGINT)
  # Two SIGINTs sent back to back count as one: Linux keeps at most one SIGINT pending per
  # process, and the second comes while the first still is (with a busy process, measured:
  # 30 times out of 30). Once the command's process has taken the first (Python's handler
  # then writes it to the wakeup fd the scripts' signal thread reads), a second SIGINT is a
  # second Ctrl-C. That takes a millisecond or so, far less than the step the first lets
  # finish before the stop.
  deadline = time.monotonic() + 10
  while signal_pending(process.pid, signal.SIGINT):
    assert time.monotonic() < deadline, 'the first SIGINT was not delivered within 10 s'
    time.sleep(0.001)
  os.killpg(process.pid, signal.SIGINT)
  sent = time.monotonic()
  code, rest = finish(process, timeout=60)
  out = so_far + rest
  assert code == 130, out
  assert time.monotonic() - sent < 10, out
  assert re.search(r'^Stopped at once by a second Ctrl-C: nothing saved since the last '
                   r'checkpoint \(exit code 130\)$', out, re.M), out
  assert 'Traceback' not in out, out
  assert_nothing_left(session=process.pid)


def test_sigterm_before_and_while_replicas_start_is_a_stop_not_a_traceback(data, tmp_path):
  args = command(data, tmp_path)
  # Every process of the run says which module it has imported (see TORCH_IMPORTED).
  env = script_env(PYTHONPROFILEIMPORTTIME='1')
  # Before any replica: the launcher has imported torch, and imports torch_xla and the rest
  # for seconds more; SIGTERM ends it as it would any command (exit 143 in a shell), with
  # nothing to save.
  process = start_script('train_resnet_mp.py', *args, env=env)
  out = wait_for(process, TORCH_IMPORTED)
  os.killpg(process.pid, signal.SIGTERM)
  code, rest = finish(process, timeout=60)
  out += rest
  assert code in (-signal.SIGTERM, 128 + signal.SIGTERM), out
  assert 'Traceback' not in out, out
  assert_nothing_left(session=process.pid)
  # Once the replica process exists, still importing: a stop, exit code 75. The second torch
  # import line is the replica's (the launcher imports torch once, before it starts it); the
  # replica then imports torch_xla and the rest for seconds more.
  process = start_script('train_resnet_mp.py', *args, env=env)
  out = wait_for(process, TORCH_IMPORTED, count=2)
  assert replicas(process.pid), out
  os.killpg(process.pid, signal.SIGTERM)  # As a VM going down signals every process.
  code, rest = finish(process, timeout=300)
  out += rest
  assert code == 75, out
  assert 'Traceback' not in out and 'BrokenProcessPool' not in out, out
  assert re.search(r'^Stopped by SIGTERM\b.*\(exit code 75\)$', out, re.M), out
  assert_nothing_left(session=process.pid)


def test_a_loader_worker_killed_mid_run_is_one_line_that_names_it_and_exit_code_137(data, tmp_path):
  # As the OOM killer ends one: torch's own error ("DataLoader worker (pid(s) N) exited
  # unexpectedly", a traceback) never said how, nor what to do.
  process, so_far = start_and_wait_for_steps('train_resnet_mp.py', command(data, tmp_path), 2)
  pid = loader_processes(process.pid, serving=True, replicas_spawned=True)[0]
  os.kill(pid, signal.SIGKILL)
  code, rest = finish(process, timeout=300)
  out = so_far + rest
  assert code == 128 + signal.SIGKILL, out
  # Seen when the replica next waits on it: in epoch 1, or 2 if its epoch-1 batches were queued.
  assert re.fullmatch(rf'error: loader worker [01] \(pid {pid}\) was killed by SIGKILL \(seen in '
                      r'epoch [12]\): the host may be out of memory \(see dmesg\); give fewer '
                      r'--num_workers \(2 now; 0 loads in this process\)', out.strip().splitlines()[-1]), out
  assert 'Traceback' not in out, out
  assert_nothing_left(session=process.pid)


def test_a_replica_killed_as_the_oom_killer_does_leaves_none_of_its_loader_processes(data, tmp_path):
  # SIGKILL to the replica alone: its loader workers are forked from a fork server, not its
  # children (torch's watchdog watches the server, which lives while a worker holds its pipe):
  # each ends once the replica is gone, and the server then.
  process, so_far = start_and_wait_for_steps('train_resnet_mp.py', command(data, tmp_path), 2)
  workers = loader_processes(process.pid, serving=True, replicas_spawned=True)
  replica, = replicas(process.pid)
  os.kill(replica, signal.SIGKILL)
  code, rest = finish(process, timeout=300)
  out = so_far + rest
  assert code == 128 + signal.SIGKILL, out
  assert out.strip().splitlines()[-1] == (f'error: replica process {replica} was killed by SIGKILL; '
                                          'ended the other replicas'), out
  assert workers and 'Traceback' not in out, out
  assert_nothing_left(session=process.pid)


def test_failing_replica_ends_the_run_with_its_code(data, tmp_path):
  folder = tmp_path / 'folder'
  make_image_folder(folder, 'train', 8, size=16)
  make_image_folder(folder, 'val', 1, size=16)
  (folder / 'train' / 'red' / 'broken.png').write_bytes(b'\x89PNG\r\n\x1a\n not an image')
  # With --seed 42 the broken image is the 19th of epoch 1: step 4 fails, steps 0-3 trained.
  # The replica reads it itself (--num_workers 0: no fork server to start); a loader worker
  # that reads a broken image: tests/test_single_core.py's test_corrupt_image_names_the_file_in_
  # the_last_line.
  process = start_script('train_resnet_mp.py', '--datadir', folder, '--model', 'resnet18',
                         '--img_dim', 16, '--batch_size', 4, '--num_workers', 0,
                         '--num_epochs', 1, '--log_steps', 1)
  code, out = finish(process, timeout=300)
  assert_one_error((code, out), 2, r'cannot read image \S*train/red/broken\.png')
  # The error is the last line: none of the replica's training lines comes after it.
  lines = out.rstrip('\n').split('\n')
  assert TRAIN_LINE.match(lines[-2]) and lines[-1].startswith('error: '), out
  assert_nothing_left(session=process.pid)


# A batch whose step needs far more than the host has (XLA:CPU allocates a graph's buffers at
# once: 209 GB here, refused at once), as a device out of memory is met.
TOO_LARGE = ['--fake_data', '--model', 'resnet18', '--img_dim', 16, '--batch_size', 400000,
             '--num_epochs', 1, '--num_steps', 1, '--num_workers', 0]
OUT_OF_MEMORY = (r'^error: out of device memory \(XLA could not allocate [\d,.]+ GB for a graph\): '
                 r'cut what a device holds with a smaller --batch_size, '
                 r'--gradient_accumulation_steps N with --batch_size / N or --amp, and run again '
                 r'\(see docs/large_models\.md#out-of-device-memory\)$')


def test_a_step_too_large_for_the_device_is_one_line_and_exit_code_23(tmp_path):
  # The mp kit alone (copied without supervisor.py), its replica spawned: train_wds_cifar.py
  # shares its replica code, train_single_core.py the SPMD scripts' (tests/test_decoder.py).
  for name in ('train_resnet_mp.py', 'utils.py'):
    shutil.copy(REPO / name, tmp_path)
  process = subprocess.Popen([sys.executable, 'train_resnet_mp.py', *map(str, TOO_LARGE)],
                             cwd=tmp_path, env=script_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
  assert_one_error(finish(process), 23, OUT_OF_MEMORY)
  assert_nothing_left(session=process.pid)


def test_failed_checkpoint_write_is_one_line_and_keeps_the_earlier_ones(data, tmp_path):
  ckpt_dir = tmp_path / 'ckpt'
  args = ['--datadir', data / 'folder', '--model', 'resnet18', '--img_dim', 16, '--batch_size',
          8, '--num_steps', 3, '--num_workers', 0, '--ckpt_dir', ckpt_dir]
  cmd = [sys.executable, str(REPO / 'train_single_core.py'), *map(str, args)]
  first = subprocess.run([*cmd, '--num_epochs', '1'], cwd=REPO, env=script_env(),
                         capture_output=True, text=True, timeout=300)
  assert first.returncode == 0, both(first)
  kept = (ckpt_dir / 'ckpt-00000003.pt').read_bytes()
  # The next save (of epoch 2) does not fit: a resnet18 checkpoint is about 90 MB.
  full = subprocess.run([*cmd, '--num_epochs', '2'], cwd=REPO, env=script_env(),
                        capture_output=True, text=True, timeout=300,
                        preexec_fn=limit_file_size(20))
  assert_one_error(full, 2, r'cannot write checkpoint \S+ckpt-00000006\.pt \(.*File too large.*\): '
                            r'free space')
  assert sorted(p.name for p in ckpt_dir.iterdir()) == ['.lock', 'best.pt', 'ckpt-00000003.pt']
  # Bitwise the checkpoint the next run resumes from (resuming is tested in test_resume.py).
  assert (ckpt_dir / 'ckpt-00000003.pt').read_bytes() == kept


def test_random_bytes_are_not_a_readable_checkpoint(tmp_path):
  path = tmp_path / 'ckpt-00000001.pt'
  path.write_bytes(np.random.default_rng(7).bytes(4096))
  result = run_script('train_single_core.py', '--fake_data', '--model', 'resnet18', '--img_dim',
                      16, '--resume', path, timeout=120)
  assert_one_error(result, 2, r'--resume: checkpoint \S+ckpt-00000001\.pt cannot be read: it is '
                              r'not a whole, readable checkpoint file')


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
    # 234 bytes of pickle: a list of 10 references to one list of 10, nested 8 deep, made 10^8
    # elements as it was read into an array (10 s; each level more, 10 times that).
    'nested references to one list': (
        lambda tmp: [*bad_pickle(tmp / 'c', {b'data': functools.reduce(
            lambda inner, _: [inner] * 10, range(8), 0), b'labels': [0] * 10}),
            '--output', tmp / 's'],
        r'^error: \S+data_batch_3 is not a CIFAR-10 batch \(a dict of b"data", N rows of 3072 '
        r'bytes, and b"labels"\): ValueError\(\'b"data" is a list, not N rows of 3072 uint8 '
        r'bytes\'\)$'),
    'unwritable output': (lambda tmp: ['--cifar_dir', make_cifar_python(tmp / 'c', 4, 4),
                                       '--output', REPO / 'README.md' / 'cifar'],
                          r'cannot write shards to --output \S+README.md/cifar'),
    'output is a folder': (lambda tmp: ['--cifar_dir', make_cifar_python(tmp / 'c', 4, 4),
                                        '--output', f'{tmp}/shards/'],
                           r'give --output PREFIX.*\(not a folder\)'),
    'original format of the release': (
        lambda tmp: ['--cifar_dir', make_cifar_python(tmp / 'c', 4, 4), '--output', tmp / 's',
                     '--format', 'original'],
        r"^error: --format original keeps the files of an --image_folder: CIFAR-10's release has "
        r'none; give --format rgb or png$'),
    'image folder without val': (
        lambda tmp: ['--image_folder', make_image_folder(tmp / 'f', 'train', 1),
                     '--output', tmp / 's'],
        r'\S+/f/val is not a folder: \S+/f needs train and val \(or test\)'),
    'a file that is not an image': (
        lambda tmp: ['--image_folder', not_an_image(make_image_folder(tmp / 'f', 'train', 1)),
                     '--output', tmp / 's'],
        r'^error: cannot read image \S+/f/val/red/notes\.png \(not an image file\): replace or '
        r'remove the file, then run the same command again \(it writes every shard anew\); until '
        r'then \S+/s-\* holds 1 whole shard and no classes file, not the whole set$'),
    'an image over the pixel limit': (  # Kept as it is, it would be refused by every epoch.
        lambda tmp: ['--image_folder', oversized_in(make_image_folder(tmp / 'f', 'train', 1)),
                     '--output', tmp / 's'],
        r"^error: image \S+/f/val/red/big\.jpg: 30000x30000 pixels, over the limit of "
        r"89,478,485 \(PIL's Image\.MAX_IMAGE_PIXELS: raise it to read such images\); resize it "
        r'or remove it, then run the same command again \(it writes every shard anew\); until '
        r'then \S+/s-\* holds 1 whole shard and no classes file, not the whole set$'),
}


def oversized_in(folder):
  """The folder with a val split whose red class holds a JPEG of 30000x30000 pixels (a frame
  of 32x32 hidden before its own)."""
  make_image_folder(folder, 'val', 1)
  (folder / 'val' / 'red' / 'big.jpg').write_bytes(crafted_jpeg())
  return folder


def not_an_image(folder):
  """The folder with a val split whose red class holds a text file named .png."""
  make_image_folder(folder, 'val', 1)
  (folder / 'val' / 'red' / 'notes.png').write_text('not an image')
  return folder


@pytest.mark.parametrize('case', SHARD_WRITER_MISTAKES)
def test_shard_writer_mistakes_are_one_line(tmp_path, case):
  make_args, message = SHARD_WRITER_MISTAKES[case]
  result = run_script('make_cifar_shards.py', *make_args(tmp_path), timeout=120)
  assert_one_error(result, 2, message)


def run_replica_pool(folder, how, watch):
  """tests/replica_pool.py run in folder (which holds utils.py, and supervisor.py for its
  watch), in a session of its own: replica 1 of 2 fails (`how`) while replica 0 waits for
  it. Returns (exit code, output, seconds from the failure to the end of the run), once no
  process of the run is left."""
  shutil.copy(REPO / 'tests' / 'replica_pool.py', folder)
  process = subprocess.Popen([sys.executable, 'replica_pool.py', how, watch], cwd=folder,
                             env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
  try:
    out, _ = process.communicate(timeout=120)
  except subprocess.TimeoutExpired:
    os.killpg(process.pid, signal.SIGKILL)
    raise AssertionError(f'{watch}: the run hangs after a replica {how}: ' + process.communicate()[0])
  seconds = time.time() - float((folder / 'failed_at').read_text())
  assert 'replica 0 waits for replica 1' in out, out
  assert_nothing_left(session=process.pid)
  return process.returncode, out, seconds


REPLICA_ENDS = [('fails', 2, r'^error: cannot read image x\.png: replace or remove the file$'),
                ('killed', 128 + 9, r'^error: replica process \d+ was killed by SIGKILL; ended the '
                                    r'other replicas$')]


# Each watch with one way to end (utils.replica_ended's two lines, the same for both): here
# supervisor.py's with a replica's error line, tests/test_copy.py's kit alone with a SIGKILL.
@pytest.mark.parametrize('how,code,line', REPLICA_ENDS[:1], ids=['fails'])
def test_supervisor_ends_every_replica_of_a_host_when_one_fails(tmp_path, how, code, line):
  for name in ('utils.py', 'supervisor.py'):
    shutil.copy(REPO / name, tmp_path)
  code_seen, out, seconds = run_replica_pool(tmp_path, how, 'supervisor')
  assert_one_error((code_seen, out), code, line)
  assert seconds < 10, out  # At once, not when the other replica's wait ends (never).
