# SPDX-License-Identifier: BSD-3-Clause
"""Checkpoints, exact resume, SIGTERM and SIGHUP in train_single_core.py, end to end on XLA:CPU.

A run is stopped by Ctrl-C at a random step, killed (SIGKILL) in the middle of writing a
checkpoint, and restarted each time with the same command; it must end with weights bitwise
equal to a run that was never interrupted.
"""

import asyncio
import io
import os
import pickle
import re
import shutil
import signal

import fsspec
import numpy as np
import pytest
import torch

import utils
from conftest import (SlowLink, assert_nothing_left, assert_one_error, assert_same_training,
                      finish, kill_during_save, make_image_folder, read_json, run_and_signal,
                      run_script, script_env, seeded_random, start_script, training_losses,
                      wait_for)

SCRIPT = 'train_single_core.py'
EPOCHS, STEPS = 2, 8  # 16 steps in all


def flags(data, ckpt_dir, *extra):
  # Random crops and flips, two loader workers: the batches of a resumed run must still match.
  return ['--datadir', data, '--model', 'resnet18', '--img_dim', 24, '--batch_size', 8,
          '--test_set_batch_size', 4, '--num_epochs', EPOCHS, '--num_steps', STEPS,
          '--log_steps', 1, '--num_workers', 2, '--lr', 0.05, '--ckpt_dir', ckpt_dir,
          '--ckpt_every_steps', 3, *extra]


@pytest.fixture(scope='module')
def data(tmp_path_factory):
  root = tmp_path_factory.mktemp('data')
  make_image_folder(root, 'train', 20, size=28, seed=1)
  make_image_folder(root, 'val', 2, size=28, seed=2)
  return root


@pytest.fixture(scope='module')
def reference(data, tmp_path_factory):
  """An uninterrupted run: (its checkpoint folder, its output)."""
  ckpt_dir = tmp_path_factory.mktemp('reference')
  result = run_script(SCRIPT, *flags(data, ckpt_dir))
  assert result.returncode == 0, result.stdout + result.stderr
  return ckpt_dir, result.stdout


def assert_same_losses(resumed_output, reference_output):
  ours, theirs = training_losses(resumed_output), training_losses(reference_output)
  assert ours and all(theirs[key] == loss for key, loss in ours.items()), (ours, theirs)


