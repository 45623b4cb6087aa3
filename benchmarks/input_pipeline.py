"""Host input pipeline for 32x32 images: samples/s of train_wds_cifar.py's shard pipeline
against torchvision ImageFolder over the same images as loose PNG files.

Both do what a CIFAR training step needs: read, decode, random crop with 4 px padding,
horizontal flip, batch. ImageFolder also converts to float and normalises on the host,
as the usual torchvision pipeline does; the shard pipeline leaves both to the device
and sends uint8. Prints a markdown table.

  python benchmarks/input_pipeline.py            # 10,000 images, about 2 minutes
  python benchmarks/input_pipeline.py --quick    # 1,000 images, a smoke test

--batch_size (128) is train_wds_cifar.py's flag.
"""

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
from absl import app, flags
from PIL import Image

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import make_cifar_shards  # noqa: E402
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


def main(argv):
  del argv
  count = 1000 if FLAGS.quick else 10000
  passes = 1 if FLAGS.quick else 5
  with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    images, labels = make_images(tmp / 'png', count)
    urls = make_cifar_shards.write_shards(images, labels, range(count),
                                          str(tmp / 'shards' / 'train-%06d.tar'),
                                          samples_per_shard=count // 10)
    T = torchvision.transforms
    folder = torchvision.datasets.ImageFolder(tmp / 'png', T.Compose([
        T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(),
        T.Normalize(train_wds_cifar.CIFAR_MEAN, train_wds_cifar.CIFAR_STD)]))
    rows = []
    for workers in map(int, FLAGS.workers):
      # Workers live through the passes, as through the epochs of the training scripts.
      persistent = dict(persistent_workers=workers > 0)
      folder_loader = torch.utils.data.DataLoader(folder, FLAGS.batch_size, shuffle=True,
                                                  num_workers=workers, drop_last=True, **persistent)
      # One pass is the batches the shards hold, as one epoch of the training script.
      batches = count // FLAGS.batch_size
      shards = train_wds_cifar.TrainShards(urls, 0, 1, batches, SimpleNamespace(
          batch_size=FLAGS.batch_size, shuffle_buffer=count, seed=0, fail_on_bad_data=True,
          num_workers=workers))
      shard_loader = utils.EpochLoader(torch.utils.data.DataLoader(
          shards, batch_size=None, num_workers=workers, **persistent), batches, order=shards)
      folder_rate = rate(folder_loader, passes)
      shard_rate = rate(shard_loader, passes)
      cores = max(1, workers)
      rows.append((workers, folder_rate, shard_rate, folder_rate / cores, shard_rate / cores))
  print(f'Input pipeline, {count} images of 32x32, batch {FLAGS.batch_size}, '
        f'{platform.processor() or platform.machine()}, {os.cpu_count()} cores')
  print()
  print('| workers | ImageFolder (PNG) samples/s | WebDataset shards samples/s | per core: ImageFolder | '
        'per core: shards | shards / ImageFolder |')
  print('| --- | --- | --- | --- | --- | --- |')
  for workers, f, s, fc, sc in rows:
    print(f'| {workers} | {f:,.0f} | {s:,.0f} | {fc:,.0f} | {sc:,.0f} | {s / f:.1f}x |')


if __name__ == '__main__':
  app.run(main)
