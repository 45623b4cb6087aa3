# SPDX-License-Identifier: BSD-3-Clause
"""Training of a decoder-only transformer language model the SPMD way, on every XLA device of a
host or pod, from ONE process per host: data parallel, or with the weights sharded (a model
larger than one chip). The same job as train_resnet_spmd.py, on tokens.

The model (written below, plain PyTorch): token embeddings, --num_hidden_layers decoder layers
(RMSNorm, causal self-attention with rotary positions and --num_key_value_heads grouped heads
through F.scaled_dot_product_attention, RMSNorm, a SwiGLU MLP), a last RMSNorm and the output
layer; the loss is the cross entropy of the next token at every position. xr.use_spmd() makes the
devices of all hosts one mesh; each global batch of --seq_len windows is sharded over it along its
first dimension. --sharding batch replicates the model on every device; fsdp shards each weight,
its gradient and its optimizer state over the devices (FSDPv2), each decoder layer a unit; hybrid
does so within groups of --fsdp_size devices (docs/large_models.md). The data: --datadir's
train.bin and val.bin (flat arrays of token ids, as nanoGPT and llm.c write them; meta.json says
their vocabulary and dtype; make_token_files.py writes all three), read by memory map, or random
tokens (--fake_data). An epoch is one pass over train.bin's windows in a seeded order. With
--ckpt_dir each host saves its own shards, and the same command started again goes on exactly
where the last one stopped, on this mesh or another. SIGTERM or SIGHUP (Ctrl-C) on any host: every
host finishes the same step and saves, exit code 75 (130).

  python make_token_files.py input.txt --output data/tokens
  python train_decoder_spmd.py --datadir data/tokens --num_epochs 2 --num_steps 100
"""

import asyncio
import functools
import json
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
                  "of each weight, gradient and optimizer state, and a layer's whole weights only "
                  'while the layer runs. hybrid: as fsdp within groups of --fsdp_size devices, '
                  'each group a copy. Each device takes 1/N of the global batch in every mode.')
flags.DEFINE_integer('fsdp_size', None, "--sharding hybrid: the devices that share one copy of the "
                     "weights (one slice's, say); it divides the devices.", lower_bound=1)
flags.DEFINE_bool('use_gradient_checkpointing', False, "Recompute each block's activations (see "
                  'BLOCKS) in the backward instead of keeping them: less memory, more compute.')
flags.DEFINE_bool('fake_data', False, 'Train on constant batches of random tokens instead of --datadir.')
flags.DEFINE_string('datadir', None, 'A folder of train.bin, val.bin and meta.json (make_token_files.py), '
                    'on this host or in a bucket (gs://).')
flags.DEFINE_string('model', 'decoder', 'The decoder below, or a name build_model knows.')
flags.DEFINE_integer('hidden_size', 256, 'Width of the model (the embeddings).', lower_bound=2)
flags.DEFINE_integer('num_hidden_layers', 4, 'Decoder layers.', lower_bound=1)
flags.DEFINE_integer('num_attention_heads', 4, 'Attention heads; they divide --hidden_size.',
                     lower_bound=1)
flags.DEFINE_integer('num_key_value_heads', None, 'Key and value heads, shared by groups of the '
                     'attention heads (grouped-query attention); default: one each.', lower_bound=1)
flags.DEFINE_integer('intermediate_size', None, 'Width of the MLP (default: 4 x --hidden_size).',
                     lower_bound=1)
flags.DEFINE_integer('seq_len', 256, 'Tokens in each window (sample); fixed, so one graph.',
                     lower_bound=1)
flags.DEFINE_integer('batch_size', 8, 'Training batch size per device, in windows (the global '
                     'batch is this times the devices of all hosts).', lower_bound=1)
flags.DEFINE_integer('gradient_accumulation_steps', 1, 'Batches of --batch_size whose gradients '
                     'make one optimizer step: a batch this many times larger at the same memory.',
                     lower_bound=1)
flags.DEFINE_integer('test_set_batch_size', 8, 'Evaluation batch size per device.', lower_bound=1)
flags.DEFINE_integer('num_epochs', 1, 'Number of epochs (passes over train.bin).', lower_bound=1)
flags.DEFINE_integer('eval_interval', 1, 'Evaluate after every this many epochs, and after the last.',
                     lower_bound=1)
flags.DEFINE_bool('test_only_at_end', False, 'Evaluate after the last epoch only.')
flags.DEFINE_integer('num_steps', None, 'Cap on training (optimizer) and evaluation steps per epoch.',
                     lower_bound=1)
