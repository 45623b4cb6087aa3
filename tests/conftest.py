# SPDX-License-Identifier: BSD-3-Clause
"""Helpers for the end-to-end tests: run a script as a user would, make image folders."""

import contextlib
import ctypes
import errno
import json
import os
import pathlib
import random
import re
import resource
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from PIL import Image

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# XLA:CPU's code generated at LLVM's -O1 instead of -O2, for every process the tests start:
# measured, a fifth less CPU for a small run (most of it compiling), the same step rate, and
# the same weights bit for bit after 6 steps. The suite is bound by its 2 cores. A level set
# in XLA_FLAGS already is kept.
XLA_CPU_FLAG = '--xla_backend_optimization_level=1'
if '--xla_backend_optimization_level' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_CPU_FLAG}".strip()

# The test files, longest first (their tests' seconds added up, in a run of the suite on 2
# cores): pytest-xdist (pytest.ini: --dist loadfile --no-loadscope-reorder) hands a worker the
# next file as its own nears its end, so the long files start early and the short ones fill
# the end. xdist's own order (most tests first) started the benchmark's one test last, alone
# on a core for more than 2 minutes. A file not named here comes after them.
LONGEST_FIRST = ['test_wds_cifar.py', 'test_benchmarks.py', 'test_launch_pod.py',
                 'test_resnet_mp.py', 'test_large_models.py', 'test_copy.py', 'test_faults.py',
                 'test_single_core.py', 'test_notebook.py', 'test_resume.py',
                 'test_resnet_spmd.py', 'test_decoder.py', 'test_torchrun.py', 'test_gke.py',
                 'test_shard_writer.py', 'test_upstream.py', 'test_install.py', 'test_splits.py']


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}  # A stable sort: a file keeps its order.
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# Distinct colours: a small CNN tells them apart within a few dozen steps.
COLOURS = {'blue': (30, 60, 220), 'green': (40, 200, 60), 'red': (220, 40, 40),
           'yellow': (230, 220, 40)}


TRAIN_LINE = re.compile(r'^\| Training Device=xla:0/0 Epoch=(\d+) Step=(\d+) Loss=([\d.]+) '
                        r'Rate=[\d.]+ GlobalRate=[\d.]+ Time=\d\d:\d\d:\d\d$', re.M)


# What a train_resnet_mp.py or train_wds_cifar.py run prints with --num_cores 1: its replica in
# the command's own process, with no spawn (tests whose subject is not the spawn run so).
ONE_PROCESS = re.compile(r'^Starting one replica \(--num_cores 1\) \.\.\.$', re.M)


def losses(stdout):
  return [float(m.group(3)) for m in TRAIN_LINE.finditer(stdout)]


def readme_command_flags():
  """The flags of the README's quick-start command 1, so tests run what users paste."""
  readme = (REPO / 'README.md').read_text()
  return shlex.split(re.search(r'\w+\.py (--fake_data.*)', readme).group(1))


def tensorboard_scalars(logdir):
  """{tag: [values]} of the scalars in a TensorBoard folder."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  events = EventAccumulator(str(logdir))
  events.Reload()
  return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()['scalars']}


def script_env(**extra):
  env = dict(os.environ, PJRT_DEVICE='CPU', PYTHONUNBUFFERED='1')
  env.pop('XLA_USE_BF16', None)
  env.update(extra)
  return env


def run_script(script, *args, env=None, timeout=900):
  """Runs one of the repo's scripts in a fresh process; returns the CompletedProcess."""
  cmd = [sys.executable, str(REPO / script), *map(str, args)]
  return subprocess.run(cmd, cwd=REPO, env=env or script_env(), capture_output=True, text=True,
                        timeout=timeout)


def both(run):
  """The last lines of a finished run's stdout and stderr, for a failure's message: a run's
  own stop or progress lines are on stdout, its errors and tracebacks on stderr."""
  return (f'{(run.stdout or "")[-3000:]}\n--- stderr ---\n{(run.stderr or "")[-3000:]}')


def read_json(path):
  """A --results_json file: read it only after asserting the exit code of the run that wrote
  it, so that a failed run shows its output rather than a FileNotFoundError."""
  with open(path) as f:
    return json.load(f)


