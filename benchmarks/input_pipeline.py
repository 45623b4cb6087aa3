# SPDX-License-Identifier: BSD-3-Clause
"""Host input pipelines: photos from image folders and from shards, 32x32 images from shards.

Photos: images/s and bytes per batch of the image-folder scripts' training pipeline
(train_single_core.build_datasets: torchvision's JPEG decoder, crop and flip on uint8 tensors, each
sample seeded as the scripts seed it) against upstream's (PIL, RandomResizedCrop, flip,
ToTensor and Normalize on the host), at 224 px, over JPEG photos of 500x375 (ImageNet's
usual size) cut from matplotlib's sample photo and re-encoded: nothing is downloaded.

Photos from files and from shards (issue 41): images/s per core of the same photos, ops
and seeds (decode, RandomResizedCrop to 224, flip, uint8) read A: from the image folder in a
random order (the image-folder scripts' loader), B: from tar shards on the local disk written
as make_cifar_shards.py --image_folder writes them, C: from the same shards over HTTP (a
ThreadingHTTPServer on 127.0.0.1) and from gs:// (a GCS emulator on 127.0.0.1, if
gcp-storage-emulator is installed; gcsfs with no credentials), B and C by
train_wds_cifar.TrainShards; with the page cache warm, and cold (dropped before each pass:
root only). The servers run in processes of their own, their CPU time apart from the
loader's. Then what each step costs a photo: file or tar reading (and the tar's parsing), the
seeding, decode, crop, collate, and a batch's way from a worker; and the ceiling, decode, crop
and flip of the same bytes in memory.

32x32: samples/s of train_wds_cifar.py's shard pipeline, over shards of each image format
it reads, against torchvision ImageFolder over the same images as loose PNG files.

Every pipeline does what a CIFAR training step needs: read, decode, random crop with 4 px
padding, horizontal flip, batch. ImageFolder also converts to float and normalises on the
host, as the usual torchvision pipeline does; the shard pipeline leaves both to the device
and sends uint8. The shards: raw bytes and PNG as make_cifar_shards.py writes them
(--format rgb, png), PPM as the Cloud TPU WebDataset tutorial writes them (webdataset's
ShardWriter and PIL images). Prints markdown tables, a row as soon as it is measured.

  python benchmarks/input_pipeline.py            # about 4 minutes on 2 cores
  python benchmarks/input_pipeline.py --quick    # fewer images, no gs:// rows: a smoke test

--batch_size (128) is train_wds_cifar.py's flag, and also the photos' batch (the
image-folder scripts' default).

Loader workers (issue 68): what starting a replica's loader workers costs, seconds to the
first batch and to a batch from each, and each worker's memory (its private pages, and its
proportional share of what it shares), in a process that imported train_resnet_mp.py as a
replica does, by start method: spawn (a replica's own, each worker importing the script, torch
and torch_xla again), forkserver as utils.loader_start gives it to a replica, and fork
(train_single_core.py and train_resnet_spmd.py, whose process was not spawned).
"""

import functools
import http.server
import io
import itertools
import json
import multiprocessing
import os
import pathlib
import platform
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import fsspec
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

try:  # The gs:// rows: a GCS emulator that runs offline (pip install gcp-storage-emulator).
  import gcp_storage_emulator.server as gcs_emulator
except ImportError:
  gcs_emulator = None

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


def photo_loaders(root, workers):
  """{pipeline: a DataLoader of 224 px training batches} for upstream's and ours."""
  T = torchvision.transforms
  upstream = torchvision.datasets.ImageFolder(root / 'train', T.Compose([
      T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
      T.Normalize(utils.IMAGENET_MEAN, utils.IMAGENET_STD)]))
  return {'upstream: PIL, ToTensor, Normalize (float32)': torch.utils.data.DataLoader(
              upstream, FLAGS.batch_size, shuffle=True, num_workers=workers, drop_last=True,
              persistent_workers=workers > 0),
          'ours: torchvision.io, uint8': folder_loader(root, workers)}


def folder_loader(root, workers, seed=0):
  """The image-folder scripts' training loader of root/train at 224 px: files in a random
  order (utils.EpochSampler), each sample seeded (utils.SeededSamples)."""
  ours = train_single_core.build_datasets(SimpleNamespace(datadir=str(root), img_dim=224))[0]
  sampler = utils.EpochSampler(ours, 0, 1, seed, FLAGS.batch_size)
  return torch.utils.data.DataLoader(utils.SeededSamples(ours), FLAGS.batch_size, sampler=sampler,
                                     num_workers=workers, drop_last=True,
                                     persistent_workers=workers > 0)


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