def test_stopped_at_a_random_step_killed_mid_save_and_cut_short_run_ends_bitwise_equal(
    data, reference, tmp_path):
  # No SIGKILL at a random step first (a run of its own once): the kill mid-save below is a
  # SIGKILL too, and with the newest checkpoint cut short its resume trains again the steps
  # after the one before, as a resume after a kill between saves does.
  ckpt_dir = tmp_path / 'ckpt'
  stop_step = seeded_random().randrange(0, 5)
  # Ctrl-C: SIGINT to the whole process group, loader workers included, as a terminal sends it.
  code, out = run_and_signal(SCRIPT, flags(data, ckpt_dir), stop_step, signal.SIGINT)
  assert code == 130, f'stop at step {stop_step}\n{out}'
  assert 'Traceback' not in out and 'KeyboardInterrupt' not in out, out
  stopped = re.search(r'^Stopped by Ctrl-C \(SIGINT\) at epoch (\d+) step (\d+): saved (\S+); run '
                      r'the same command to resume \(exit code 130\)$', out, re.M)
  assert stopped, out
  assert_same_losses(out, reference[1])
  saved = torch.load(stopped.group(3), weights_only=True)
  assert (saved['epoch'], saved['step']) == (int(stopped.group(1)), int(stopped.group(2)))

  code, out = kill_during_save(SCRIPT, flags(data, ckpt_dir), ckpt_dir, after_saves=1)
  assert code == -signal.SIGKILL, out
  # Resumed from the stop: the steps it trained are the uninterrupted run's.
  assert re.search(rf'^Resumed from {re.escape(stopped.group(3))} at epoch ', out, re.M), out
  assert_same_losses(out, reference[1])
  assert any('.pt.tmp' in p.name for p in ckpt_dir.iterdir())  # Killed while writing.
  # And the newest whole checkpoint cut short besides (a copy or a disk that stopped): the resume
  # says so in one warning and goes on from the one before it. (Here, not in a run of its own:
  # the resume below is one anyway, and every step it trains again must still match.)
  whole = sorted(ckpt_dir.glob('ckpt-*.pt'))  # Two at least: keep 2, and a save since the stop.
  newest, previous = whole[-1], whole[-2]
  newest.write_bytes(newest.read_bytes()[:100_000])
  before = torch.load(previous, weights_only=True)

  # With torch_xla's compile cache (written; XLA:CPU cannot read it back): the same training.
  result = run_script(SCRIPT, *flags(data, ckpt_dir, '--results_json', tmp_path / 'r.json',
                                     '--compile_cache_dir', tmp_path / 'cache'))
  assert result.returncode == 0, result.stdout + result.stderr
  assert len(list((tmp_path / 'cache').iterdir())) >= 4  # A file per graph it compiled.
  warnings = [l for l in result.stderr.splitlines() if l.startswith('warning: checkpoint')]
  assert len(warnings) == 1 and f'{newest.name} cannot be read' in warnings[0], result.stderr
  resumed = re.search(r'^Resumed from (\S+) at epoch (\d+) step (\d+)$', result.stdout, re.M)
  assert resumed, result.stdout
  assert (resumed.group(1), int(resumed.group(2)), int(resumed.group(3))) == (
      str(previous), before['epoch'], before['step']), result.stdout
  assert not any('.pt.tmp' in p.name for p in ckpt_dir.iterdir())
  assert_same_losses(result.stdout, reference[1])
  assert_same_training(ckpt_dir, reference[0])
  results = read_json(tmp_path / 'r.json')
  assert results['train_steps'] == EPOCHS * STEPS and results['epochs'] == EPOCHS
  # The curves' data is whole across the stop and the kill mid-save: every step
  # once, with the loss the uninterrupted run printed; each epoch's accuracy once.
  reference_losses = training_losses(reference[1])
  assert [(h['epoch'], h['step'], f"{h['loss']:.5f}") for h in results['history']] == [
      (epoch, step, reference_losses[epoch, step]) for epoch in (1, 2) for step in range(STEPS)]
  assert len(results['epoch_accuracies']) == EPOCHS
  # Two newest checkpoints and best.pt are kept.
  names = sorted(p.name for p in ckpt_dir.iterdir())
  assert names == ['.lock', 'best.pt', 'ckpt-00000015.pt', 'ckpt-00000016.pt'], names
  # The same command once more says the run is over:
  # test_checkpoint_holding_other_objects_is_refused runs it on a finished run's folder.


class Payload:
  """Stands for any object a pickle could smuggle in: it runs code when unpickled."""

  def __reduce__(self):
    return (print, ('this ran while loading a checkpoint',))


def test_checkpoint_holding_other_objects_is_refused(reference, data, tmp_path):
  ckpt_dir = tmp_path / 'ckpt'
  shutil.copytree(reference[0], ckpt_dir)
  state = torch.load(ckpt_dir / 'ckpt-00000016.pt', weights_only=True)
  state['flags'] = Payload()
  torch.save(state, ckpt_dir / 'ckpt-00000099.pt', pickle_protocol=pickle.HIGHEST_PROTOCOL)

  result = run_script(SCRIPT, *flags(data, ckpt_dir, '--resume', ckpt_dir / 'ckpt-00000099.pt'))
  assert_one_error(result, 2, r'--resume: checkpoint \S+ckpt-00000099.pt holds objects other than '
                              r'tensors and plain values')
  assert 'this ran' not in result.stdout + result.stderr

  # Found in --ckpt_dir, it is reported and passed over for the newest good one: the end of the
  # run, and the same command then says so and trains nothing (one run for both: a process
  # fewer).
  result = run_script(SCRIPT, *flags(data, ckpt_dir))
  assert result.returncode == 0, result.stdout + result.stderr
  assert 'this ran' not in result.stdout + result.stderr
  assert re.search(r'^warning: checkpoint \S+ckpt-00000099.pt holds objects', result.stderr, re.M)
  assert re.search(r'^Run already finished: \S+ckpt-00000016.pt is the end of epoch 2 '
                   r'\(--num_epochs 2\)\. To train on, give more --num_epochs; to start over, '
                   rf'remove {re.escape(str(ckpt_dir))} or give another --ckpt_dir$', result.stdout,
                   re.M), result.stdout
  assert 'Training' not in result.stdout and 'compiling' not in result.stdout, result.stdout


