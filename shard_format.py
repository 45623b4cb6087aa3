# SPDX-License-Identifier: BSD-3-Clause
"""The CIFAR shard format, for its writer (make_cifar_shards.py) and its reader
(train_wds_cifar.py): WebDataset tar shards in which each sample is two tar members,
KEY.rgb, the image as 3,072 raw bytes (32x32x3 uint8, height x width x channel), and
KEY.cls, the label as ASCII digits. Raw bytes decode in about 1 us (np.frombuffer); a
32x32 PNG takes about 50 us, enough to make the host, not the TPU, the bottleneck. The
writer can write KEY.png instead, and the reader also takes the images that webdataset's
ShardWriter writes (ppm, png, jpg, webp) and numpy's npy.
"""

import io
import re
import sys
import tarfile

import braceexpand
import fsspec
import numpy as np
import PIL.Image
import torch
import webdataset as wds

import utils

SIDE = 32  # CIFAR images are 32x32 RGB.
# The image files a sample may hold, tried in this order: raw bytes (make_cifar_shards.py),
# the formats webdataset's ShardWriter writes from a PIL image, and numpy's.
IMAGE_KEYS = ('rgb', 'ppm', 'png', 'jpg', 'jpeg', 'webp', 'npy')
PPM_HEADER = re.compile(rb'P6\s+(\d+)\s+(\d+)\s+255\s')  # 8-bit binary RGB, no comment.



# ---------------------------------------------------------------------------- writing
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


# ---------------------------------------------------------------------------- reading
def shard_missing(url):
  """Whether the shard does not exist; a UsageError if its server or bucket cannot be asked."""
  try:
    utils.reach(url, lambda: _info(url))
    return False
  except utils.UsageError:
    raise
  except FileNotFoundError as e:
    # fsspec's http also says this for a server it cannot reach, with the connection's
    # error (an OSError) as the cause.
    if not isinstance(e.__cause__, OSError) or isinstance(e.__cause__, FileNotFoundError):
      return True
    error = e.__cause__
  except Exception as e:  # A name that does not resolve, a bucket without credentials, ...
    error = e
  raise utils.UsageError(f'cannot reach {url} ({type(error).__name__}: {error}): check that '
                         'the server or bucket is up and the address is right')


def _info(url):
  fs, path = fsspec.core.url_to_fs(url)
  return fs.info(path)


def check_shards(flag, pattern, strict):
  """A UsageError if no shard of the pattern exists (pipe: commands are not checked), or if
  some do not and strict; else a warning line naming those that will be skipped. Returns the
  number of shards the pattern names."""
  urls = list(braceexpand.braceexpand(pattern))
  missing = [url for url in urls if not url.startswith('pipe:') and shard_missing(url)]
  if len(missing) == len(urls):
    raise utils.UsageError(f'--{flag}: no shard found at {pattern} (first: {urls[0]}); check the '
                           'path or URL and the {first..last} range')
  if missing:
    message = f'--{flag}: {len(missing)} of {len(urls)} shards do not exist, e.g. {missing[0]}'
    if strict:
      raise utils.UsageError(f'{message}: fix the pattern, or drop --fail_on_bad_data to skip them')
    print(f'warning: {message}; they will be skipped', file=sys.stderr, flush=True)
  first = next((url for url in urls if url not in missing and not url.startswith('pipe:')), None)
  if first:
    check_format(flag, first)
  return len(urls)


def check_format(flag, url):
  """A UsageError if the first sample of the shard is not of a kind this script reads: shards
  of another format are one line at start, not a warning for every sample."""
  try:
    with fsspec.open(url, 'rb') as stream:
      files = wds.tariterators.tar_file_expander([dict(url=url, stream=stream)])
      sample = next(wds.tariterators.group_by_keys(files))
  except Exception:
    return  # No sample can be read: skipped with a warning (or fatal) when it is.
  try:
    decode(sample)
  except ForeignSample as e:
    raise utils.UsageError(f'--{flag}: sample {sample["__key__"]} of {url} {e}') from None
  except BadSample:
    pass  # One corrupt sample: skipped with a warning (or fatal) when it is read.


class BadSample(ValueError):
  """A sample that cannot be used, saying why."""


class ForeignSample(BadSample):
  """A sample that is not one of a set this script can read (keys, image size)."""


