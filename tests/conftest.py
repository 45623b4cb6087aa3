"""Helpers for the end-to-end tests: run a script as a user would, make image folders."""

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Distinct colours: a small CNN tells them apart within a few dozen steps.
COLOURS = {'blue': (30, 60, 220), 'green': (40, 200, 60), 'red': (220, 40, 40),
           'yellow': (230, 220, 40)}


TRAIN_LINE = re.compile(r'^\| Training Device=xla:0/0 Epoch=(\d+) Step=(\d+) Loss=([\d.]+) '
                        r'Rate=[\d.]+ GlobalRate=[\d.]+ Time=\d\d:\d\d:\d\d$', re.M)


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


def read_json(path):
  with open(path) as f:
    return json.load(f)


def write_image(path, colour, size, rng):
  pixels = np.clip(np.array(colour) + rng.normal(0, 25, (size, size, 3)), 0, 255)
  Image.fromarray(pixels.astype(np.uint8)).save(path)


def make_image_folder(root, split, per_class, size=32, seed=0, colours=COLOURS):
  """root/split/CLASS/i.png with per_class noisy images of each class's colour."""
  rng = np.random.default_rng(seed)
  for name, colour in colours.items():
    folder = pathlib.Path(root, split, name)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(per_class):
      write_image(folder / f'{i}.png', colour, size, rng)
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
