# SPDX-License-Identifier: BSD-3-Clause
"""Trains a torchvision classifier on ONE XLA device: a TPU core, or XLA:CPU without a TPU.

No processes are spawned, so this is the script for debugging, for profiling one core and
for small runs; train_resnet_mp.py runs the same job on every device of a host. Data: an
ImageNet-style folder (--datadir) or constant fake batches (--fake_data). With --ckpt_dir,
the same command started again goes on exactly where the last one stopped. SIGTERM or SIGHUP
(Ctrl-C): it finishes the step, saves, exit code 75 (130); a second Ctrl-C ends it at once.

  python train_single_core.py --fake_data --model resnet18 --img_dim 64 \
      --batch_size 16 --num_epochs 1 --num_steps 40 --log_steps 10
"""

import os
import sys
import time
from types import SimpleNamespace

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_bool('fake_data', False, 'Train on constant fake batches instead of --datadir.')
flags.DEFINE_string('datadir', None, 'ImageNet-style folder: DIR/train/CLASS/*.jpg, DIR/val/CLASS/*.jpg.')
flags.DEFINE_string('model', 'resnet50', 'A torchvision classifier (resnet18, ...) or a name build_model knows.')
flags.DEFINE_integer('img_dim', 224, 'Image side in pixels; small values make CPU runs fast.', lower_bound=8)
flags.DEFINE_integer('batch_size', 128, 'Training batch size.', lower_bound=1)
flags.DEFINE_integer('gradient_accumulation_steps', 1, 'Batches of --batch_size whose gradients '
                     'make one optimizer step: a batch this many times larger at the same memory.',
                     lower_bound=1)
flags.DEFINE_integer('test_set_batch_size', 64, 'Evaluation batch size.', lower_bound=1)
flags.DEFINE_integer('num_epochs', 18, 'Number of epochs.', lower_bound=1)
flags.DEFINE_integer('eval_interval', 1, 'Evaluate after every this many epochs, and after the last.',
                     lower_bound=1)
flags.DEFINE_bool('test_only_at_end', False, 'Evaluate after the last epoch only.')
flags.DEFINE_integer('num_steps', None, 'Cap on training (optimizer) and evaluation steps per epoch.',
                     lower_bound=1)
flags.DEFINE_integer('log_steps', 20, 'Print a training line every this many steps.', lower_bound=1)
flags.DEFINE_float('lr', 0.1, 'Peak learning rate (SGD).', lower_bound=0.0)
flags.DEFINE_enum('lr_scheduler_type', 'none', ['WarmupAndExponentialDecayScheduler', 'none'],
                  'Linear warm-up, then division every N epochs; or a constant rate.')
flags.DEFINE_float('lr_warmup_epochs', 0.9, 'Epochs of linear warm-up from 0.', lower_bound=0.0)
flags.DEFINE_integer('lr_scheduler_divide_every_n_epochs', 20, 'LR division period.', lower_bound=1)
flags.DEFINE_float('lr_scheduler_divisor', 5, 'What the LR is divided by.', lower_bound=1.0)
flags.DEFINE_float('momentum', 0.9, 'SGD momentum, below 1.', lower_bound=0.0)
flags.register_validator('momentum', lambda m: m < 1, 'give a momentum below 1, such as 0.9: at 1 '
                         'or more each step adds all of the last one, and the weights run away')
flags.DEFINE_float('weight_decay', 1e-4, 'SGD weight decay.', lower_bound=0.0)
flags.DEFINE_integer('seed', 42, 'Seed of the weights and of the data order.')
flags.DEFINE_bool('drop_last', True, 'Drop the last partial training batch (a new shape compiles).')
flags.DEFINE_integer('num_workers', 8, 'DataLoader worker processes.', lower_bound=0)
flags.DEFINE_bool('persistent_workers', True, 'Keep DataLoader workers from epoch to epoch.')
flags.DEFINE_integer('prefetch_factor', None, 'Batches each loader worker loads ahead.', lower_bound=1)
flags.DEFINE_integer('loader_prefetch_size', 8, 'Host batches MpDeviceLoader queues.', lower_bound=1)
flags.DEFINE_integer('device_prefetch_size', 4, 'Device batches MpDeviceLoader queues.', lower_bound=1)
flags.DEFINE_integer('host_to_device_transfer_threads', 1, 'Host-to-device copy threads.', lower_bound=1)
flags.DEFINE_bool('bf16', False, 'Train in bfloat16: sets XLA_USE_BF16=1 before the runtime starts.')
flags.DEFINE_bool('amp', False, 'Mixed precision: forward and loss autocast to bfloat16, weights and '
                  'optimizer in float32 (see docs/tpu.md).')
