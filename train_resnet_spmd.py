# SPDX-License-Identifier: BSD-3-Clause
"""Training of a torchvision classifier the SPMD way, on every XLA device of a host or pod,
from ONE process per host: data parallel, or with the weights sharded (a model larger than one
chip).

xr.use_spmd() makes the devices of all hosts one mesh; each batch is sharded over it along its
first dimension, so XLA compiles one program for all devices and inserts the collectives itself
(a plain optimizer.step(); BatchNorm statistics over the global batch). --sharding batch
replicates the model on every device; fsdp shards each weight, its gradient and its optimizer
state over the devices (FSDPv2); hybrid does so within groups of --fsdp_size devices (docs/
large_models.md). Run the same command on every worker of a pod: each host loads only its part
of each global batch, from an ImageNet-style folder (--datadir) or constant fake batches
(--fake_data). Without a TPU, CPU_NUM_DEVICES=4 gives four XLA:CPU devices. With --ckpt_dir,
each host saves its own shards (torch.distributed.checkpoint), and the same command started
again goes on exactly where the last one stopped, on this mesh or another. SIGTERM or SIGHUP
(Ctrl-C) on any host: every host finishes the same step and saves, exit code 75 (130).

  python train_resnet_spmd.py --fake_data --model resnet18 --img_dim 32 \
      --batch_size 16 --num_epochs 2 --num_steps 40 --log_steps 10
"""

import functools
import math
import os
import sys
import time
import warnings
from types import SimpleNamespace

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_enum('sharding', 'batch', ['batch', 'fsdp', 'hybrid'], 'How the model lies on the N devices. batch: each device '
                    'holds the whole model, its gradients and optimizer state. fsdp: each holds 1/N '
                    "of each weight, gradient and optimizer state, and a block's whole weights only "
                    'while the block runs. hybrid: as fsdp within groups of --fsdp_size devices, '
                    'each group a copy. Each device takes 1/N of the global batch in every mode.')
flags.DEFINE_integer('fsdp_size', None, "--sharding hybrid: the devices that share one copy of the "
                     "weights (one slice's, say); it divides the devices.", lower_bound=1)
flags.DEFINE_bool('use_gradient_checkpointing', False, "Recompute each block's activations (see "
                  'BLOCKS) in the backward instead of keeping them: less memory, more compute.')
flags.DEFINE_bool('fake_data', False, 'Train on constant fake batches instead of --datadir.')
flags.DEFINE_string('datadir', None, 'ImageNet-style folder: DIR/train/CLASS/*.jpg, DIR/val/CLASS/*.jpg.')
flags.DEFINE_string('model', 'resnet50', 'A torchvision classifier (resnet18, ...) or a name build_model knows.')
flags.DEFINE_integer('img_dim', 224, 'Image side in pixels; small values make CPU runs fast.', lower_bound=8)
flags.DEFINE_integer('batch_size', 128, 'Training batch size per device (the global batch is this '
                     'times the devices of all hosts).', lower_bound=1)
flags.DEFINE_integer('gradient_accumulation_steps', 1, 'Batches of --batch_size whose gradients '
                     'make one optimizer step: a batch this many times larger at the same memory.',
                     lower_bound=1)
flags.DEFINE_integer('test_set_batch_size', 64, 'Evaluation batch size per device.', lower_bound=1)
flags.DEFINE_integer('num_epochs', 18, 'Number of epochs.', lower_bound=1)
flags.DEFINE_integer('eval_interval', 1, 'Evaluate after every this many epochs, and after the last.',
                     lower_bound=1)
flags.DEFINE_bool('test_only_at_end', False, 'Evaluate after the last epoch only.')
flags.DEFINE_integer('num_steps', None, 'Cap on training (optimizer) and evaluation steps per epoch.',
                     lower_bound=1)
flags.DEFINE_integer('log_steps', 20, 'Print a training line every this many steps.', lower_bound=1)
flags.DEFINE_float('lr', None, 'Peak SGD LR (default: 0.5 for resnet50, else 0.1).', lower_bound=0.0)
flags.DEFINE_enum('lr_scheduler_type', None, ['WarmupAndExponentialDecayScheduler', 'none'],
                  'Default: WarmupAndExponentialDecayScheduler for resnet50, else none.')
