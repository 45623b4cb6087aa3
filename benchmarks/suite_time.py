# SPDX-License-Identifier: BSD-3-Clause
"""Where the test suite's time goes. Runs pytest (the README's command, or the tests given after
--) while it reads every 0.25 s the CPU time of each process that pytest starts (/proc), then
prints: the wall time and how busy the cores were; what one process pays to import torch_xla
on this machine that day (the calibration: a machine's pace changed by 14% overnight, and the
suite's time with it); the CPU seconds by kind of process, by test file and for the slowest
tests. The pod tests' workers, started by their sshd, are counted apart (no test can be told
from them); a process that ends within 0.25 s may be missed.

  python benchmarks/suite_time.py                                     # the suite: ~35 minutes
  python benchmarks/suite_time.py -- tests/test_resnet_mp.py -n 0     # a part of it
  python benchmarks/suite_time.py --samples run.json   # then --from_samples run.json: again
"""

import collections
import json
import os
import pathlib
import re
import resource
import subprocess
import sys
import threading
import time

from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parents[1]
HZ = os.sysconf('SC_CLK_TCK')
FLAGS = flags.FLAGS
flags.DEFINE_integer('calibration_runs', 3, 'Imports of torch_xla timed before the suite (the '
                     'least is kept).', lower_bound=1)
flags.DEFINE_integer('slowest', 15, 'Tests listed by their time.', lower_bound=0)
flags.DEFINE_string('samples', None, "Also write what the run took (each process's test, "
                    'command line and CPU-s; each test\'s seconds) to this JSON file.')
flags.DEFINE_string('from_samples', None, 'Print the tables of a --samples file; run nothing.')


def cpu_seconds(command, env):
  """CPU seconds (user and system) of a command run to its end, and its children's."""
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def machine_cpu():
  """(busy, idle, steal) jiffies of all cores since boot (/proc/stat)."""
  user, nice, system, idle, iowait, irq, softirq, steal = map(
      int, open('/proc/stat').readline().split()[1:9])
  return user + nice + system + irq + softirq, idle + iowait, steal


class Processes:
  """Every descendant of one process, sampled until stop(): {pid:start: its parent's key, the
  test it ran for (pytest's PYTEST_CURRENT_TEST in its environment), its command line and
  CPU seconds when last seen}."""

  def __init__(self, root):
    self.seen, self.keys = {}, {}  # keys: {pid: the key of the process it is now}
    self.stopped = threading.Event()
    self._sample(root, force=True)
    self.thread = threading.Thread(target=self._poll, daemon=True)
    self.thread.start()

  def _sample(self, pid, force=False):
    stat = open(f'/proc/{pid}/stat').read()
    fields = stat[stat.rfind(')') + 2:].split()
    key, parent = f'{pid}:{fields[19]}', self.keys.get(int(fields[1]))
    if key not in self.seen:
      if not (force or parent):  # Not pytest's (a pid once pytest's, used again: not either).
        return
      env = open(f'/proc/{pid}/environ', 'rb').read().split(b'\0')
      test = next((e.split(b'=', 1)[1].decode(errors='replace').rsplit(' (', 1)[0] for e in env
                   if e.startswith(b'PYTEST_CURRENT_TEST=')), None)
      self.seen[key] = dict(parent=parent, test=test, command='', cpu=0.0)
      self.keys[pid] = key
    process = self.seen[key]
    process['cpu'] = (int(fields[11]) + int(fields[12])) / HZ
    command = open(f'/proc/{pid}/cmdline', 'rb').read().replace(b'\0', b' ').decode(errors='replace')
    process['command'] = command.strip() or process['command']

  def _poll(self):
    while not self.stopped.wait(0.25):
      for name in os.listdir('/proc'):
        try:
          if name.isdigit():
            self._sample(int(name))
        except (OSError, IndexError, ValueError):  # Gone as it was read.
          continue

  def stop(self):
    self.stopped.set()
    self.thread.join()

  def test_of(self, key):  # Its own marker, or its nearest ancestor's.
    while key and not self.seen[key]['test']:
      if re.match(r'(\S*/)?sshd\b', self.seen[key]['command']):  # Its sessions: any test's.
        return "(the pod tests' workers, started by their sshd)"
      key = self.seen[key]['parent']
    return self.seen[key]['test'] if key else None


def kind(command, cpu, imports):
  """What a process was, from its command line and CPU time."""
  words = command.split()
  if 'multiprocessing.spawn' in command:
    return 'a replica or loader worker started by spawn'
  if 'multiprocessing.forkserver' in command:
    return 'a fork server and the loader workers it forked'
  if words[1:3] == ['-m', 'pytest'] or 'import sys;exec(eval(' in command:  # xdist's workers
    return "pytest and its workers (the tests that run in pytest's process)"
  script = re.search(r'\b(\w+)\.py\b', ' '.join(words[:2]))
  if words and 'python' in os.path.basename(words[0]) and script:
    size = ('less than' if cpu < 0.6 * imports else 'about' if cpu < 1.5 * imports else
            'more than')  # About: a bad input said, or a launcher that waits on its replicas.
    return f'{script[1]}.py, {size} an import of torch_xla'
  return 'other (' + (os.path.basename(words[0]) if words else '?') + ')'


