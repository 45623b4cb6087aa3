# SPDX-License-Identifier: BSD-3-Clause
"""Host input pipeline for 32x32 images: samples/s of train_wds_cifar.py's shard pipeline,
over shards of each image format it reads, against torchvision ImageFolder over the same
images as loose PNG files.

Every pipeline does what a CIFAR training step needs: read, decode, random crop with 4 px
padding, horizontal flip, batch. ImageFolder also converts to float and normalises on the
host, as the usual torchvision pipeline does; the shard pipeline leaves both to the device
and sends uint8. The shards: raw bytes and PNG as make_cifar_shards.py writes them
(--format rgb, png), PPM as the Cloud TPU WebDataset tutorial writes them (webdataset's
ShardWriter and PIL images). Prints a markdown table.

  python benchmarks/input_pipeline.py            # 10,000 images, about 4 minutes
  python benchmarks/input_pipeline.py --quick    # 1,000 images, a smoke test

--batch_size (128) is train_wds_cifar.py's flag.
"""

import io
import os
import pathlib
import platform
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import torch
import torchvision
import webdataset as wds
from absl import app, flags
from PIL import Image

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import shard_format  # noqa: E402
import train_wds_cifar  # noqa: E402
import utils  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_bool('quick', False, '1,000 images and one pass: checks that the benchmark runs.')
flags.DEFINE_list('workers', ['0', '2'], 'DataLoader worker counts to measure.')


def make_images(root, count, classes=10):
  """count random 32x32 PNGs in root/CLASS/ and the same pixels as arrays."""
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (count, 32, 32, 3), dtype=np.uint8)
  labels = rng.integers(0, classes, count)
  for c in range(classes):
    (root / f'class{c}').mkdir(parents=True)
  for i, (image, label) in enumerate(zip(images, labels)):
    Image.fromarray(image).save(root / f'class{label}' / f'{i}.png')
  return images, labels


def rate(loader, passes):
  """Samples/s over `passes` passes of the loader, timed from its first batch."""
  start, samples = None, 0
  for _ in range(passes):
    for _, labels in loader:
      if start is None:  # The clock starts once the first workers are up.
        start = time.perf_counter()
        continue
      samples += len(labels)
  return samples / (time.perf_counter() - start)


def write_tutorial_shards(images, labels, pattern, samples_per_shard):
  """The images as the Cloud TPU WebDataset tutorial writes them: PPM from PIL, int labels."""
  with wds.ShardWriter(pattern, maxcount=samples_per_shard, verbose=0) as sink:
    for i, (image, label) in enumerate(zip(images, labels)):
      sink.write({'__key__': '%07d' % i, 'ppm': Image.fromarray(image), 'cls': int(label)})
  return sorted(str(path) for path in pathlib.Path(pattern).parent.glob('*.tar'))


def shard_loader(urls, count, workers):
  """train_wds_cifar.py's loader over the shards: one pass is the batches they hold."""
  batches = count // FLAGS.batch_size
  shards = train_wds_cifar.TrainShards(urls, 0, 1, batches, SimpleNamespace(
      batch_size=FLAGS.batch_size, shuffle_buffer=count, seed=0, fail_on_bad_data=True,
      num_workers=workers))
  # Workers live through the passes, as through the epochs of the training scripts.
  return utils.EpochLoader(torch.utils.data.DataLoader(
      shards, batch_size=None, num_workers=workers, persistent_workers=workers > 0), batches,
      order=shards)


def decode_costs(images):
  """Microseconds shard_format.decode takes for one image of each format it reads."""
  def encoded(image, image_format, **options):
    with io.BytesIO() as f:
      if image_format == 'NPY':
        np.save(f, image)
      else:
        Image.fromarray(image).save(f, format=image_format, **options)
      return f.getvalue()
  files = {'rgb': lambda image: image.tobytes(), 'ppm': lambda image: encoded(image, 'PPM'),
           'png': lambda image: encoded(image, 'PNG'),
           'jpg': lambda image: encoded(image, 'JPEG', quality=95),
           'webp': lambda image: encoded(image, 'WEBP', lossless=True),
           'npy': lambda image: encoded(image, 'NPY')}
  costs = {}
  for key, encode in files.items():
    samples = [{'__key__': str(i), key: encode(image), 'cls': b'1'} for i, image in enumerate(images)]
    start = time.perf_counter()
    for sample in samples:
      shard_format.decode(sample)
    costs[key] = ((time.perf_counter() - start) / len(samples) * 1e6,
                  sum(len(sample[key]) for sample in samples) / len(samples))
  return costs


def main(argv):
  del argv
  count = 1000 if FLAGS.quick else 10000
  passes = 1 if FLAGS.quick else 5
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    images, labels = make_images(tmp / 'png', count)
    per_shard = count // 10
    shards = {f'shards, {image_format}': shard_format.write_shards(
        images, labels, range(count), str(tmp / image_format / 'train-%06d.tar'), per_shard,
        image_format) for image_format in ('rgb', 'png')}
    (tmp / 'ppm').mkdir()
    shards['shards, ppm (tutorial)'] = write_tutorial_shards(
        images, labels, str(tmp / 'ppm' / 'train-%06d.tar'), per_shard)
    T = torchvision.transforms
    folder = torchvision.datasets.ImageFolder(tmp / 'png', T.Compose([
        T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(),
        T.Normalize(train_wds_cifar.CIFAR_MEAN, train_wds_cifar.CIFAR_STD)]))
    for workers in map(int, FLAGS.workers):
      folder_loader = torch.utils.data.DataLoader(folder, FLAGS.batch_size, shuffle=True,
                                                  num_workers=workers, drop_last=True,
                                                  persistent_workers=workers > 0)
      folder_rate = rate(folder_loader, passes)
      rows.append(('ImageFolder, loose PNG files', workers, folder_rate, 1.0))
      for name, urls in shards.items():
        shard_rate = rate(shard_loader(urls, count, workers), passes)
        rows.append((name, workers, shard_rate, shard_rate / folder_rate))
  machine = f'{platform.processor() or platform.machine()}, {os.cpu_count()} cores'
  print(f'Decoding one 32x32 noise image (shard_format.decode, mean of 1,000), {machine}')
  print()
  print('| image file | us per image | bytes per image |')
  print('| --- | --- | --- |')
  for key, (micros, size) in decode_costs(images[:1000]).items():
    print(f'| {key} | {micros:.1f} | {size:,.0f} |')
  print()
  print(f'Input pipeline, {count} images of 32x32, batch {FLAGS.batch_size}, {machine}')
  print()
  print('| images | workers | samples/s | per core | / ImageFolder |')
  print('| --- | --- | --- | --- | --- |')
  for name, workers, samples, ratio in rows:
    print(f'| {name} | {workers} | {samples:,.0f} | {samples / max(1, workers):,.0f} | '
          f'{ratio:.1f}x |')


if __name__ == '__main__':
  app.run(main)