def shard_loader(urls, count, workers, img_dim=32, num_classes=10, seed=0):
  """train_wds_cifar.py's loader over the shards: one pass is the batches they hold."""
  batches = count // FLAGS.batch_size
  shards = train_wds_cifar.TrainShards(urls, 0, 1, batches, SimpleNamespace(
      batch_size=FLAGS.batch_size, shuffle_buffer=count, img_dim=img_dim,
      num_classes=num_classes, seed=seed, fail_on_bad_data=True, num_workers=workers,
      read_timeout=FLAGS['read_timeout'].default, trainsize=count))
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
    samples = [encode(image) for image in images]
    start = time.perf_counter()
    for data in samples:
      train_wds_cifar.decode(key, data)
    costs[key] = ((time.perf_counter() - start) / len(samples) * 1e6,
                  sum(map(len, samples)) / len(samples))
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


class RangeRequests(http.server.SimpleHTTPRequestHandler):
  """A folder's files over HTTP, a byte range when asked, as a bucket or nginx serves them:
  fsspec reads a file bigger than its block (5 MB) in ranges, which http.server refuses.
  Counts the GETs in `gets`."""
  gets = None

  def do_GET(self):
    with self.gets.get_lock():
      self.gets.value += 1
    asked = re.fullmatch(r'bytes=(\d+)-(\d*)', self.headers.get('Range', ''))
    if not asked:
      return super().do_GET()
    with open(self.translate_path(self.path), 'rb') as f:
      size = os.fstat(f.fileno()).st_size
      start, end = int(asked[1]), min(size, int(asked[2] or size - 1) + 1)
      f.seek(start)
      self.send_response(206)
      self.send_header('Content-Range', f'bytes {start}-{end - 1}/{size}')
      self.send_header('Content-Length', str(end - start))
      self.end_headers()
      self.wfile.write(f.read(end - start))


def start_server(serve, port):
  """Runs serve() in a process of its own (forked, its output dropped), so that the server
  neither takes the loader's GIL nor counts in its CPU time; returns it once port answers."""
  def run():
    # A line per request, tracebacks of clients that hung up: the table's reader needs none.
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    os.dup2(2, 1)
    serve()
  server = multiprocessing.get_context('fork').Process(target=run, daemon=True)
  server.start()
  for _ in range(200):
    try:
      socket.create_connection(('127.0.0.1', port), timeout=1).close()
      return server
    except OSError:
      time.sleep(0.05)
  raise RuntimeError(f'the server on 127.0.0.1:{port} did not start')


def serve_http(folder, gets):
  """(the folder's base URL, the server process): a ThreadingHTTPServer on 127.0.0.1."""
  handler = type('Handler', (RangeRequests,), dict(gets=gets))
  httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0),
                                          functools.partial(handler, directory=str(folder)))
  port = httpd.server_address[1]
  server = start_server(httpd.serve_forever, port)
  httpd.server_close()  # The child's copy listens.
  return f'http://127.0.0.1:{port}/', server


def serve_gcs(files, gets):
  """(gs://bench/, the server process) with the files uploaded to bucket bench of a GCS
  emulator on 127.0.0.1 (gcp-storage-emulator, objects in its memory), read by gcsfs with
  no credentials: nothing leaves the machine. None without the emulator."""
  if gcs_emulator is None:
    return None
  # gcsfs 2026 first asks a gRPC endpoint for the bucket's layout, which the emulator has
  # not: 60 s timeouts at every open. Read when gcsfs is imported (fsspec's first gs://).
  os.environ['GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT'] = 'false'
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  def serve():
    handler = gcs_emulator.RequestHandler
    get = handler.do_GET
    def counted(request):
      with gets.get_lock():
        gets.value += 1
      get(request)
    handler.do_GET = counted
    gcs_emulator.create_server('127.0.0.1', port, in_memory=True, default_bucket='bench').run()
  server = start_server(serve, port)
  # Every gs:// filesystem of this process and its loader workers: anonymous, the emulator.
  fsspec.config.conf['gs'] = dict(token='anon', endpoint_url=f'http://127.0.0.1:{port}')
  fsspec.filesystem('gs').put([str(f) for f in files], 'bench/')
  return 'gs://bench/', server