flags.DEFINE_float('lr_warmup_epochs', 0.9, 'Epochs of linear warm-up from 0.', lower_bound=0.0)
flags.DEFINE_integer('lr_scheduler_divide_every_n_epochs', 20, 'LR division period.', lower_bound=1)
flags.DEFINE_float('lr_scheduler_divisor', 5, 'What the LR is divided by.', lower_bound=1.0)
flags.DEFINE_float('momentum', 0.9, 'SGD momentum, below 1.', lower_bound=0.0)
flags.register_validator('momentum', lambda m: m < 1, 'give a momentum below 1, such as 0.9: at 1 '
                         'or more each step adds all of the last one, and the weights run away')
flags.DEFINE_float('weight_decay', 1e-4, 'SGD weight decay.', lower_bound=0.0)
flags.DEFINE_integer('seed', 42, 'Seed of the weights and of the data order.')
flags.DEFINE_bool('drop_last', True, 'Drop the last partial training batch (a new shape compiles).')
flags.DEFINE_integer('num_workers', 8, 'DataLoader worker processes of each host.', lower_bound=0)
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
flags.DEFINE_string('logdir', None, 'TensorBoard folder for loss, rate, lr and accuracy (process 0).')
flags.DEFINE_bool('metrics_debug', False, "Print torch_xla's metrics report after each epoch.")
flags.DEFINE_bool('debug_graphs', False, "Say why each graph compiled after epoch 1 did (torch_xla's analysis).")
flags.DEFINE_bool('profile', False, 'Start the profiler server so TensorBoard can capture a trace.')
flags.DEFINE_integer('profiler_port', 9012, 'Profiler server port.')
flags.DEFINE_integer('profile_step', None, 'Capture a trace of each host\'s process from this '
                     'step on (counted from the run\'s start, as checkpoints count), into '
                     '--profile_logdir.', lower_bound=0)
flags.DEFINE_integer('profile_duration_ms', 5000, 'How long --profile_step traces.', lower_bound=1)
flags.DEFINE_string('profile_logdir', None, "Folder (or gs://) for --profile_step's trace "
                    '(default: --logdir), which TensorBoard\'s profile tab reads.')
flags.register_multi_flags_validator(
    ['profile_step', 'profile_logdir', 'logdir'],
    lambda f: f['profile_step'] is None or bool(f['profile_logdir'] or f['logdir']),
    '--profile_step needs a folder for its trace: give --profile_logdir DIR (or --logdir)')
flags.DEFINE_string('results_json', None, 'Write accuracy, rates and compile counts here (process 0).')
flags.DEFINE_string('ckpt_dir', None, 'Save checkpoints here, resume from the newest (pod: gs://...).')
flags.DEFINE_integer('ckpt_every_steps', None, 'Also save every N steps.', lower_bound=1)
flags.DEFINE_integer('keep_checkpoints', 2, 'Checkpoints kept, besides best.pt.', lower_bound=1)
flags.DEFINE_string('resume', None, 'Resume from this checkpoint instead of the newest in --ckpt_dir.')
flags.DEFINE_string('compile_cache_dir', None, "torch_xla's compile cache, on this host's disk: a restart loads graphs, not compiles (TPU).")
flags.register_multi_flags_validator(
    ['sharding', 'fsdp_size'], lambda given: (given['sharding'] == 'hybrid') == bool(given['fsdp_size']),
    '--sharding hybrid takes --fsdp_size N (the devices that hold one copy of the weights), and '
    'only it')

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

# XLA's C++ warnings (GSPMD's deprecation notice at each compile of a sharded graph, 20 at a
# resume) say nothing a user can act on; its errors still print. Unset or 1 is torch_xla's own
# default, which a notebook's kernel passes on: TF_CPP_MIN_LOG_LEVEL=0 shows them.
if os.environ.get('TF_CPP_MIN_LOG_LEVEL', '1') == '1':  # Before torch_xla loads XLA.
  os.environ['TF_CPP_MIN_LOG_LEVEL'] = '2'
