# SPDX-License-Identifier: BSD-3-Clause
"""Writes CIFAR-10, or ImageNet, as WebDataset tar shards for train_wds_cifar.py.

Reads the folder that CIFAR-10's official python release unpacks to (cifar-10-batches-py:
data_batch_1..5, test_batch, batches.meta; torchvision.datasets.CIFAR10 uses the same) or an
ImageNet-style image folder (DIR/train/CLASS/*.jpg, DIR/val/CLASS/*.jpg; or DIR/test), and
writes PREFIX-train-000000.tar, ..., PREFIX-test-000000.tar (PREFIX-val-... for a val
folder), ... and PREFIX-classes.txt (the class names, a line each, in label order) to a
local folder or any fsspec URL (gs://bucket/imagenet/imagenet, ...). Training samples are
shuffled once, with --shuffle_seed, so that every shard holds every class; a shard is
written under a temporary name and renamed when whole, so a stopped run (Ctrl-C, or SIGTERM
as a preempted VM gets it) leaves none that looks whole, and the same command finishes the
job. A prefix holding shards this command would not write (another run's, which training
would mix with these) is refused, unless --overwrite removes them first. While it writes it
says how far it is (samples/s, time left) on stderr: one line redrawn on a terminal, a line
every tenth of the way (and every minute) in a log.

Each sample is two tar members: an image file and KEY.cls (the label as ASCII digits).
CIFAR-10's image is KEY.rgb (the 32x32x3 uint8 pixels as 3,072 raw bytes, height x width x
channel): raw bytes decode in about 1 us (np.frombuffer), where a 32x32 PNG takes about 50,
enough to make the host, not the TPU, the bottleneck; --format png writes KEY.png instead,
which any WebDataset reader decodes (`.decode('pil')`) and any image viewer shows. An image
folder's files are kept as they are (--format original, its default: ImageNet's JPEGs, no
decoding, no resizing) as KEY.jpg, KEY.png or KEY.webp by what their bytes are; a file of
another format (BMP, TIFF, ...) is stored as a lossless PNG.

  python make_cifar_shards.py --cifar_dir data/cifar-10-batches-py --output shards/cifar
  python make_cifar_shards.py --image_folder imagenet --output gs://bucket/imagenet/imagenet \
      --samples_per_shard 2002   # The article's 640 training shards.
"""

import contextlib
import functools
import io
import itertools
import os
import pickle
import random
import re
import signal
import sys
import tarfile
import time

import fsspec
import fsspec.implementations.local
import fsspec.spec
import numpy as np
import PIL.Image
from absl import app, flags

import supervisor
import utils

SIDE = 32  # CIFAR images are 32x32 RGB.
FLAGS = flags.FLAGS
flags.DEFINE_string('cifar_dir', None, 'The cifar-10-batches-py folder of the python release.')
flags.DEFINE_string('image_folder', None, 'Or a folder with train/CLASS/*.jpg and val/CLASS/*.jpg '
                    '(or test/CLASS/...), as ImageNet is.')
flags.DEFINE_string('output', None, 'Shard prefix: a local path or fsspec URL, e.g. gs://b/cifar.')
flags.DEFINE_integer('samples_per_shard', 1000, 'Samples in each shard (the last may hold fewer; '
                     'ImageNet in the 640 training shards of the Cloud TPU article: 2002).',
                     lower_bound=1)
flags.DEFINE_integer('repeat', 1, 'Write the training set this many times, each reshuffled '
                     '(the Cloud TPU tutorial made an ImageNet-sized set this way: 25 '
                     'x 50,000 = 1.25M samples).', lower_bound=1)
flags.DEFINE_integer('shuffle_seed', 0, 'Seed of the shuffle (training samples; an image folder\'s '
                     'evaluation samples too, which it holds class by class).')
flags.DEFINE_enum('format', None, ['rgb', 'png', 'original'], 'Image files: rgb, raw 32x32 bytes '
                  '(fastest to read; CIFAR), png, 32x32 PNG (readable by other tools; lossless, '
                  'about as big), or original, an image folder\'s files as they are (any size). '
                  'Default: rgb for --cifar_dir, original for --image_folder.')
flags.DEFINE_bool('overwrite', False, 'First remove the shards and classes file that --output '
                  'holds (an earlier run\'s); without it such shards, if this run would not write '
                  'the same names, are refused.')