def decode(sample):
  """(image uint8 32x32x3, label) of a sample: the image from its rgb (3,072 raw bytes), ppm,
  png, jpg, jpeg, webp (converted to RGB as PIL does) or npy (uint8 32x32x3) file, the label
  from its cls file (ASCII digits: how ShardWriter writes an int). Shards of another image
  format: add its file extension to IMAGE_KEYS and its decoding here."""
  image_key = next((key for key in IMAGE_KEYS if key in sample), None)
  if image_key is None or 'cls' not in sample:
    found = ', '.join(sorted(key for key in sample if not key.startswith('__'))) or 'no file'
    raise ForeignSample(f'holds {found}, where an image ({", ".join(IMAGE_KEYS)}) and a label '
                        "(cls) are expected: write the shards with such keys, e.g. ShardWriter "
                        "and {'ppm': PIL image, 'cls': int}, or with make_cifar_shards.py")
  data = sample[image_key]
  try:
    if image_key == 'rgb':
      image = np.frombuffer(data, np.uint8).reshape(SIDE, SIDE, 3)
    elif image_key == 'npy':
      image = np.load(io.BytesIO(data), allow_pickle=False)
    elif image_key == 'ppm' and (header := PPM_HEADER.match(data)):  # Raw RGB: no PIL needed.
      width, height = int(header[1]), int(header[2])
      image = np.frombuffer(data, np.uint8, width * height * 3, header.end())
      image = image.reshape(height, width, 3)
    else:
      with PIL.Image.open(io.BytesIO(data)) as pil:
        image = np.asarray(pil.convert('RGB'))
    label = int(sample['cls'])
  except (ValueError, OSError, EOFError, SyntaxError) as e:  # What PIL and numpy raise.
    raise BadSample(f'has no readable {image_key} image and cls label ({e!r})') from None
  if image.shape != (SIDE, SIDE, 3) or image.dtype != np.uint8:
    size = (f'{image.shape[1]}x{image.shape[0]}' if image.ndim == 3 and image.dtype == np.uint8
            else f'a {image.dtype} array of shape {image.shape}')
    raise ForeignSample(f'holds a {image_key} image of {size}: this script trains on 32x32 RGB '
                        'images (uint8 arrays in npy); resize them when writing the shards')
  return image, label


def read_samples(urls, on_bad):
  """(image uint8 HWC, label) of every sample of the shards in turn. A shard that cannot be
  opened or read to the end, or a sample without a readable image and label, is passed
  to on_bad(message), which raises or counts it, and reading goes on."""
  for url in urls:
    try:
      # A pipe: command (e.g. 'pipe:gsutil cat gs://bucket/shard.tar') or an fsspec URL.
      stream = wds.gopen(url) if url.startswith('pipe:') else fsspec.open(url, 'rb').open()
      try:
        whole = WholeTar(stream)
        files = wds.tariterators.tar_file_expander([dict(url=url, stream=whole)])
        for sample in wds.tariterators.group_by_keys(files):
          try:
            yield decode(sample)
          except BadSample as e:
            on_bad(f'sample {sample["__key__"]} of {url} {e}')
        if whole.cut_short():
          on_bad(f'shard {url} cannot be read to the end (it ends inside a tar header, '
                 f'after {whole.size} bytes: the rest of it is lost)')
      finally:
        stream.close()
    except utils.BadDataError:
      raise
    except Exception as e:  # A missing shard, a truncated or corrupt tar.
      on_bad(f'shard {url} cannot be read to the end ({type(e).__name__}: '
             f'{e.args[0] if e.args else e})')


class WholeTar:
  """A shard's bytes as tarfile reads them, which tell at their end whether the tar was whole:
  tarfile takes a header cut short for the end of the archive, and says nothing, but a
  whole tar ends in zero blocks (a compressed one is left to its decompressor)."""

  def __init__(self, stream):
    self.stream, self.size, self.head, self.tail = stream, 0, b'', b''

  def read(self, size=-1):
    data = self.stream.read(size)
    self.head = self.head or data[:6]
    self.size += len(data)
    self.tail = (self.tail + data[-tarfile.BLOCKSIZE:])[-tarfile.BLOCKSIZE:]  # 1 KB, not the read
    return data

  def cut_short(self):
    """Whether the stream, read to its end, is not a whole tar."""
    while self.read(1 << 16):
      pass
    compressed = self.head.startswith((b'\x1f\x8b', b'BZh', b'\xfd7zXZ'))
    return not compressed and (self.size % tarfile.BLOCKSIZE != 0 or
                               self.tail != bytes(tarfile.BLOCKSIZE))


class BadData:
  """A missing or corrupt shard or sample: raised (strict), or counted in counts[slot] with a
  warning line for the first few; counts may be a tensor that the loader workers of a
  replica share (one slot each), so that a million bad samples are not a million lines."""
  SHOWN = 5

  def __init__(self, strict, counts=None, slot=0):
    self.strict, self.slot = strict, slot
    self.counts = torch.zeros(1, dtype=torch.int64) if counts is None else counts

  @property
  def count(self):
    return int(self.counts[self.slot])

  def __call__(self, message):
    if self.strict:
      raise utils.BadDataError(f'{message}: replace it, or drop --fail_on_bad_data to skip it')
    self.counts[self.slot] += 1
    shown = int(self.counts.sum())
    if shown <= self.SHOWN:
      more = ' (more are counted, not shown: see the count at the end)' if shown == self.SHOWN else ''
      print(f'warning: {message}; skipped{more}', file=sys.stderr, flush=True)
