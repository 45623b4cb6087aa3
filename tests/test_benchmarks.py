# SPDX-License-Identifier: BSD-3-Clause
"""The benchmarks keep working (their numbers are read by people, not asserted)."""

import re
import subprocess
import sys

from conftest import REPO, script_env


def test_benchmark_prints_its_tables_row_by_row():
  # Its progress lines (stderr) and table rows (stdout) in the order they were written.
  result = subprocess.run([sys.executable, 'benchmarks/training.py', '--quick'], cwd=REPO,
                          env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=900)
  out = result.stdout
  assert result.returncode == 0, out[-3000:]
  scripts = re.findall(r'^\| (\S+) \| [^|]+ \| [\d,.]+ \| [\d.]+% \| \d+ \| (\d+) \|$', out, re.M)
  # --quick leaves out the rows whose launch another row runs (single core and SPMD: one
  # process, as the precision rows' runs).
  assert [s for s, _ in scripts] == ['train_resnet_mp.py', 'train_wds_cifar.py'], out
  # Each row is printed when its run ends, before the next run starts: a reader sees the
  # table grow instead of minutes of silence.
  order = re.findall(r'^(?:\[[\d:]+\] running (\S+) on|\| (train_\S+) \|)', out, re.M)
  assert order == [('train_resnet_mp.py', ''), ('', 'train_resnet_mp.py'),
                   ('train_wds_cifar.py', ''), ('', 'train_wds_cifar.py')], out
  # What the checkpoint measurement prints itself stays out of the tables.
  assert 'Resumed from' not in out and 'Saved checkpoint' not in out, out
  assert re.search(r'^\| eager PyTorch, CPU \| fake \| [\d,.]+ \| \| \| \|$', out, re.M)
  precisions = re.findall(r'^\| ([\w-]+) \| [\d,.]+ \| [\d.]+% \| \d+ \| [\d,]+ MB \|$', out, re.M)
  assert precisions == ['float32'], out  # --quick: one row (all three without it)
  assert re.search(r'^\| resnet18 \+ momentum, size \| [\d,]+ MB \|$', out, re.M)  # 50 if not quick
  assert re.search(r'resumed at epoch 2 step 1: start to first new step \| [\d.]+ s \|$', out, re.M)
  # train_resnet_spmd.py's checkpoint on 4 devices: one file against its shards.
  sharded = re.findall(r'^\| (one file|shards, --sharding \w+) \| [\d,]+ MB \| [\d.]+ s \| [\d.]+ s \|$',
                       out, re.M)
  assert sharded == ['one file', 'shards, --sharding batch', 'shards, --sharding fsdp'], out
  # --gradient_accumulation_steps (--quick: one row): the process's peak memory, its graphs
  # (here 5 without accumulation: 6 with 2 batches a step, 7 with 3 or more).
  accumulated = re.findall(r'^\| ([\w ]+) \| [\d,.]+ \| ([\d,]+) MB \| (\d+) \|$', out, re.M)
  assert [name for name, _, _ in accumulated] == ['2 accumulated batches of 2'], out
  assert int(accumulated[0][1].replace(',', '')) > 100 and int(accumulated[0][2]) <= 7, out
  # input_pipeline.py's loader start: a replica's workers by each start method (issue 68).
  starts = re.findall(r'^\| (spawn|forkserver|fork) \| [^|]+ \| [\d.]+ \| [\d.]+ \| ([\d,]+) \| '
                      r'[\d,]+ \| [\d,]+ \|$', out, re.M)
  assert [method for method, _ in starts] == ['spawn', 'forkserver', 'fork'], out
  assert all(int(private.replace(',', '')) > 0 for _, private in starts), out
  decoders = re.findall(r'^\| (\w+) \| [\d.]+ \| [\d,]+ \|$', out, re.M)
  assert decoders == ['rgb', 'ppm', 'png', 'jpg', 'webp', 'npy'], out
  # The photos: upstream's pipeline sends float32 batches, ours uint8 (a quarter).
  photos = re.findall(r'^\| (upstream|ours)[^|]* \| (\d) \| [\d,]+ \| [\d,]+ \| [\d.]+x \| '
                      r'([\d.]+) MB \|$', out, re.M)
  assert photos == [(p, w, b) for w in '02' for p, b in (('upstream', '77.1'), ('ours', '19.3'))], out
  pipeline = re.findall(r'^\| ([^|]+) \| (\d) \| [\d,]+ \| [\d,]+ \| [\d.]+x \|$', out, re.M)
  sources = ['ImageFolder, loose PNG files', 'shards, rgb', 'shards, png', 'shards, ppm (tutorial)']
  assert pipeline == [(s, w) for w in '02' for s in sources], out
  # The photos from files and shards, held to the ceiling of decoding and cropping them, and
  # where a photo's time goes (issue 48's profile).
  assert re.search(r'^\| ceiling: decode, crop and flip of the bytes in memory \| \| 0 \| [\d,]+ \| '
                   r'[\d,]+ \| [\d.]+x \| \| \| \|$', out, re.M), out
  steps = re.findall(r'^\| ([^|]+?) \| (?:warm|cold|) \| [\d,]+ \|$', out, re.M)
  assert {'B: of which parsing the tar, in memory (train_wds_cifar.TarFiles)',
          'seed the sample (utils.seeded)', 'decode (utils.decode_image)',
          'crop and flip (RandomResizedCrop to 224)', 'ceiling: decode, crop and flip',
          "collate in a loader worker and send it to the loader's process"} <= set(steps), out