import numpy as np
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.debug.profiler as xp
import torch_xla.distributed.parallel_loader as pl
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
import torch_xla.test.test_utils as test_utils
import torch_xla.utils.utils as xu
import torchvision
from torch.utils.tensorboard import SummaryWriter
from torch_xla.distributed.fsdp import checkpoint_module
from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch_xla.experimental.spmd_fully_sharded_data_parallel import \
    SpmdFullyShardedDataParallel as FSDPv2
from torchvision.transforms import v2

import sharded_checkpoints
import utils

try:  # Optional: checks before the run starts and a watch over its processes (see its docstring).
  import supervisor
except ModuleNotFoundError as e:
  if e.name != 'supervisor':
    raise
  supervisor = None

# Warnings of torch 2.9 about torch_xla 2.9's own code (FSDPv2's backward hook, the checkpoint
# planners) and about a checkpoint of one host (no process group), at every step or save:
# nothing a user of this script can act on.
for message in ('Full backward hook is firing', r'The function definition for \w+Planner',
                'TypedStorage is deprecated', 'Using a non-tuple sequence',
                'torch.distributed is disabled'):
  warnings.filterwarnings('ignore', message=message)
utils.redefinable(FLAGS)  # A notebook may import several scripts or %run one again.

FAKE_TRAIN_SAMPLES, FAKE_TEST_SAMPLES, FAKE_CLASSES = 1_200_000, 50_000, 1000  # ImageNet's
# Upstream's tuned resnet50 recipe (for a global batch of 1024); other models get DEFAULTS.
DEFAULTS = dict(lr=0.1, lr_scheduler_type='none')
MODEL_DEFAULTS = {'resnet50': dict(lr=0.5, lr_scheduler_type='WarmupAndExponentialDecayScheduler')}


