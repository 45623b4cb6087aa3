# SPDX-License-Identifier: BSD-3-Clause
"""train_resnet_spmd.py on four XLA:CPU devices (CPU_NUM_DEVICES=4): real SPMD data-parallel
training, with the collectives XLA inserts, in one process."""

import re
import signal
import subprocess
import sys

import numpy as np
import torch

from conftest import (REPO, assert_one_error, assert_same_training, both, finish, index_chunks,
                      limit_file_size, make_image_folder, newest_checkpoint, read_checkpoint,
                      read_json, run_and_signal, run_script, script_env, seeded_random,
                      start_script, training_losses, write_image)

SCRIPT = 'train_resnet_spmd.py'
FOUR = script_env(CPU_NUM_DEVICES='4')


def test_four_devices_learn_count_every_image_once_and_compile_only_in_epoch_1(tmp_path,
                                                                           colour_folder):
  # 21 val images, one of them a red image filed under green: exactly 20/21 correct, in
  # global evaluation batches of 8 (the last one padded). At --lr 0.005 three seeds each
  # ended at 20/21 after 3 epochs, and the default seed (42) and seed 1 after 2 already
  # (47.62 then 95.24); at 0.01 the default seed ended at 15/21. Two epochs: the second shows
  # that nothing compiles after the first, at a third less CPU than three.
  write_image(colour_folder / 'val' / 'green' / 'red_one.png', (220, 40, 40), 32,
              np.random.default_rng(3))
  result = run_script(SCRIPT, '--datadir', colour_folder, '--model', 'resnet18', '--img_dim', 16,
                      '--batch_size', 4, '--test_set_batch_size', 2, '--num_epochs', 2,
                      '--lr', 0.005, '--num_workers', 2, '--log_steps', 4,
                      '--results_json', tmp_path / 'r.json', env=FOUR)
  assert result.returncode == 0, both(result)
  results = read_json(tmp_path / 'r.json')
  assert results['world_size'] == 4 and results['spmd']
  assert (results['eval_correct'], results['eval_samples']) == (20, 21), result.stdout
  assert re.search(r'^Epoch 2 test end \d\d:\d\d:\d\d, Accuracy=95\.24$', result.stdout, re.M)
  assert results['train_steps'] == 2 * 16  # 256 images in global batches of 4 x 4.
  assert re.findall(r'^Epoch \d Host Train Samples=(\d+) Devices=4 of 4 Host=0$', result.stdout,
                    re.M) == ['256'] * 2
  counts = results['compilations_after_epoch']
  assert len(counts) == 2 and counts[0] == counts[1], counts  # Nothing compiled after epoch 1.


