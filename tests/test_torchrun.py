# SPDX-License-Identifier: BSD-3-Clause
"""The kit of train_resnet_mp.py (the script and utils.py, as docs/scripts.md's copy line
copies it) under the real torchrun, alone and with supervisor.py: SIGTERM to torchrun, and a
Ctrl-C to its process group, which reaches the worker twice."""

import os
import re
import shutil
import signal

import pytest

from conftest import REPO, assert_nothing_left, read_json
from test_copy import copy_kit, signal_after_training_lines, start_in


TORCHRUN_ARGS = ['--fake_data', '--model', 'resnet18', '--img_dim', 16, '--batch_size', 4,
                 '--test_set_batch_size', 4, '--num_epochs', 1, '--num_steps', 40,
                 '--log_steps', 1]


# With supervisor.py, the Ctrl-C: its watch must not take the second delivery for a second
# Ctrl-C (SIGTERM takes the same path in it, once). That run trains with --ddp (torch's
# DistributedDataParallel under torchrun, as upstream's DDP page runs it): the stop the same.
@pytest.mark.parametrize('kit,sig', [('kit alone', 'SIGTERM to torchrun'), ('kit alone', 'Ctrl-C'),
                                     ('with supervisor.py, --ddp', 'Ctrl-C')])
def test_under_torchrun_a_signal_stops_the_worker_with_a_checkpoint(tmp_path, kit, sig):
  project = tmp_path / 'project'
  copy_kit('train_resnet_mp.py', project)
  if kit != 'kit alone':
    shutil.copy(REPO / 'supervisor.py', project)
  # torchrun passes SIGTERM or SIGINT on to its workers and kills them 30 s later; a Ctrl-C
  # in a terminal reaches the worker twice, from the terminal and from torchrun.
  process = start_in(project, '-m', 'torch.distributed.run', '--nproc_per_node', 1,
                     'train_resnet_mp.py', *TORCHRUN_ARGS, '--ckpt_dir', tmp_path / 'ckpt',
                     '--results_json', tmp_path / 'r.json',
                     *(['--ddp'] if '--ddp' in kit else []))
  sigterm = sig.startswith('SIGTERM')
  code, out = signal_after_training_lines(process, 2, signal.SIGTERM if sigterm else signal.SIGINT,
                                          to_group=not sigterm)
  assert 'the replica of this torchrun worker' in out, out[-3000:]
  name, exit_code = ('SIGTERM', 75) if sigterm else (r'Ctrl-C \(SIGINT\)', 130)
  stopped = re.search(rf'^Stopped by {name} at epoch 1 step (\d+): saved (\S+); run the same '
                      rf'command to resume \(exit code {exit_code}\)$', out, re.M)
  assert stopped, out[-3000:]
  assert os.path.exists(stopped.group(2))
  results = read_json(tmp_path / 'r.json')  # What a restart policy can read: torchrun says 1.
  assert results['checkpoint'] == stopped.group(2)
  assert results['preempted' if sigterm else 'interrupted'] is True
  assert code == 1, out[-3000:]  # torchrun's own code after a signal.
  assert 'Stopped at once' not in out  # The second delivery of a Ctrl-C ends nothing.
  assert_nothing_left(session=process.pid)