flags.DEFINE_string('results_json', None, "Write train_wds_cifar.py's data flags here (JSON).")
# A notebook may import several scripts (the same flag names) or %run one again.
utils.redefinable(FLAGS)

TRAIN_BATCHES = [f'data_batch_{i}' for i in range(1, 6)]
DEFAULT_LOADER_WORKERS = 4  # train_wds_cifar.py's --num_workers
DEFAULT_BATCH_SIZE = 128  # train_wds_cifar.py's --batch_size
SPLITS = ('train', 'val', 'test')  # The shards this script writes: PREFIX-SPLIT-NNNNNN.tar.
PLAIN_SECONDS = 60  # Progress in a log: a line every tenth of the way, and at least this often.
# The first bytes of the image files kept as they are, and their key in a sample.
KEPT = {b'\xff\xd8\xff': 'jpg', b'\x89PNG\r\n\x1a\n': 'png', b'RIFF': 'webp'}


def add_member(tar, name, data):
  info = tarfile.TarInfo(name)
  info.size = len(data)
  info.mode = 0o444
  tar.addfile(info, io.BytesIO(data))


def encode(image, image_format):
  """(key, bytes) of an image (uint8 H x W x 3) as a sample's file: raw rgb or png."""
  if image_format == 'rgb':
    return 'rgb', image.tobytes()
  with io.BytesIO() as f:
    PIL.Image.fromarray(image).save(f, format='PNG')
    return 'png', f.getvalue()


def write_shards(samples, pattern, samples_per_shard, progress=None):
  """Writes the samples, (image file key, its bytes, label) each, in turn to pattern % 0,
  pattern % 1, ..., samples_per_shard a shard; returns the URLs written. samples may be a
  generator: a shard's samples are all that is held in memory. progress: a Progress told of
  each shard written."""
  urls, samples = [], iter(samples)
  key = 0
  while shard := list(itertools.islice(samples, samples_per_shard)):
    url = pattern % len(urls)
    with written_whole(url) as f, tarfile.open(fileobj=f, mode='w',
                                               format=tarfile.USTAR_FORMAT) as tar:
      for image_key, data, label in shard:
        add_member(tar, f'{key:08d}.{image_key}', data)
        add_member(tar, f'{key:08d}.cls', str(int(label)).encode())
        key += 1
    urls.append(url)
    if progress:
      progress.add(len(shard))
  return urls


class Progress:
  """How far the writing is: samples written of all, samples/s, time left. On a terminal one
  line redrawn in place; in a log, a pod's output or a notebook (not a terminal) a plain line
  at each tenth of the way and at least every PLAIN_SECONDS. On stderr, as tqdm writes it, so
  that stdout holds only the lines a program reads (the command to train with)."""

  def __init__(self, total, stream=sys.stderr):
    self.total, self.done, self.stream = total, 0, stream
    self.live = stream.isatty()
    self.start = self.said = time.monotonic()
    self.tenths, self.width = 0, 0

  def __enter__(self):
    return self

  def __exit__(self, *exception):
    if self.live and self.width:  # The next line, the last or a stop's error, on a line of its own.
      self.stream.write('\n')
      self.stream.flush()

  def add(self, count):
    self.done += count
    now, tenths = time.monotonic(), self.done * 10 // max(1, self.total)
    if self.live and (now - self.said >= 0.2 or self.done >= self.total):  # 5 redraws a second
      line = self.line(now)
      self.stream.write('\r' + line.ljust(self.width))  # Spaces over a longer line before it.
      self.stream.flush()
      self.said, self.width = now, max(self.width, len(line))
    elif not self.live and (tenths > self.tenths or now - self.said >= PLAIN_SECONDS):
      print(self.line(now), file=self.stream, flush=True)
      self.said, self.tenths = now, tenths

  def line(self, now):
    seconds = now - self.start
    rate = self.done / seconds if seconds > 0 else 0.0
    when = (f'done in {clock(seconds)}' if self.done >= self.total else
            f'{clock((self.total - self.done) / rate)} left' if rate else 'time left unknown')
    return (f'{self.done:,} of {self.total:,} samples written ({self.done * 100 // self.total}%), '
            f'{rate:,.0f} samples/s, {when}')


def clock(seconds):
  """H:MM:SS, as tqdm and time(1) show a duration."""
  minutes, seconds = divmod(round(seconds), 60)
  return f'{minutes // 60}:{minutes % 60:02d}:{seconds:02d}'