def assert_one_error(run, code, pattern):
  """A run that ended as a user mistake or bad data should: exit code `code`, no traceback,
  and exactly one line starting with 'error: ', which matches `pattern` (re.search).

  `run` is a subprocess.CompletedProcess (its stderr must hold the error line; both streams
  are shown on failure) or the (exit code, merged output) pair of finish/run_and_signal."""
  if isinstance(run, subprocess.CompletedProcess):
    returncode, text, shown = run.returncode, run.stderr, run.stdout + run.stderr
  else:
    returncode, text = run
    shown = text
  assert returncode == code, shown
  assert 'Traceback' not in text, shown
  errors = [line for line in text.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1 and re.search(pattern, errors[0]), shown


def write_image(path, colour, size, rng):
  pixels = np.clip(np.array(colour) + rng.normal(0, 25, (size, size, 3)), 0, 255)
  Image.fromarray(pixels.astype(np.uint8)).save(path)


def make_image_folder(root, split, per_class, size=32, seed=0, colours=COLOURS):
  """root/split/CLASS/i.png with per_class noisy images of each class's colour; every third
  one (2, 5, ...) is i.jpg instead, read by the other decoder (torchvision's, not PIL)."""
  rng = np.random.default_rng(seed)
  for name, colour in colours.items():
    folder = pathlib.Path(root, split, name)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(per_class):
      write_image(folder / f'{i}{".jpg" if i % 3 == 2 else ".png"}', colour, size, rng)
  return pathlib.Path(root)


@pytest.fixture
def colour_folder(tmp_path):
  """A learnable ImageNet-style folder: 4 colour classes, 64 train and 5 val images each."""
  make_image_folder(tmp_path / 'data', 'train', 64, seed=1)
  make_image_folder(tmp_path / 'data', 'val', 5, seed=2)
  return tmp_path / 'data'


def make_cifar_python(folder, per_batch, test_count, seed=0, colours=COLOURS):
  """A folder in the exact layout of CIFAR-10's python release (cifar-10-batches-py), with
  learnable colour classes: data_batch_1..5 and test_batch hold {b'data': N x 3072 uint8,
  channel planes first, b'labels': [...]}, batches.meta holds b'label_names'."""
  import pickle
  rng = np.random.default_rng(seed)
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  names = list(colours)

  def batch(n, label_name):
    labels = rng.integers(0, len(names), n)
    hwc = np.array([list(colours[names[l]]) for l in labels], float)[:, None, None, :]
    pixels = np.clip(hwc + rng.normal(0, 25, (n, 32, 32, 3)), 0, 255).astype(np.uint8)
    return {b'batch_label': label_name.encode(), b'labels': labels.tolist(),
            b'data': pixels.transpose(0, 3, 1, 2).reshape(n, 3072),
            b'filenames': [f'{i}.png'.encode() for i in range(n)]}

  for i in range(1, 6):
    with open(folder / f'data_batch_{i}', 'wb') as f:
      pickle.dump(batch(per_batch, f'training batch {i} of 5'), f)
  with open(folder / 'test_batch', 'wb') as f:
    pickle.dump(batch(test_count, 'testing batch 1 of 1'), f)
  with open(folder / 'batches.meta', 'wb') as f:
    pickle.dump({b'label_names': [n.encode() for n in names], b'num_vis': 3072,
                 b'num_cases_per_batch': per_batch}, f)
  return folder


# ------------------------------------------------------------ interrupted runs

def start_script(script, *args, env=None, wrapper=()):
  """Starts one of the repo's scripts in a process group of its own (with its replicas and
  loader workers); stdout and stderr come merged, line by line. wrapper: a command that runs
  it (['nohup'])."""
  cmd = [*wrapper, sys.executable, str(REPO / script), *map(str, args)]
  return subprocess.Popen(cmd, cwd=REPO, env=env or script_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)


def finish(process, timeout=900):
  """(exit code, all output) of a started script."""
  output, _ = process.communicate(timeout=timeout)
  return process.returncode, output


def wait_for(process, pattern, count=1):
  """Reads a started process's output up to its count-th line that matches pattern
  (re.search); returns what it read. Fails with the output if the output ends first."""
  lines, found = [], 0
  for line in process.stdout:
    lines.append(line)
    found += bool(re.search(pattern, line))
    if found >= count:
      return ''.join(lines)
  raise AssertionError(f'no {count} lines match {pattern!r} in the output:\n' + ''.join(lines))


def run_processes(session=None, mark=None):
  """Pids of the live processes of a run, from one scan of Linux's /proc: those in session
  `session` (the pid of a command started in a session of its own, as start_script does)
  and those whose command line or environment holds the string `mark` (processes started
  through ssh run under sshd, in sessions of their own). Zombies (dead, not yet reaped by
  their parent) are not counted."""
  assert session is not None or mark is not None
  found = []
  for entry in filter(str.isdigit, os.listdir('/proc')):
    try:
      with open(f'/proc/{entry}/stat') as f:
        # state and session: fields 3 and 6, after the command name (which may hold ')').
        state, _, _, pid_session = f.read().rsplit(')', 1)[1].split()[:4]
    except (OSError, ValueError):
      continue  # Gone meanwhile.
    if state == 'Z':
      continue
    if session is not None and int(pid_session) == session:
      found.append(int(entry))
    elif mark is not None and any(mark.encode() in _read_proc(entry, part)
                                  for part in ('cmdline', 'environ')):
      found.append(int(entry))
  return found


def loader_processes(session, serving, replicas_spawned, timeout=300):
  """Pids of the run's loader processes once there is one, polling /proc: the processes below
  those that train (the session's leader, or its spawned replicas: replicas_spawned, as in
  train_resnet_mp.py and train_wds_cifar.py), but multiprocessing's resource tracker. serving:
  loader workers up and serving (they ignore SIGTERM: utils.ignore_stop_signals); else those
  that do not ignore it: a worker still starting, or a replica's fork server (utils.loader_start),
  which imports the script, torch and torch_xla for seconds before it forks a worker."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    status = {pid: _status(pid) for pid in run_processes(session=session)}
    parent = {pid: int(fields.get('PPid', 0)) for pid, fields in status.items()}
    trainers = ({pid for pid in status if parent[pid] == session and
                 b'spawn_main' in _read_proc(pid, 'cmdline')} if replicas_spawned else {session})
    below, todo = set(), set(trainers)
    while todo:
      todo = {pid for pid in status if parent[pid] in todo} - below
      below |= todo
    found = [pid for pid in below if b'resource_tracker' not in _read_proc(pid, 'cmdline') and
             bool(int(status[pid].get('SigIgn', '0'), 16) >> (signal.SIGTERM - 1) & 1) == serving]
    if found:
      return found
    time.sleep(0.01)
  raise AssertionError(f'no loader process {"serving" if serving else "starting"} in {timeout} s')


def _status(pid):
  """/proc/PID/status as a dict ({} if the process is gone)."""
  return dict(line.split(':\t', 1) for line in _read_proc(pid, 'status').decode().splitlines()
              if ':\t' in line)


def _read_proc(pid, part):
  """/proc/PID/part, or b'' if the process is gone or not ours to read."""
  try:
    with open(f'/proc/{pid}/{part}', 'rb') as f:
      return f.read()
  except OSError:
    return b''


def assert_nothing_left(session=None, mark=None, seconds=5):
  """No process of the run (see run_processes) is alive within `seconds` of its command's
  end: processes killed at the end are reaped by init (or sshd) within that time."""
  deadline = time.monotonic() + seconds
  while (left := run_processes(session, mark)) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not left, 'processes of the run still alive: ' + '; '.join(
      f'{pid} {_read_proc(pid, "cmdline").replace(bytes(1), b" ").decode(errors="replace").strip()}'
      for pid in left)


def run_and_signal(script, args, at_step, sig, to='group', env=None):
  """Runs a script with --log_steps 1 and sends sig once it has printed at_step + 1 training
  lines: to its whole process group (`to='group'`, as a VM going down does), to the
  command's process only (`'command'`, `kill PID`), or to each other process of the run (its
  replicas and loader workers) at a thread other than its main one (`'threads'`: Linux
  delivers a signal sent to a process to any of its threads, while Python runs handlers in
  the main thread only; on a VM going down the command's own signal, and the copy it passes
  on, may land the same way). Returns (exit code, output)."""
  process = start_script(script, *args, env=env)
  lines, steps = [], 0
  for line in process.stdout:
    lines.append(line)
    if TRAIN_LINE.match(line.rstrip('\n')):
      steps += 1
      if steps > at_step:
        if to == 'threads':
          signal_other_threads(set(run_processes(session=process.pid)) - {process.pid}, sig)
        else:
          (os.killpg if to == 'group' else os.kill)(process.pid, sig)
        break
  code, rest = finish(process)
  # finish() read the output to its end: no process of the run holds it open any more.
  return code, ''.join(lines) + rest


def signal_other_threads(pids, sig):
  """sig to each process at its newest thread other than the main one (if it has one)."""
  tgkill = ctypes.CDLL(None, use_errno=True).tgkill
  for pid in pids:
    try:
      threads = sorted(int(tid) for tid in os.listdir(f'/proc/{pid}/task'))
    except OSError:
      continue  # Gone meanwhile.
    if tgkill(pid, threads[-1], sig) != 0 and ctypes.get_errno() != errno.ESRCH:
      raise OSError(ctypes.get_errno(), f'tgkill {pid} {threads[-1]}')


def kill_during_save(script, args, ckpt_dir, after_saves):
  """Runs a script and SIGKILLs it while it writes a checkpoint (a temporary file is in
  ckpt_dir), once after_saves checkpoints are complete. Returns (exit code, output)."""
  process = start_script(script, *args)
  lines, saves = [], 0
  for line in process.stdout:
    lines.append(line)
    saves += line.startswith('Saved checkpoint')
    if saves >= after_saves:
      break
  while process.poll() is None:
    if any('.pt.tmp' in name for name in os.listdir(ckpt_dir)):
      os.killpg(process.pid, 9)
      break
    time.sleep(0.002)  # A 94 MB checkpoint takes 0.1 s or more to write.
  code, rest = finish(process)
  return code, ''.join(lines) + rest


def limit_file_size(megabytes):
  """preexec_fn: files of this process and its children stop growing at the limit, as on a
  full disk (write fails with EFBIG instead of the signal SIGXFSZ)."""
  def limit():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (megabytes << 20, megabytes << 20))
  return limit


def seeded_random():
  """A random.Random whose seed is printed (TEST_SEED=N reruns a failure the same way)."""
  seed = int(os.environ.get('TEST_SEED', time.time_ns() % 10**6))
  print(f'TEST_SEED={seed}')
  return random.Random(seed)


def training_losses(output):
  """{(epoch, step): loss text} of the training lines."""
  return {(int(m.group(1)), int(m.group(2))): m.group(3) for m in TRAIN_LINE.finditer(output)}


def read_checkpoint(path):
  """A checkpoint file's state, with the tensors of its folder of shards (train_resnet_spmd.py's)
  put back whole where the script took them out: the weights, the optimizer's state."""
  import tempfile
  import torch
  from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
  state = torch.load(path, weights_only=True)
  if 'shards' in state:
    with tempfile.TemporaryDirectory() as scratch:
      dcp_to_torch_save(pathlib.Path(path).parent / state['shards'], f'{scratch}/whole.pt')
      whole = torch.load(f'{scratch}/whole.pt', weights_only=True)
    state['model'] = whole['model']
    for index, tensors in whole['optimizer'].items():
      state['optimizer']['state'].setdefault(int(index), {}).update(tensors)
  return state


