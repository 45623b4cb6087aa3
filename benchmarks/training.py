# SPDX-License-Identifier: BSD-3-Clause
"""Training loop benchmarks: what transfers from XLA:CPU to a TPU, taken side by side.

Runs each training script as a user would (a fresh process, --results_json) and prints
markdown tables:
  1. steady-state training samples/s (the epochs after the first) of each script, and the
     same step in plain eager PyTorch on the CPU as a reference point;
  2. graphs compiled per run and after the first epoch (must be zero), with fake data and
     with image folders whose sizes do not divide the batch;
  3. host overhead: the share of the steady-state epoch's wall time not covered by graph
     execution (torch_xla's ExecuteTime, read from the metrics report --metrics_debug
     prints at each epoch's end), i.e. time the device would wait for the host;
  4. precision: float32, --amp and --bf16 side by side (samples/s, host overhead, graphs
     compiled, checkpoint size);
  5. checkpoints: save and load time and size for resnet50, and how long a resumed run
     takes to its first new step against a fresh run;
  6. train_resnet_spmd.py's checkpoints on 4 devices: one file (as before it sharded) against
     its shards under --sharding batch and fsdp (the training table has fsdp's step rate);
  7. --gradient_accumulation_steps: a step of 64 images at 224 px as one batch, as 4
     accumulated batches of 16, and a batch of 16 alone (samples/s, the process's peak
     memory, graphs compiled); the training table has --ddp's row;
  8. the input pipeline table of benchmarks/input_pipeline.py.

  python benchmarks/training.py            # about 21 minutes on 2 cores
  python benchmarks/training.py --quick    # a smoke test: tiny runs, same tables
"""

import contextlib
import json
import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from absl import app, flags
from PIL import Image

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import make_cifar_shards  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_bool('quick', False, 'A few steps per run: checks that the benchmark works.')
flags.DEFINE_string('bench_model', 'resnet18', 'Model of the fake-data and folder runs.')
flags.DEFINE_integer('bench_img_dim', 32, 'Image side of the fake-data and folder runs.')
flags.DEFINE_integer('bench_batch_size', 16, 'Batch size of every run.')

TRAIN_LINE = re.compile(r'^\| Training .* Step=(\d+) ', re.M)


def start(script, args, devices=None, stderr=subprocess.DEVNULL):
  env = dict(os.environ, PJRT_DEVICE=os.environ.get('PJRT_DEVICE', 'CPU'), PYTHONUNBUFFERED='1')
  if devices:  # XLA:CPU devices, for the SPMD script.
    env['CPU_NUM_DEVICES'] = str(devices)
  return subprocess.Popen([sys.executable, str(REPO / script), *map(str, args)], cwd=REPO,
                          env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
                          start_new_session=True)


def run(script, *args, devices=None):
  """(results dict, seconds from start to the first training line) of one run of a training
  script on XLA:CPU, as a user runs it. results['epoch_device_busy']: for each epoch after
  the first, the share of its wall time (training, evaluation and saving) in which graphs
  executed, from the metrics report --metrics_debug prints as each epoch ends;
  results['peak_mb']: the largest memory the run's processes held (their peak RSS)."""
  with tempfile.TemporaryDirectory() as tmp, open(pathlib.Path(tmp, 'stderr'), 'w+') as errors:
    out = pathlib.Path(tmp, 'results.json')
    began, first, reports, metric = time.time(), None, [], None
    proc = start(script, [*args, '--metrics_debug', '--results_json', out], devices, errors)
    for line in proc.stdout:
      if first is None and TRAIN_LINE.match(line):
        first = time.time() - began
      if line.startswith(('Metric: ', 'Counter: ')):
        if metric is None:  # A report's first line.
          reports.append([time.time(), 0.0])
        metric = line.split()[1]
      elif not line.startswith('  '):  # A report's lines are these and indented ones.
        metric = None
      elif metric in ('ExecuteTime', 'ExecuteReplicatedTime') and 'Accumulator:' in line:
        reports[-1][1] += seconds(line.split()[1])
    _, status, usage = os.wait4(proc.pid, 0)  # Its rusage: its replicas' peak too.
    if os.waitstatus_to_exitcode(status) != 0:  # Its last lines on stderr say why.
      errors.seek(0)
      sys.exit(f'{script} {" ".join(map(str, args))} failed with exit code '
               f'{os.waitstatus_to_exitcode(status)}:\n' + ''.join(errors.readlines()[-15:]))
    proc.returncode = os.waitstatus_to_exitcode(status)
    results = json.loads(out.read_text())
    results['peak_mb'] = usage.ru_maxrss / 1024  # KiB on Linux
  results['epoch_device_busy'] = [None] + [(executed - executed_before) / (when - before)
      for (before, executed_before), (when, executed) in zip(reports, reports[1:])]
  return results, first