def plural(count, noun):
  return f'{count} {noun}' + ('' if count == 1 else 's')


@contextlib.contextmanager
def written_whole(url):
  """A file to write to url that no reader sees half-written: a local file is written under a
  temporary name, then moved (and removed if the writing stops: Ctrl-C, a full disk); a
  bucket shows an object only once its upload is whole."""
  fs, path = fsspec.core.url_to_fs(url)
  local = isinstance(fs, fsspec.implementations.local.LocalFileSystem)
  temporary = path + '.tmp' if local else path
  if local:
    fs.makedirs(os.path.dirname(path), exist_ok=True)
  try:
    f = fs.open(temporary, 'wb')
    try:
      yield f
    except BaseException:
      if isinstance(f, fsspec.spec.AbstractBufferedFile):  # A bucket's upload (gcsfs, s3fs):
        f.discard()  # dropped, where closing would commit what was written.
        f.closed = True
      raise
    finally:
      f.close()
    if local:
      fs.mv(temporary, path)
  finally:
    if local and fs.exists(temporary):
      fs.rm(temporary)


def earlier_files(fs, path):
  """What the prefix path (in fs) holds of an earlier run: its shards, the temporary files of
  a killed one and its classes file. Another prefix's (PATH-10-train-...) are not counted."""
  base = path.rsplit('/', 1)[-1]
  ours = re.compile(rf'{re.escape(base)}-(({"|".join(SPLITS)})-\d{{6}}\.tar(\.tmp)?|classes\.txt)')
  try:
    names = fs.ls(os.path.dirname(path), detail=False)
  except FileNotFoundError:  # A folder that the writing makes.
    return []
  return sorted(name for name in names if ours.fullmatch(name.rstrip('/').rsplit('/', 1)[-1]))


def clear_prefix(prefix, shard_counts, overwrite):
  """Refuses a prefix holding shards that this run would not write ({split: shards}): another
  run's, which training would read mixed with these under the new names. Shards it writes
  again are no reason (the same command after a stop finishes the job). With overwrite,
  removes the prefix's shards and classes file instead. Before anything is written."""
  fs, path = fsspec.core.url_to_fs(prefix)
  found = supervisor.reach(prefix, lambda: earlier_files(fs, path))
  if overwrite:
    if found:
      fs.rm(found)
      print(f'Removed {plural(len(found), "file")} of an earlier run from {prefix}-*', flush=True)
    return
  ours = {f'{path.rsplit("/", 1)[-1]}-{split}-{i:06d}.tar'
          for split, count in shard_counts.items() for i in range(count)}
  stale = [name.rsplit('/', 1)[-1] for name in found if name.endswith('.tar')]
  stale = [name for name in stale if name not in ours]
  if stale:
    raise utils.UsageError(
        f'--output {prefix} holds {plural(len(stale), "shard")} that this command would not '
        f'write, such as {stale[0]} (another run\'s: training would mix them with these): give '
        f'--overwrite to remove the shards and classes file of {prefix} first, or another --output')


def brace_pattern(prefix, split, count):
  return f'{prefix}-{split}-{{{0:06d}..{count - 1:06d}}}.tar'


class CifarUnpickler(pickle.Unpickler):
  """Reads what a CIFAR-10 batch holds (dicts, lists, strings, bytes, numbers, numpy arrays) and
  refuses any other object before it is made: unpickling one can run any code."""
  ARRAYS = {(module, name) for package in ('numpy.core', 'numpy._core') for module, name in (
      (f'{package}.multiarray', '_reconstruct'), (f'{package}.multiarray', 'scalar'),
      (f'{package}.numeric', '_frombuffer'))} | {('numpy', 'ndarray'), ('numpy', 'dtype')}

  def find_class(self, module, name):
    if (module, name) == ('_codecs', 'encode'):  # Bytes, as Python 3 pickles them.
      return self.latin1
    if (module, name) not in self.ARRAYS:
      raise pickle.UnpicklingError(f'it holds a {module}.{name}, which no CIFAR-10 batch holds')
    return super().find_class(module, name)

  @staticmethod
  def latin1(text, encoding):
    """_codecs.encode for the one codec of pickled bytes: another ('hex', nested in itself)
    doubles the size at each level (754 bytes of pickle made 256 MiB)."""
    if encoding != 'latin1':
      raise pickle.UnpicklingError(f'it encodes bytes as {encoding!r}, which no CIFAR-10 batch '
                                   'does')
    return text.encode('latin1')


