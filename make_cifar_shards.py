# SPDX-License-Identifier: BSD-3-Clause
"""Writes CIFAR-10 as WebDataset tar shards for train_wds_cifar.py.

Reads the folder that the official python release unpacks to (cifar-10-batches-py:
data_batch_1..5, test_batch, batches.meta; torchvision.datasets.CIFAR10 uses the same)
or an image folder (DIR/train/CLASS/*.png, DIR/test/CLASS/*.png, 32x32 images), and
writes PREFIX-train-000000.tar, ... and PREFIX-test-000000.tar, ... to a local folder or
any fsspec URL (gs://bucket/cifar10/cifar, ...).

Each sample is two tar members, KEY.rgb (the image as 3,072 raw bytes, 32x32x3 uint8,
height x width x channel) and KEY.cls (the label as ASCII digits). Raw bytes decode in
about 1 us (np.frombuffer); a 32x32 PNG takes about 50 us, enough to make the host, not the
TPU, the bottleneck. --format png writes KEY.png instead, which any WebDataset reader
decodes (`.decode('pil')`) and any image viewer shows. train_wds_cifar.py reads both.

  python make_cifar_shards.py --cifar_dir data/cifar-10-batches-py --output shards/cifar
"""

import io
import os
import pickle
import random
import sys
import tarfile

import fsspec
import numpy as np
import PIL.Image
from absl import app, flags

import supervisor
import utils

SIDE = 32  # CIFAR images are 32x32 RGB.
FLAGS = flags.FLAGS
flags.DEFINE_string('cifar_dir', None, 'The cifar-10-batches-py folder of the python release.')
flags.DEFINE_string('image_folder', None, 'Or a folder with train/CLASS/*.png and test/CLASS/*.png.')
flags.DEFINE_string('output', None, 'Shard prefix: a local path or fsspec URL, e.g. gs://b/cifar.')
flags.DEFINE_integer('samples_per_shard', 1000, 'Samples in each shard (the last may hold fewer).',
                     lower_bound=1)
flags.DEFINE_integer('repeat', 1, 'Write the training set this many times, each reshuffled '
                     '(the Cloud TPU tutorial made 1.28M samples with 25).', lower_bound=1)
flags.DEFINE_integer('shuffle_seed', 0, 'Seed of the training-set shuffle.')
flags.DEFINE_enum('format', 'rgb', ['rgb', 'png'], 'Image files: raw bytes (fastest to read) or '
                  'PNG (readable by other tools; lossless, about as big).')
flags.DEFINE_string('results_json', None, "Write train_wds_cifar.py's data flags here (JSON).")
# A notebook may import several scripts (the same flag names) or %run one again.
utils.redefinable(FLAGS)

TRAIN_BATCHES = [f'data_batch_{i}' for i in range(1, 6)]
DEFAULT_LOADER_WORKERS = 4  # train_wds_cifar.py's --num_workers


def add_member(tar, name, data):
  info = tarfile.TarInfo(name)
  info.size = len(data)
  info.mode = 0o444
  tar.addfile(info, io.BytesIO(data))


def encode(image, image_format):
  """The bytes of an image file of a sample: raw rgb or png."""
  if image_format == 'rgb':
    return image.tobytes()
  with io.BytesIO() as f:
    PIL.Image.fromarray(image).save(f, format='PNG')
    return f.getvalue()


def write_shards(images, labels, order, pattern, samples_per_shard, image_format='rgb'):
  """Writes samples images[order[k]], labels[order[k]] to pattern % 0, pattern % 1, ...,
  the images as image_format (rgb or png) files; returns the URLs written."""
  urls = []
  for shard, start in enumerate(range(0, len(order), samples_per_shard)):
    url = pattern % shard
    # Written under a temporary name, then moved: a reader never sees half a shard.
    with fsspec.open(url + '.tmp', 'wb') as f, tarfile.open(fileobj=f, mode='w',
                                                            format=tarfile.USTAR_FORMAT) as tar:
      for key in range(start, min(start + samples_per_shard, len(order))):
        index = order[key]
        add_member(tar, f'{key:08d}.{image_format}', encode(images[index], image_format))
        add_member(tar, f'{key:08d}.cls', str(int(labels[index])).encode())
    fs, path = fsspec.core.url_to_fs(url)
    fs.mv(path + '.tmp', path)
    urls.append(url)
  return urls


def brace_pattern(prefix, split, count):
  return f'{prefix}-{split}-{{{0:06d}..{count - 1:06d}}}.tar'