def test_checkpoint_of_another_script_and_model_names_what_differs(reference, data, tmp_path):
  # As train_wds_cifar.py saves resnet18 at 32 px (the CIFAR stem: a 3x3 first convolution),
  # met by a resnet34 run of this script: the line names the script and both flags.
  ckpt_dir = tmp_path / 'ckpt'
  ckpt_dir.mkdir()
  state = torch.load(reference[0] / 'ckpt-00000016.pt', weights_only=True)
  assert state['results']['script'] == SCRIPT
  state['results']['script'], state['flags']['img_dim'] = 'train_wds_cifar.py', 32
  state['model']['conv1.weight'] = torch.zeros(64, 3, 3, 3)
  torch.save(state, ckpt_dir / 'ckpt-00000016.pt')
  before = (ckpt_dir / 'ckpt-00000016.pt').read_bytes()
  result = run_script(SCRIPT, *flags(data, ckpt_dir, '--model', 'resnet34'))
  assert_one_error(result, 2, (
      r'^error: checkpoint \S+ckpt-00000016\.pt holds another model: conv1\.weight is \[64, 3, 3, '
      r'3\] there, \[64, 3, 7, 7\] here \(97 of 218 weights differ\); it was saved by '
      r'train_wds_cifar\.py \(this is train_single_core\.py\) with --model resnet18 \(resnet34 '
      r'now\), --img_dim 32 \(24 now\): give the flags of that run, or another --ckpt_dir$'))
  assert (ckpt_dir / 'ckpt-00000016.pt').read_bytes() == before


def test_a_stop_as_an_epoch_ends_saves_once_and_after_the_last_epoch_is_the_end(tmp_path):
  ckpt_dir = tmp_path / 'ckpt'
  args = ['--fake_data', '--model', 'resnet18', '--img_dim', 16, '--batch_size', 4,
          '--test_set_batch_size', 4, '--num_steps', 3, '--log_steps', 1, '--num_epochs', 2,
          '--ckpt_dir', ckpt_dir, '--ckpt_every_steps', 3, '--results_json', tmp_path / 'r.json']

  def stop_as_epoch_ends(epoch, signals, nohup=False, second_run=False):
    """The signals, in turn, to the run's process group once the epoch's training is over: they
    land while the epoch is evaluated. A closed terminal or ssh session sends SIGHUP so.
    second_run: the same command started again while this run trains (held by SIGSTOP)."""
    process = start_script(SCRIPT, *args, wrapper=['nohup'] if nohup else [])
    so_far = ''
    if second_run:
      so_far = wait_for(process, r'^\| Training ')
      os.killpg(process.pid, signal.SIGSTOP)
      second = run_script(SCRIPT, *args)
      os.killpg(process.pid, signal.SIGCONT)
      # Refused before the probe that frees what a killed save left: nothing of it was touched.
      assert_one_error(second, 2, rf'^error: --ckpt_dir {re.escape(str(ckpt_dir))} is in use by '
                                  rf'another run \(process {process.pid} on \S+, since [-\d]+ '
                                  r'[:\d]+\): let it end or stop it, or give this run another '
                                  r'--ckpt_dir$')
    so_far += wait_for(process, rf'^Epoch {epoch} train end ')
    for sig in signals:
      os.killpg(process.pid, sig)
    code, rest = finish(process)
    return code, so_far + rest

  code, out = stop_as_epoch_ends(1, [signal.SIGHUP], second_run=True)
  assert code == 75, out
  assert re.search(r'^Stopping after this step and saving \(SIGHUP\)$', out, re.M), out
  saved = str(ckpt_dir / 'ckpt-00000003.pt')
  # Once, though --ckpt_every_steps falls on the epoch's last step too.
  assert re.findall(r'^Saved checkpoint (\S+)$', out, re.M) == [saved], out
  assert re.search(rf'^Stopped by SIGHUP at epoch 2 step 0: saved {re.escape(saved)}; run the '
                   r'same command to resume \(exit code 75\)$', out, re.M), out
  # Epoch 2 is the last: a stop as it ends has nothing left to stop, and the run is done. Under
  # nohup the SIGHUP is no stop: the SIGTERM after it is the one the line names.
  code, out = stop_as_epoch_ends(2, [signal.SIGHUP, signal.SIGTERM], nohup=True)
  assert code == 0, out
  assert re.search(r'^Stopping after this step and saving \(SIGTERM\)$', out, re.M), out
  assert re.findall(r'^Saved checkpoint (\S+)$', out, re.M) == [str(ckpt_dir / 'ckpt-00000006.pt')]
  assert 'Stopped by' not in out and re.search(r'^Max Accuracy: 100.00%$', out, re.M), out
  results = read_json(tmp_path / 'r.json')
  assert results['train_steps'] == 6 and 'preempted' not in results, results


