# SPDX-License-Identifier: BSD-3-Clause
"""The first compile of train_decoder_spmd.py's Decoder with its layers run as a Python loop (the
script's forward) and under torch_xla's scan_layers (one layer's graph, scanned), on 4 XLA:CPU
devices under SPMD with the batch sharded (the script's --sharding batch).

scan_layers needs jax and torchax, which requirements.txt does not install (torch_xla 2.9 calls
jax through torchax for the scan's sharded backward); without them this prints one line saying
so. Under FSDPv2 (--sharding fsdp) scan_layers failed here ("Expected XLA tensor"), which is
why the script has no --scan_layers (docs/scripts.md). Each mode runs in a fresh process (no
compile cache) and does 3 AdamW steps; the table says the seconds of the first step (tracing,
compiling, running), XLA's compile time (its CompileTime metric), the graphs compiled, the
third step's seconds, the process's peak memory and the third step's loss (equal in both modes:
the same computation). A run the kernel kills (out of memory) is a row that says so.

  pip install jax==0.7.1 jaxlib==0.7.1 torchax==0.0.13
  python benchmarks/scan_layers.py                  # 16 layers: about 3 minutes on 2 cores
  python benchmarks/scan_layers.py --layers 32
"""

import os
import pathlib
import subprocess
import sys

from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parents[1]
FLAGS = flags.FLAGS
flags.DEFINE_integer('layers', 16, 'Decoder layers.', lower_bound=1)
flags.DEFINE_integer('hidden_size', 512, 'Width of the model.', lower_bound=8)
flags.DEFINE_integer('devices', 4, 'XLA:CPU devices (CPU_NUM_DEVICES).', lower_bound=1)

# One mode in a process of its own: argv is mode, layers, width. Prints one tab-separated row.
RUN = '''
import resource, sys, time
import numpy as np, torch, torch_xla
import torch_xla.debug.metrics as met, torch_xla.distributed.spmd as xs, torch_xla.runtime as xr
import train_decoder_spmd as script
mode, layers, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
xr.use_spmd()
devices = xr.global_runtime_device_count()
mesh = xs.Mesh(np.arange(devices), (devices, 1), ('data', 'fsdp'))
torch.manual_seed(0)
model = script.Decoder(256, width, layers, 8, 8, 4 * width).to(torch_xla.device())
if mode == 'scan_layers':
  from torch_xla.experimental.scan_layers import scan_layers
  forward = lambda tokens: model.output(model.norm(scan_layers(model.layers,
                                                               model.embed_tokens(tokens))))
else:
  forward = model
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(256, (4 * devices, 257), generator=torch.Generator().manual_seed(0))
tokens, targets = ids[:, :-1].to(torch_xla.device()), ids[:, 1:].to(torch_xla.device())
for tensor in (tokens, targets):
  xs.mark_sharding(tensor, mesh, ('data', None))
seconds = []
for step in range(3):
  start = time.time()
  loss = torch.nn.functional.cross_entropy(forward(tokens).flatten(0, 1), targets.flatten())
  loss.backward()
  optimizer.step()
  optimizer.zero_grad()
  torch_xla.sync(wait=True)
  seconds.append(time.time() - start)
count, nanoseconds = met.metric_data('CompileTime')[:2]
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KB to GB
print(f'{seconds[0]:.1f}\\t{nanoseconds / 1e9:.1f}\\t{count}\\t{seconds[2]:.2f}\\t{peak:.1f}\\t'
      f'{loss.item():.6f}')
'''


def main(argv):
  del argv
  try:
    import jax  # noqa: F401
    import torchax  # noqa: F401
  except ImportError as e:
    sys.exit(f'error: scan_layers needs jax and torchax ({e}): pip install jax==0.7.1 '
             'jaxlib==0.7.1 torchax==0.0.13')
  env = dict(os.environ, PJRT_DEVICE='CPU', CPU_NUM_DEVICES=str(FLAGS.devices),
             TF_CPP_MIN_LOG_LEVEL='2', PYTHONPATH=os.pathsep.join(filter(None, (
                 str(REPO), os.environ.get('PYTHONPATH')))))
  env.pop('XLA_PERSISTENT_CACHE_PATH', None)
  print(f'Decoder of {FLAGS.layers} layers of width {FLAGS.hidden_size}, batch of 4 windows of '
        f'256 tokens on each of {FLAGS.devices} XLA:CPU devices, sharded along the batch')
  print('| layers run as | first step (s) | XLA compile (s) | graphs | third step (s) | '
        'peak memory (GB) | loss |')
  print('| --- | --- | --- | --- | --- | --- | --- |', flush=True)
  for mode in ('a loop', 'scan_layers'):
    result = subprocess.run([sys.executable, '-c', RUN, mode, str(FLAGS.layers),
                             str(FLAGS.hidden_size)], cwd=REPO, env=env, capture_output=True,
                            text=True)
    if result.returncode == -9:  # The kernel's OOM killer, as a rule (see dmesg).
      print(f'| {mode} | killed by SIGKILL: out of memory? | | | | | |', flush=True)
    elif result.returncode:
      sys.exit(f'error: the run of {mode} failed (exit code {result.returncode}):\n'
               + '\n'.join(result.stderr.splitlines()[-15:]))
    else:
      print(f'| {mode} | ' + ' | '.join(result.stdout.split()[-6:]) + ' |', flush=True)


if __name__ == '__main__':
  app.run(main)
