"""Trains a torchvision classifier on ONE XLA device: a TPU core, or XLA:CPU without a TPU.

No processes are spawned, so this is the script for debugging, for profiling one core
and for small runs; train_resnet_mp.py runs the same job on every device of a host.
Data is an ImageNet-style folder (--datadir DIR with DIR/train/CLASS/*.jpg and
DIR/val/CLASS/*.jpg) or constant fake batches (--fake_data), as in pytorch/xla's
test_train_mp_imagenet.py.

  python train_single_core.py --fake_data --model resnet18 --img_dim 64 \
      --batch_size 16 --num_epochs 1 --num_steps 40 --log_steps 10

With --ckpt_dir the run saves its whole state and, started again with the same command,
goes on from the newest checkpoint exactly where it stopped. On SIGTERM it finishes the
step, saves and exits with code 75.
"""

import functools
import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.distributed.parallel_loader as pl
import torch_xla.runtime as xr
from absl import app, flags

import utils

FLAGS = flags.FLAGS
flags.DEFINE_bool('fake_data', False, 'Train on constant fake batches instead of --datadir.')
flags.DEFINE_string('datadir', None, 'ImageNet-style folder: DIR/train/CLASS/*.jpg, DIR/val/CLASS/*.jpg.')
flags.DEFINE_string('model', 'resnet50', 'Any torchvision classification model, e.g. resnet18.')
flags.DEFINE_integer('img_dim', 224, 'Image side in pixels; small values make CPU runs fast.', lower_bound=8)
flags.DEFINE_integer('batch_size', 128, 'Training batch size.', lower_bound=1)
flags.DEFINE_integer('test_set_batch_size', 64, 'Evaluation batch size.', lower_bound=1)
flags.DEFINE_integer('num_epochs', 18, 'Number of epochs.', lower_bound=1)
flags.DEFINE_integer('num_steps', None, 'Cap on training and evaluation steps per epoch.', lower_bound=1)
flags.DEFINE_integer('log_steps', 20, 'Print a training line every this many steps.', lower_bound=1)
flags.DEFINE_float('lr', 0.1, 'Learning rate (SGD).', lower_bound=0.0)
flags.DEFINE_float('momentum', 0.9, 'SGD momentum.', lower_bound=0.0)
flags.DEFINE_float('weight_decay', 1e-4, 'SGD weight decay.', lower_bound=0.0)
flags.DEFINE_integer('seed', 42, 'Seed of the weights and of the data order.')
flags.DEFINE_bool('drop_last', True, 'Drop the last partial training batch (its new shape '
                  'would compile a new graph). Evaluation always counts every image.')
flags.DEFINE_integer('num_workers', 8, 'DataLoader worker processes.', lower_bound=0)
flags.DEFINE_bool('persistent_workers', True, 'Keep DataLoader workers between epochs '
                  '(--nopersistent_workers: start them anew each epoch).')
flags.DEFINE_integer('prefetch_factor', None, 'Batches each worker loads ahead (needs workers).',
                     lower_bound=1)
flags.DEFINE_integer('loader_prefetch_size', 8, 'Host batches MpDeviceLoader queues.', lower_bound=1)
flags.DEFINE_integer('device_prefetch_size', 4, 'Device batches MpDeviceLoader queues.', lower_bound=1)
flags.DEFINE_integer('host_to_device_transfer_threads', 1, 'Threads copying batches to the device.',
                     lower_bound=1)
flags.DEFINE_bool('bf16', False, 'Train in bfloat16: sets XLA_USE_BF16=1 before the runtime starts.')
flags.DEFINE_float('target_accuracy', 0.0, 'Exit with code 21 if the final accuracy (%) is below it.')
flags.DEFINE_string('logdir', None, 'TensorBoard folder for loss, rate, lr and accuracy.')
flags.DEFINE_bool('metrics_debug', False, "Print torch_xla's metrics report after each epoch.")
flags.DEFINE_string('results_json', None, 'Write accuracy, rates and compile counts here at exit.')
flags.DEFINE_string('ckpt_dir', None, 'Save checkpoints here (local path or fsspec URL such as '
                    'gs://bucket/run1) and resume from the newest one when started again.')