def as_dict(samples):
  """A batch as a dict: MpDeviceLoader shards each entry of a dict by its own spec."""
  images, labels = torch.utils.data.default_collate(samples)
  return dict(images=images, labels=labels)


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
  your own is then accepted. Called on every host, seeded with --seed. A --model it cannot build:
  raise utils.UsageError saying what to give (one `error:` line, exit code 2); anything else it
  raises is a bug: a traceback."""
  return utils.create_model(cfg.model, num_classes)


# The model's blocks: each instance of these classes is one unit under --sharding fsdp and hybrid
# (its weights gathered whole only while it runs) and under --use_gradient_checkpointing (its
# activations recomputed in the backward). Put your model's repeated block here (a transformer
# layer, say): a module with a forward of its own that takes and returns tensors.
BLOCKS = (torchvision.models.resnet.BasicBlock, torchvision.models.resnet.Bottleneck)


def build_datasets(cfg):
  """(training set, evaluation set, class count) of a run without --fake_data: map-style
  datasets of (C x H x W uint8 or float tensor, integer label below the class count), all of
  one shape. The step normalises uint8 images on the device (utils.normalize, ImageNet's mean
  and std); float ones reach the model as they are. Here: --datadir's ImageNet-style folders,
  as uint8. A mistake the user can fix (a path, a flag) raises utils.UsageError, a file
  that cannot be read utils.BadDataError (each one `error:` line, exit code 2); anything else
  it or its datasets raise is a bug: a traceback that ends there.
  Called on every host; their first and last samples are checked."""
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
def load_data(cfg, host, hosts, local_devices):
  """This host's part of every global batch (batch_size x its devices) of the train and
  test sets, capped at --num_steps, and the class count. Every host gets the same number
  of batches: host h loads samples h, h + hosts, ... of each epoch's order."""
  cap = cfg.num_steps or sys.maxsize
  batch_size, test_batch_size = cfg.batch_size * local_devices, cfg.test_set_batch_size * local_devices
  if cfg.fake_data:
    def fake(batch_size, samples):  # One constant batch: the run measures the devices alone.
      batch = dict(images=torch.zeros(batch_size, 3, cfg.img_dim, cfg.img_dim),
                   labels=torch.zeros(batch_size, dtype=torch.int64))
      return xu.SampleGenerator(batch, samples // hosts // batch_size)
    return (utils.EpochLoader(fake(batch_size, FAKE_TRAIN_SAMPLES), cap,
                              per_step=cfg.gradient_accumulation_steps),
            utils.EpochLoader(fake(test_batch_size, FAKE_TEST_SAMPLES), cap), FAKE_CLASSES)
  train_set, test_set, num_classes = build_datasets(cfg)
  # Batches of (seed, epoch), each crop of its sample's seed: a resume sees the very same ones.
  sampler = utils.EpochSampler(train_set, host, hosts, cfg.seed, batch_size)
  workers = dict(num_workers=cfg.num_workers, worker_init_fn=utils.ignore_stop_signals,
                 collate_fn=as_dict)
  if cfg.num_workers:  # torch 2.9 raises on these without workers.
    workers.update(persistent_workers=cfg.persistent_workers, prefetch_factor=cfg.prefetch_factor,
                   multiprocessing_context=utils.loader_start())
  train_loader = torch.utils.data.DataLoader(utils.SeededSamples(train_set), batch_size,
                                             sampler=sampler, drop_last=cfg.drop_last, **workers)
  if len(train_loader) == 0:
    raise utils.UsageError(f'{len(train_set)} training images make no global batch of '
                           f'{cfg.batch_size} x {local_devices * hosts} devices: lower '
                           '--batch_size or pass --nodrop_last')
  # Padded with label -1 (not counted) to whole batches: every batch has one shape.
  test_set = utils.eval_share(test_set, host, hosts, test_batch_size)
  test_loader = torch.utils.data.DataLoader(test_set, test_batch_size, **workers)
  return (utils.EpochLoader(train_loader, cap, sampler, cfg.gradient_accumulation_steps),
          utils.EpochLoader(test_loader, cap), num_classes)


class MeshStopVote(utils.StopVote):
  """utils.StopVote over the mesh: each host's flag on each of its devices, in one global
  tensor that the step's program sums."""

  def __init__(self, device, stop_signal, optimizer, num_classes, mesh):
    super().__init__(device, stop_signal, optimizer, num_classes)
    local = torch.ones(xr.addressable_runtime_device_count())
    spec = xs.ShardingSpec(mesh, (('data', 'fsdp'),), minibatch=True)
    self.flags = tuple(xm.send_cpu_data_to_device(local * flag, device, spec)[0] for flag in (0, 1))
    self.agree(False)  # Compiles the epoch end's vote before epoch 1 ends.

  def sum(self, flag):
    return torch.sum(flag)

  def tally(self, flag, loss):  # The loss is the global batch's already.
    return torch.cat([self.sum(flag).view(1), self.health(loss)])

  def agree(self, pending):
    return self.sum(self.flags[pending]).item() > 0


def start_run(cfg, num_classes, steps_per_epoch, stop_signal, mesh):
  """Model, optimizer, LR schedule, log, stop vote and results, restored from the newest
  checkpoint if there is one; run.epoch and run.step are where training goes on."""
  device = torch_xla.device()  # One device that stands for the whole mesh.
  cfg.num_classes = num_classes  # train_step checks the model's output against it.
  # Every host builds the same weights from the same seed, and keeps its devices' shards.
  model = shard_model(build_model(cfg, num_classes), mesh, cfg)
  optimizer = build_optimizer(cfg, model)
  utils.make_optimizer_state(optimizer)  # Before the first step: one graph less.
  scheduler = None
  if cfg.lr_scheduler_type == 'WarmupAndExponentialDecayScheduler':
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: utils.warmup_step_decay(
        step, steps_per_epoch, cfg.lr_warmup_epochs, cfg.lr_scheduler_divide_every_n_epochs,
        cfg.lr_scheduler_divisor))
  writer = SummaryWriter(cfg.logdir) if cfg.logdir and utils.is_master() else None
  results = utils.new_results(cfg.model, amp=cfg.amp, world_size=xr.global_runtime_device_count(),
                              spmd=True)
  run = SimpleNamespace(cfg=cfg, model=model, optimizer=optimizer, scheduler=scheduler,
                        stop_signal=stop_signal,
                        stop=MeshStopVote(device, stop_signal, optimizer, num_classes,
                                          mesh),
                        steps_per_epoch=steps_per_epoch,
                        results=results, num_classes=num_classes, epoch=1, step=0,
                        global_step=0)
  path, state = utils.checkpoint_to_resume(cfg.resume, cfg.ckpt_dir, weights(model), vars(cfg),
                                           run.results['world_size'], sharded=True)
  if state is not None:
    utils.say_resumed(path, state, vars(cfg), restore_checkpoint(run, state))
  # The model's buffers (BatchNorm's statistics) whole on every device, marked so as a step's
  # outputs are: unmarked, the first step would compile a graph of its own. After the restore,
  # which loads them unmarked.
  for buffer in model.buffers():
    xs.mark_sharding(buffer, mesh, (None,) * buffer.dim())
  run.log = utils.StepLog(device, writer, run.results)  # After the restore.
  # The profiler serves TensorBoard's captures, and --profile_step's, while this run is held.
  run.profiler = utils.start_profiler(cfg, cfg.profiler_port, run.global_step,
                                      steps_per_epoch * cfg.num_epochs)
  if run.epoch <= cfg.num_epochs:  # Else: 'Run already finished'.
    xm.master_print(f'Mesh of {mesh.size()} devices ({mesh.mesh_shape[0]} data x '
                    f'{mesh.mesh_shape[1]} fsdp, --sharding {cfg.sharding}); compiling the first '
                    'step ...', flush=True)
  return run