def read_cifar_python(folder):
  """(train_images, train_labels, test_images, test_labels, class_names) from the pickles."""
  def unpickle(name):
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
      raise utils.UsageError(f'{path} is missing: --cifar_dir must be the cifar-10-batches-py '
                             'folder (data_batch_1..5, test_batch, batches.meta)')
    try:
      with open(path, 'rb') as f:
        return CifarUnpickler(f, encoding='bytes').load()
    except pickle.UnpicklingError as e:
      raise utils.UsageError(f'{path} is not a CIFAR-10 batch ({e}): refused unread, since loading '
                             'it could run code; download the python release again') from None
    except Exception as e:
      raise utils.UsageError(f'cannot read {path} ({e}): download the python release again')

  def images_labels(name):
    batch = unpickle(name)
    try:  # Rows are 3072 bytes: the red plane, then green, then blue (channel-first).
      data, labels = batch[b'data'], batch[b'labels']
      if isinstance(labels, np.ndarray) and labels.ndim == 1:  # (The release's is a list.)
        labels = labels.tolist()
      # Their kinds and sizes first: a pickle of 300 bytes can nest references to one list to
      # make billions of elements, which np.asarray would expand.
      if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2 and
              data.shape[1] == 3072):
        kind = (f'a {data.dtype} array of shape {data.shape}' if isinstance(data, np.ndarray)
                else f'a {type(data).__name__}')
        raise ValueError(f'b"data" is {kind}, not N rows of 3072 uint8 bytes')
      if not (isinstance(labels, list) and len(labels) == len(data) and
              all(type(label) is int for label in labels)):
        raise ValueError(f'{len(labels) if isinstance(labels, list) else "no list of"} labels '
                         f'for data of shape {data.shape}, or a label not an int')
      images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
      labels = np.asarray(labels, np.int64)
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


def cifar_splits(folder, image_format):
  """{split: [samples]}, the class names: the release's images as encode makes them."""
  train_images, train_labels, test_images, test_labels, classes = read_cifar_python(folder)
  def samples(images, labels):
    return [lambda i=i: (*encode(images[i], image_format), labels[i]) for i in range(len(labels))]
  return {'train': samples(train_images, train_labels),
          'test': samples(test_images, test_labels)}, classes


def folder_splits(root, image_format):
  """The same from DIR/train/CLASS/* and DIR/val/CLASS/* (or DIR/test): each sample read from
  its file when written, kept as it is (original) or as a 32x32 image (rgb, png)."""
  test = 'val' if os.path.isdir(os.path.join(root, 'val')) else 'test'
  if not os.path.isdir(os.path.join(root, test)):
    raise utils.UsageError(f'{os.path.join(root, "val")} is not a folder: {root} needs train and '
                           f'val (or test) with one folder of images per class ({root}/val/CLASS/'
                           'x.jpg)')
  datasets = supervisor.check_image_folders(root, ('train', test))
  read = kept_file if image_format == 'original' else functools.partial(cifar_file, image_format)
  return ({split: [functools.partial(read, path, label) for path, label in dataset.samples]
           for split, dataset in zip(('train', test), datasets)}, datasets[0].classes)


def kept_file(path, label):
  """(key, bytes, label) of an image file as it is: a JPEG, PNG or WebP's own bytes, any other
  image as a lossless PNG."""
  with open(path, 'rb') as f:
    data = f.read()
  image_key = next((key for magic, key in KEPT.items() if data.startswith(magic)), None)
  if image_key == 'webp' and data[8:12] != b'WEBP':
    image_key = None
  if image_key is None:
    return (*encode(utils.load_image(path).permute(1, 2, 0).numpy(), 'png'), label)
  check_pixels(path, data)
  return image_key, data, label


def check_pixels(path, data):
  """A BadDataError for an image file that the reader would refuse for its pixel count (see
  utils.check_pixels), from its header: it would be skipped every epoch. One whose header
  cannot be read is stored: the reader skips it with a warning, as any corrupt sample."""
  try:
    size = (data.startswith(b'\xff\xd8\xff') and utils.jpeg_size(data)) or utils.pil_size(data)
    if size:
      utils.check_pixels(*size)
  except OSError:
    pass
  except ValueError as e:
    raise utils.BadDataError(f'image {path}: {e}; resize it or remove it') from None