def index_chunks(folder):
  """{tensor: the sizes of its chunks} in the index of a folder of shards."""
  from torch.distributed.checkpoint import FileSystemReader
  index = FileSystemReader(folder).read_metadata()
  return {name: [list(chunk.sizes) for chunk in stored.chunks]
          for name, stored in index.state_dict_metadata.items() if hasattr(stored, 'chunks')}


def newest_checkpoint(ckpt_dir):
  names = sorted(p for p in os.listdir(ckpt_dir) if re.fullmatch(r'ckpt-\d+\.pt', p))
  return read_checkpoint(pathlib.Path(ckpt_dir, names[-1]))


def assert_same_training(resumed_dir, reference_dir):
  """The newest checkpoints of two runs hold bitwise equal weights and optimizer state
  after the same number of steps."""
  import torch
  ours, theirs = newest_checkpoint(resumed_dir), newest_checkpoint(reference_dir)
  assert (ours['epoch'], ours['step'], ours['global_step']) == (
      theirs['epoch'], theirs['step'], theirs['global_step'])
  assert ours['model'].keys() == theirs['model'].keys()
  differ = [k for k in ours['model'] if not torch.equal(ours['model'][k], theirs['model'][k])]
  assert not differ, f'{len(differ)} tensors differ, e.g. {differ[0]}'
  for index, state in theirs['optimizer']['state'].items():
    assert torch.equal(ours['optimizer']['state'][index]['momentum_buffer'],
                       state['momentum_buffer']), index