def shard_model(model, mesh, cfg):
  """The model on the mesh, by --sharding: whole on every device (batch), or each of its BLOCKS,
  then the rest, wrapped in FSDPv2, which shards each weight over the mesh's 'fsdp' axis (along
  its largest dimension) and gathers a block's whole weights only while it runs. With
  --use_gradient_checkpointing, each block recomputes its activations in the backward."""
  if cfg.sharding == 'batch':
    if cfg.use_gradient_checkpointing:
      for module in model.modules():
        if isinstance(module, BLOCKS):
          checkpoint_module(module)  # Wraps its forward, in place.
    return model.to(torch_xla.device())
  wrap = ((lambda module, *args, **kwargs: FSDPv2(checkpoint_module(module), *args, **kwargs))
          if cfg.use_gradient_checkpointing else None)
  # extra_data_axis: the output (the logits) sharded along the batch, as the input is.
  return FSDPv2(model, mesh=mesh, extra_data_axis='data', auto_wrapper_callable=wrap,
                auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                   transformer_layer_cls=set(BLOCKS)))


def weights(model):
  """The model's state_dict under the names of the model unwrapped (FSDPv2 adds _orig_module.):
  a checkpoint names its weights alike under every --sharding."""
  return {name.replace('_orig_module.', ''): tensor for name, tensor in model.state_dict().items()}


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
    # Not xm.optimizer_step: the loss is the global batch's mean, whose gradients the compiler
    # has already reduced over the mesh.
    optimizer.step()
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
    for i, batch in enumerate(batches, 1):
      # Named steps in a profile; each batch ends in a sync, so that a step of several holds one
      # batch's activations at a time, and compiles at most three graphs however many there are.
      with xp.StepTrace('train_step', step_num=step):
        loss = loss + train_step(run, batch['images'], batch['labels'], (i, len(batches)))
        if i < len(batches):
          continue
        labels = torch.cat([batch['labels'] for batch in batches])
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
  # Counted on the device and read once at the end: an .item() per step would sync. The
  # sums over the sharded batch are over every device of every host.
  counts = torch.zeros(2, dtype=torch.int64, device=torch_xla.device())
  with torch.no_grad(), torch.autocast('xla', dtype=torch.bfloat16, enabled=cfg.amp):
    for batch in loader:
      images, labels = batch['images'], batch['labels']
      hits = (model(utils.normalize(images)).argmax(dim=1) == labels).sum()
      counts += torch.stack([hits, (labels >= 0).sum()])
  correct, total = counts.tolist()
  return 100.0 * correct / max(total, 1), correct, total