flags.DEFINE_enum('mat_mul_precision', 'default', ['default', 'high', 'highest'], 'Float32 matrix products and convolutions on a TPU: 1, 3 or 6 bfloat16 passes (docs/tpu.md).')
flags.DEFINE_float('target_accuracy', 0.0, 'Exit with code 21 if the final accuracy (%) is below it.')
flags.DEFINE_string('logdir', None, 'TensorBoard folder for loss, rate, lr and accuracy.')
flags.DEFINE_bool('metrics_debug', False, "Print torch_xla's metrics report after each epoch.")
flags.DEFINE_bool('debug_graphs', False, "Say why each graph compiled after epoch 1 did (torch_xla's analysis).")
flags.DEFINE_bool('profile', False, 'Start the profiler server so TensorBoard can capture a trace.')
flags.DEFINE_integer('profiler_port', 9012, 'Profiler server port.')
flags.DEFINE_integer('profile_step', None, 'Capture a trace of the run from this step on '
                     '(counted from the run\'s start, as checkpoints count), into --profile_logdir.',
                     lower_bound=0)
flags.DEFINE_integer('profile_duration_ms', 5000, 'How long --profile_step traces.', lower_bound=1)
flags.DEFINE_string('profile_logdir', None, "Folder (or gs://) for --profile_step's trace "
                    '(default: --logdir), which TensorBoard\'s profile tab reads.')
flags.register_multi_flags_validator(
    ['profile_step', 'profile_logdir', 'logdir'],
    lambda f: f['profile_step'] is None or bool(f['profile_logdir'] or f['logdir']),
    '--profile_step needs a folder for its trace: give --profile_logdir DIR (or --logdir)')
flags.DEFINE_string('results_json', None, 'Write accuracy, rates and compile counts here at exit.')
flags.DEFINE_string('ckpt_dir', None, 'Save checkpoints here, resume from the newest (pod: gs://...).')
flags.DEFINE_integer('ckpt_every_steps', None, 'Also save every N steps.', lower_bound=1)
flags.DEFINE_integer('keep_checkpoints', 2, 'Checkpoints kept, besides best.pt.', lower_bound=1)
flags.DEFINE_string('resume', None, 'Resume from this checkpoint instead of the newest in --ckpt_dir.')
flags.DEFINE_string('compile_cache_dir', None, "torch_xla's compile cache, on this host's disk: a restart loads graphs, not compiles (TPU).")

# --help answers here, before torch and torch_xla load (seconds): absl prints it as it parses.
# (In a notebook, %run goes through run(), below.)
if (__name__ == '__main__' and 'IPython' not in sys.modules and
    {'--help', '--helpshort', '--helpfull', '-?'} & set(sys.argv[1:])):
  app.define_help_flags()  # As app.run does.
  try:
    FLAGS(sys.argv, known_only=True)
  except SystemExit:  # absl's, after the help, is 1.
    sys.exit(0)
  except BrokenPipeError:  # --help | head: the reader has what it wanted.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python flushes at exit.
    sys.exit(0)
  except flags.Error:
    pass  # Said in one line by app.run's parse.

import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.debug.profiler as xp
import torch_xla.distributed.parallel_loader as pl
import torch_xla.test.test_utils as test_utils
import torch_xla.utils.utils as xu
from torch.utils.tensorboard import SummaryWriter
from torchvision.transforms import v2