flags.DEFINE_integer('ckpt_every_steps', None, 'Also save every N steps (always at each epoch end).',
                     lower_bound=1)
flags.DEFINE_integer('keep_checkpoints', 2, 'Checkpoints kept, besides best.pt.', lower_bound=1)
flags.DEFINE_string('resume', None, 'Resume from this checkpoint instead of the newest in --ckpt_dir.')
flags.register_validator('model', lambda name: name in utils.model_names(),
                         'is not a torchvision classification model (e.g. resnet18, resnet50)')

FAKE_TRAIN_SAMPLES = 1_200_000  # About ImageNet's size, as upstream.
FAKE_TEST_SAMPLES = 50_000
FAKE_CLASSES = 1000
EXIT_BELOW_TARGET = 21  # upstream's code for a run below --target_accuracy


def load_data(cfg):
  """Train and test loaders, capped at --num_steps batches, the train sampler and the class count."""
  cap = cfg.num_steps or sys.maxsize
  if cfg.fake_data:
    train = utils.FakeBatches(cfg.batch_size, cfg.img_dim, FAKE_TRAIN_SAMPLES // cfg.batch_size)
    test = utils.FakeBatches(cfg.test_set_batch_size, cfg.img_dim,
                             FAKE_TEST_SAMPLES // cfg.test_set_batch_size)
    return utils.CappedLoader(train, cap), utils.CappedLoader(test, cap), None, FAKE_CLASSES
  if not cfg.datadir:
    raise utils.UsageError('give --datadir DIR (DIR/train/CLASS/*.jpg, DIR/val/CLASS/*.jpg) '
                           'or --fake_data')
  train_dir, test_dir = os.path.join(cfg.datadir, 'train'), os.path.join(cfg.datadir, 'val')
  classes = utils.check_image_folder(train_dir)
  if utils.check_image_folder(test_dir) != classes:
    raise utils.UsageError(f'{test_dir} and {train_dir} must hold the same class folders')
  train_set = utils.image_folder(train_dir, cfg.img_dim, train=True)
  test_set = utils.image_folder(test_dir, cfg.img_dim, train=False)
  # World size 1: the whole set, in an order that is a function of (seed, epoch) alone,
  # each image cropped by its own seed: a resumed run sees the same batches.
  sampler = utils.train_sampler(train_set, rank=0, world_size=1, seed=cfg.seed)
  workers = dict(num_workers=cfg.num_workers, worker_init_fn=utils.ignore_sigterm)
  if cfg.num_workers:  # torch 2.9 raises on these without workers.
    workers.update(persistent_workers=cfg.persistent_workers, prefetch_factor=cfg.prefetch_factor)
  train_loader = torch.utils.data.DataLoader(utils.SeededSamples(train_set), cfg.batch_size,
                                             sampler=sampler, drop_last=cfg.drop_last, **workers)
  if len(train_loader) == 0:
    raise utils.UsageError(f'{train_dir} has {len(train_set)} images, fewer than one batch: '
                           'lower --batch_size or pass --nodrop_last')
  # Padded to whole batches: a partial last batch would compile another graph.
  test_set = utils.PaddedSubset(
      test_set, utils.eval_indices(len(test_set), 0, 1, cfg.test_set_batch_size),
      blank=torch.zeros(3, cfg.img_dim, cfg.img_dim))
  test_loader = torch.utils.data.DataLoader(test_set, cfg.test_set_batch_size, **workers)
  return (utils.CappedLoader(train_loader, cap), utils.CappedLoader(test_loader, cap), sampler,
          len(classes))


def train_step(model, optimizer, images, labels):
  optimizer.zero_grad()
  loss = F.cross_entropy(model(images), labels)
  loss.backward()
  xm.optimizer_step(optimizer)
  return loss


def train_one_epoch(model, optimizer, loader, epoch, first_step, global_step, cfg, writer, stop,
                    checkpoint):
  """Trains the epoch from step first_step on; returns (steps run, whether SIGTERM stopped it)."""
  device, ordinal = torch_xla.device(), xr.global_ordinal()
  tracker = xm.RateTracker()
  model.train()
  steps = 0
  for step, (images, labels) in enumerate(loader, first_step):
    loss = train_step(model, optimizer, images, labels)
    tracker.add(cfg.batch_size)
    steps += 1
    if step % cfg.log_steps == 0:
      lr = optimizer.param_groups[0]['lr']
      xm.add_step_closure(utils.log_training_step, args=(
          device, ordinal, epoch, step, global_step + steps - 1, loss, tracker, lr, writer))
    if stop.requested:
      return steps, True
    if cfg.ckpt_dir and cfg.ckpt_every_steps and (global_step + steps) % cfg.ckpt_every_steps == 0:
      checkpoint(epoch, step + 1, global_step + steps)
  return steps, False


def evaluate(model, loader):
  """(accuracy %, correct, total) over every image once; padding (label -1) is not counted."""
  device = torch_xla.device()
  model.eval()
  # Counted on the device and read once at the end: an .item() per step would sync.
  correct = torch.zeros((), dtype=torch.int64, device=device)
  total = torch.zeros((), dtype=torch.int64, device=device)
  with torch.no_grad():
    for images, labels in loader:
      correct += (model(images).argmax(dim=1) == labels).sum()
      total += (labels >= 0).sum()
  correct, total = correct.item(), total.item()
  return 100.0 * correct / max(total, 1), correct, total


def save_checkpoint(cfg, model, optimizer, results, epoch, step, global_step, best=False):
  """Saves the whole training state after `step` steps of `epoch`; returns its path."""
  state = dict(model=model.state_dict(), optimizer=optimizer.state_dict(), lr_scheduler=None,
               epoch=epoch, step=step, global_step=global_step, rng=utils.rng_state(),
               flags=vars(cfg), results=results)
  return utils.save_checkpoint(state, cfg.ckpt_dir, cfg.keep_checkpoints, best)


def train(cfg):
  """The whole run; returns the results dict that --results_json writes."""
  stop = utils.StopRequest()
  torch.manual_seed(cfg.seed)
  if cfg.ckpt_dir:
    utils.check_checkpoint_dir(cfg.ckpt_dir)
  train_loader, test_loader, sampler, num_classes = load_data(cfg)
  device = torch_xla.device()
  model = utils.create_model(cfg.model, num_classes).to(device)
  optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                              weight_decay=cfg.weight_decay)
  writer = utils.summary_writer(cfg.logdir)
  prefetch = dict(loader_prefetch_size=cfg.loader_prefetch_size,
                  device_prefetch_size=cfg.device_prefetch_size,
                  host_to_device_transfer_threads=cfg.host_to_device_transfer_threads)
  train_device_loader = pl.MpDeviceLoader(train_loader, device, **prefetch)
  test_device_loader = pl.MpDeviceLoader(test_loader, device, **prefetch)

  results = dict(model=cfg.model, epochs=0, train_steps=0, max_accuracy=0.0, final_accuracy=0.0,
                 eval_correct=0, eval_samples=0, epoch_rates=[], epoch_device_busy=[],
                 compilations_after_epoch=[], train_seconds=0.0, bf16=os.environ.get('XLA_USE_BF16') == '1')
  first_epoch, first_step = 1, 0
  path, state = utils.find_checkpoint(cfg.resume, cfg.ckpt_dir)
  if state is not None:
    first_epoch, first_step, results = utils.restore(state, path, model, optimizer, None,
                                                     vars(cfg), num_classes)
    if first_epoch > cfg.num_epochs:
      print(f'Run already finished: {path} is the end of epoch {first_epoch - 1} '
            f'(--num_epochs {cfg.num_epochs})', flush=True)
      return results
    print(f'Resumed from {path} at epoch {first_epoch} step {first_step}', flush=True)
  checkpoint = functools.partial(save_checkpoint, cfg, model, optimizer, results)

  for epoch in range(first_epoch, cfg.num_epochs + 1):
    if sampler is not None:  # Skips, on the host, the batches a resumed run has trained.
      sampler.set_epoch(epoch, skip=first_step * cfg.batch_size)
    train_loader.start = first_step
    print(f'Epoch {epoch} train begin {utils.now()}', flush=True)
    start, executed = time.time(), utils.execute_seconds()
    steps, stopped = train_one_epoch(model, optimizer, train_device_loader, epoch, first_step,
                                     results['train_steps'], cfg, writer, stop, checkpoint)
    train_loader.check()
    xm.wait_device_ops()  # Time the device work, not just the tracing.
    utils.flush_training_log()  # Its lines before the epoch's.
    seconds = time.time() - start
    busy = (utils.execute_seconds() - executed) / seconds  # Device time / wall time.
    results['train_steps'] += steps
    results['train_seconds'] += seconds
    if stopped:
      return stop_run(cfg, checkpoint, results, epoch, first_step + steps)
    print(f'Epoch {epoch} train end {utils.now()}', flush=True)

    accuracy, correct, total = evaluate(model, test_device_loader)
    test_loader.check()
    print(f'Epoch {epoch} test end {utils.now()}, Accuracy={accuracy:.2f}', flush=True)
    utils.write_scalars(writer, epoch, {'Accuracy/test': accuracy})
    if cfg.metrics_debug:
      print(met.metrics_report(), flush=True)

    best = accuracy > results['max_accuracy']
    results.update(epochs=epoch, final_accuracy=accuracy, eval_correct=correct,
                   eval_samples=total, max_accuracy=max(results['max_accuracy'], accuracy))
    if steps:
      results['epoch_rates'].append(steps * cfg.batch_size / seconds)
      results['epoch_device_busy'].append(busy)
    results['compilations_after_epoch'].append(utils.compile_count())
    if cfg.ckpt_dir:
      checkpoint(epoch + 1, 0, results['train_steps'], best=best)
    if stop.requested:
      return stop_run(cfg, checkpoint, results, epoch + 1, 0)
    first_step = 0

  if writer is not None:
    writer.close()
  results['train_samples'] = results['train_steps'] * cfg.batch_size
  results['global_rate'] = results['train_samples'] / max(results['train_seconds'], 1e-9)
  results['compilations'] = utils.compile_count()
  print(f'Max Accuracy: {results["max_accuracy"]:.2f}%', flush=True)
  return results


def stop_run(cfg, checkpoint, results, epoch, step):
  """The end of a run stopped by SIGTERM at a step boundary: saves, says so."""
  saved = checkpoint(epoch, step, results['train_steps']) if cfg.ckpt_dir else None
  print(f'Stopped by SIGTERM at epoch {epoch} step {step}: ' +
        (f'saved {saved}; run the same command to resume' if saved else
         'nothing saved (no --ckpt_dir)') + f' (exit code {utils.EXIT_PREEMPTED})', flush=True)
  results['preempted'] = True
  return results


def main(argv):
  del argv
  utils.stop_on_sigterm()
  if FLAGS.bf16:
    os.environ['XLA_USE_BF16'] = '1'  # Read when the runtime starts, which is still ahead.
  cfg = SimpleNamespace(**FLAGS.flag_values_dict())
  try:
    results = train(cfg)
  except (utils.UsageError, utils.BadDataError) as e:
    utils.die(e)
  finally:
    utils.end_loader_workers()
  utils.write_results(cfg.results_json, results)
  if results.get('preempted'):
    sys.exit(utils.EXIT_PREEMPTED)
  if results['final_accuracy'] < cfg.target_accuracy:
    print(f'Accuracy {results["final_accuracy"]:.2f} is below target {cfg.target_accuracy:.2f}',
          flush=True)
    sys.exit(EXIT_BELOW_TARGET)


if __name__ == '__main__':
  app.run(main, flags_parser=utils.parse_flags)