def save_checkpoint(run, epoch, step, best=False):
  """Saves the run after `step` steps of `epoch` (every process calls it); returns its path."""
  torch_xla.sync()  # Runs the step's log closure, ...
  run.log.flush()  # ... and waits for it: the history saved is whole.
  run.stop.check_losses()  # Nothing that ran away is saved.
  state = dict(model=weights(run.model), optimizer=run.optimizer.state_dict(),
               lr_scheduler=run.scheduler.state_dict() if run.scheduler else None, epoch=epoch,
               step=step, global_step=run.global_step, flags=vars(run.cfg),
               rng=dict(torch=torch.get_rng_state(), xla=xm.get_rng_state()), results=run.results)
  return sharded_checkpoints.write_sharded(state, run.cfg.ckpt_dir, run.cfg.keep_checkpoints,
                                           best)


def restore_checkpoint(run, state):
  """Puts save_checkpoint's state back into the run, with the --lr, --momentum and
  --weight_decay given now (utils.new_recipe); returns what those changed."""
  # The weights in place; the rest returned.
  state = sharded_checkpoints.read_sharded(state, weights(run.model), run.optimizer)
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
                       recipe(run.cfg)[1]['lr'])
  if run.cfg.metrics_debug:
    xm.master_print(met.metrics_report(), flush=True)
  saved = save_checkpoint(run, epoch + 1, 0, best=best) if run.cfg.ckpt_dir else None
  # Every vote read, the last epoch's too (a last step that ran away: Diverged); after the last
  # epoch a stop has nothing left to stop, and the run ends as done.
  stop = run.stop.agreed_at_epoch_end()
  return epoch < run.cfg.num_epochs and stop, saved


