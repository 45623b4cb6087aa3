# SPDX-License-Identifier: BSD-3-Clause
"""Host input pipelines: photos for the image-folder scripts, 32x32 images for the shards.

Photos: images/s and bytes per batch of the image-folder scripts' training pipeline
(train_single_core.build_datasets: torchvision's JPEG decoder, crop and flip on uint8 tensors, each
sample seeded as the scripts seed it) against upstream's (PIL, RandomResizedCrop, flip,
ToTensor and Normalize on the host), at 224 px, over JPEG photos of 500x375 (ImageNet's
usual size) cut from matplotlib's sample photo and re-encoded: nothing is downloaded.

32x32: samples/s of train_wds_cifar.py's shard pipeline, over shards of each image format
it reads, against torchvision ImageFolder over the same images as loose PNG files.

Every pipeline does what a CIFAR training step needs: read, decode, random crop with 4 px
padding, horizontal flip, batch. ImageFolder also converts to float and normalises on the
host, as the usual torchvision pipeline does; the shard pipeline leaves both to the device
and sends uint8. The shards: raw bytes and PNG as make_cifar_shards.py writes them
(--format rgb, png), PPM as the Cloud TPU WebDataset tutorial writes them (webdataset's
ShardWriter and PIL images). Prints a markdown table.

  python benchmarks/input_pipeline.py            # 10,000 images, about 5 minutes
  python benchmarks/input_pipeline.py --quick    # 1,000 images, a smoke test

--batch_size (128) is train_wds_cifar.py's flag, and also the photos' batch (the
image-folder scripts' default).
"""

import io
import os
import pathlib
import platform
import sys
import tempfile
import time
from types import SimpleNamespace

import matplotlib.cbook
import numpy as np
import torch
import torchvision
import webdataset as wds
from absl import app, flags
from PIL import Image

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import make_cifar_shards  # noqa: E402
import train_single_core  # noqa: E402
import train_wds_cifar  # noqa: E402
import utils  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_bool('quick', False, '1,000 images and one pass: checks that the benchmark runs.')
flags.DEFINE_list('workers', ['0', '2'], 'DataLoader worker counts to measure.')
MACHINE = f'{platform.processor() or platform.machine()}, {os.cpu_count()} cores'


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


def make_photos(root, count, classes=4):
  """count JPEG photos of 500x375 in root/train/CLASS/ and root/val/CLASS/ (the same ones):
  crops of matplotlib's sample photo (512x600) at seeded places, every other one mirrored,
  saved at quality 90 (ImageNet's are about 110 KB at this size; these about 60 KB)."""
  rng = np.random.default_rng(0)
  photo = Image.open(matplotlib.cbook.get_sample_data('grace_hopper.jpg')).convert('RGB')
  for i in range(count):
    left, top = rng.integers(0, photo.width - 500 + 1), rng.integers(0, photo.height - 375 + 1)
    crop = photo.crop((left, top, left + 500, top + 375))
    if i % 2:
      crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    for split in ('train', 'val'):
      folder = root / split / f'class{i % classes}'
      folder.mkdir(parents=True, exist_ok=True)
      crop.save(folder / f'{i}.jpg', quality=90)
  return np.mean([path.stat().st_size for path in (root / 'train').glob('*/*.jpg')])


def photo_loaders(root, workers, seed=0):
  """{pipeline: a DataLoader of 224 px training batches} for upstream's and ours."""
  T = torchvision.transforms
  upstream = torchvision.datasets.ImageFolder(root / 'train', T.Compose([
      T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
      T.Normalize(utils.IMAGENET_MEAN, utils.IMAGENET_STD)]))
  ours = train_single_core.build_datasets(SimpleNamespace(datadir=str(root), img_dim=224))[0]
  options = dict(batch_size=FLAGS.batch_size, num_workers=workers, drop_last=True,
                 persistent_workers=workers > 0)
  sampler = utils.EpochSampler(ours, 0, 1, seed, FLAGS.batch_size)
  return {'upstream: PIL, ToTensor, Normalize (float32)': torch.utils.data.DataLoader(
              upstream, shuffle=True, **options),
          'ours: torchvision.io, uint8': torch.utils.data.DataLoader(
              utils.SeededSamples(ours), sampler=sampler, **options)}


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
  """Microseconds train_wds_cifar.decode takes for one image of each format it reads."""
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
      train_wds_cifar.decode(sample)
    costs[key] = ((time.perf_counter() - start) / len(samples) * 1e6,
                  sum(len(sample[key]) for sample in samples) / len(samples))
  return costs