def seconds(duration):
  """Seconds of a duration as torch_xla's metrics report writes it (01m02s034ms800.080us)."""
  scale = dict(h=3600, m=60, s=1, ms=1e-3, us=1e-6, ns=1e-9)
  return sum(float(number) * scale[unit] for number, unit in
             re.findall(r'([\d.]+)(ms|us|ns|h|m|s)', duration))


def eager_rate(model_name, img_dim, batch_size, steps):
  """Samples/s of the same SGD step in eager PyTorch on the CPU (after 2 warm-up steps)."""
  torch.manual_seed(0)
  model = torchvision.models.get_model(model_name, weights=None, num_classes=1000)
  optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
  images = torch.zeros(batch_size, 3, img_dim, img_dim)
  labels = torch.zeros(batch_size, dtype=torch.int64)
  for i in range(steps + 2):
    if i == 2:
      start = time.perf_counter()
    optimizer.zero_grad()
    F.cross_entropy(model(images), labels).backward()
    optimizer.step()
  return steps * batch_size / (time.perf_counter() - start)


def image_folder(root, train, val, classes=4):
  rng = np.random.default_rng(0)
  for split, count in (('train', train), ('val', val)):
    for i in range(count):
      folder = root / split / f'class{i % classes}'
      folder.mkdir(parents=True, exist_ok=True)
      Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(folder / f'{i}.png')
  return root