def build_mesh(cfg, devices, hosts):
  """The mesh of every device: a 'data' axis of copies of the weights, and an 'fsdp' axis over
  which each copy is sharded (1 device under --sharding batch, all under fsdp)."""
  fsdp = {'batch': 1, 'fsdp': devices, 'hybrid': cfg.fsdp_size}[cfg.sharding]
  if devices % fsdp:
    raise utils.UsageError(f'--fsdp_size {fsdp} does not divide the {devices} devices: give a '
                           f'divisor, such as {devices // hosts} (one host\'s)')
  if hosts > 1 and not torch.distributed.is_initialized():  # The hosts' checkpoint collectives.
    import torch_xla.distributed.xla_backend  # noqa: F401 (registers init_method='xla://')
    torch.distributed.init_process_group('gloo', init_method='xla://')
  # Device ids run host by host and slice by slice: an 'fsdp' group of a slice's devices or
  # fewer lies within one slice (its fast links), the 'data' axis across slices.
  return xs.Mesh(np.arange(devices), (devices // fsdp, fsdp), ('data', 'fsdp'))


def say_held(run, epoch, steps):
  """Says, and records in the results, the bytes the first device holds of the weights and of
  the optimizer's state, once: after the run's first epoch (on this mesh) that trained a step,
  when the optimizer's state exists. Its shard of each sharded tensor, all of each other one
  (4 bytes a value: torch's count, under --bf16 too)."""
  if epoch != run.epoch or not steps:
    return
  def on_device(tensors):
    total = 0
    for tensor in tensors:
      if tensor.device.type != 'xla':
        continue
      count = tensor.numel()
      if torch_xla._XLAC._get_xla_sharding_spec(tensor):
        index = torch_xla._XLAC._get_local_shard_replica_and_indices([tensor])[0][0][1]
        count = count if index is Ellipsis else math.prod(s.stop - s.start for s in index)
      total += count * tensor.element_size()
    return total
  state = [value for values in run.optimizer.state.values() for value in values.values()
           if isinstance(value, torch.Tensor)]
  held = run.results['bytes_per_device'] = dict(weights=on_device(run.model.parameters()),
                                                optimizer=on_device(state))
  xm.master_print(f'Each device holds {held["weights"] / 1e6:.1f} MB of weights and '
                  f'{held["optimizer"] / 1e6:.1f} MB of optimizer state', flush=True)


def sharded(loaders, mesh, cfg):
  """An MpDeviceLoader of each loader: its batches on the device, each host's batch its devices'
  rows of the global batch, sharded over every device of the mesh (BatchSharding)."""
  return [pl.MpDeviceLoader(loader, torch_xla.device(), input_sharding=BatchSharding(mesh),
                            loader_prefetch_size=cfg.loader_prefetch_size,
                            device_prefetch_size=cfg.device_prefetch_size,
                            host_to_device_transfer_threads=cfg.host_to_device_transfer_threads)
          for loader in loaders]


class BatchSharding(xs.ShardingSpec):
  """MpDeviceLoader's spec for every tensor of a batch: its first dimension (the batch) split over
  both axes of the mesh, the others whole, whatever their number: images (N, C, H, W), labels
  (N,) and tokens (N, T) alike. (One spec of a fixed rank would send a tensor of another rank
  to every device whole, without a word.) minibatch: each host gives its devices' rows."""

  def __init__(self, mesh):
    super().__init__(mesh, (('data', 'fsdp'),), minibatch=True)
    self.by_rank = {}

  def xla_spec(self, tensor):
    rank = max(tensor.dim(), 1)  # A 0-dimensional tensor: no spec fits, so on every device.
    if rank not in self.by_rank:
      self.by_rank[rank] = xs.ShardingSpec(self.mesh, (('data', 'fsdp'),) + (None,) * (rank - 1),
                                           minibatch=True)
    return self.by_rank[rank].xla_spec(tensor)


def train(cfg, stop_signal):
  """This process's run; returns (its results, the exit code) where it finishes, stops (when
  stop_signal() says) or diverges. A run that fails raises (main says why)."""
  torch.manual_seed(cfg.seed)
  host, hosts, devices = xr.process_index(), xr.process_count(), xr.global_runtime_device_count()
  mesh, local_devices = build_mesh(cfg, devices, hosts), xr.addressable_runtime_device_count()
  train_loader, test_loader, num_classes = load_data(cfg, host, hosts, local_devices)
  run = start_run(cfg, num_classes, train_loader.steps, stop_signal, mesh)
  results = run.results
  train_device_loader, test_device_loader = sharded((train_loader, test_loader), mesh, cfg)
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
      say_held(run, epoch, steps)
      if stopped:  # By SIGTERM, SIGHUP or Ctrl-C: saved here (--ckpt_dir); exit code 75 or 130.
        return results, stop_run(run, epoch, first_step + steps)
      samples = steps * cfg.batch_size * cfg.gradient_accumulation_steps
      print(f'Epoch {epoch} Host Train Samples={samples * local_devices} '
            f'Devices={local_devices} of {devices} Host={host}', flush=True)
      rate = samples * devices / seconds  # Every host runs every step.
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
                   cfg.batch_size * cfg.gradient_accumulation_steps * devices, run.log)
  if 'diverged' in results:
    return results, utils.say_diverged(results['diverged'], vars(cfg))  # Exit code 22
  return results, utils.say_finished(results, cfg.target_accuracy)  # Done: 0, or 21 below target


def main(argv):
  del argv
  cfg = SimpleNamespace(**FLAGS.flag_values_dict())
  recipe_name, settings = recipe(cfg)
  for name, value in settings.items():
    if getattr(cfg, name) is None:
      setattr(cfg, name, value)
  utils.set_precision(cfg.amp, cfg.bf16)  # Before the runtime starts.
  # Before any XLA tensor or device exists: the runtime then makes every device one mesh.
  xr.use_spmd()
  # SIGTERM and Ctrl-C stop every host after the same step (see MeshStopVote).
  with (supervisor.watched(launcher=False, saving=bool(cfg.ckpt_dir)) if supervisor else
        utils.stop_on_signals()):
    try:
      if supervisor:  # What runs, said first; bad input in one line.
        given = {name for name in FLAGS if FLAGS[name].present}
        supervisor.check_job(cfg, build_datasets, build_model, FAKE_CLASSES, given,
                             (recipe_name, settings), build_optimizer)
      utils.prepare_process(cfg, xr.process_index())  # Before any computation.
      results, code = train(cfg, utils.stop_signal)
      if utils.is_master():
        utils.write_results(cfg.results_json, results)
    except Exception as e:  # A bad flag, path or file, a full disk, a device out of memory:
      utils.die_or_raise(e)  # one line; a bug: its traceback.
  sys.exit(code)


def recipe(cfg):
  """(name, settings) of the recipe that the flags not given come from."""
  if cfg.model in MODEL_DEFAULTS:
    return f"{cfg.model}'s tuned recipe", MODEL_DEFAULTS[cfg.model]
  return 'the default recipe', DEFAULTS


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