def cifar_file(image_format, path, label):
  """(key, bytes, label) of a 32x32 image file as make_cifar_shards.py writes CIFAR-10."""
  image = utils.load_image(path).permute(1, 2, 0).numpy()  # H x W x C
  if image.shape != (SIDE, SIDE, 3):
    raise utils.UsageError(f'{path} is {image.shape[1]}x{image.shape[0]}: --format {image_format} '
                           'holds 32x32 images; keep the files as they are with --format original')
  return (*encode(image, image_format), label)


def main(argv):
  del argv
  image_format = checked_format()
  try:
    supervisor.check_outputs(None, None, FLAGS.results_json)
    if FLAGS.cifar_dir:
      splits, classes = cifar_splits(FLAGS.cifar_dir, image_format)
    else:
      splits, classes = folder_splits(FLAGS.image_folder, image_format)
  except (utils.UsageError, utils.BadDataError) as e:
    utils.die(e)
  (train, train_samples), (test_name, test_samples) = splits.items()
  # Shuffled before sharding, so that every shard (and every replica's share of the
  # shards) holds all classes; each repetition in a new order.
  rng = random.Random(FLAGS.shuffle_seed)
  order = []
  for _ in range(FLAGS.repeat):
    order += rng.sample(range(len(train_samples)), len(train_samples))
  test_order = (range(len(test_samples)) if FLAGS.cifar_dir else  # The release's own order.
                rng.sample(range(len(test_samples)), len(test_samples)))
  jobs = ((train, train_samples, order), (test_name, test_samples, test_order))
  with said_as_one_line():
    clear_prefix(FLAGS.output, {split: -(-len(indices) // FLAGS.samples_per_shard)
                                for split, _, indices in jobs}, FLAGS.overwrite)
  print(f'Writing {len(order):,} training samples shuffled with --shuffle_seed {FLAGS.shuffle_seed} '
        f'and {len(test_samples):,} {test_name} samples, {image_format} images, '
        f'{FLAGS.samples_per_shard} a shard, to {FLAGS.output}-*', flush=True)
  written = write_all(jobs, classes)
  print(f'Classes ({len(classes)}, in {FLAGS.output}-classes.txt): {" ".join(classes[:20])}'
        + (' ...' if len(classes) > 20 else ''))
  print(f'Wrote {plural(len(order), "training sample")} in {plural(len(written[0]), "shard")} and '
        f'{plural(len(test_samples), test_name + " sample")} in {plural(len(written[1]), "shard")}. '
        'Train with:')
  data_flags = training_flags(test_name, len(written[0]), len(order), len(written[1]),
                              len(test_samples), image_format)
  try:
    utils.write_results(FLAGS.results_json, dict(data_flags, classes=classes))
  except utils.UsageError as e:
    utils.die(e)


def checked_format():
  """The image format of the shards, once the flags are checked."""
  if (FLAGS.cifar_dir is None) == (FLAGS.image_folder is None):
    utils.die('give one of --cifar_dir and --image_folder')
  if not FLAGS.output or FLAGS.output.endswith('/'):
    utils.die(f'give --output PREFIX, a path or URL the shard names start with, such as '
              f'{FLAGS.output or ""}cifar (not a folder): PREFIX-train-000000.tar, ...')
  image_format = FLAGS.format or ('rgb' if FLAGS.cifar_dir else 'original')
  if FLAGS.cifar_dir and image_format == 'original':
    utils.die('--format original keeps the files of an --image_folder: CIFAR-10\'s release has '
              'none; give --format rgb or png')
  return image_format


def write_all(jobs, classes):
  """Writes the shards of each (split, samples, order of the samples) in jobs, then the
  classes file; returns each split's shard URLs."""
  with said_as_one_line(), Progress(sum(len(indices) for _, _, indices in jobs)) as progress:
    fs, path = fsspec.core.url_to_fs(FLAGS.output)
    fs.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    try:
      written = [write_shards((samples[i]() for i in indices), f'{FLAGS.output}-{split}-%06d.tar',
                              FLAGS.samples_per_shard, progress)
                 for split, samples, indices in jobs]
    except utils.BadDataError as e:  # An image refused midway (its pixels): what is left.
      left = [name for name in earlier_files(fs, path) if name.endswith('.tar')]
      raise utils.BadDataError(f'{e}, then run the same command again (it writes every shard '
                               f'anew); until then {FLAGS.output}-* holds '
                               f'{plural(len(left), "whole shard")} and no classes file, not the '
                               'whole set') from None
    with written_whole(FLAGS.output + '-classes.txt') as f:
      f.write('\n'.join(classes).encode() + b'\n')
  return written


@contextlib.contextmanager
def said_as_one_line():
  """What the user can fix, ends as one `error:` line: bad input or a place that cannot be
  written (no permission, a full disk, a file where a folder should be, ...)."""
  try:
    yield
  except (utils.UsageError, utils.BadDataError) as e:  # An image that cannot be read, ...
    utils.die(e)
  except OSError as e:
    utils.die(f'cannot write shards to --output {FLAGS.output} ({type(e).__name__}: {e}): give '
              'a place this job can write')


def training_flags(test_name, train_shards, train_samples, test_shards, test_samples, image_format):
  """Prints the train_wds_cifar.py command that trains on these shards on one device as it is
  printed (its defaults lowered where they would be refused); returns its flags."""
  data_flags = dict(wds_traindir=brace_pattern(FLAGS.output, 'train', train_shards),
                    trainsize=train_samples,
                    wds_testdir=brace_pattern(FLAGS.output, test_name, test_shards),
                    testsize=test_samples)
  # Each loader worker of each replica reads shards of its own: few shards, fewer workers.
  if train_shards < DEFAULT_LOADER_WORKERS:
    data_flags['num_workers'] = train_shards
  if train_samples < DEFAULT_BATCH_SIZE:  # No whole batch: the largest power of 2 that fits.
    data_flags['batch_size'] = 1 << (train_samples.bit_length() - 1)
  print('  python train_wds_cifar.py ' + ' '.join(
      f'--{name} "{value}"' if isinstance(value, str) else f'--{name} {value}'
      for name, value in data_flags.items()))
  if image_format == 'original':
    print('(It crops the images to --img_dim, 32 unless given: ImageNet trains at 224, with '
          '--img_dim 224 --model resnet50)')
  limits = []  # What 8 devices (a TPU host) with the defaults would be refused for.
  if train_shards < 8 * DEFAULT_LOADER_WORKERS:
    limits.append(f'replicas x --num_workers at most the {plural(train_shards, "training shard")} '
                  '(for more, write smaller shards with --samples_per_shard)')
  if train_samples < 8 * DEFAULT_BATCH_SIZE:
    limits.append(f'replicas x --batch_size at most the {plural(train_samples, "training sample")}')
  if limits:
    print(f'(On several devices or hosts: {"; ".join(limits)})')
  return dict(data_flags, num_workers=min(train_shards, DEFAULT_LOADER_WORKERS))


class Preempted(BaseException):
  """SIGTERM (a VM's preemption or maintenance notice, a container stopped), raised where the
  writing is as Ctrl-C raises KeyboardInterrupt: the half-written shard is removed on its way
  out. A BaseException, as KeyboardInterrupt is, so that no `except Exception` stops it."""


def preempted(signum, frame):
  signal.signal(signal.SIGTERM, signal.SIG_IGN)  # A second one would cut the clean-up short.
  raise Preempted()


def run(argv):
  """This script from Python or a notebook cell: run(['--flag', value, ...]) returns the
  results (see --results_json) or raises what the exit code means (see command.py)."""
  import command  # Only run() and %run need command.py.
  return command.run(__file__, argv)


if __name__ == '__main__':
  if utils.in_notebook():  # %run in a notebook: a command of its own, as run() starts it.
    run(sys.argv[1:])
  else:
    signal.signal(signal.SIGTERM, preempted)
    # Ctrl-C as KeyboardInterrupt even when started with SIGINT ignored (a background job of a
    # script, whose SIGINT Python then leaves ignored), as the training scripts take it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
      app.run(main, flags_parser=utils.parse_flags)
    except (KeyboardInterrupt, Preempted) as e:
      name, code = ((utils.INTERRUPT, utils.EXIT_INTERRUPTED) if isinstance(e, KeyboardInterrupt)
                    else ('SIGTERM', utils.EXIT_PREEMPTED))
      utils.die(f'stopped by {name}: the shards written are whole (one half-written is removed); '
                'run the same command to write them all', code)
