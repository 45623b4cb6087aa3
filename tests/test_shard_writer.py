# SPDX-License-Identifier: BSD-3-Clause
"""make_cifar_shards.py as a user meets it: a prefix holding another run's shards, a stop by
SIGTERM, its progress in a log, the training command it prints, run as printed, and a crafted
CIFAR-10 batch file, refused before any of its code runs."""

import codecs
import functools
import os
import pickle
import re
import shlex
import signal
import tarfile

import fsspec
import pytest

import make_cifar_shards
import utils
from conftest import (ONE_PROCESS, assert_one_error, both, finish, make_cifar_python, read_json,
                      run_script, start_script, wait_for)

PROGRESS = re.compile(r'^([\d,]+) of ([\d,]+) samples written \((\d+)%\), [\d,]+ samples/s, '
                      r'(\d+:\d\d:\d\d left|done in \d+:\d\d:\d\d)$')


@pytest.fixture(scope='module')
def small_cifar(tmp_path_factory):
  """The python release's layout with 120 training samples (5 x 24) and 10 test samples."""
  return make_cifar_python(tmp_path_factory.mktemp('small') / 'cifar', per_batch=24, test_count=10)


def contents(folder):
  return {path.name: path.read_bytes() for path in folder.iterdir()}


def test_prefix_holding_another_runs_shards_is_refused_or_overwritten(small_cifar, tmp_path):
  out = tmp_path / 'out'
  out.mkdir()
  for name in ('c-classes.txt', 'c-test-000000.tar', *(f'c-train-{i:06d}.tar' for i in range(12))):
    (out / name).write_bytes(b'an earlier run')  # Its 12 training shards of 10 samples, say.
  (out / 'c-10-train-000000.tar').write_bytes(b'another prefix')  # Not c's: left alone.
  before = contents(out)
  args = ['--cifar_dir', small_cifar, '--output', out / 'c', '--samples_per_shard', 20]  # 6 shards
  refused = run_script('make_cifar_shards.py', *args)
  assert_one_error(refused, 2, rf'^error: --output {re.escape(str(out / "c"))} holds 6 shards that '
                   r'this command would not write, such as c-train-000006\.tar .* give --overwrite '
                   r'to remove the shards and classes file of .* first, or another --output$')
  assert 'Writing' not in refused.stdout and contents(out) == before  # Checked before writing.
  result = run_script('make_cifar_shards.py', *args, '--overwrite')
  assert result.returncode == 0, both(result)
  assert result.stdout.startswith(f'Removed 14 files of an earlier run from {out / "c"}-*\n')
  after = contents(out)
  assert sorted(after) == ['c-10-train-000000.tar', 'c-classes.txt', 'c-test-000000.tar',
                           *(f'c-train-{i:06d}.tar' for i in range(6))]
  assert after['c-10-train-000000.tar'] == b'another prefix' and b'an earlier run' not in (
      after.values())


def test_prefix_at_a_url_the_same_way(capsys):
  fs = fsspec.filesystem('memory')
  for name in ('c-train-000000.tar', 'c-train-000001.tar', 'c-val-000000.tar', 'c-classes.txt',
               'c-train-000002.tar.tmp', 'c-10-train-000000.tar'):  # .tmp: a killed run's.
    fs.pipe_file(f'/url-prefix/{name}', b'x')
  # What the command writes again (the same command after a stop) is no reason to refuse.
  make_cifar_shards.clear_prefix('memory://url-prefix/c', {'train': 2, 'val': 1}, False)
  with pytest.raises(utils.UsageError, match=r'^--output memory://url-prefix/c holds 1 shard that '
                     r'this command would not write, such as c-val-000000\.tar '):
    make_cifar_shards.clear_prefix('memory://url-prefix/c', {'train': 2, 'test': 1}, False)
  make_cifar_shards.clear_prefix('memory://url-prefix/c', {'train': 1, 'test': 1}, True)
  assert capsys.readouterr().out == 'Removed 5 files of an earlier run from memory://url-prefix/c-*\n'
  assert fs.ls('/url-prefix', detail=False) == ['/url-prefix/c-10-train-000000.tar']


def test_sigterm_stops_the_writer_as_ctrl_c_does_and_the_same_command_finishes(tmp_path):
  make_cifar_python(tmp_path / 'cifar', per_batch=500, test_count=10)
  args = ['--cifar_dir', tmp_path / 'cifar', '--output', tmp_path / 'out' / 'c', '--repeat', 20,
          '--samples_per_shard', 50]  # 50,000 samples in 1,000 shards: seconds of writing.
  process = start_script('make_cifar_shards.py', *args)
  wait_for(process, r'^[\d,]+ of 50,010 samples written \(1\d%\)')  # A tenth of the way.
  os.killpg(process.pid, signal.SIGTERM)  # As a VM going down does.
  code, out = finish(process)
  assert_one_error((code, out), 75, '')
  assert out.strip().splitlines()[-1] == (
      'error: stopped by SIGTERM: the shards written are whole (one half-written is removed); run '
      'the same command to write them all'), out
  written = sorted((tmp_path / 'out').iterdir())
  assert 0 < len(written) < 1000 and all(path.suffix == '.tar' for path in written), written
  for path in written:  # Each whole: every member of its 50 samples there.
    with tarfile.open(path) as tar:
      assert len(tar.getmembers()) == 100, path
  result = run_script('make_cifar_shards.py', *args)  # As the line says: not refused.
  assert result.returncode == 0, both(result)
  assert len(list((tmp_path / 'out').glob('c-train-*.tar'))) == 1000