def cifar_shards(root, train, test):
  rng = np.random.default_rng(0)
  patterns = []
  for split, count in (('train', train), ('test', test)):
    images = rng.integers(0, 256, (count, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, count)
    urls = make_cifar_shards.write_shards(
        ((*make_cifar_shards.encode(image, 'rgb'), label) for image, label in zip(images, labels)),
        str(root / f'cifar-{split}-%06d.tar'), samples_per_shard=max(1, count // 8))
    patterns.append(f'{root}/cifar-{split}-{{000000..{len(urls) - 1:06d}}}.tar')
  return patterns


def first_step_seconds(script, args):
  """Seconds from the start of a run to its first training line, and its output so far."""
  began, lines = time.time(), []
  proc = start(script, args)
  for line in proc.stdout:
    lines.append(line)
    if TRAIN_LINE.match(line):
      break
  seconds = time.time() - began
  os.killpg(proc.pid, signal.SIGKILL)  # The run's replica and loader workers too.
  proc.communicate()
  return seconds, ''.join(lines)


def checkpoint_costs(tmp, name):
  """A checkpoint of model `name` on XLA:CPU: (save seconds, load seconds, MB)."""
  import torch_xla
  import torch_xla.core.xla_model as xm
  import utils
  device = torch_xla.device()
  model = torchvision.models.get_model(name, num_classes=1000).to(device)
  optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  images = torch.zeros(2, 3, 32, 32, device=device)
  labels = torch.zeros(2, dtype=torch.int64, device=device)
  F.cross_entropy(model(images), labels).backward()
  xm.optimizer_step(optimizer)  # Momentum buffers exist, as in a real checkpoint.
  torch_xla.sync()
  xm.wait_device_ops()
  state = lambda: dict(model=model.state_dict(), optimizer=optimizer.state_dict(),  # noqa: E731
                       lr_scheduler=None, epoch=1, step=1, global_step=1, flags={}, results={},
                       rng=dict(torch=torch.get_rng_state(), xla=xm.get_rng_state()))
  start = time.perf_counter()
  path = utils.write_checkpoint(state(), str(tmp / 'ckpt'), keep=2, best=False)
  save = time.perf_counter() - start
  start = time.perf_counter()
  saved = utils.load_checkpoint(path)  # As a script's restore_checkpoint puts it back.
  model.load_state_dict(saved['model'])
  optimizer.load_state_dict(saved['optimizer'])
  xm.wait_device_ops()
  load = time.perf_counter() - start
  return save, load, os.path.getsize(path) / 1e6


# A checkpoint of train_resnet_spmd.py on 4 XLA:CPU devices, as its save_checkpoint and
# restore_checkpoint write and read it, in one process of its own (the mesh's devices are
# fixed when the runtime starts): prints [(kind, MB, save s, load s), ...].
SHARDED_COSTS = """
import json, pathlib, sys, time, types
import torch, torch_xla, torch_xla.core.xla_model as xm
import sharded_checkpoints, train_resnet_spmd as script, utils
script.FLAGS(['costs', '--fake_data', '--model', sys.argv[1], '--lr', '0.1'])
script.xr.use_spmd()
rows = []
for kind in ('one file', 'batch', 'fsdp'):
  script.FLAGS.sharding = 'batch' if kind == 'one file' else kind
  cfg = types.SimpleNamespace(**script.FLAGS.flag_values_dict())
  devices = script.xr.global_runtime_device_count()
  mesh = script.build_mesh(cfg, devices, 1)
  model = script.shard_model(script.build_model(cfg, 1000), mesh, cfg)
  optimizer = script.build_optimizer(cfg, model)
  # Momentum buffers, as the scripts make them before a first step: no step to compile, and the
  # bytes a real checkpoint saves and loads.
  utils.make_optimizer_state(optimizer)
  torch_xla.sync()
  xm.wait_device_ops()
  state = dict(model=script.weights(model), optimizer=optimizer.state_dict(), lr_scheduler=None,
               epoch=1, step=1, global_step=1, flags={}, results={},
               rng=dict(torch=torch.get_rng_state(), xla=xm.get_rng_state()))
  folder = pathlib.Path(sys.argv[2], kind.replace(' ', '-'))
  start = time.perf_counter()
  write = utils.write_checkpoint if kind == 'one file' else sharded_checkpoints.write_sharded
  path = write(state, str(folder), 2, False)
  save = time.perf_counter() - start
  start = time.perf_counter()
  saved = utils.load_checkpoint(path)
  if kind == 'one file':
    model.load_state_dict(saved['model'])
  else:
    saved = sharded_checkpoints.read_sharded(saved, script.weights(model), optimizer)
  optimizer.load_state_dict(saved['optimizer'])
  xm.wait_device_ops()
  load = time.perf_counter() - start
  size = sum(f.stat().st_size for f in folder.rglob('*') if f.is_file() and f.name != '.lock')
  rows.append((kind, size / 1e6, save, load))
print(json.dumps(rows))
"""


def sharded_costs(tmp, name):
  """[(kind, MB, save seconds, load seconds)] of SHARDED_COSTS for model `name`."""
  env = dict(os.environ, PJRT_DEVICE=os.environ.get('PJRT_DEVICE', 'CPU'), CPU_NUM_DEVICES='4')
  done = subprocess.run([sys.executable, '-c', SHARDED_COSTS, name, str(tmp / 'sharded')],
                        cwd=REPO, env=env, capture_output=True, text=True)
  if done.returncode != 0:
    sys.exit(f'the sharded checkpoint measurement failed:\n{done.stderr[-3000:]}')
  return json.loads(done.stdout.strip().splitlines()[-1])


def runs_to_measure(tmp, quick):
  """(script, data, flags) of each row of the training table, and the WebDataset run's flags."""
  epochs, steps = (2, 3) if quick else (3, 40)
  model, img_dim, batch = FLAGS.bench_model, FLAGS.bench_img_dim, FLAGS.bench_batch_size
  common = ['--model', model, '--img_dim', img_dim, '--batch_size', batch, '--test_set_batch_size',
            batch, '--num_epochs', epochs, '--log_steps', 10]
  # Sizes that divide neither batch: a partial training batch is dropped, a partial
  # evaluation batch padded; neither may compile a graph after epoch 1.
  folder = image_folder(tmp / 'folder', train=(steps + 1) * batch + 5, val=2 * batch + 3)
  train_pattern, test_pattern = cifar_shards(tmp / 'shards', train=(steps + 1) * batch,
                                             test=2 * batch + 3)
  wds_args = ['--wds_traindir', train_pattern, '--trainsize', (steps + 1) * batch,
              '--wds_testdir', test_pattern, '--testsize', 2 * batch + 3, '--num_steps', steps,
              '--num_workers', 2, '--batch_size', batch, '--test_set_batch_size', batch,
              '--num_epochs', epochs, '--log_steps', 10, '--ckpt_dir', tmp / 'ckpt']
  fake = ['--fake_data', '--num_steps', steps, *common]
  runs = [
      ('train_single_core.py', 'fake', fake),
      ('train_resnet_mp.py', 'fake', fake),
      ('train_resnet_mp.py', 'fake, --ddp', [*fake, '--ddp']),
      # Batch sizes are per device there: the same global batch on 1 or 4 devices.
      ('train_resnet_spmd.py', 'fake, 1 device', fake),
      ('train_resnet_spmd.py', 'fake, 4 devices', [*fake, '--batch_size', batch // 4,
                                                   '--test_set_batch_size', batch // 4]),
      ('train_resnet_spmd.py', '--sharding fsdp, fake, 4 devices',
       [*fake, '--batch_size', batch // 4, '--test_set_batch_size', batch // 4, '--sharding',
        'fsdp']),
      ('train_single_core.py', 'image folder', ['--datadir', folder, '--num_workers', 2, *common]),
      ('train_resnet_mp.py', 'image folder', ['--datadir', folder, '--num_workers', 2, *common]),
      # Checkpoints too (every epoch end and at step steps - 1), for the resume below.
      ('train_wds_cifar.py', 'shards, CIFAR stem', [*wds_args, '--ckpt_every_steps', steps - 1]),
  ]
  if quick:  # A row of each launch: the folder runs take the same path as the fake ones,
    # and the SPMD script the single core's (one process).
    runs = [r for r in runs if r[0] != 'train_resnet_spmd.py' and r[1] != 'image folder'
            and '--ddp' not in r[1]][1:]
  return runs, wds_args


def precision_rows(tmp, quick):
  """(precision, samples/s, host overhead, graphs compiled, checkpoint MB) of the single-core
  fake-data run in float32, with --amp and with --bf16, each row when its run ends."""
  epochs, steps = (2, 3) if quick else (3, 40)
  precisions = (('float32', []), ('--amp', ['--amp']), ('--bf16', ['--bf16']))
  # --quick: float32's row (bfloat16 is emulated on a CPU: its run takes three times as long).
  for name, extra in precisions[:1] if quick else precisions:
    say(f'measuring train_single_core.py in {name}')
    ckpt_dir = tmp / f'precision-{name.strip("-")}'
    results, _ = run('train_single_core.py', '--fake_data', '--model', FLAGS.bench_model,
                     '--img_dim', FLAGS.bench_img_dim, '--batch_size', FLAGS.bench_batch_size,
                     '--test_set_batch_size', FLAGS.bench_batch_size, '--num_epochs', epochs,
                     '--num_steps', steps, '--log_steps', 10, '--ckpt_dir', ckpt_dir, *extra)
    rate, busy = (np.mean(results[k][1:]) for k in ('epoch_rates', 'epoch_device_busy'))
    size = max(ckpt_dir.glob('ckpt-*.pt')).stat().st_size / 1e6
    yield name, rate, overhead(busy), results['compilations'], size


def accumulation_rows(quick):
  """(how a step is made, samples/s, peak MB, graphs compiled) of train_single_core.py on fake
  data: a step of 64 as one batch, as 4 accumulated batches of 16, and 16 alone (--quick: one
  row, 2 batches of 2 at 16 px)."""
  img_dim, epochs, steps = (16, 2, 2) if quick else (224, 2, 3)
  ways = (('a batch of 64', [64, 1]), ('4 accumulated batches of 16', [16, 4]),
          ('a batch of 16', [16, 1]))
  for name, (batch, count) in [('2 accumulated batches of 2', [2, 2])] if quick else ways:
    say(f'running train_single_core.py with {name}')
    results, _ = run('train_single_core.py', '--fake_data', '--model', FLAGS.bench_model,
                     '--img_dim', img_dim, '--batch_size', batch, '--gradient_accumulation_steps',
                     count, '--test_set_batch_size', 8, '--num_epochs', epochs, '--num_steps',
                     steps, '--log_steps', 10, '--num_workers', 0)
    yield name, np.mean(results['epoch_rates'][1:]), results['peak_mb'], results['compilations']


def overhead(busy):
  """The host's share of an epoch: 1 - the device's busy share, which timing noise can put
  above 1 in a short epoch (the device still runs the last step when the epoch's clock stops)."""
  return max(0.0, 1 - busy)


def measure_row(script, data, args):
  """(the training table's row of one run, its seconds from start to the first step)."""
  devices = int(data.split()[-2]) if data.endswith(('device', 'devices')) else None
  results, first_step = run(script, *args, devices=devices)
  compiled = results['compilations_after_epoch']
  # Steady state: the epochs after the first (which compiles), averaged.
  rate, busy = (np.mean(results[k][1:]) for k in ('epoch_rates', 'epoch_device_busy'))
  row = (script, data, rate, overhead(busy), results['compilations'], compiled[-1] - compiled[0])
  return row, first_step


def resumed_first_step(tmp, wds_args, epochs, steps):
  """(seconds to the first new step, where) of the WebDataset run resumed mid-epoch: a
  resumed shard stream reads the samples of the batches it skips, the costliest skip.
  It resumes from the mid-epoch checkpoint of the last epoch (the last run's)."""
  os.remove(tmp / 'ckpt' / f'ckpt-{epochs * steps:08d}.pt')
  resumed, out = first_step_seconds('train_wds_cifar.py', [*wds_args, '--log_steps', 1])
  resumed_at = re.search(r'Resumed from \S+ at epoch (\d+) step (\d+)', out)
  return resumed, f'epoch {resumed_at.group(1)} step {resumed_at.group(2)}' if resumed_at else '?'


@contextlib.contextmanager
def stdout_discarded():
  """Discards stdout at its file descriptor (utils' lines, which would fall into the table)."""
  sys.stdout.flush()
  kept = os.dup(1)
  with open(os.devnull, 'w') as devnull:
    os.dup2(devnull.fileno(), 1)
  try:
    yield
  finally:
    sys.stdout.flush()
    os.dup2(kept, 1)
    os.close(kept)


def say(what):
  """A progress line, on stderr: stdout holds the tables alone."""
  print(f'[{time.strftime("%H:%M:%S")}] {what} ...', file=sys.stderr, flush=True)


def main(argv):
  del argv
  epochs, steps = (2, 3) if FLAGS.quick else (3, 40)
  checkpointed = 'resnet18' if FLAGS.quick else 'resnet50'
  print(f'Training on XLA:CPU, {platform.processor() or platform.machine()}, '
        f'{os.cpu_count()} cores; {FLAGS.bench_model} at {FLAGS.bench_img_dim} px, batch '
        f'{FLAGS.bench_batch_size}, {epochs} epochs of {steps} steps, a line logged every 10; '
        'rate and overhead: mean of the epochs after the first')
  print()
  # Each row as soon as it is measured: a whole run takes minutes.
  print('| script | data | samples/s | host overhead | graphs compiled | compiled after epoch 1 |')
  print('| --- | --- | --- | --- | --- | --- |', flush=True)
  with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    say('writing an image folder and shards')
    runs, wds_args = runs_to_measure(tmp, FLAGS.quick)
    first_step = {}
    for script, data, args in runs:
      say(f'running {script} on {data}')
      row, first_step[script] = measure_row(script, data, args)
      print('| {} | {} | {:,.1f} | {:.1%} | {} | {} |'.format(*row), flush=True)
    say('resuming train_wds_cifar.py mid-epoch')
    resumed, where = resumed_first_step(tmp, wds_args, epochs, steps)
    say('saving and loading a checkpoint')  # After the resume: it writes to the same folder.
    with stdout_discarded():  # Its 'Saved checkpoint' line.
      save, load, size = checkpoint_costs(tmp, checkpointed)
    say('running the eager PyTorch step')
    # After the XLA runtime is up: autograd sizes its device queues at the first backward.
    eager = eager_rate(FLAGS.bench_model, FLAGS.bench_img_dim, FLAGS.bench_batch_size,
                       3 if FLAGS.quick else 20)
    print(f'| eager PyTorch, CPU | fake | {eager:,.1f} | | | |')
    print()
    print('| precision (train_single_core.py, fake) | samples/s | host overhead | graphs compiled '
          '| checkpoint |')
    print('| --- | --- | --- | --- | --- |', flush=True)
    for row in precision_rows(tmp, FLAGS.quick):
      print('| {} | {:,.1f} | {:.1%} | {} | {:,.0f} MB |'.format(*row), flush=True)
    print()
    print('| checkpoint | value |')
    print('| --- | --- |')
    print(f'| {checkpointed} + momentum, size | {size:,.0f} MB |')
    print(f'| save (device to host, serialise, write, rename) | {save:.2f} s |')
    print(f'| load (read, check, copy to the device) | {load:.2f} s |')
    print(f'| train_wds_cifar.py, fresh run: start to first step | '
          f'{first_step["train_wds_cifar.py"]:.1f} s |')
    print(f'| train_wds_cifar.py, resumed at {where}: start to first new step | {resumed:.1f} s |')
    say('saving and loading train_resnet_spmd.py\'s checkpoints on 4 devices')
    print()
    print(f'| train_resnet_spmd.py, 4 devices: {checkpointed} + momentum | size | save | load |')
    print('| --- | --- | --- | --- |')
    for kind, size, save, load in sharded_costs(tmp, checkpointed):
      print(f'| {kind if kind == "one file" else "shards, --sharding " + kind} | {size:,.0f} MB | '
            f'{save:.2f} s | {load:.2f} s |', flush=True)
    print()
    print(f'| train_single_core.py, {FLAGS.bench_model}, fake, a step of | samples/s | peak memory '
          '| graphs compiled |')
    print('| --- | --- | --- | --- |', flush=True)
    for row in accumulation_rows(FLAGS.quick):
      print('| {} | {:,.1f} | {:,.0f} MB | {} |'.format(*row), flush=True)
  print(flush=True)
  say('running benchmarks/input_pipeline.py')
  # The input pipeline has its own script (it imports train_wds_cifar, whose flags would
  # clash with these).
  pipeline = subprocess.run([sys.executable, str(REPO / 'benchmarks' / 'input_pipeline.py'),
                             *(['--quick'] if FLAGS.quick else [])], cwd=REPO,
                            capture_output=True, text=True)
  print(pipeline.stdout.strip() if pipeline.returncode == 0 else
        f'input_pipeline.py failed:\n{pipeline.stderr[-3000:]}')


if __name__ == '__main__':
  app.run(main)
