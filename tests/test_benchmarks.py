"""The benchmarks keep working (their numbers are read by people, not asserted)."""

import re

from conftest import run_script


def test_benchmark_prints_its_tables():
  result = run_script('benchmarks/training.py', '--quick', timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  scripts = re.findall(r'^\| (\S+) \| [^|]+ \| [\d,.]+ \| [\d.]+% \| \d+ \| (\d+) \|$', out, re.M)
  # --quick leaves out the rows whose loop another row runs (single core: the mp script's).
  assert [s for s, _ in scripts] == ['train_resnet_mp.py', 'train_resnet_spmd.py',
                                     'train_wds_cifar.py']
  assert re.search(r'^\| eager PyTorch, CPU \| fake \| [\d,.]+ \| \| \| \|$', out, re.M)
  assert re.search(r'^\| resnet18 \+ momentum, size \| [\d,]+ MB \|$', out, re.M)  # 50 if not quick
  assert re.search(r'resumed at epoch 2 step 1: start to first new step \| [\d.]+ s \|$', out, re.M)
  decoders = re.findall(r'^\| (\w+) \| [\d.]+ \| [\d,]+ \|$', out, re.M)
  assert decoders == ['rgb', 'ppm', 'png', 'jpg', 'webp', 'npy'], out
  pipeline = re.findall(r'^\| ([^|]+) \| (\d) \| [\d,]+ \| [\d,]+ \| [\d.]+x \|$', out, re.M)
  sources = ['ImageFolder, loose PNG files', 'shards, rgb', 'shards, png', 'shards, ppm (tutorial)']
  assert pipeline == [(s, w) for w in '02' for s in sources], out