def read_cifar_python(folder):
  """(train_images, train_labels, test_images, test_labels, class_names) from the pickles."""
  def unpickle(name):
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
      raise utils.UsageError(f'{path} is missing: --cifar_dir must be the cifar-10-batches-py '
                             'folder (data_batch_1..5, test_batch, batches.meta)')
    try:
      with open(path, 'rb') as f:
        return pickle.load(f, encoding='bytes')
    except Exception as e:
      raise utils.UsageError(f'cannot read {path} ({e}): download the python release again')

  def images_labels(name):
    batch = unpickle(name)
    try:  # Rows are 3072 bytes: the red plane, then green, then blue (channel-first).
      images = np.asarray(batch[b'data'], np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
      labels = np.asarray(batch[b'labels'], np.int64)
      if len(images) != len(labels) or np.asarray(batch[b'data']).shape[1:] != (3072,):
        raise ValueError(f'{len(labels)} labels for data of shape {np.shape(batch[b"data"])}')
    except (TypeError, KeyError, IndexError, ValueError) as e:
      raise utils.UsageError(f'{os.path.join(folder, name)} is not a CIFAR-10 batch (a dict of '
                             f'b"data", N rows of 3072 bytes, and b"labels"): {e!r}') from None
    return np.ascontiguousarray(images), labels

  train = [images_labels(name) for name in TRAIN_BATCHES]
  test_images, test_labels = images_labels('test_batch')
  try:
    names = [n.decode() for n in unpickle('batches.meta')[b'label_names']]
  except (TypeError, KeyError, AttributeError) as e:
    raise utils.UsageError(f'{os.path.join(folder, "batches.meta")} holds no b"label_names" '
                           f'({e!r}): download the python release again') from None
  return (np.concatenate([t[0] for t in train]), np.concatenate([t[1] for t in train]),
          test_images, test_labels, names)


def read_image_folder(root):
  """The same from DIR/train/CLASS/*.png and DIR/test/CLASS/*.png (class folders sorted)."""
  classes = supervisor.check_image_folders(root, ('train', 'test'))[0].classes

  def split(name):
    images, labels = [], []
    for label, cls in enumerate(classes):
      for entry in sorted(os.scandir(os.path.join(root, name, cls)), key=lambda e: e.name):
        if entry.is_file() and entry.name.lower().endswith(supervisor.IMG_EXTENSIONS):
          image = utils.load_image(entry.path).permute(1, 2, 0).numpy()  # H x W x C
          if image.shape != (SIDE, SIDE, 3):
            raise utils.UsageError(f'{entry.path} is {image.shape[1]}x{image.shape[0]}: '
                                   'CIFAR shards hold 32x32 images')
          images.append(image)
          labels.append(label)
    return np.stack(images), np.asarray(labels, np.int64)

  return (*split('train'), *split('test'), classes)


def main(argv):
  del argv
  if (FLAGS.cifar_dir is None) == (FLAGS.image_folder is None):
    utils.die('give one of --cifar_dir and --image_folder')
  if not FLAGS.output or FLAGS.output.endswith('/'):
    utils.die(f'give --output PREFIX, a path or URL the shard names start with, such as '
              f'{FLAGS.output or ""}cifar (not a folder): PREFIX-train-000000.tar, ...')
  try:
    supervisor.check_outputs(None, None, FLAGS.results_json)
    if FLAGS.cifar_dir:
      train_images, train_labels, test_images, test_labels, classes = read_cifar_python(
          FLAGS.cifar_dir)
    else:
      train_images, train_labels, test_images, test_labels, classes = read_image_folder(
          FLAGS.image_folder)
  except (utils.UsageError, utils.BadDataError) as e:
    utils.die(e)
  # Shuffled before sharding, so that every shard (and every replica's share of the
  # shards) holds all classes; each repetition in a new order.
  rng = random.Random(FLAGS.shuffle_seed)
  order = []
  for _ in range(FLAGS.repeat):
    indices = list(range(len(train_labels)))
    rng.shuffle(indices)
    order += indices
  try:
    fs, path = fsspec.core.url_to_fs(FLAGS.output)
    fs.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    train = write_shards(train_images, train_labels, order, FLAGS.output + '-train-%06d.tar',
                         FLAGS.samples_per_shard, FLAGS.format)
    test = write_shards(test_images, test_labels, range(len(test_labels)),
                        FLAGS.output + '-test-%06d.tar', FLAGS.samples_per_shard, FLAGS.format)
  except OSError as e:  # No permission, a full disk, a file where a folder should be, ...
    utils.die(f'cannot write shards to --output {FLAGS.output} ({type(e).__name__}: {e}): give '
              'a place this job can write')
  print(f'Classes: {" ".join(classes)}')
  print(f'Wrote {len(order)} training samples in {len(train)} shards and {len(test_labels)} test '
        f'samples in {len(test)} shards. Train with:')
  data_flags = training_flags(len(train), len(order), len(test), len(test_labels))
  try:
    utils.write_results(FLAGS.results_json, dict(data_flags, classes=classes))
  except utils.UsageError as e:
    utils.die(e)


def training_flags(train_shards, train_samples, test_shards, test_samples):
  """Prints the train_wds_cifar.py command that trains on these shards; returns its flags."""
  data_flags = dict(wds_traindir=brace_pattern(FLAGS.output, 'train', train_shards),
                    trainsize=train_samples,
                    wds_testdir=brace_pattern(FLAGS.output, 'test', test_shards),
                    testsize=test_samples)
  print('  python train_wds_cifar.py ' + ' '.join(
      f'--{name} "{value}"' if isinstance(value, str) else f'--{name} {value}'
      for name, value in data_flags.items()) +
      # Each loader worker of each replica reads shards of its own: few shards, fewer workers.
      (f' --num_workers {train_shards}' if train_shards < DEFAULT_LOADER_WORKERS else ''))
  if train_shards < 8 * DEFAULT_LOADER_WORKERS:  # Too few for 8 devices' default workers.
    print(f'(On several devices or hosts, replicas x --num_workers must be at most the number of '
          f'training shards, {train_shards}: for more, write smaller shards with --samples_per_shard)')
  return dict(data_flags, num_workers=min(train_shards, DEFAULT_LOADER_WORKERS))

def run(argv):
  """This script from Python or a notebook cell: run(['--flag', value, ...]) returns the
  results (see --results_json) or raises what the exit code means (see command.py)."""
  import command  # Only run() and %run need command.py.
  return command.run(__file__, argv)


if __name__ == '__main__':
  if utils.in_notebook():  # %run in a notebook: a command of its own, as run() starts it.
    run(sys.argv[1:])
  else:
    app.run(main, flags_parser=utils.parse_flags)