def test_a_bucket_that_trickles_ends_a_save_or_a_resume_in_one_line_and_keeps_every_checkpoint(
    bucket, monkeypatch):
  # Cloud Storage's emulator behind a link that starts to trickle (a byte every 0.2 s) after the
  # second save: each request to the bucket has BUCKET_TIMEOUT (here 2 s), so the next save ends
  # the run in seconds, and the checkpoints before it stay, whole.
  link = SlowLink(int(bucket['STORAGE_EMULATOR_HOST'].rsplit(':', 1)[1]))
  slow = {**bucket, 'STORAGE_EMULATOR_HOST': f'http://127.0.0.1:{link.port}'}
  args = ['--fake_data', '--model', 'resnet18', '--img_dim', 16, '--batch_size', 4,
          '--test_set_batch_size', 4, '--num_steps', 6, '--log_steps', 1, '--num_epochs', 1,
          '--ckpt_dir', 'gs://data/run1', '--ckpt_every_steps', 2]
  process = start_script(SCRIPT, *args, env=script_env(BUCKET_TIMEOUT='2', **slow))
  out = wait_for(process, r'^Saved checkpoint gs://data/run1/ckpt-00000004\.pt$')
  link.trickle = True
  code, rest = finish(process)
  # (The save lists the folder first: that request is the one that misses its deadline.)
  assert_one_error((code, out + rest), 2, r'^error: cannot list --ckpt_dir gs://data/run1: a '
                   r'request to the bucket took over 2 s; check the network, then run the same '
                   r'command again$')
  assert_nothing_left(session=process.pid)
  # The same command, its resume's download of the newest checkpoint trickling: one line, not
  # a checkpoint taken for corrupt (then the older one, or none, trained from, and the newer
  # ones removed by its first save).
  link = SlowLink(link.target, when=b'ckpt-00000004')
  stalled = {**bucket, 'STORAGE_EMULATOR_HOST': f'http://127.0.0.1:{link.port}'}
  result = run_script(SCRIPT, *args[:-4], '--num_epochs', 2, *args[-4:],
                      env=script_env(BUCKET_TIMEOUT='2', **stalled), timeout=300)
  assert_one_error(result, 2, r'^error: cannot read checkpoint gs://data/run1/ckpt-00000004\.pt: '
                   r'a request to the bucket took over 2 s; check the network, then run the same '
                   r'command again$')
  assert 'warning' not in result.stderr and 'Resumed' not in result.stdout, result.stderr
  for name, value in bucket.items():  # Straight to the emulator.
    monkeypatch.setenv(name, value)
  fs = fsspec.filesystem('gs', skip_instance_cache=True)
  assert fs.ls('data/run1', refresh=True) == ['data/run1/ckpt-00000002.pt',
                                               'data/run1/ckpt-00000004.pt']
  assert utils.load_checkpoint('gs://data/run1/ckpt-00000004.pt')['global_step'] == 4
  fsspec.filesystem('gs').clear_instance_cache()
  monkeypatch.setenv('STORAGE_EMULATOR_HOST', slow['STORAGE_EMULATOR_HOST'])
  # An upload and a download have the same limit, through the trickle.
  monkeypatch.setenv('STORAGE_EMULATOR_HOST', slow['STORAGE_EMULATOR_HOST'])
  monkeypatch.setattr(utils, 'BUCKET_SECONDS', 1)
  fsspec.filesystem('gs').clear_instance_cache()
  with pytest.raises(asyncio.TimeoutError):
    utils.write_atomically(b'1' * 1000, 'gs://data/run1/ckpt-00000004.pt')
  with pytest.raises(utils.BucketTimeout, match=r'^cannot read checkpoint gs://data/run1/'
                     r'ckpt-00000002\.pt: a request to the bucket took over 1 s; '):
    utils.load_checkpoint('gs://data/run1/ckpt-00000002.pt')
  fsspec.filesystem('gs').clear_instance_cache()