def test_progress_in_a_log_is_plain_lines_and_the_last_lines_stay(small_cifar, tmp_path):
  out = tmp_path / 'out' / 'c'
  result = run_script('make_cifar_shards.py', '--cifar_dir', small_cifar, '--output', out,
                      '--samples_per_shard', 10)  # To a pipe, as a log or a pod's output.
  assert result.returncode == 0, both(result)
  assert '\r' not in result.stderr
  lines = [PROGRESS.match(line) for line in result.stderr.splitlines()]
  assert all(lines), result.stderr
  done = [int(m.group(1)) for m in lines]
  tenths = [int(m.group(3)) // 10 for m in lines]
  assert {int(m.group(2)) for m in lines} == {130}  # 120 training and 10 test samples.
  assert tenths == sorted(set(tenths)) and len(tenths) >= 9, result.stderr  # A line each tenth.
  assert done[-1] == 130 and lines[-1].group(4).startswith('done in '), result.stderr
  assert result.stdout.splitlines() == [
      f'Writing 120 training samples shuffled with --shuffle_seed 0 and 10 test samples, rgb '
      f'images, 10 a shard, to {out}-*',
      f'Classes (4, in {out}-classes.txt): blue green red yellow',
      'Wrote 120 training samples in 12 shards and 10 test samples in 1 shard. Train with:',
      f'  python train_wds_cifar.py --wds_traindir "{out}-train-{{000000..000011}}.tar" --trainsize '
      f'120 --wds_testdir "{out}-test-{{000000..000000}}.tar" --testsize 10 --batch_size 64',
      '(On several devices or hosts: replicas x --num_workers at most the 12 training shards (for '
      'more, write smaller shards with --samples_per_shard); replicas x --batch_size at most the '
      '120 training samples)']


def test_printed_command_trains_on_a_small_set_as_printed(small_cifar, tmp_path):
  result = run_script('make_cifar_shards.py', '--cifar_dir', small_cifar, '--output',
                      tmp_path / 'out' / 'c', '--results_json', tmp_path / 'flags.json')
  assert result.returncode == 0, both(result)
  assert 'Wrote 120 training samples in 1 shard and 10 test samples in 1 shard. Train with:' in (
      result.stdout), result.stdout
  command = shlex.split(re.search(r'^  (python train_wds_cifar\.py .*)$', result.stdout,
                                  re.M).group(1))
  # One shard and 120 samples: the defaults (4 loader workers, a batch of 128) are refused.
  assert command[-4:] == ['--num_workers', '1', '--batch_size', '64'], command
  flags = read_json(tmp_path / 'flags.json')
  assert (flags['num_workers'], flags['batch_size']) == (1, 64)
  # As printed; one epoch (of one step) instead of 30, to be short, and its replica in this
  # process (--num_cores 1: the same replica code, no spawn nor fork server to import torch
  # again; spawned replicas: tests/test_wds_cifar.py's test_stopped_run_ends_bitwise_equal).
  trained = run_script(command[1], *command[2:], '--num_epochs', 1, '--num_cores', 1)
  assert trained.returncode == 0, trained.stdout + trained.stderr
  assert ONE_PROCESS.search(trained.stdout), trained.stdout
  assert re.search(r'^Epoch 1 Replica Train Samples=64 ', trained.stdout, re.M), trained.stdout


class Planted:
  """What a crafted batch file holds: unpickled, it would create the file `path` (harmless
  here, and seen; a real one could run any command)."""

  def __init__(self, path):
    self.path = path

  def __reduce__(self):
    return open, (str(self.path), 'w')


def test_a_crafted_cifar_batch_is_refused_before_any_of_its_code_runs(small_cifar, tmp_path):
  cifar = tmp_path / 'cifar'
  cifar.mkdir()
  for path in small_cifar.iterdir():
    (cifar / path.name).write_bytes(path.read_bytes())
  planted = tmp_path / 'planted'
  with open(cifar / 'data_batch_3', 'wb') as f:
    pickle.dump({b'data': Planted(planted), b'labels': [0]}, f)
  # As --cifar_dir reads it (the writer says a UsageError in one line, exit 2: see
  # tests/test_faults.py's writer mistakes).
  with pytest.raises(utils.UsageError) as refused:
    make_cifar_shards.read_cifar_python(str(cifar))
  assert re.fullmatch(rf'{re.escape(str(cifar / "data_batch_3"))} is not a CIFAR-10 batch \(it '
                      r'holds a \w+\.open, which no CIFAR-10 batch holds\): refused unread, since '
                      r'loading it could run code; download the python release again',
                      str(refused.value)), refused.value
  assert not planted.exists()
  # Bytes encoded as hex in hex in hex ... (each level doubles them; 754 bytes of such a pickle
  # made 256 MiB): refused at the first, as any codec but latin1, the one of pickled bytes.
  with open(cifar / 'data_batch_3', 'wb') as f:
    pickle.dump({b'data': functools.reduce(lambda inner, _: Hex(inner), range(20), b'\x00'),
                 b'labels': [0]}, f, protocol=2)
  with pytest.raises(utils.UsageError, match=r"\(it encodes bytes as 'hex', which no CIFAR-10 "
                     r'batch does\): refused unread'):
    make_cifar_shards.read_cifar_python(str(cifar))


class Hex:
  """Pickles as _codecs.encode(inner, 'hex')."""

  def __init__(self, inner):
    self.inner = inner

  def __reduce__(self):
    return codecs.encode, (self.inner, 'hex')