import utils

try:  # Optional: checks before the run starts and a watch over its processes (see its docstring).
  import supervisor
except ModuleNotFoundError as e:
  if e.name != 'supervisor':
    raise
  supervisor = None

utils.redefinable(FLAGS)  # A notebook may import several scripts or %run one again.

FAKE_TRAIN_SAMPLES, FAKE_TEST_SAMPLES, FAKE_CLASSES = 1_200_000, 50_000, 1000  # ImageNet's


# ---------------------------------------------------------- your model and your data
def build_optimizer(cfg, model):
  """The optimizer of the model's parameters: SGD with --lr, --momentum and --weight_decay. Put
  yours here (docs/adapt.md shows AdamW); a restore gives back its state_dict whatever it holds.
  A flag value it cannot take: raise utils.UsageError (one `error:` line, exit code 2)."""
  return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                         weight_decay=cfg.weight_decay)


def build_model(cfg, num_classes):
  """The model to train: a torch.nn.Module from a float batch (N, C, H, W) to logits (N,
  num_classes). Here: the torchvision classifier --model names. Put yours here; a --model name of
  your own is then accepted. Called once, seeded with --seed. A --model it cannot build: raise
  utils.UsageError saying what to give (one `error:` line, exit code 2); anything else it raises
  is a bug: a traceback."""
  return utils.create_model(cfg.model, num_classes)