def memory_checkpoint(path, step, data=None):
  """Writes a checkpoint of global step `step` (or the bytes `data`) at memory://path."""
  if data is None:
    state = dict(model={'w': torch.full((2,), float(step))}, optimizer={}, lr_scheduler=None,
                 epoch=1, step=step, global_step=step, rng={}, flags={}, results={})
    torch.save(state, buffer := io.BytesIO())
    data = buffer.getvalue()
  fsspec.filesystem('memory').pipe(f'/{path}/ckpt-{step:08d}.pt', data)


def test_a_resume_never_removes_a_newer_checkpoint_nor_starts_over_from_unreadable_ones(capsys):
  # fsspec's memory file system stands for a bucket: the same calls as gs://.
  fs = fsspec.filesystem('memory')
  for step in (4, 8):
    memory_checkpoint('resume/run1', step)
  memory_checkpoint('resume/run1', 12, data=b'PK\x03\x04 not the rest of a zip archive')
  path, state = utils.find_checkpoint(None, 'memory://resume/run1')
  assert path.endswith('ckpt-00000008.pt') and state['global_step'] == 8
  assert re.fullmatch(r'warning: checkpoint memory://resume/run1/ckpt-00000012\.pt cannot be '
                      r'read: it is not a whole, readable checkpoint file \(.*\); trying the '
                      r'previous one\n', capsys.readouterr().err)
  # Its saves (keep 2) remove the older ones, not the newer one it passed over.
  for step in (10, 11):
    utils.write_checkpoint({**state, 'step': step, 'global_step': step}, 'memory://resume/run1',
                           keep=2, best=False)
  assert [p.rsplit('/', 1)[1] for p in sorted(fs.ls('/resume/run1', detail=False))] == [
      'ckpt-00000010.pt', 'ckpt-00000011.pt', 'ckpt-00000012.pt']
  # --resume of an older one while a newer one is there: one line, before anything is written.
  with pytest.raises(utils.UsageError, match=r'^--ckpt_dir memory://resume/run1 holds '
                     r'ckpt-00000011\.pt, newer than --resume memory://resume/run1/'
                     r'ckpt-00000010\.pt \(step 10\): a run never removes a newer checkpoint'):
    utils.find_checkpoint('memory://resume/run1/ckpt-00000010.pt', 'memory://resume/run1')
  # None readable: one line, not a run from step 0 whose saves would replace them.
  memory_checkpoint('resume/run2', 3, data=b'')
  memory_checkpoint('resume/run2', 6, data=np.random.default_rng(3).bytes(4096))
  with pytest.raises(utils.UsageError, match=r'^none of the 2 checkpoints in --ckpt_dir '
                     r'memory://resume/run2 can be read \(see the warnings above\): move them out '
                     r'of it to start over, or give another --ckpt_dir$'):
    utils.find_checkpoint(None, 'memory://resume/run2')
  assert len(capsys.readouterr().err.splitlines()) == 2