def oversized_image(kind, side):
  """The bytes of a side x side PNG or JPEG as its header says, small on disk: a real 16x16
  image whose header (PNG's IHDR, JPEG's frame) is made to say side x side. Decoded, it would
  fail or take side x side x 3 bytes; read from its header, its size alone refuses it."""
  import io
  import struct
  import zlib
  with io.BytesIO() as f:
    Image.new('RGB', (16, 16), (200, 30, 30)).save(f, format=kind)
    data = bytearray(f.getvalue())
  if kind == 'PNG':  # IHDR: its length, type, width, height, ..., and a CRC of type and data.
    data[16:24] = struct.pack('>II', side, side)
    data[29:33] = struct.pack('>I', zlib.crc32(bytes(data[12:29])))
  else:  # The frame header (SOF0): marker, length, precision, height, width.
    frame = data.index(b'\xff\xc0')
    data[frame + 5:frame + 9] = struct.pack('>HH', side, side)
  return bytes(data)


def crafted_jpeg(standalone=b'\xff\xd0'):
  """A JPEG of 30000x30000 pixels (oversized_image's) behind a marker without a length
  (standalone: RST0, or TEM) and an APP0 segment that hides a frame header of 32x32 where a walk
  that reads a length after every marker lands: read as libjpeg reads it, it is 30000x30000."""
  import struct
  real = oversized_image('JPEG', 30000)
  hidden = bytes.fromhex('ffc0 0011 08 0020 0020 03 012200 021101 031101')
  # standalone's "length" would be APP0's marker, FF E0: 65504 bytes on from standalone + 2.
  payload = bytes(2 + 2 + 0xFFE0 - 8) + hidden
  return real[:2] + standalone + b'\xff\xe0' + struct.pack('>H', len(payload) + 2) + payload + real[2:]