def test_killed_and_stopped_fsdp_run_on_four_devices_ends_bitwise_equal_and_as_one_device(
    tmp_path, colour_folder):
  # Under --sharding fsdp: each host saves and loads its own shards (one host here). A fifth
  # class: 4 devices do not divide the head's 5 rows (a resume crashed on such a mesh).
  make_image_folder(colour_folder, 'train', 64, seed=5, colours={'purple': (150, 40, 200)})
  make_image_folder(colour_folder, 'val', 5, seed=6, colours={'purple': (150, 40, 200)})
  args = ['--sharding', 'fsdp', '--datadir', colour_folder, '--model', 'resnet18', '--img_dim', 16,
          '--test_set_batch_size', 4, '--num_epochs', 2, '--num_steps', 5, '--log_steps', 1,
          '--lr', 0.005, '--lr_scheduler_type', 'WarmupAndExponentialDecayScheduler',
          '--lr_scheduler_divide_every_n_epochs', 1, '--num_workers', 1]
  four = args + ['--batch_size', 4, '--ckpt_every_steps', 2]
  reference = start_script(SCRIPT, *four, '--ckpt_dir', tmp_path / 'reference',
                           '--keep_checkpoints', 10, '--results_json', tmp_path / 'reference.json',
                           env=FOUR)
  # The same global batch of 16 on one device, for the first epoch.
  one = start_script(SCRIPT, *args, '--batch_size', 16, '--num_epochs', 1, '--ckpt_every_steps', 2,
                     '--ckpt_dir', tmp_path / 'one', '--keep_checkpoints', 10,
                     env=script_env(CPU_NUM_DEVICES='1'))
  ckpt_dir = tmp_path / 'ckpt'
  # With torch_xla's compile cache (written; XLA:CPU cannot read it back): the same training.
  run = four + ['--ckpt_dir', ckpt_dir, '--compile_cache_dir', tmp_path / 'cache']
  # kill -9 of every process of the run mid-epoch (a VM that crashes).
  kill_step = seeded_random().randrange(2, 5)
  code, out = run_and_signal(SCRIPT, run, kill_step, signal.SIGKILL, env=FOUR)
  assert code == -signal.SIGKILL, out

  # SIGTERM to every process: the hosts' vote stops all at one step, which is saved.
  code, out = run_and_signal(SCRIPT, run, 0, signal.SIGTERM, env=FOUR)
  assert code == 75, f'killed at step {kill_step}\n{out}'
  assert re.search(r'^Resumed from \S+ at epoch 1 step [24]$', out, re.M), out
  assert re.search(r'^Stopped by SIGTERM at epoch \d step \d: saved \S+; run the same command '
                   r'to resume \(exit code 75\)$', out, re.M), out

  result = run_script(SCRIPT, *run, '--results_json', tmp_path / 'resumed.json', env=FOUR)
  assert result.returncode == 0, result.stdout + result.stderr
  assert re.search(r'^Resumed from \S+ at epoch \d step \d$', result.stdout, re.M), result.stdout
  code, reference_out = finish(reference)
  assert code == 0, reference_out
  resumed, uninterrupted = training_losses(result.stdout), training_losses(reference_out)
  assert resumed and all(uninterrupted[key] == loss for key, loss in resumed.items())
  assert_same_training(ckpt_dir, tmp_path / 'reference')
  # Each resume put the momentum back sharded as the weights are: the same bytes a device, the
  # same chunks in the checkpoints it saved, and the graphs of the run never stopped (the
  # optimizer's state made before the first step, in both: utils.make_optimizer_state).
  ours, theirs = read_json(tmp_path / 'resumed.json'), read_json(tmp_path / 'reference.json')
  assert ours['bytes_per_device'] == theirs['bytes_per_device'], result.stdout
  assert ours['compilations'] == theirs['compilations'], result.stdout
  newest = max(path.name for path in ckpt_dir.glob('ckpt-*.pt'))[:-len('.pt')]
  assert index_chunks(ckpt_dir / newest) == index_chunks(tmp_path / 'reference' / newest)
  # best.pt names the folder of the best epoch end, kept though --keep_checkpoints (2) has
  # rotated its file out: it reads whole.
  best = read_checkpoint(ckpt_dir / 'best.pt')
  assert best['model'].keys() == newest_checkpoint(ckpt_dir)['model'].keys(), best['shards']
  assert len(list((tmp_path / 'cache' / 'process-0').iterdir())) >= 5  # A file per graph.

  # Four devices compute what one does with the same global batch, up to float rounding:
  # the gradients and BatchNorm statistics are summed over the devices in another order
  # (measured: gradients within 1e-6). Training amplifies such differences, here fast (at
  # 16 px, layer4's BatchNorm normalises 16 values per channel): weights still agree within
  # 1e-5 after 2 steps, the momentum within 4e-5 after 3, then they part (1e-2 after 4).
  # So: the losses of steps 0-2 within 1e-4, and every weight after step 2 within 1e-5.
  code, one_out = finish(one)
  assert code == 0, one_out
  one_losses = training_losses(one_out)
  assert len(one_losses) == 5
  for step in range(3):
    ours, theirs = float(uninterrupted[1, step]), float(one_losses[1, step])
    assert abs(ours - theirs) <= 1e-4 * max(1, theirs), (step, ours, theirs)
  ours = read_checkpoint(tmp_path / 'reference' / 'ckpt-00000002.pt')['model']
  theirs = read_checkpoint(tmp_path / 'one' / 'ckpt-00000002.pt')['model']
  for name, weight in ours.items():
    if weight.is_floating_point():
      torch.testing.assert_close(weight, theirs[name], rtol=1e-5, atol=1e-5, msg=name)

  # One more epoch on two devices, on a disk that fills as its first save writes the shards
  # (a 20 MB file limit; the shards are 90 MB): one line, exit code 2, and no file for that
  # step, so the half-written folder is no checkpoint. (No compile cache: its files too.)
  two, more = script_env(CPU_NUM_DEVICES='2'), [*four, '--ckpt_dir', ckpt_dir, '--num_epochs', 3]
  full = subprocess.run([sys.executable, SCRIPT, *map(str, more)], cwd=REPO, env=two,
                        capture_output=True, text=True, timeout=900,
                        preexec_fn=limit_file_size(20))
  # (The reason is torch's zip writer's, which sees the short write: 'unexpected pos ...'.)
  assert_one_error(full, 2, r'^error: cannot write checkpoint \S+ckpt-00000012 \((OSError|Runtime'
                   r'Error): .*\): free space in --ckpt_dir or give another; the checkpoints '
                   r'already there are kept$')
  assert not (ckpt_dir / 'ckpt-00000012.pt').exists()
  # The same command again: it goes on from the checkpoint before, and says what changes.
  result = run_script(SCRIPT, *more, env=two)
  assert result.returncode == 0, result.stdout + result.stderr
  assert re.search(r'^warning: resuming \S+ckpt-00000010\.pt on 2 devices, saved on 4: the global '
                   r'batch is 8 instead of 16 \(--batch_size 4 per device\), so the run will '
                   r'differ from one never interrupted \(see docs/checkpoints\.md\)$', result.stderr,
                   re.M), result.stderr
  assert re.search(r'^Resumed from \S+ckpt-00000010\.pt at epoch 3 step 0$', result.stdout, re.M)
  # Its save of step 12 written anew and read back whole by the test's reader.
  assert re.search(r'^Saved checkpoint \S+ckpt-00000012\.pt$', result.stdout, re.M)
  assert newest_checkpoint(ckpt_dir)['global_step'] == 15


def test_bad_input_is_one_clear_line_and_exit_2(tmp_path):
  result = run_script(SCRIPT, '--datadir', tmp_path / 'nowhere', env=FOUR, timeout=300)
  assert_one_error(result, 2, 'nowhere')