flags.DEFINE_integer('log_steps', 20, 'Print a training line every this many steps.', lower_bound=1)
flags.DEFINE_float('lr', None, 'Peak AdamW LR (default: 3e-4).', lower_bound=0.0)
flags.DEFINE_integer('lr_warmup_steps', None, 'Steps of linear warm-up from 0, then a cosine decay '
                     "to --min_lr_ratio x --lr at the run's last step (default: 100, or a tenth "
                     "of the run's steps if fewer).", lower_bound=0)
flags.DEFINE_float('min_lr_ratio', 0.1, 'Where the cosine decay ends, as a share of --lr.',
                   lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_float('weight_decay', 0.1, 'AdamW weight decay of the matrices (not of norms and '
                   'biases).', lower_bound=0.0)
flags.DEFINE_float('max_grad_norm', 1.0, 'Clip the gradients to this global norm (0: no clipping).',
                   lower_bound=0.0)
flags.DEFINE_integer('seed', 42, 'Seed of the weights and of the data order.')
flags.DEFINE_integer('num_workers', 2, 'DataLoader worker processes of each host.', lower_bound=0)
flags.DEFINE_bool('persistent_workers', True, 'Keep DataLoader workers from epoch to epoch.')
flags.DEFINE_integer('prefetch_factor', None, 'Batches each loader worker loads ahead.', lower_bound=1)
flags.DEFINE_integer('loader_prefetch_size', 8, 'Host batches MpDeviceLoader queues.', lower_bound=1)
flags.DEFINE_integer('device_prefetch_size', 4, 'Device batches MpDeviceLoader queues.', lower_bound=1)
flags.DEFINE_integer('host_to_device_transfer_threads', 1, 'Host-to-device copy threads.', lower_bound=1)
flags.DEFINE_bool('bf16', False, 'Train in bfloat16: sets XLA_USE_BF16=1 before the runtime starts.')
flags.DEFINE_bool('amp', False, 'Mixed precision: forward and loss autocast to bfloat16, weights and '
                  'optimizer in float32 (see docs/tpu.md).')
flags.DEFINE_enum('mat_mul_precision', 'default', ['default', 'high', 'highest'], 'Float32 matrix products and convolutions on a TPU: 1, 3 or 6 bfloat16 passes (docs/tpu.md).')
flags.DEFINE_string('logdir', None, 'TensorBoard folder for loss, rate, lr and eval loss (process 0).')
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
flags.DEFINE_string('results_json', None, 'Write eval losses, rates and compile counts here (process 0).')
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

# XLA's C++ warnings (GSPMD's deprecation notice at each compile of a sharded graph) say nothing
# a user can act on; its errors still print. TF_CPP_MIN_LOG_LEVEL=0 shows them.
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
from torch import nn
from torch.utils.tensorboard import SummaryWriter
from torch_xla.distributed.fsdp import checkpoint_module
from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch_xla.experimental.spmd_fully_sharded_data_parallel import \
    SpmdFullyShardedDataParallel as FSDPv2

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

FAKE_TRAIN_WINDOWS, FAKE_TEST_WINDOWS = 1_000_000, 10_000
FAKE_VOCAB = 32_000  # Llama 2's vocabulary
DEFAULTS = dict(lr=3e-4)
BETAS = (0.9, 0.95)  # AdamW's, as nanoGPT and Llama train
DTYPES = ('uint8', 'uint16', 'uint32')  # Of the token ids in train.bin and val.bin


def as_dict(samples):
  """A batch as a dict: MpDeviceLoader shards each entry of a dict by its own spec."""
  tokens, targets = torch.utils.data.default_collate(samples)
  return dict(tokens=tokens, targets=targets)


# ---------------------------------------------------------- your model and your data
def build_optimizer(cfg, model):
  """AdamW with --lr and --weight_decay on the matrices (embeddings and linear layers), none on
  the norms and biases. Put yours here; a restore gives back its state_dict whatever it holds. A
  flag value it cannot take: raise utils.UsageError (one `error:` line, exit code 2)."""
  matrices = [p for p in model.parameters() if p.dim() >= 2]
  others = [p for p in model.parameters() if p.dim() < 2]
  return torch.optim.AdamW([dict(params=matrices, weight_decay=cfg.weight_decay),
                            dict(params=others, weight_decay=0.0)], lr=cfg.lr, betas=BETAS)


def build_model(cfg, vocab_size):
  """The model to train: a torch.nn.Module from a batch of token ids (N, T) to the scores of the
  next token at each position (N, T, vocab_size). Here: the Decoder below, sized by the flags. Put
  yours here; a --model name of your own is then accepted. Called on every host, seeded with
  --seed. A --model or size it cannot build: raise utils.UsageError saying what to give."""
  if cfg.model != 'decoder':
    raise utils.UsageError(f'--model {cfg.model}: this script builds --model decoder (sized by '
                           '--hidden_size, --num_hidden_layers, ...); put your own in build_model')
  heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
  if cfg.hidden_size % heads or (cfg.hidden_size // heads) % 2:
    raise utils.UsageError(f'--num_attention_heads {heads} must divide --hidden_size '
                           f'{cfg.hidden_size} into heads of an even width (rotary positions '
                           'turn pairs): give, say, --num_attention_heads '
                           f'{max(1, cfg.hidden_size // 64)}')
  if heads % kv_heads:
    raise utils.UsageError(f'--num_key_value_heads {kv_heads} must divide --num_attention_heads '
                           f'{heads} (each key and value head serves a group of them)')
  return Decoder(vocab_size, cfg.hidden_size, cfg.num_hidden_layers, heads, kv_heads,
                 cfg.intermediate_size or 4 * cfg.hidden_size)


class RMSNorm(nn.Module):
  def __init__(self, width, eps=1e-6):
    super().__init__()
    self.weight, self.eps = nn.Parameter(torch.ones(width)), eps

  def forward(self, x):
    scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
    return self.weight * (x.float() * scale).to(x.dtype)


def rotate(q, k):
  """Rotary positions: each pair (x1, x2) of a head's features (N x heads x T x width) turned by
  an angle of its position, computed once for q and k in the graph (no table to shard)."""
  pairs = torch.arange(0, q.shape[-1], 2, device=q.device, dtype=torch.float32) / q.shape[-1]
  positions = torch.arange(q.shape[-2], device=q.device, dtype=torch.float32)
  angles = positions[:, None] * 10000.0 ** -pairs[None]
  cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
  def turned(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
  return turned(q), turned(k)


class Attention(nn.Module):
  def __init__(self, width, heads, kv_heads):
    super().__init__()
    self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
    self.q_proj = nn.Linear(width, width, bias=False)
    self.k_proj = nn.Linear(width, kv_heads * self.head_dim, bias=False)
    self.v_proj = nn.Linear(width, kv_heads * self.head_dim, bias=False)
    self.o_proj = nn.Linear(width, width, bias=False)

  def forward(self, x):
    n, t, width = x.shape
    q = self.q_proj(x).view(n, t, self.heads, self.head_dim).transpose(1, 2)
    k = self.k_proj(x).view(n, t, self.kv_heads, self.head_dim).transpose(1, 2)
    v = self.v_proj(x).view(n, t, self.kv_heads, self.head_dim).transpose(1, 2)
    q, k = rotate(q, k)
    groups = self.heads // self.kv_heads  # Each key and value head serves this many query heads.
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.o_proj(y.transpose(1, 2).reshape(n, t, width))


class DecoderLayer(nn.Module):
  def __init__(self, width, heads, kv_heads, intermediate):
    super().__init__()
    self.input_layernorm, self.post_attention_layernorm = RMSNorm(width), RMSNorm(width)
    self.self_attn = Attention(width, heads, kv_heads)
    self.gate_proj = nn.Linear(width, intermediate, bias=False)
    self.up_proj = nn.Linear(width, intermediate, bias=False)
    self.down_proj = nn.Linear(intermediate, width, bias=False)

  def forward(self, x):
    x = x + self.self_attn(self.input_layernorm(x))
    h = self.post_attention_layernorm(x)
    return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Decoder(nn.Module):
  def __init__(self, vocab_size, width, layers, heads, kv_heads, intermediate):
    super().__init__()
    self.embed_tokens = nn.Embedding(vocab_size, width)
    self.layers = nn.ModuleList(DecoderLayer(width, heads, kv_heads, intermediate)
                                for _ in range(layers))
    self.norm = RMSNorm(width)
    self.output = nn.Linear(width, vocab_size, bias=False)
    for module in self.modules():  # GPT-2's initialisation, as nanoGPT's.
      if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)

  def forward(self, tokens):
    x = self.embed_tokens(tokens)
    for layer in self.layers:
      x = layer(x)
    return self.output(self.norm(x))


# The model's blocks: each instance of these classes is one unit under --sharding fsdp and hybrid
# (its weights gathered whole only while it runs) and under --use_gradient_checkpointing (its
# activations recomputed in the backward). Put your model's repeated block here.
BLOCKS = (DecoderLayer,)


class TokenWindows(torch.utils.data.Dataset):
  """Window i of a token file: its ids i x seq_len to (i + 1) x seq_len (the input) and the same
  shifted by one (the targets: the next token at each position). A file on this host's disk is
  memory-mapped in the process that reads it (a loader worker gets the path, not the data); a
  file in a bucket (gs://) is read a window at a time, one range request each."""

  def __init__(self, path, dtype, seq_len, size):
    self.path, self.dtype, self.seq_len, self.tokens = path, dtype, seq_len, None
    self.windows = (size // np.dtype(dtype).itemsize - 1) // seq_len

  def __len__(self):
    return self.windows

  def __getitem__(self, index):
    start, end = index * self.seq_len, (index + 1) * self.seq_len + 1
    if '://' in self.path:
      size = np.dtype(self.dtype).itemsize
      ids = np.frombuffer(in_time(self.path, 'cat_file', start * size, end * size), self.dtype)
    else:
      if self.tokens is None:
        self.tokens = np.memmap(self.path, self.dtype, mode='r')
      ids = self.tokens[start:end]
    window = torch.from_numpy(ids.astype(np.int64))
    return window[:-1], window[1:]

  def __getstate__(self):
    return dict(vars(self), tokens=None)


def build_datasets(cfg):
  """(training set, evaluation set, vocabulary size) of a run without --fake_data: map-style
  datasets of (tokens, targets), each a (--seq_len,) int64 tensor. Here: --datadir's train.bin
  and val.bin (this host's disk, or gs://), checked against meta.json. A mistake the user can fix
  raises utils.UsageError, a file that cannot be read utils.BadDataError (each one `error:`
  line, exit code 2)."""
  if not cfg.datadir:
    raise utils.UsageError('give --datadir DIR (train.bin, val.bin and meta.json, as '
                           'make_token_files.py writes them) or --fake_data')
  meta_path = f'{cfg.datadir.rstrip("/")}/meta.json'
  fix = 'write the files again with make_token_files.py'
  try:
    meta = json.loads(in_time(meta_path, 'cat_file'))
    vocab, dtype = meta['vocab_size'], meta['dtype']
  except FileNotFoundError:
    raise utils.UsageError(f'{meta_path} is missing: --datadir needs train.bin, val.bin and '
                           f'meta.json (their vocabulary and dtype); {fix}') from None
  except (ValueError, KeyError, TypeError) as e:
    raise utils.BadDataError(f'{meta_path} is not a token files\' meta.json ({type(e).__name__}: '
                             f'{e}): {fix}') from None
  if not (isinstance(vocab, int) and vocab >= 2 and dtype in DTYPES and
          vocab <= np.iinfo(dtype).max + 1):
    raise utils.BadDataError(f'{meta_path} says vocab_size {vocab!r} and dtype {dtype!r}: give a '
                             f'vocabulary of 2 or more ids that the dtype ({", ".join(DTYPES)}) '
                             f'holds; {fix}')
  sets = {}
  for split in ('train', 'val'):
    path = f'{cfg.datadir.rstrip("/")}/{split}.bin'
    size = check_token_file(path, dtype, vocab, fix)
    sets[split] = TokenWindows(path, dtype, cfg.seq_len, size)
    if len(sets[split]) == 0:
      raise utils.UsageError(f'{path} holds {size // np.dtype(dtype).itemsize:,} tokens, no '
                             f'window of --seq_len {cfg.seq_len} and its next token: give a '
                             'shorter --seq_len or more text')
  return sets['train'], sets['val'], vocab


def check_token_file(path, dtype, vocab, fix):
  """The size of path in bytes; a BadDataError if it is not whole ids of dtype, or if it holds
  an id at or over vocab. A bucket's file is not read whole here: the stop vote checks each
  batch's targets on the devices (a BadDataError naming the id and the step)."""
  try:
    size, itemsize = in_time(path, 'size'), np.dtype(dtype).itemsize
  except FileNotFoundError:
    raise utils.UsageError(f'{path} is missing: {fix}') from None
  if size % itemsize:
    raise utils.BadDataError(f'{path} is {size:,} bytes, not a whole number of {dtype} ids '
                             f'({itemsize} bytes each, as meta.json says): {fix}')
  if '://' in path or size == 0 or vocab > np.iinfo(dtype).max:  # (Every id is in the vocabulary.)
    return size
  tokens = np.memmap(path, dtype, mode='r')
  for start in range(0, len(tokens), 1 << 26):  # 64M ids at a time
    chunk = tokens[start:start + (1 << 26)]
    if chunk.max() >= vocab:
      at = start + int(np.argmax(chunk >= vocab))
      raise utils.BadDataError(f'{path} holds token id {tokens[at]} at position {at:,}, outside '
                               f'the vocabulary of {vocab} that meta.json says: {fix}')
  return size


def in_time(url, call, *args):
  """fs.call(path, *args) on url's file system. A request to a bucket past its deadline
  (utils.BUCKET_SECONDS) is one line: a BadDataError, which a loader worker sends back whole."""
  fs, path = utils.url_fs(url)
  try:
    return getattr(fs, call)(path, *args)
  except asyncio.TimeoutError:  # (A TimeoutError, so an OSError, from Python 3.11 on.)
    raise utils.BadDataError(str(utils.BucketTimeout(f'cannot read {url}'))) from None


# ------------------------------------------------------------------------------ loop
def load_data(cfg, host, hosts, local_devices):
  """This host's part of every global batch (batch_size x its devices) of the train and
  test sets, capped at --num_steps, and the vocabulary size. Every host gets the same number
  of batches: host h loads windows h, h + hosts, ... of each epoch's order."""
  cap = cfg.num_steps or sys.maxsize
  batch_size, test_batch_size = cfg.batch_size * local_devices, cfg.test_set_batch_size * local_devices
  if cfg.fake_data:
    def fake(batch_size, windows):  # One constant batch: the run measures the devices alone.
      ids = torch.randint(FAKE_VOCAB, (batch_size, cfg.seq_len + 1),
                          generator=torch.Generator().manual_seed(cfg.seed))
      return xu.SampleGenerator(dict(tokens=ids[:, :-1], targets=ids[:, 1:]),
                                windows // hosts // batch_size)
    return (utils.EpochLoader(fake(batch_size, FAKE_TRAIN_WINDOWS), cap,
                              per_step=cfg.gradient_accumulation_steps),
            utils.EpochLoader(fake(test_batch_size, FAKE_TEST_WINDOWS), cap), FAKE_VOCAB)
  train_set, test_set, vocab_size = build_datasets(cfg)
  # Batches of (seed, epoch): a resume sees the very same ones.
  sampler = utils.EpochSampler(train_set, host, hosts, cfg.seed, batch_size)
  workers = dict(num_workers=cfg.num_workers, worker_init_fn=utils.ignore_stop_signals,
                 collate_fn=as_dict)
  if cfg.num_workers:  # torch 2.9 raises on these without workers.
    workers.update(persistent_workers=cfg.persistent_workers, prefetch_factor=cfg.prefetch_factor,
                   multiprocessing_context=utils.loader_start())
  train_loader = torch.utils.data.DataLoader(utils.SeededSamples(train_set), batch_size,
                                             sampler=sampler, drop_last=True, **workers)
  if len(train_loader) == 0:
    raise utils.UsageError(f'{len(train_set)} training windows make no global batch of '
                           f'{cfg.batch_size} x {local_devices * hosts} devices: lower '
                           '--batch_size or --seq_len')
  # Padded with targets -1 (not counted) to whole batches: every batch has one shape.
  test_set = utils.eval_share(test_set, host, hosts, test_batch_size)
  test_loader = torch.utils.data.DataLoader(test_set, test_batch_size, **workers)
  return (utils.EpochLoader(train_loader, cap, sampler, cfg.gradient_accumulation_steps),
          utils.EpochLoader(test_loader, cap), vocab_size)


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


def start_run(cfg, vocab_size, steps_per_epoch, stop_signal, mesh):
  """Model, optimizer, LR schedule, log, stop vote and results, restored from the newest
  checkpoint if there is one; run.epoch and run.step are where training goes on."""
  device = torch_xla.device()  # One device that stands for the whole mesh.
  cfg.vocab_size = vocab_size  # train_step checks the model's output against it.
  # Every host builds the same weights from the same seed, and keeps its devices' shards.
  model = shard_model(build_model(cfg, vocab_size), mesh, cfg)
  optimizer = build_optimizer(cfg, model)
  utils.make_optimizer_state(optimizer)  # Before the first step: one graph less.
  total = cfg.num_epochs * steps_per_epoch
  warmup = min(100, total // 10) if cfg.lr_warmup_steps is None else cfg.lr_warmup_steps
  scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
      warmup_cosine, warmup=warmup, total=total, floor=cfg.min_lr_ratio))
  writer = SummaryWriter(cfg.logdir) if cfg.logdir and utils.is_master() else None
  results = utils.new_results(cfg.model, amp=cfg.amp, world_size=xr.global_runtime_device_count(),
                              spmd=True, seq_len=cfg.seq_len, vocab_size=vocab_size,
                              eval_losses=[], final_eval_loss=None, min_eval_loss=None)
  for key in ('max_accuracy', 'final_accuracy', 'eval_correct', 'eval_samples',
              'epoch_accuracies'):
    del results[key]  # A classifier's.
  run = SimpleNamespace(cfg=cfg, model=model, optimizer=optimizer, scheduler=scheduler,
                        stop_signal=stop_signal,
                        stop=MeshStopVote(device, stop_signal, optimizer, vocab_size, mesh),
                        steps_per_epoch=steps_per_epoch,
                        results=results, num_classes=vocab_size, epoch=1, step=0,
                        global_step=0)
  path, state = utils.checkpoint_to_resume(cfg.resume, cfg.ckpt_dir, weights(model), vars(cfg),
                                           run.results['world_size'], sharded=True)
  if state is not None:
    utils.say_resumed(path, state, vars(cfg), restore_checkpoint(run, state))
  run.log = utils.StepLog(device, writer, run.results)  # After the restore.
  # The profiler serves TensorBoard's captures, and --profile_step's, while this run is held.
  run.profiler = utils.start_profiler(cfg, cfg.profiler_port, run.global_step,
                                      steps_per_epoch * cfg.num_epochs)
  if run.epoch <= cfg.num_epochs:  # Else: 'Run already finished'.
    xm.master_print(f'Mesh of {mesh.size()} devices ({mesh.mesh_shape[0]} data x '
                    f'{mesh.mesh_shape[1]} fsdp, --sharding {cfg.sharding}); compiling the first '
                    'step ...', flush=True)
  return run


def warmup_cosine(step, warmup, total, floor):
  """The LR factor at a step: linear up to 1 over warmup steps, then a cosine down towards floor
  at the run's end. Never 0: torch_xla compiles a scalar 0 into its graph as a constant, where
  any other LR is the same graph's input (a step at LR 0 would compile a graph of its own)."""
  if step < warmup:
    return (step + 1) / (warmup + 1)
  progress = min(1.0, (step - warmup) / max(1, total - warmup))
  return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def shard_model(model, mesh, cfg):
  """The model on the mesh, by --sharding: whole on every device (batch), or each of its BLOCKS,
  then the rest (the embeddings, the last norm and the output layer), wrapped in FSDPv2, which
  shards each weight over the mesh's 'fsdp' axis and gathers a block's whole weights only while
  it runs. With --use_gradient_checkpointing, each block recomputes its activations in the
  backward."""
  if cfg.sharding == 'batch':
    if cfg.use_gradient_checkpointing:
      for module in model.modules():
        if isinstance(module, BLOCKS):
          checkpoint_module(module)  # Wraps its forward, in place.
    return model.to(torch_xla.device())
  wrap = ((lambda module, *args, **kwargs: FSDPv2(checkpoint_module(module), *args, **kwargs))
          if cfg.use_gradient_checkpointing else None)
  # extra_data_axis: the output (the scores) sharded along the batch, as the input is.
  return FSDPv2(model, mesh=mesh, extra_data_axis='data', auto_wrapper_callable=wrap,
                auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                   transformer_layer_cls=set(BLOCKS)))


def weights(model):
  """The model's state_dict under the names of the model unwrapped (FSDPv2 adds _orig_module.):
  a checkpoint names its weights alike under every --sharding."""
  return {name.replace('_orig_module.', ''): tensor for name, tensor in model.state_dict().items()}


def check_scores(scores, targets, vocab_size):
  """The model's output, if it is (N, T, vocab_size) for targets (N, T): else a UsageError
  naming the shape (known as the step is traced: no wait)."""
  expected = (*targets.shape, vocab_size)
  if tuple(scores.shape) != expected:
    raise utils.UsageError(f'the model returns outputs of shape {tuple(scores.shape)} for tokens '
                           f'of shape {tuple(targets.shape)}: expected {expected}, a score for '
                           f'each of the {vocab_size} ids at each position; fix build_model')
  return scores


def lm_loss(scores, targets, vocab_size, reduction='mean'):
  """The cross entropy of the next token at every position (targets -1: padding, not counted)."""
  return F.cross_entropy(check_scores(scores, targets, vocab_size).flatten(0, 1).float(),
                         targets.flatten(), ignore_index=-1, reduction=reduction)


def train_step(run, tokens, targets, part=(1, 1)):
  """Adds the gradients of the batch's loss to the weights'; on the last batch of a step (part: i
  of n, n --gradient_accumulation_steps), clips them and steps. Returns the loss / n."""
  (i, n), cfg, optimizer = part, run.cfg, run.optimizer
  # --amp: bfloat16 has float32's range, so no gradient scaler (see docs/tpu.md).
  with torch.autocast('xla', dtype=torch.bfloat16, enabled=cfg.amp):
    loss = lm_loss(run.model(tokens), targets, cfg.vocab_size) / n
  loss.backward()  # Added to the gradients of the step's batches before.
  if i == n:
    if cfg.max_grad_norm:  # The global norm over every shard of every gradient.
      torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.max_grad_norm)
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
        loss = loss + train_step(run, batch['tokens'], batch['targets'], (i, len(batches)))
        if i < len(batches):
          continue
        targets = torch.cat([batch['targets'] for batch in batches]).flatten()
        tracker.add(len(targets) // cfg.seq_len)
        if step % cfg.log_steps == 0:
          xm.add_step_closure(run.log.add, args=(epoch, step, run.global_step, loss, tracker,
                                                 run.optimizer.param_groups[0]['lr']))
        # The same answer on every process; the end of the run if loss or weights run away, or a
        # target is none of the vocabulary's ids.
        stopping = run.stop.agreed_after_step(loss, targets, f'epoch {epoch} step {step}')
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
  """(mean loss, its summed loss, tokens) over every window once; padding (-1) is not counted."""
  model.eval()
  # Counted on the device and read once at the end: an .item() per step would sync. The
  # sums over the sharded batch are over every device of every host.
  sums = torch.zeros(2, dtype=torch.float32, device=torch_xla.device())
  with torch.no_grad(), torch.autocast('xla', dtype=torch.bfloat16, enabled=cfg.amp):
    for batch in loader:
      targets = batch['targets']
      loss = lm_loss(model(batch['tokens']), targets, cfg.vocab_size, reduction='sum')
      sums += torch.stack([loss, (targets >= 0).sum().float()])
  total, count = sums.tolist()
  return total / max(count, 1), total, int(count)


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
  """Puts save_checkpoint's state back into the run, with the --lr and --weight_decay given now
  (utils.new_recipe); returns what those changed."""
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


def end_epoch(run, epoch, loss):
  """Records and saves an epoch, evaluated or not (loss None); returns (whether to stop now,
  its checkpoint or None)."""
  results = run.results
  results['epochs'] = epoch
  lowest = results['min_eval_loss']
  best = loss is not None and (lowest is None or loss < lowest)
  if loss is not None:  # Only evaluated epochs count for best.pt and the results.
    results['eval_losses'].append(loss)
    results['eval_epochs'].append(epoch)
    results.update(final_eval_loss=loss, min_eval_loss=loss if best else lowest)
    test_utils.write_to_summary(run.log.writer, epoch, {'Loss/eval': loss})
  run.log.end_epoch(epoch, evaluated=loss is not None)  # The graphs compiled by now.
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
  both axes of the mesh, the others whole, whatever their number. minibatch: each host gives its
  devices' rows."""

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
  train_loader, test_loader, vocab_size = load_data(cfg, host, hosts, local_devices)
  run = start_run(cfg, vocab_size, train_loader.steps, stop_signal, mesh)
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
      xm.master_print(f'Epoch {epoch} train end {test_utils.now()}, Reduced GlobalRate={rate:.2f}'
                      f' samples/s, {rate * cfg.seq_len:,.0f} tokens/s', flush=True)
      loss = None  # Unless evaluated (--eval_interval, --test_only_at_end).
      if utils.evaluates(epoch, cfg.num_epochs, cfg.eval_interval, cfg.test_only_at_end):
        loss, _, tokens = evaluate(run.model, test_device_loader, cfg)
        test_loader.check()
        xm.master_print(f'Epoch {epoch} test end {test_utils.now()}, Eval loss={loss:.4f} '
                        f'perplexity={perplexity(loss):.2f} ({tokens:,} tokens)',
                        flush=True)
      stop, saved = end_epoch(run, epoch, loss)
      if stop:  # The same, asked for as the epoch ended: its checkpoint holds this state.
        return results, stop_run(run, epoch + 1, 0, saved)
  except utils.Diverged as error:  # From run.stop: the loss or weights ran away (see StopVote).
    results['diverged'] = str(error)  # Nothing is saved after it.
  utils.add_totals(results, run.global_step,
                   cfg.batch_size * cfg.gradient_accumulation_steps * devices, run.log)
  if 'diverged' in results:
    return results, utils.say_diverged(results['diverged'], vars(cfg))  # Exit code 22
  return results, say_finished(results)  # Done: 0


def say_finished(results):
  """Says a finished run's totals and its evaluation loss; returns its exit code, 0."""
  utils.say_time_and_graphs(results)
  if results['final_eval_loss'] is not None:
    xm.master_print(f'Final eval loss: {results["final_eval_loss"]:.4f} (perplexity '
                    f'{perplexity(results["final_eval_loss"]):.2f}), lowest '
                    f'{results["min_eval_loss"]:.4f}', flush=True)
  return 0


def perplexity(loss):
  return math.exp(min(loss, 700))  # Past about 709, exp overflows a float.


def check_job(cfg, given):
  """Builds the data and the model once, before the run, and says what they are and the recipe:
  bad input is one line. Caps cfg.num_workers at the CPUs there are; probes the output folders."""
  if cfg.fake_data:
    vocab_size = FAKE_VOCAB
    print(f'Data: fake, constant batches of random tokens, windows of {cfg.seq_len}, a '
          f'vocabulary of {vocab_size:,}')
  else:
    cfg.num_workers = supervisor.usable_workers(cfg.num_workers, 'num_workers' in given)
    train_set, test_set, vocab_size = build_datasets(cfg)
    print(f'Data: {len(train_set):,} training and {len(test_set):,} evaluation windows of '
          f'{cfg.seq_len} tokens, a vocabulary of {vocab_size:,}')
  model = build_model(cfg, vocab_size)
  parameters = sum(parameter.numel() for parameter in model.parameters())
  tokens = cfg.batch_size * cfg.gradient_accumulation_steps * cfg.seq_len
  print(f'Model: {cfg.model} ({type(model).__name__}, {parameters / 1e6:.2f}M parameters); '
        f'{6 * parameters * tokens / 1e9:,.2f} GFLOPs a step of each device (6 x parameters x '
        'tokens)')
  warmup = (f'{cfg.lr_warmup_steps} steps' if cfg.lr_warmup_steps is not None else
            "100 steps (a tenth of the run's if fewer)")
  print(f'Recipe: AdamW, lr {cfg.lr:g}, betas {BETAS[0]:g} and {BETAS[1]:g}, weight decay '
        f'{cfg.weight_decay:g} (matrices only), warm-up {warmup} then cosine to '
        f'{cfg.min_lr_ratio:g} x lr, gradients clipped to norm {cfg.max_grad_norm:g}', flush=True)
  supervisor.check_outputs(cfg.ckpt_dir, cfg.logdir, cfg.results_json, cfg.compile_cache_dir,
                           cfg.profile_logdir if cfg.profile_step is not None else None)


def main(argv):
  del argv
  cfg = SimpleNamespace(**FLAGS.flag_values_dict())
  settings = recipe(cfg)[1]
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
        check_job(cfg, {name for name in FLAGS if FLAGS[name].present})
      utils.prepare_process(cfg, xr.process_index())  # Before any computation.
      results, code = train(cfg, utils.stop_signal)
      if utils.is_master():
        utils.write_results(cfg.results_json, results)
    except Exception as e:  # A bad flag, path or file, a full disk, a device out of memory:
      utils.die_or_raise(e)  # one line; a bug: its traceback.
  sys.exit(code)


def recipe(cfg):
  """(name, settings) of the recipe that the flags not given come from."""
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
    app.run(main, flags_parser=lambda argv: utils.parse_flags(
        argv, supervisor.DECODER_FLAGS if supervisor else None))