def test_decoder_benchmark_prints_a_row_for_each_sharding():
  result = subprocess.run([sys.executable, 'benchmarks/decoder.py', '--quick'], cwd=REPO,
                          env=script_env(), capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  rows = re.findall(r'^\| train_decoder_spmd\.py --sharding (\w+) \| ([\d,]+) \| ([\d.,]+) \| '
                    r'(\d+) \| [\d.]+ \| [\d.]+ \|$', result.stdout, re.M)
  assert [mode for mode, *_ in rows] == ['batch', 'fsdp'], result.stdout
  # Both modes: the same model FLOPs a step, and the same graphs compiled.
  assert rows[0][2] == rows[1][2] and float(rows[0][2]) > 0, rows
  assert rows[0][3] == rows[1][3], rows


def test_suite_time_counts_each_tests_processes_by_kind_and_file(tmp_path):
  # Two tests, one at a time: a bad input to train_single_core.py (its process imports
  # torch_xla, then says the line; a path in its command holds 'pytest') and launch_pod.py on a
  # worker of the tests' sshd. The tables again from the samples it saved: the same.
  samples = tmp_path / 'run.json'
  result = subprocess.run([sys.executable, 'benchmarks/suite_time.py', '--calibration_runs', '1',
                           '--slowest', '2', '--samples', samples, '--',
                           'tests/test_single_core.py::test_bad_input_is_one_clear_line_and_exit_2'
                           '[unwritable logdir]', 'tests/test_launch_pod.py::test_a_missing_workdir_'
                           'names_the_worker_and_the_folder', '-n', '0'], cwd=REPO,
                          env=script_env(), capture_output=True, text=True, timeout=300)
  out = result.stdout
  assert result.returncode == 0, out + result.stderr[-3000:]
  again = subprocess.run([sys.executable, 'benchmarks/suite_time.py', '--slowest', '2',
                          '--from_samples', samples], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
  assert again.returncode == 0 and again.stdout == out, again.stdout + again.stderr
  assert re.search(r'^pytest: 2 passed in ', out, re.M), out
  imports = float(re.search(r'^\| `import torch_xla` \(calibration, least of 1\) \| ([\d.]+) '
                            r'CPU-s \|$', out, re.M)[1])
  assert imports > 1, out  # torch and torch_xla: seconds, on any machine.
  # The training script's one process imported torch_xla: counted so, in its test and file.
  assert re.search(r'^\| train_single_core\.py, (about|more than) an import of torch_xla \| 1 \| '
                   r'\d+ \| 1 \|$', out, re.M), out
  assert re.search(r'^\| tests/test_single_core\.py \| [\d.]+ \| \d+ \| \d+ \| 1 \|$', out, re.M), out
  assert re.search(r'^\| tests/test_single_core\.py::test_bad_input_is_one_clear_line_and_exit_2'
                   r'\[unwritable logdir\] \| [\d.]+ \| \d+ \| \d+ \| 1 \|$', out, re.M), out
  # The other test's processes end within a second: not asserted (a sample may miss them).
  assert re.search(r'^\| tests/test_launch_pod\.py::test_a_missing_workdir_names_the_worker_and_'
                   r'the_folder \| [\d.]+ \| \d+ \| \d+ \| 0 \|$', out, re.M), out
