# SPDX-License-Identifier: BSD-3-Clause
"""train_decoder_spmd.py's speed on 4 XLA:CPU devices, beside upstream's FSDPv2 decoder example.

Runs the script as a user would (a fresh process, --results_json) on token files of random ids
(upstream's vocabulary of 3,200, its windows of 512 tokens and its 16 windows a device) under
--sharding batch and fsdp, and prints a markdown table: tokens/s of the epoch after the first
(which compiles), the model FLOPs of a step (6 x parameters x tokens: divide by a step's time
and the chip's peak for the utilisation; none is claimed on a CPU), the graphs compiled, the
seconds from start to the first step and the process's peak memory. With --upstream_examples
DIR (the examples folder of a pytorch/xla v2.9.0 checkout), the same model and batch run by
upstream's examples/fsdp/train_decoder_only_fsdp_v2.py on the same devices too; a run whose
memory passes --memory_cap_gb is stopped and said so.

  python benchmarks/decoder.py                      # about 4 minutes on 2 cores
  python benchmarks/decoder.py --upstream_examples ~/xla/examples
  python benchmarks/decoder.py --quick              # a smoke test: tiny runs, the same table
"""

import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parents[1]
FLAGS = flags.FLAGS
flags.DEFINE_bool('quick', False, 'Tiny runs: checks that the benchmark works.')
flags.DEFINE_string('upstream_examples', None, "pytorch/xla's examples folder (v2.9.0), to run "
                    'its FSDPv2 decoder example beside ours.')
flags.DEFINE_float('memory_cap_gb', 12, 'Stop a run whose memory (RSS) passes this.')
flags.DEFINE_integer('devices', 4, 'XLA:CPU devices (CPU_NUM_DEVICES).')

VOCAB = 3200  # upstream's DecoderOnlyConfig.vocab_size, fixed there, as its batch and windows are
MODEL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=256)
STEP_LINE = re.compile(r'^(?:\| Training .* Step=\d+ |epoch: \d+, step: \d+, loss: )')


def watched(command, env, cwd):
  """(exit code or 'over N GB', output, peak RSS in GB, seconds to the first step line) of a
  command whose memory is polled and capped."""
  with tempfile.TemporaryFile('w+') as out:
    began, peak, first = time.time(), 0.0, None
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    while proc.poll() is None:
      peak = max(peak, sum(rss_gb(pid) for pid in session_pids(proc.pid)))
      if first is None:
        out.seek(0)
        if any(STEP_LINE.match(line) for line in out):
          first = time.time() - began
      if peak > FLAGS.memory_cap_gb:
        os.killpg(proc.pid, 9)
        proc.wait()
        break
      time.sleep(0.2)
    out.seek(0)
    code = proc.returncode if peak <= FLAGS.memory_cap_gb else f'over {FLAGS.memory_cap_gb:g} GB'
    return code, out.read(), peak, first


def session_pids(session):
  pids = []
  for entry in filter(str.isdigit, os.listdir('/proc')):
    try:
      with open(f'/proc/{entry}/stat') as f:
        if int(f.read().rsplit(')', 1)[1].split()[3]) == session:
          pids.append(entry)
    except (OSError, ValueError, IndexError):
      pass
  return pids


def rss_gb(pid):
  try:
    with open(f'/proc/{pid}/status') as f:
      return next(int(line.split()[1]) for line in f if line.startswith('VmRSS:')) / 2**20
  except (OSError, StopIteration):
    return 0.0


