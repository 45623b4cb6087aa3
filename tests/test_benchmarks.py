"""The benchmarks keep working (their numbers are read by people, not asserted)."""

import re

from conftest import run_script


def test_input_pipeline_benchmark_prints_its_table():
  result = run_script('benchmarks/input_pipeline.py', '--quick', timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  rows = re.findall(r'^\| (\d+) \| [\d,]+ \| [\d,]+ \| [\d,]+ \| [\d,]+ \| [\d.]+x \|$',
                    result.stdout, re.M)
  assert rows == ['0', '2']