def closed_port():
  """A port on 127.0.0.1 where nothing listens (bound, then closed)."""
  with socket.socket() as probe:
    probe.bind(('127.0.0.1', 0))
    return probe.getsockname()[1]


@pytest.fixture
def bucket(tmp_path):
  """A Cloud Storage emulator on 127.0.0.1 (gcp-storage-emulator, in memory) holding a bucket
  named data, and the environment through which gcsfs reaches it as it reaches the real one
  (STORAGE_EMULATOR_HOST; no credentials, google-auth's metadata server at a closed port)."""
  port, closed = closed_port(), f'127.0.0.1:{closed_port()}'
  server = subprocess.Popen([sys.executable, '-m', 'gcp_storage_emulator', 'start', '--host',
                             '127.0.0.1', '--port', str(port), '--in-memory', '--default-bucket',
                             'data', '--quiet'], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
  while True:  # Until it listens.
    assert server.poll() is None, 'the emulator ended'
    with socket.socket() as probe:
      if probe.connect_ex(('127.0.0.1', port)) == 0:
        break
  yield dict(STORAGE_EMULATOR_HOST=f'http://127.0.0.1:{port}', GOOGLE_APPLICATION_CREDENTIALS='',
             GCE_METADATA_HOST=closed, GCE_METADATA_IP=closed, NO_GCE_CHECK='true',
             CLOUDSDK_CONFIG=str(tmp_path))
  os.killpg(server.pid, signal.SIGTERM)
  server.wait()


HTTP_METHODS = {b'GET', b'HEAD', b'POST', b'PUT', b'PATCH', b'DELETE'}


class SlowLink:
  """A TCP proxy on 127.0.0.1 to a server's port, whose answers pass, or trickle (a byte every
  `every` s) once `trickle` is set, or once a request holds the bytes `when`: a slow or
  half-dead link in front of a real server. `later` counts the requests sent once it trickles."""

  def __init__(self, port, every=0.2, when=None):
    self.target, self.every, self.trickle, self.when = port, every, False, when
    self.later = 0
    self.listener = socket.create_server(('127.0.0.1', 0))
    self.port = self.listener.getsockname()[1]
    threading.Thread(target=self._accept, daemon=True).start()

  def _accept(self):
    while True:
      client, _ = self.listener.accept()
      server = socket.create_connection(('127.0.0.1', self.target))
      threading.Thread(target=self._pass, args=(client, server, False), daemon=True).start()
      threading.Thread(target=self._pass, args=(server, client, True), daemon=True).start()

  def _pass(self, source, sink, answers):
    try:
      while data := source.recv(65536):
        if not answers and self.trickle and data.split(b' ', 1)[0] in HTTP_METHODS:
          self.later += 1
        if not answers and self.when and self.when in data:
          self.trickle = True
        if answers and self.trickle:
          for byte in data:
            sink.sendall(bytes([byte]))
            time.sleep(self.every)
        else:
          sink.sendall(data)
    except OSError:
      pass  # The other side gave up.
    finally:
      for end in (source, sink):
        with contextlib.suppress(OSError):
          end.shutdown(socket.SHUT_RDWR)
