# SPDX-License-Identifier: BSD-3-Clause
"""How long train_wds_cifar.py takes, with its default deadlines (--read_timeout 20), from the
moment the server of its shards fails mid-epoch to its last line: a local HTTP server and a
Cloud Storage emulator (gcp-storage-emulator, as the tests run it), each stopped (SIGSTOP: a
stall), behind a link that trickles (a byte every 0.2 s), and killed (connections refused).
Prints a table: the case, the seconds, the exit code and the last line. Takes 3 to 4 minutes
(three runs at a time); nothing leaves 127.0.0.1.

  python benchmarks/stalls.py
"""

import concurrent.futures
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
from PIL import Image

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / 'tests'))
from conftest import SlowLink, closed_port, script_env  # noqa: E402 (the tests' own helpers)

CASES = [('http', 'stall'), ('http', 'trickle'), ('http', 'killed'),
         ('gs', 'stall'), ('gs', 'trickle'), ('gs', 'killed')]


def make_shards(folder):
  """Shards of 32 px images of 4 classes (8 a shard, 24 for training) written by
  make_cifar_shards.py; returns its flags for them (paths relative to folder)."""
  rng = np.random.default_rng(0)
  for split, count in (('train', 48), ('val', 4)):
    for label in range(4):
      os.makedirs(folder / 'images' / split / f'c{label}', exist_ok=True)
      for i in range(count):
        pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / 'images' / split / f'c{label}' / f'{i}.png')
  subprocess.run([sys.executable, str(REPO / 'make_cifar_shards.py'), '--image_folder',
                  folder / 'images', '--output', folder / 'shards' / 's', '--samples_per_shard',
                  '8'], check=True, capture_output=True)
  return dict(wds_traindir='s-train-{000000..000023}.tar', trainsize=192,
              wds_testdir='s-val-{000000..000001}.tar', testsize=16)


def serve(kind, folder):
  """(server process, base URL, environment) of folder's shards."""
  port = closed_port()
  if kind == 'http':
    server = subprocess.Popen([sys.executable, '-m', 'http.server', '--bind', '127.0.0.1',
                               str(port), '--directory', str(folder)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
  else:
    server = subprocess.Popen([sys.executable, '-m', 'gcp_storage_emulator', 'start', '--host',
                               '127.0.0.1', '--port', str(port), '--in-memory',
                               '--default-bucket', 'data', '--quiet'], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
  while socket.socket().connect_ex(('127.0.0.1', port)):
    time.sleep(0.1)
  return server, port


def run_case(kind, how, folder, data):
  server, port = serve(kind, folder)
  try:
    return timed_case(kind, how, folder, data, server, port)
  finally:  # Interrupted too: no server outlives the benchmark.
    os.killpg(server.pid, signal.SIGKILL)


def timed_case(kind, how, folder, data, server, port):
  """The row of one case, against its server (see run_case)."""
  link = SlowLink(port)
  if how == 'trickle':  # Through the link; else straight to the server.
    port = link.port
  closed = f'127.0.0.1:{closed_port()}'
  env = script_env(STORAGE_EMULATOR_HOST=f'http://127.0.0.1:{port}',
                   GOOGLE_APPLICATION_CREDENTIALS='', GCE_METADATA_HOST=closed,
                   GCE_METADATA_IP=closed, NO_GCE_CHECK='true', CLOUDSDK_CONFIG=str(folder))
  if kind == 'gs':  # The shards go up to the emulator's bucket.
    subprocess.run([sys.executable, '-c', 'import fsspec, sys, pathlib\n'
                    'fs = fsspec.filesystem("gs")\n'
                    'for p in pathlib.Path(sys.argv[1]).glob("*.tar"):\n'
                    '  fs.pipe(f"data/shards/{p.name}", p.read_bytes())', str(folder)],
                   env=env, check=True, capture_output=True)
  base = f'http://127.0.0.1:{port}' if kind == 'http' else 'gs://data/shards'
  args = ['--wds_traindir', f'{base}/{data["wds_traindir"]}', '--trainsize', data['trainsize'],
          '--wds_testdir', f'{base}/{data["wds_testdir"]}', '--testsize', data['testsize'],
          '--batch_size', 8, '--num_epochs', 1, '--shuffle_buffer', 8, '--prefetch_factor', 1,
          '--loader_prefetch_size', 1, '--device_prefetch_size', 1, '--log_steps', 1]
  process = subprocess.Popen([sys.executable, str(REPO / 'train_wds_cifar.py'), *map(str, args)],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
  lines = []
  for line in process.stdout:
    lines.append(line)
    if re.match(r'\| Training .* Step=0 ', line):
      break
  failed = time.monotonic()
  if how == 'stall':
    os.killpg(server.pid, signal.SIGSTOP)
  elif how == 'trickle':
    link.trickle = True
  else:
    os.killpg(server.pid, signal.SIGKILL)
  lines += process.stdout.readlines()
  code = process.wait()
  seconds = time.monotonic() - failed
  last = lines[-1].strip() if lines else ''
  return f'| {kind} | {how} | {seconds:.0f} | {code} | {last} |'


def main():
  with tempfile.TemporaryDirectory() as tmp:
    folder = pathlib.Path(tmp)
    data = make_shards(folder)
    print('| shards | the server | seconds to the last line | exit code | the last line |')
    print('|---|---|---|---|---|', flush=True)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
      for row in pool.map(lambda case: run_case(*case, folder / 'shards', data), CASES):
        print(row, flush=True)


if __name__ == '__main__':
  main()