def photo_table(count, passes):
  """Prints the photos' table, a row per pipeline and worker count."""
  with tempfile.TemporaryDirectory() as tmp:
    size = make_photos(pathlib.Path(tmp), count)
    print(f'Photos: {count} JPEGs of 500x375 (mean {size / 1000:.0f} KB) to 224 px training '
          f'batches of {FLAGS.batch_size}, {MACHINE}')
    print()
    print('| pipeline | workers | images/s | per core | / upstream | bytes per batch |')
    print('| --- | --- | --- | --- | --- | --- |')
    threads = torch.get_num_threads()
    for workers in map(int, FLAGS.workers):
      # One core for the loop without workers too (each worker runs one thread): per core.
      torch.set_num_threads(1 if workers == 0 else threads)
      upstream = None
      for name, loader in photo_loaders(pathlib.Path(tmp), workers).items():
        images = rate(loader, passes)
        upstream = upstream or images
        batch = next(iter(loader))
        print(f'| {name} | {workers} | {images:,.0f} | {images / max(1, workers):,.0f} | '
              f'{images / upstream:.2f}x | {sum(t.nbytes for t in batch) / 1e6:.1f} MB |',
              flush=True)
    torch.set_num_threads(threads)
  print()


def main(argv):
  del argv
  photo_table(*((2 * FLAGS.batch_size, 1) if FLAGS.quick else (8 * FLAGS.batch_size, 3)))
  count = 1000 if FLAGS.quick else 10000
  passes = 1 if FLAGS.quick else 5
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    images, labels = make_images(tmp / 'png', count)
    per_shard = count // 10
    shards = {f'shards, {image_format}': make_cifar_shards.write_shards(
        images, labels, range(count), str(tmp / image_format / 'train-%06d.tar'), per_shard,
        image_format) for image_format in ('rgb', 'png')}
    (tmp / 'ppm').mkdir()
    shards['shards, ppm (tutorial)'] = write_tutorial_shards(
        images, labels, str(tmp / 'ppm' / 'train-%06d.tar'), per_shard)
    T = torchvision.transforms
    folder = torchvision.datasets.ImageFolder(tmp / 'png', T.Compose([
        T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(),
        T.Normalize(utils.CIFAR_MEAN, utils.CIFAR_STD)]))
    for workers in map(int, FLAGS.workers):
      folder_loader = torch.utils.data.DataLoader(folder, FLAGS.batch_size, shuffle=True,
                                                  num_workers=workers, drop_last=True,
                                                  persistent_workers=workers > 0)
      folder_rate = rate(folder_loader, passes)
      rows.append(('ImageFolder, loose PNG files', workers, folder_rate, 1.0))
      for name, urls in shards.items():
        shard_rate = rate(shard_loader(urls, count, workers), passes)
        rows.append((name, workers, shard_rate, shard_rate / folder_rate))
  print(f'Decoding one 32x32 noise image (train_wds_cifar.decode, mean of 1,000), {MACHINE}')
  print()
  print('| image file | us per image | bytes per image |')
  print('| --- | --- | --- |')
  for key, (micros, size) in decode_costs(images[:1000]).items():
    print(f'| {key} | {micros:.1f} | {size:,.0f} |')
  print()
  print(f'Input pipeline, {count} images of 32x32, batch {FLAGS.batch_size}, {MACHINE}')
  print()
  print('| images | workers | samples/s | per core | / ImageFolder |')
  print('| --- | --- | --- | --- | --- |')
  for name, workers, samples, ratio in rows:
    print(f'| {name} | {workers} | {samples:,.0f} | {samples / max(1, workers):,.0f} | '
          f'{ratio:.1f}x |')


if __name__ == '__main__':
  app.run(main)