def cpu_seconds(pid):
  """User and system CPU seconds of a process so far, all its threads (Linux's /proc)."""
  with open(f'/proc/{pid}/stat') as f:
    fields = f.read().rsplit(')', 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def loader_cpu_seconds(servers):
  """CPU seconds of this process and its children (the loader workers) but the servers."""
  total = cpu_seconds(os.getpid())
  for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
      with open(f'/proc/{pid}/stat') as f:
        parent = int(f.read().rsplit(')', 1)[1].split()[1])
      if parent == os.getpid() and int(pid) not in servers:
        total += cpu_seconds(pid)
    except (OSError, ValueError):  # Gone meanwhile.
      pass
  return total


def drop_page_cache():
  """Empties Linux's page cache (root only), so that the next reads come from the disk;
  returns why it could not, or None."""
  try:
    os.sync()
    with open('/proc/sys/vm/drop_caches', 'w') as f:
      f.write('3')
  except OSError as e:
    return f'{type(e).__name__}: {e}'
  return None


class Meters:
  """Wall time, the loader's CPU time (this process and its workers), the servers' CPU time
  and their GETs, from start() to stop(), added up over the passes of a row."""

  def __init__(self, servers, gets):
    self.servers, self.gets = servers, gets
    self.totals = np.zeros(4)

  def now(self):
    return np.array([time.perf_counter(), loader_cpu_seconds(self.servers),
                     sum(map(cpu_seconds, self.servers)), sum(g.value for g in self.gets)])

  def start(self):
    self.started = self.now()

  def stop(self):
    self.totals += self.now() - self.started


def timed_passes(loader, passes, cold, meters, limit):
  """(images, meters' totals) over `passes` passes of the loader after an untimed one (it
  starts the workers and, warm, reads the files into the page cache); cold: the cache
  emptied before each pass. A row stops after `limit` seconds of each (slow sources)."""
  start = time.perf_counter()
  for _ in loader:
    if time.perf_counter() - start > limit:
      break
  images = 0
  for _ in range(passes):
    if cold:
      drop_page_cache()
    meters.start()
    for _, labels in loader:
      images += len(labels)
      if meters.totals[0] + time.perf_counter() - meters.started[0] > limit:
        break
    meters.stop()
    if meters.totals[0] > limit:
      break
  return images, meters.totals


def write_photo_shards(root, folder, shards, seed=0):
  """The photos of root/train as make_cifar_shards.py --image_folder writes them (the files'
  own bytes, shuffled with seed) in `shards` shards in folder; their paths."""
  samples = torchvision.datasets.ImageFolder(root / 'train').samples
  samples = random.Random(seed).sample(samples, len(samples))
  folder.mkdir()
  return [pathlib.Path(url) for url in make_cifar_shards.write_shards(
      (make_cifar_shards.kept_file(path, label) for path, label in samples),
      str(folder / 'train-%06d.tar'), -(-len(samples) // shards))]


def photo_sources(shards, servers, gets):
  """{row: the shards' URLs (None: the image folder)}: A, B, C over HTTP and gs:// (the
  servers started, their processes in servers, their GET counters in gets)."""
  sources = {'A: image folder, random order': None,
             'B: the same as local shards': [str(s) for s in shards]}
  http_row, gs_row = 'C: shards over HTTP, 127.0.0.1', 'C: shards from gs://, emulator'
  gets[http_row] = multiprocessing.Value('L', 0)
  base, server = serve_http(shards[0].parent, gets[http_row])
  servers.append(server)
  sources[http_row] = [base + s.name for s in shards]
  gets[gs_row] = multiprocessing.Value('L', 0)
  bucket = serve_gcs(shards, gets[gs_row])
  if bucket:
    servers.append(bucket[1])
    sources[gs_row] = [bucket[0] + s.name for s in shards]
  return sources


def step_costs(root, sources, samples, cold):
  """[(step, cache, microseconds per photo)] on one core: reading `samples` photos, A's files
  (in a random order) and B's and C's from the tar (train_wds_cifar.read_samples), with the
  page cache warm and, if cold, dropped first; then what every source does next: decode
  (utils.decode_image), crop and flip."""
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  folder = train_single_core.build_datasets(SimpleNamespace(datadir=str(root), img_dim=224))[0]
  files = random.Random(0).sample([path for path, _ in folder.samples], samples)
  readers = {'A: image folder: open, read and close a file':
             lambda: [pathlib.Path(path).read_bytes() for path in files]}
  for name, urls in sources.items():
    if urls:
      readers[f'{name}: read a sample from the tar'] = lambda urls=urls: [
          data for _, _, data, _ in itertools.islice(train_wds_cifar.read_samples(
              urls, train_wds_cifar.parse, sys.maxsize, train_wds_cifar.BadData(True),
              FLAGS['read_timeout'].default), samples)]
  costs, photos = [], None
  for cache in ('warm', 'cold') if cold else ('warm',):
    for step, read in readers.items():
      if cache == 'cold' and 'gs://' in step:
        continue  # The emulator holds the objects in its memory.
      read()  # Warm: in the page cache now.
      if cache == 'cold':
        drop_page_cache()
      start = time.perf_counter()
      data = read()
      costs.append((step, cache, (time.perf_counter() - start) / samples * 1e6))
      photos = photos or data
  shard = pathlib.Path(sources['B: the same as local shards'][0]).read_bytes()
  start = time.perf_counter()
  tar = train_wds_cifar.TarFiles(io.BytesIO(shard))
  parsed = sum(1 for _ in train_wds_cifar.tar_samples(tar, ''))
  costs.append(('B: of which parsing the tar, in memory (train_wds_cifar.TarFiles)', '',
                (time.perf_counter() - start) / parsed * 1e6))
  start = time.perf_counter()
  for key in range(samples):
    with utils.seeded(key):
      pass
  costs.append(('seed the sample (utils.seeded)', '',
                (time.perf_counter() - start) / samples * 1e6))
  # Each decoded and cropped, then dropped, as in a pipeline (a list of them all would time
  # the memory's first touch too); the second of two passes.
  decoded = [utils.decode_image(photo) for photo in photos[:8]]
  rows = {'decode (utils.decode_image)': lambda i: utils.decode_image(photos[i]),
          'crop and flip (RandomResizedCrop to 224)': lambda i: folder.transform(decoded[i % 8]),
          'ceiling: decode, crop and flip':
              lambda i: folder.transform(utils.decode_image(photos[i]))}
  for step, work in rows.items():
    for _ in range(2):
      start = time.perf_counter()
      for i in range(samples):
        work(i)
      micros = (time.perf_counter() - start) / samples * 1e6
    costs.append((step, '', micros))
  crops = [folder.transform(image) for image in decoded] * (FLAGS.batch_size // 8)
  start = time.perf_counter()
  for _ in range(10):
    train_wds_cifar.collate([(crop, 0) for crop in crops])
  costs.append((f'collate a batch of {len(crops)} (train_wds_cifar.collate)', '',
                (time.perf_counter() - start) / 10 / len(crops) * 1e6))
  torch.set_num_threads(threads)
  costs.append(worker_cost(crops))
  return costs, 1e6 / micros  # The ceiling's: the last row of the loop.


class Collated(torch.utils.data.Dataset):
  """The same crops collated into a batch, again and again, as a loader worker does."""

  def __init__(self, crops, count):
    self.crops, self.count = crops, count

  def __len__(self):
    return self.count

  def __getitem__(self, index):
    return train_wds_cifar.collate([(crop, 0) for crop in self.crops])


def worker_cost(crops, count=20):
  """(step, '', microseconds per photo) of collating a batch in a loader worker and sending it
  to the loader's process (through shared memory, as the scripts' workers do)."""
  loader = torch.utils.data.DataLoader(Collated(crops, count + 1), batch_size=None, num_workers=1)
  start = None
  for _ in loader:
    start = start or time.perf_counter()  # From the first batch: the worker is up.
  micros = (time.perf_counter() - start) / count / len(crops) * 1e6
  return ('collate in a loader worker and send it to the loader\'s process', '', micros)


def source_rows(root, sources, servers, gets, passes, limit):
  """Measures every source (see photo_sources) as train_single_core.py or train_wds_cifar.py
  loads it, with the page cache warm, then cold (not with --quick; not if it cannot be
  dropped), with each --workers count; yields (row, cache, workers, images, wall seconds,
  loader CPU seconds, servers' CPU seconds, their GETs)."""
  count = len(torchvision.datasets.ImageFolder(root / 'train'))
  classes = len(torchvision.datasets.ImageFolder(root / 'train').classes)
  threads = torch.get_num_threads()
  for cache in ('warm',) if FLAGS.quick else ('warm', 'cold'):
    # Tried after the warm rows, which find the files in the page cache as written.
    if cache == 'cold' and drop_page_cache():
      break
    for workers in map(int, FLAGS.workers):
      torch.set_num_threads(1 if workers == 0 else threads)  # Per core, as the photo table.
      for name, urls in sources.items():
        if 'gs://' in name and (cache == 'cold' or FLAGS.quick):
          continue  # The emulator holds the objects in its memory; --quick: seconds a row.
        loader = (folder_loader(root, workers) if urls is None else
                  shard_loader(urls, count, workers, 224, classes))
        meters = Meters([s.pid for s in servers], list(gets.values()))
        images, totals = timed_passes(loader, passes, cache == 'cold', meters, limit)
        yield (name, cache, workers, images, *totals)
  torch.set_num_threads(threads)


def source_table(count, passes, limit):
  """Prints A, B and C's images/s per core, warm and cold (issue 41, item 3), a row at a
  time, then where a photo's time goes."""
  servers, gets, cut, reference_0 = [], {}, [], None
  with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp)
    size = make_photos(root, count)
    shards = write_photo_shards(root, root / 'shards', 8)
    megabytes = sum(s.stat().st_size for s in shards) / count / 1e6  # A sample's, in the tar
    sources = photo_sources(shards, servers, gets)
    print(f'Photos from files and from shards: {count} JPEGs of 500x375 (mean {size / 1000:.0f} '
          f'KB; B and C: in {len(shards)} shards) to 224 px uint8 training batches of '
          f'{FLAGS.batch_size}, seed 0; {passes} timed passes after an untimed one, at most '
          f'{limit} s; cold: the page cache dropped before each pass; {MACHINE}')
    print()
    print('| source | cache | workers | images/s | per core | / A | images per loader CPU s | '
          'server CPU | GETs per MB |')
    print('| --- | --- | --- | --- | --- | --- | --- | --- | --- |')
    for name, cache, workers, images, wall, loader_cpu, server_cpu, requests in source_rows(
        root, sources, servers, gets, passes, limit):
      if name.startswith('A:'):
        reference = images / wall
        reference_0 = reference if cache == 'warm' and workers == 0 else reference_0
      cut += [f'{name}, {cache}, {workers} workers'] if wall > limit else []
      print(f'| {name} | {cache} | {workers} | {images / wall:,.0f} | '
            f'{images / wall / max(1, workers):,.0f} | {images / wall / reference:.2f}x | '
            f'{images / loader_cpu:,.0f} | {server_cpu / wall:.0%} | ' +
            (f'{requests / images / megabytes:.1f} |' if name in gets else '|'), flush=True)
    cold = drop_page_cache()  # Why cold cannot be measured, or None.
    costs, ceiling = step_costs(root, sources, min(count, 2 * count // len(shards)), not cold)
    print(f'| ceiling: decode, crop and flip of the bytes in memory | | 0 | {ceiling:,.0f} | '
          f'{ceiling:,.0f} | {ceiling / reference_0:.2f}x | | | |', flush=True)
    for server in servers:
      server.terminate()
      server.join()
  print()
  for row in cut:
    print(f'({row}: stopped after {limit} s, the rate of the batches read by then)')
  if len(sources) < 4:
    print('(gs:// emulator not installed: pip install gcp-storage-emulator)')
  if cold:
    print(f'(cold not measured: the page cache cannot be dropped here, {cold})')
  elif FLAGS.quick:
    print('(--quick: warm rows only, and none from gs://; their reading is timed below)')
  else:
    print('(gs://, cold: not measured, the emulator holds the objects in its memory)')
  print()
  print(f'Where a photo\'s time goes: microseconds per photo, one core, {MACHINE}')
  print()
  print('| step | page cache | us per photo |')
  print('| --- | --- | --- |')
  for step, cache, micros in costs:
    print(f'| {step} | {cache} | {micros:,.0f} |')
  print()


# One run of a replica's loader workers, in a process of its own: it imports the training
# script as a replica does, and sets it as its main module (a spawned worker imports it again
# as __mp_main__). Prints a JSON line.
WORKERS_CHILD = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import train_resnet_mp
import multiprocessing, torch, utils
sys.modules['__main__'].__file__ = train_resnet_mp.__file__
method, workers = sys.argv[2], int(sys.argv[3])
if method == 'forkserver':  # What a replica (whose start method is spawn) starts them with.
  multiprocessing.set_start_method('spawn')
  context = utils.loader_start()
else:
  context = multiprocessing.get_context(method)
loader = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.zeros(4 * workers, 3, 8, 8)), batch_size=1,
    num_workers=workers, multiprocessing_context=context, worker_init_fn=utils.ignore_stop_signals,
    persistent_workers=True)
start = time.monotonic()
iterator = iter(loader)
next(iterator)
first = time.monotonic() - start
for _ in range(workers - 1):  # Batch i comes from worker i: each has started.
  next(iterator)
every = time.monotonic() - start
memory = []
for process in iterator._workers:
  with open(f'/proc/{process.pid}/smaps_rollup') as f:
    fields = {line.split(':')[0]: int(line.split()[1]) for line in f if line.endswith('kB\n')}
  memory.append((fields['Private_Clean'] + fields['Private_Dirty'], fields['Pss'], fields['Rss']))
print(json.dumps(dict(first=first, every=every, memory=memory)))
utils.end_loader_workers()  # They ignore the SIGTERM that multiprocessing's exit would wait on.
"""


def worker_start_table(workers, repeats):
  """Seconds to start a replica's loader workers and their memory, by start method."""
  print(f"Starting {workers} loader workers in a replica's process (train_resnet_mp.py imported), "
        f'mean of {repeats} runs, {MACHINE}')
  print()
  print('| start method | who starts them so | s to the first batch | s to one from each | '
        'private MB a worker | PSS MB a worker | RSS MB a worker |')
  print('| --- | --- | --- | --- | --- | --- | --- |')
  who = {'spawn': "train_resnet_mp.py's and train_wds_cifar.py's replicas before issue 68",
         'forkserver': 'their replicas now (utils.loader_start)',
         'fork': 'train_single_core.py, train_resnet_spmd.py'}
  repo = str(pathlib.Path(__file__).resolve().parents[1])
  for method in ('spawn', 'forkserver', 'fork'):
    runs = []
    for _ in range(repeats):
      out = subprocess.run([sys.executable, '-c', WORKERS_CHILD, repo, method, str(workers)],
                           check=True, capture_output=True, text=True).stdout
      runs.append(json.loads(out.strip().splitlines()[-1]))
    memory = np.array([run['memory'] for run in runs], dtype=float) / 1024  # MB
    private, pss, rss = memory.reshape(-1, 3).mean(axis=0)
    print(f"| {method} | {who[method]} | {np.mean([r['first'] for r in runs]):.1f} | "
          f"{np.mean([r['every'] for r in runs]):.1f} | {private:,.0f} | {pss:,.0f} | {rss:,.0f} |",
          flush=True)
  print()


def main(argv):
  del argv
  worker_start_table(2, 1 if FLAGS.quick else 3)
  photo_table(*((2 * FLAGS.batch_size, 1) if FLAGS.quick else (8 * FLAGS.batch_size, 3)))
  source_table(*((FLAGS.batch_size, 1, 3) if FLAGS.quick else (8 * FLAGS.batch_size, 3, 20)))
  count = 1000 if FLAGS.quick else 10000
  passes = 1 if FLAGS.quick else 5
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    images, labels = make_images(tmp / 'png', count)
    per_shard = count // 10
    for image_format in ('rgb', 'png', 'ppm'):
      (tmp / f'{image_format}-shards').mkdir()
    shards = {f'shards, {image_format}': make_cifar_shards.write_shards(
        ((*make_cifar_shards.encode(image, image_format), label)
         for image, label in zip(images, labels)),
        str(tmp / f'{image_format}-shards' / 'train-%06d.tar'), per_shard)
        for image_format in ('rgb', 'png')}
    shards['shards, ppm (tutorial)'] = write_tutorial_shards(
        images, labels, str(tmp / 'ppm-shards' / 'train-%06d.tar'), per_shard)
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