def build_datasets(cfg):
  """(training set, evaluation set, class count) of a run without --fake_data: map-style
  datasets of (C x H x W uint8 or float tensor, integer label below the class count), all of
  one shape. The step normalises uint8 images on the device (utils.normalize, ImageNet's mean
  and std); float ones reach the model as they are. Here: --datadir's ImageNet-style folders,
  as uint8. A mistake the user can fix (a path, a flag) raises utils.UsageError, a file
  that cannot be read utils.BadDataError (each one `error:` line, exit code 2); anything else
  it or its datasets raise is a bug: a traceback that ends there.
  Its first and last samples are checked at start."""
  if not cfg.datadir:
    raise utils.UsageError('give --datadir DIR (DIR/train/CLASS/*.jpg, DIR/val/CLASS/*.jpg) '
                           'or --fake_data')
  if supervisor:  # Links that reach an image twice, classes that differ: one line.
    supervisor.check_image_folders(cfg.datadir, ('train', 'val'))
  # torchvision's ImageNet crops on uint8 tensors (utils.image_folder: torchvision's ImageFolder,
  # JPEGs decoded by libjpeg-turbo; a missing or empty folder is one line): a quarter of
  # float32's bytes go to the replica and the device, which normalises them. The evaluation
  # resize is 256/224 of the crop, as torchvision's references do at 224 px.
  train_set = utils.image_folder(cfg.datadir, 'train', transform=v2.Compose([
      v2.RandomResizedCrop(cfg.img_dim), v2.RandomHorizontalFlip()]))
  val_set = utils.image_folder(cfg.datadir, 'val', transform=v2.Compose([
      v2.Resize(cfg.img_dim * 256 // 224), v2.CenterCrop(cfg.img_dim)]))
  return train_set, val_set, len(train_set.classes)


# ------------------------------------------------------------------------------ loop
def load_data(cfg, rank, world_size):
  """This replica's train and test loaders, capped at --num_steps, and the class count.
  Every replica gets the same number of train and test batches."""
  cap = cfg.num_steps or sys.maxsize
  if cfg.fake_data:
    def fake(batch_size, samples):  # One constant batch: the run measures the device alone.
      batch = (torch.zeros(batch_size, 3, cfg.img_dim, cfg.img_dim),
               torch.zeros(batch_size, dtype=torch.int64))
      return xu.SampleGenerator(batch, samples // world_size // batch_size)
    return (utils.EpochLoader(fake(cfg.batch_size, FAKE_TRAIN_SAMPLES), cap,
                              per_step=cfg.gradient_accumulation_steps),
            utils.EpochLoader(fake(cfg.test_set_batch_size, FAKE_TEST_SAMPLES), cap), FAKE_CLASSES)
  train_set, test_set, num_classes = build_datasets(cfg)
  # Batches of (seed, epoch), each crop of its sample's seed: a resume sees the very same ones.
  sampler = utils.EpochSampler(train_set, rank, world_size, cfg.seed, cfg.batch_size)
  workers = dict(num_workers=cfg.num_workers, worker_init_fn=utils.ignore_stop_signals)
  if cfg.num_workers:  # torch 2.9 raises on these without workers.
    workers.update(persistent_workers=cfg.persistent_workers, prefetch_factor=cfg.prefetch_factor,
                   multiprocessing_context=utils.loader_start())
  # Every replica's share has the same length, so every replica has the same batches.
  train_loader = torch.utils.data.DataLoader(utils.SeededSamples(train_set), cfg.batch_size,
                                             sampler=sampler, drop_last=cfg.drop_last, **workers)
  if len(train_loader) == 0:
    raise utils.UsageError(f'{len(train_set)} training images make no batch of {cfg.batch_size} '
                           f'for each of {world_size} replicas: lower --batch_size or pass '
                           '--nodrop_last')
  test_set = utils.eval_share(test_set, rank, world_size, cfg.test_set_batch_size)
  test_loader = torch.utils.data.DataLoader(test_set, cfg.test_set_batch_size, **workers)
  return (utils.EpochLoader(train_loader, cap, sampler, cfg.gradient_accumulation_steps),
          utils.EpochLoader(test_loader, cap), num_classes)


def device_loaders(loaders, cfg):
  """An MpDeviceLoader of each loader: its batches copied to the device by threads of its own,
  ahead of the steps that take them (--loader_prefetch_size and the next two flags)."""
  prefetch = {name: getattr(cfg, name) for name in (
      'loader_prefetch_size', 'device_prefetch_size', 'host_to_device_transfer_threads')}
  return [pl.MpDeviceLoader(loader, torch_xla.device(), **prefetch) for loader in loaders]


def start_run(cfg, num_classes, steps_per_epoch, stop_signal):
  """Model, optimizer, LR schedule, log and results, restored from the newest checkpoint if
  there is one; run.epoch and run.step are where training goes on."""
  device = torch_xla.device()
  cfg.num_classes = num_classes  # train_step checks the model's output against it.
  model = build_model(cfg, num_classes)
  model = model.to(device)
  optimizer = build_optimizer(cfg, model)
  utils.make_optimizer_state(optimizer)  # Before the first step: one graph less.
  scheduler = None
  if cfg.lr_scheduler_type == 'WarmupAndExponentialDecayScheduler':
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: utils.warmup_step_decay(
        step, steps_per_epoch, cfg.lr_warmup_epochs, cfg.lr_scheduler_divide_every_n_epochs,
        cfg.lr_scheduler_divisor))
  writer = SummaryWriter(cfg.logdir) if cfg.logdir else None
  run = SimpleNamespace(cfg=cfg, model=model, optimizer=optimizer, scheduler=scheduler,
                        stop=utils.StopVote(device, stop_signal, optimizer, num_classes),
                        stop_signal=stop_signal, steps_per_epoch=steps_per_epoch,
                        results=utils.new_results(cfg.model, amp=cfg.amp),
                        num_classes=num_classes, epoch=1, step=0, global_step=0)
  path, state = utils.checkpoint_to_resume(cfg.resume, cfg.ckpt_dir, model.state_dict(),
                                           vars(cfg), run.results['world_size'])
  if state is not None:
    utils.say_resumed(path, state, vars(cfg), restore_checkpoint(run, state))
  run.log = utils.StepLog(device, writer, run.results)  # After the restore.
  # The profiler serves TensorBoard's captures, and --profile_step's, while this run is held.
  run.profiler = utils.start_profiler(cfg, cfg.profiler_port, run.global_step,
                                      steps_per_epoch * cfg.num_epochs)
  return run


def train_step(run, images, labels, part=(1, 1)):
  """Adds the gradients of the batch's loss to the weights'; on the last batch of a step (part: i
  of n, n --gradient_accumulation_steps), steps. Returns the loss / n."""
  (i, n), cfg, optimizer = part, run.cfg, run.optimizer
  # --amp: bfloat16 has float32's range, so no gradient scaler (see docs/tpu.md).
  with torch.autocast('xla', dtype=torch.bfloat16, enabled=cfg.amp):
    output = run.model(utils.normalize(images))
    loss = F.cross_entropy(utils.check_scores(output, labels, cfg.num_classes), labels) / n
  loss.backward()  # Added to the gradients of the step's batches before.
  if i == n:
    xm.optimizer_step(optimizer)
    optimizer.zero_grad()  # For the next step's first batch.
    if run.scheduler is not None:
      run.scheduler.step()
  return loss


def train_one_epoch(run, loader, epoch, first_step):
  """Trains the epoch from step first_step on; returns (steps run, whether to stop now)."""
  cfg = run.cfg
  tracker = xm.RateTracker()
  run.model.train()
  steps = 0
  for step, batches in enumerate(utils.in_steps(loader, cfg.gradient_accumulation_steps),
                                 first_step):
    if run.global_step == cfg.profile_step and xm.is_master_ordinal():
      utils.capture_trace(cfg)  # Of the next --profile_duration_ms, as the run trains on.
    loss = 0
    for i, (images, labels) in enumerate(batches, 1):
      # Named steps in a profile; each batch ends in a sync, so that a step of several holds one
      # batch's activations at a time, and compiles at most three graphs however many there are.
      with xp.StepTrace('train_step', step_num=step):
        loss = loss + train_step(run, images, labels, (i, len(batches)))
        if i < len(batches):
          continue
        labels = torch.cat([labels for _, labels in batches])
        tracker.add(len(labels))
        if step % cfg.log_steps == 0:
          xm.add_step_closure(run.log.add, args=(epoch, step, run.global_step, loss, tracker,
                                                 run.optimizer.param_groups[0]['lr']))
        # The same answer on every process; the end of the run if loss or weights run away, or a
        # label is none of the classes.
        stopping = run.stop.agreed_after_step(loss, labels, f'epoch {epoch} step {step}')
    steps += 1
    run.global_step += 1
    if stopping:
      return steps, True
    # The epoch's last step is saved at its end, with its evaluation.
    if (cfg.ckpt_dir and cfg.ckpt_every_steps and run.global_step % cfg.ckpt_every_steps == 0
        and step + 1 < run.steps_per_epoch):
      save_checkpoint(run, epoch, step + 1)
  return steps, False


def evaluate(model, loader, cfg):
  """(accuracy %, correct, total) over every image once; padding (label -1) is not counted."""
  model.eval()
  # Counted on the device and read once at the end: an .item() per step would sync.
  counts = torch.zeros(2, dtype=torch.int64, device=torch_xla.device())
  with torch.no_grad(), torch.autocast('xla', dtype=torch.bfloat16, enabled=cfg.amp):
    for images, labels in loader:
      hits = (model(utils.normalize(images)).argmax(dim=1) == labels).sum()
      counts += torch.stack([hits, (labels >= 0).sum()])
  correct, total = counts.tolist()
  return 100.0 * correct / max(total, 1), correct, total


def save_checkpoint(run, epoch, step, best=False):
  """Saves the run after `step` steps of `epoch` (every process calls it); returns its path."""
  torch_xla.sync()  # Runs the step's log closure, ...
  run.log.flush()  # ... and waits for it: the history saved is whole.
  run.stop.check_losses()  # Nothing that ran away is saved.
  state = dict(model=run.model.state_dict(), optimizer=run.optimizer.state_dict(),
               lr_scheduler=run.scheduler.state_dict() if run.scheduler else None, epoch=epoch,
               step=step, global_step=run.global_step, flags=vars(run.cfg),
               rng=dict(torch=torch.get_rng_state(), xla=xm.get_rng_state()), results=run.results)
  return utils.write_checkpoint(state, run.cfg.ckpt_dir, run.cfg.keep_checkpoints, best)


def restore_checkpoint(run, state):
  """Puts save_checkpoint's state back into the run, with the --lr, --momentum and
  --weight_decay given now (utils.new_recipe); returns what those changed."""
  run.model.load_state_dict(state['model'])
  run.optimizer.load_state_dict(state['optimizer'])
  if run.scheduler is not None and state['lr_scheduler'] is not None:
    run.scheduler.load_state_dict(state['lr_scheduler'])
  torch.set_rng_state(state['rng']['torch'])
  xm.set_rng_state(state['rng']['xla'])
  vars(run).update({key: state[key] for key in ('epoch', 'step', 'global_step', 'results')})
  return utils.new_recipe(run.optimizer, run.scheduler, state['flags'], vars(run.cfg))


def stop_run(run, epoch, step, saved=None):
  """The end of a run stopped at a step boundary: saves (unless `saved` holds this very state),
  says so; returns the exit code (75 for SIGTERM or SIGHUP, 130 for Ctrl-C)."""
  if saved is None and run.cfg.ckpt_dir:
    xm.master_print(f'Stopping at epoch {epoch} step {step}: saving a checkpoint ...', flush=True)
    saved = save_checkpoint(run, epoch, step)
  name, code = utils.record_stop(run.results, run.stop_signal(), run.global_step, saved)
  xm.master_print(f'Stopped by {name} at epoch {epoch} step {step}: ' +
                  (f'saved {saved}; run the same command to resume' if saved else
                   'nothing saved (no --ckpt_dir)') + f' (exit code {code})', flush=True)
  return code


def end_epoch(run, epoch, accuracy, counts):
  """Records and saves an epoch, evaluated or not (accuracy None); returns (whether to stop now,
  its checkpoint or None)."""
  results = run.results
  results['epochs'] = epoch
  best = accuracy is not None and accuracy > results['max_accuracy']
  if accuracy is not None:  # Only evaluated epochs count for best.pt, the target and the results.
    results['epoch_accuracies'].append(accuracy)
    results['eval_epochs'].append(epoch)
    results.update(final_accuracy=accuracy, eval_correct=counts[0], eval_samples=counts[1],
                   max_accuracy=max(results['max_accuracy'], accuracy))
    test_utils.write_to_summary(run.log.writer, epoch, {'Accuracy/test': accuracy})
  run.log.end_epoch(epoch, evaluated=accuracy is not None)  # The graphs compiled by now.
  utils.check_learning(run.log, epoch, run.num_classes, run.cfg.lr,
                       FLAGS['lr'].default)
  if run.cfg.metrics_debug:
    xm.master_print(met.metrics_report(), flush=True)
  saved = save_checkpoint(run, epoch + 1, 0, best=best) if run.cfg.ckpt_dir else None
  # Every vote read, the last epoch's too (a last step that ran away: Diverged); after the last
  # epoch a stop has nothing left to stop, and the run ends as done.
  stop = run.stop.agreed_at_epoch_end()
  return epoch < run.cfg.num_epochs and stop, saved


def train(cfg, stop_signal):
  """This process's run; returns (its results, the exit code) where it finishes, stops (when
  stop_signal() says) or diverges. A run that fails raises (main says why)."""
  torch.manual_seed(cfg.seed)
  rank, world_size, device = 0, 1, torch_xla.device()
  train_loader, test_loader, num_classes = load_data(cfg, rank, world_size)
  run = start_run(cfg, num_classes, train_loader.steps, stop_signal)
  results = run.results
  train_device_loader, test_device_loader = device_loaders((train_loader, test_loader), cfg)
  if run.epoch <= cfg.num_epochs:  # Else: 'Run already finished'.
    xm.master_print(f'Device {device}; compiling the first step ...', flush=True)
  try:
    for epoch in range(run.epoch, cfg.num_epochs + 1):
      first_step = run.step if epoch == run.epoch else 0
      train_loader.set_epoch(epoch, first_step)  # Skips, on the host, what a resumed run trained.
      xm.master_print(f'Epoch {epoch} train begin {test_utils.now()}', flush=True)
      start = time.time()
      steps, stopped = train_one_epoch(run, train_device_loader, epoch, first_step)
      train_loader.check()
      xm.wait_device_ops()  # Time the device work, not just the tracing.
      run.log.trained(epoch)  # Its lines before the epoch's, and a graph its last steps compiled.
      seconds = time.time() - start
      results['train_seconds'] += seconds
      if stopped:  # By SIGTERM, SIGHUP or Ctrl-C: saved here (--ckpt_dir); exit code 75 or 130.
        return results, stop_run(run, epoch, first_step + steps)
      samples = steps * cfg.batch_size * cfg.gradient_accumulation_steps
      print(f'Epoch {epoch} Replica Train Samples={samples} Device={device}/{rank}', flush=True)
      rate = samples / seconds
      results['epoch_rates'] += [rate] if steps else []
      xm.master_print(f'Epoch {epoch} train end {test_utils.now()}, Reduced GlobalRate={rate:.2f}',
                      flush=True)
      accuracy = counts = None  # Unless evaluated (--eval_interval, --test_only_at_end).
      if utils.evaluates(epoch, cfg.num_epochs, cfg.eval_interval, cfg.test_only_at_end):
        accuracy, *counts = evaluate(run.model, test_device_loader, cfg)
        test_loader.check()
        xm.master_print(f'Epoch {epoch} test end {test_utils.now()}, Accuracy={accuracy:.2f}',
                        flush=True)
      stop, saved = end_epoch(run, epoch, accuracy, counts)
      if stop:  # The same, asked for as the epoch ended: its checkpoint holds this state.
        return results, stop_run(run, epoch + 1, 0, saved)
  except utils.Diverged as error:  # From run.stop: the loss or weights ran away (see StopVote).
    results['diverged'] = str(error)  # Nothing is saved after it.
  utils.add_totals(results, run.global_step,
                   cfg.batch_size * cfg.gradient_accumulation_steps * world_size, run.log)
  if 'diverged' in results:
    return results, utils.say_diverged(results['diverged'], vars(cfg))  # Exit code 22
  return results, utils.say_finished(results, cfg.target_accuracy)  # Done: 0, or 21 below target


def main(argv):
  del argv
  utils.set_precision(FLAGS.amp, FLAGS.bf16)  # Before the runtime starts.
  cfg = SimpleNamespace(**FLAGS.flag_values_dict())
  # SIGTERM and Ctrl-C stop after a step with a checkpoint.
  with (supervisor.watched(launcher=False, saving=bool(cfg.ckpt_dir)) if supervisor else
        utils.stop_on_signals()):
    try:
      if supervisor:  # What runs, said first; bad input in one line.
        supervisor.check_job(cfg, build_datasets, build_model, FAKE_CLASSES,
                             {name for name in FLAGS if FLAGS[name].present},
                             build_optimizer=build_optimizer)
      utils.prepare_process(cfg)  # Before any computation.
      results, code = train(cfg, utils.stop_signal)
      utils.write_results(cfg.results_json, results)
    except Exception as e:  # A bad flag, path or file, a full disk, a device out of memory:
      utils.die_or_raise(e)  # one line; a bug: its traceback.
  sys.exit(code)


def run(argv):
  """This script from Python or a notebook cell: run(['--flag', value, ...]) returns the
  results (see --results_json) or raises what the exit code means (see command.py)."""
  import command  # Only run() and %run need command.py.
  return command.run(__file__, argv)


if __name__ == '__main__':
  if utils.in_notebook():  # %run in a notebook: a command of its own, as run() starts it.
    run(sys.argv[1:])
  else:
    # A flag of upstream's scripts that this one lacks: what does its job here (supervisor.py).
    app.run(main, flags_parser=lambda argv: utils.parse_flags(
        argv, supervisor.UPSTREAM_FLAGS if supervisor else None))