def write_tokens(folder, count):
  rng = np.random.default_rng(0)
  folder.mkdir()
  rng.integers(0, VOCAB, count).astype(np.uint16).tofile(folder / 'train.bin')
  rng.integers(0, VOCAB, count // 10).astype(np.uint16).tofile(folder / 'val.bin')
  (folder / 'meta.json').write_text(json.dumps(dict(vocab_size=VOCAB, dtype='uint16')))


def ours(tmp, sharding, seq_len, batch, steps, env):
  """The table's row of train_decoder_spmd.py under --sharding."""
  results = tmp / f'{sharding}.json'
  flags_ = [f'--{name}={value}' for name, value in MODEL.items()]
  command = [sys.executable, str(REPO / 'train_decoder_spmd.py'), '--datadir', str(tmp / 'tokens'),
             *flags_, '--seq_len', str(seq_len), '--batch_size', str(batch), '--test_set_batch_size',
             str(batch), '--num_steps', str(steps), '--num_epochs', '2', '--log_steps', '1',
             '--sharding', sharding, '--num_workers', '1', '--results_json', str(results)]
  code, out, peak, first = watched(command, env, REPO)
  if code != 0:
    sys.exit(f'train_decoder_spmd.py --sharding {sharding} failed ({code}):\n{out[-3000:]}')
  done = json.loads(results.read_text())
  flops = float(re.search(r'([\d,.]+) GFLOPs a step of each device', out)[1].replace(',', ''))
  return (f'train_decoder_spmd.py --sharding {sharding}', f'{done["epoch_rates"][-1] * seq_len:,.0f}',
          f'{flops * FLAGS.devices:,.1f}', str(done['compilations']), f'{first:.1f}', f'{peak:.1f}')


def upstream(tmp, steps, env):
  """The row of upstream's FSDPv2 example: the same model; its windows, batch and vocabulary
  are its own (512, 16 a device, 3,200)."""
  folder = pathlib.Path(FLAGS.upstream_examples).expanduser().resolve()
  names = {'hidden_size': 'hidden-size', 'num_hidden_layers': 'num-layers',
           'num_attention_heads': 'num-attention-heads',
           'num_key_value_heads': 'num-key-value-heads', 'intermediate_size': 'intermediate-size'}
  command = [sys.executable, str(folder / 'fsdp' / 'train_decoder_only_fsdp_v2.py'),
             *(f'--{names[name]}={value}' for name, value in MODEL.items()),
             '--num-steps', str(2 * steps + 1)]
  code, out, peak, first = watched(command, env, folder.parent)
  rates = [float(r) for r in re.findall(r'^epoch: \d+, step: \d+, loss: \S+, rate: ([\d.]+)', out,
                                        re.M)]
  rate = f'{rates[-1] * 512:,.0f}' if code == 0 and len(rates) > 1 else f'none ({code})'
  first = f'{first:.1f}' if first is not None else '-'
  return ('examples/fsdp/train_decoder_only_fsdp_v2.py', rate, '', '', first, f'{peak:.1f}')


def main(argv):
  del argv
  seq_len, batch, steps = (64, 2, 2) if FLAGS.quick else (512, 16, 5)
  env = dict(os.environ, PJRT_DEVICE='CPU', CPU_NUM_DEVICES=str(FLAGS.devices),
             PYTHONUNBUFFERED='1')
  params = ', '.join(f'{name} {value}' for name, value in MODEL.items())
  print(f'A decoder ({params}, vocabulary {VOCAB:,}) on {FLAGS.devices} XLA:CPU devices, '
        f'{os.cpu_count()} cores: windows of {seq_len} tokens, {batch} a device, 2 epochs of '
        f'{steps} steps; tokens/s of epoch 2')
  print()
  print('| run | tokens/s | model GFLOPs a step | graphs compiled | start to first step (s) | '
        'peak memory (GB) |')
  print('| --- | --- | --- | --- | --- | --- |', flush=True)
  with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    write_tokens(tmp / 'tokens', 50 * seq_len * batch * FLAGS.devices)
    for sharding in ('batch', 'fsdp'):
      print('| ' + ' | '.join(ours(tmp, sharding, seq_len, batch, steps, env)) + ' |', flush=True)
    if FLAGS.upstream_examples and not FLAGS.quick:
      print('| ' + ' | '.join(upstream(tmp, steps, env)) + ' |', flush=True)


if __name__ == '__main__':
  app.run(main)