def durations(output):
  """{test: its seconds, setup and teardown included} from pytest's --durations=0 lines."""
  seconds = collections.Counter()
  for m in re.finditer(r'^([\d.]+)s (?:call|setup|teardown) +(\S.*)$', output, re.M):
    seconds[m[2]] += float(m[1])
  return seconds


def totals(rows, group):
  """[group, processes, CPU-s, processes that imported torch_xla] of each group of rows, the
  most CPU-s first."""
  sums = collections.defaultdict(lambda: [0, 0.0, 0])
  for row in rows:
    total = sums[group(row)]
    total[0], total[1], total[2] = total[0] + 1, total[1] + row[2], total[2] + row[3]
  return [[name, n, f'{cpu:,.0f}', h] for name, (n, cpu, h) in
          sorted(sums.items(), key=lambda item: -item[1][1])]


def table(header, rows):
  print('| ' + ' | '.join(header) + ' |\n|' + '---|' * len(header))
  for row in rows:
    print('| ' + ' | '.join(str(cell) for cell in row) + ' |')
  print()


def run_suite(pytest_args):
  """What a run of pytest took: a dict of plain values (see report)."""
  env = dict(os.environ, PJRT_DEVICE=os.environ.get('PJRT_DEVICE', 'CPU'))
  env.pop('PYTEST_CURRENT_TEST', None)  # Run from a test: the tests' own markers, not its.
  imports = min(cpu_seconds([sys.executable, '-c', 'import torch_xla'], env)
                for _ in range(FLAGS.calibration_runs))
  command = [sys.executable, '-m', 'pytest', *(pytest_args or ['tests']), '--durations=0']
  print(f'[{time.strftime("%H:%M:%S")}] {" ".join(command[1:])}', file=sys.stderr, flush=True)
  start, machine = time.time(), machine_cpu()
  pytest = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
  processes, lines = Processes(pytest.pid), []
  for line in pytest.stdout:
    sys.stderr.write(line)
    lines.append(line)
  code = pytest.wait()
  processes.stop()
  busy, idle, steal = ((now - then) / HZ for now, then in zip(machine_cpu(), machine))
  return dict(
      summary=next((line.strip('= \n') for line in reversed(lines) if line.startswith('=')), ''),
      code=code, minutes=(time.time() - start) / 60, busy=busy, idle=idle, steal=steal,
      cores=os.cpu_count(), imports=imports, calibration_runs=FLAGS.calibration_runs,
      seconds=durations(''.join(lines)),
      processes=[(processes.test_of(key), p['command'], p['cpu'])
                 for key, p in processes.seen.items()])


def report(run):
  imports, seconds = run['imports'], collections.Counter(run['seconds'])
  print(f"pytest: {run['summary']} (exit code {run['code']}), {run['minutes']:.1f} minutes; the "
        f"tests' own times add up to {sum(seconds.values()):,.0f} s\n")
  table(['the machine', ''], [
      ['cores', run['cores']],
      ['busy (all processes, /proc/stat)',
       f"{run['busy']:,.0f} CPU-s, {run['busy'] / (run['busy'] + run['idle']):.1%}"],
      ['stolen by the host', f"{run['steal']:,.0f} s"],
      ["pytest's processes (counted below)", f"{sum(p[2] for p in run['processes']):,.0f} CPU-s"],
      [f"`import torch_xla` (calibration, least of {run['calibration_runs']})",
       f'{imports:.2f} CPU-s']])
  rows = []  # (test, kind, CPU-s, whether it imported torch_xla) of each process
  for test, command, cpu in run['processes']:
    name = kind(command, cpu, imports)
    rows.append((test or '(none: pytest, or an environment made at import)', name, cpu,
                 cpu >= 0.6 * imports and not name.startswith('pytest')))
  heavy = sum(row[3] for row in rows)
  table(['kind of process', 'processes', 'CPU-s', 'of them imported torch_xla'],
        totals(rows, lambda row: row[1]))
  print(f'Processes that imported torch_xla: {heavy}, about {heavy * imports:,.0f} CPU-s at '
        f"{imports:.2f} each, {heavy * imports / max(run['busy'], 1):.0%} of the cores' busy "
        f'time (a process counts if its CPU-s reached {0.6 * imports:.1f}; pytest\'s own do '
        'not).\n')
  files = collections.Counter()
  for test, taken in seconds.items():
    files[test.split('::')[0]] += taken
  table(['test file', "tests' seconds", 'processes', 'CPU-s', 'of them imported torch_xla'],
        [[name, f'{files[name]:,.0f}', *rest] for name, *rest in
         sorted(totals(rows, lambda row: row[0].split('::')[0]), key=lambda r: -files[r[0]])])
  by_test = {name: rest for name, *rest in totals(rows, lambda row: row[0])}
  table(['slowest tests', 'seconds', 'processes', 'CPU-s', 'of them imported torch_xla'],
        [[test, f'{taken:,.1f}', *by_test.get(test, (0, 0, 0))]
         for test, taken in seconds.most_common(FLAGS.slowest)])


def main(argv):
  if FLAGS.from_samples:
    run = json.loads(pathlib.Path(FLAGS.from_samples).read_text())
  else:
    run = run_suite(argv[1:])
    if FLAGS.samples:
      pathlib.Path(FLAGS.samples).write_text(json.dumps(run))
  report(run)
  sys.exit(run['code'])


if __name__ == '__main__':
  app.run(main)
