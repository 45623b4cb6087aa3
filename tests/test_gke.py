# SPDX-License-Identifier: BSD-3-Clause
"""The GKE path of docs/pods.md, checked with the real xpk (no cloud: its own --dry-run writes
the JobSet manifest): the restart policy against our exit codes, the grace period, our
command; and the manifest's container command, run here with bash as the container runs it,
stopped with SIGTERM as the kubelet stops a pod, then started again as the JobSet restarts
it. xpk lives in a venv of its own (its pins clash with ours): .ci/run builds it and names
it in $XPK; without $XPK the fixture builds it."""

import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import yaml

from conftest import REPO, assert_nothing_left, script_env

XPK_VERSION = '1.16.0'
# The exit codes of docs/checkpoints.md: done, a bug, a usage or data error, a run that diverged; and
# the stops: preempted (SIGTERM), Ctrl-C, killed by SIGKILL or SIGTERM before it could save.
NEVER_RESTART = [0, 1, 2, 22]
RESTART = [75, 130, 137, 143]


@pytest.fixture(scope='module')
def xpk():
  if os.environ.get('XPK'):
    return os.environ['XPK']
  venv = pathlib.Path('~/.cache/xla-train-refs').expanduser() / f'xpk-{XPK_VERSION}'
  if not (venv / '.complete').exists():
    subprocess.run([sys.executable, '-m', 'venv', '--clear', venv], check=True)
    subprocess.run([venv / 'bin' / 'python', '-m', 'pip', 'install', '--quiet',
                    f'xpk=={XPK_VERSION}'], check=True)
    (venv / '.complete').touch()
  return str(venv / 'bin' / 'xpk')


def docs_command():
  """The words of the `xpk workload create` command of docs/pods.md."""
  text = (REPO / 'docs' / 'pods.md').read_text()
  block = re.search(r'```\n *(xpk workload create .*?)\n *```', text, re.S).group(1)
  return shlex.split(block.replace('\\\n', ' '))


def manifest_of(xpk, words, tmp_path):
  """The JobSet that `xpk workload create WORDS --dry-run` would apply (placeholders filled,
  as a user fills them), as a dict."""
  fill = {'CLUSTER': 'refs-cluster', 'PROJECT': 'refs-project', 'ZONE': 'us-central2-b',
          'IMAGE': 'us-docker.pkg.dev/refs-project/refs/refs:2.9', 'BUCKET': 'refs-bucket'}
  words = [re.sub(r'\b(' + '|'.join(fill) + r')\b', lambda m: fill[m.group(1)], w) for w in words]
  manifest = tmp_path / 'jobset.yaml'
  # Without its usage report, which xpk posts to play.googleapis.com from a temporary file (as
  # `xpk config set send-telemetry false` turns it off): nothing leaves 127.0.0.1, or is left.
  config = tmp_path / '.config' / 'xpk' / 'config.yaml'
  config.parent.mkdir(parents=True, exist_ok=True)
  config.write_text(yaml.safe_dump({'version': 'v1', 'configs': {'send-telemetry': 'false'}}))
  done = subprocess.run([xpk, *words[1:], '--dry-run', '--output-manifest-file', manifest],
                        env=dict(os.environ, HOME=str(tmp_path), TMPDIR=str(tmp_path)),
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert not list(tmp_path.glob('tmp*')), list(tmp_path.iterdir())  # A report's file
  return yaml.safe_load(manifest.read_text()), words


def flag(words, name):
  return words[words.index(name) + 1]


def test_the_docs_xpk_command_restarts_on_our_stop_codes_only(xpk, tmp_path):
  jobset, words = manifest_of(xpk, docs_command(), tmp_path)
  assert jobset['kind'] == 'JobSet'
  spec = jobset['spec']
  assert spec['failurePolicy']['maxRestarts'] == int(flag(words, '--max-restarts')) >= 1
  job = spec['replicatedJobs'][0]['template']['spec']
  # A pod that ends with a code outside the list fails the JobSet; any other ends its Job,
  # which the JobSet restarts (backoffLimit 0: no restart of the pod alone).
  rule, = job['podFailurePolicy']['rules']
  assert rule['action'] == 'FailJob' and rule['onExitCodes']['operator'] == 'NotIn'
  restarted = set(rule['onExitCodes']['values'])
  assert set(RESTART) <= restarted and not set(NEVER_RESTART) & restarted, restarted
  assert job['backoffLimit'] == 0
  pod = job['template']['spec']
  assert pod['terminationGracePeriodSeconds'] == int(flag(words, '-tgps'))
  container, = pod['containers']
  assert container['image'] == flag(words, '--docker-image')
  assert container['command'][:2] == ['bash', '-c']
  assert f'({flag(words, "--command")})' in container['command'][2]
  # Checkpoints in a bucket (a restarted pod has a new disk), the compile cache kept.
  assert re.search(r'--ckpt_dir gs://\S+', flag(words, '--command'))
  assert '--compile_cache_dir' in flag(words, '--command')

  # More slices: one Job per slice, the same policy.
  words[words.index('--num-slices') + 1] = '2'
  jobset, _ = manifest_of(xpk, words, tmp_path)
  assert jobset['spec']['replicatedJobs'][0]['replicas'] == 2


def test_the_container_command_stops_with_a_checkpoint_and_resumes(xpk, tmp_path):
  # The docs' command with a small CPU run in --command: the manifest's own wrapper runs it.
  words = docs_command()
  small = [sys.executable, 'train_resnet_mp.py', '--fake_data', '--model', 'resnet18',
           '--img_dim', '16', '--batch_size', '4', '--test_set_batch_size', '4',
           '--num_epochs', '2', '--num_steps', '8', '--log_steps', '1',
           '--ckpt_dir', str(tmp_path / 'ckpt'), '--compile_cache_dir', str(tmp_path / 'cache')]
  words[words.index('--command') + 1] = shlex.join(small)
  jobset, words = manifest_of(xpk, words, tmp_path)
  pod = jobset['spec']['replicatedJobs'][0]['template']['spec']['template']['spec']
  command, grace = pod['containers'][0]['command'], pod['terminationGracePeriodSeconds']

  # As the kubelet stops a pod: SIGTERM to the container's first process (the wrapper),
  # SIGKILL to all that is left when the grace period is over. The wrapper passes it on as its
  # `sleep 5` ends, so up to 5 s later: sent as the first step compiles, it lands in the run
  # (measured, alone, at 4 steps an epoch: its first step ended 8.3 s after that line, the run
  # 14 s; 8 an epoch here).
  container = subprocess.Popen(command, cwd=REPO, env=script_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
  lines = []
  for line in container.stdout:
    lines.append(line)
    if line.startswith('Replicas started: 1; compiling the first step'):
      break
  container.send_signal(signal.SIGTERM)
  sent = time.monotonic()
  try:
    code = container.wait(timeout=grace)
  except subprocess.TimeoutExpired:
    os.killpg(container.pid, signal.SIGKILL)
    code = container.wait()
  seconds = time.monotonic() - sent
  out = ''.join(lines) + container.stdout.read()
  print(f'SIGTERM to the wrapper: it exited {code} after {seconds:.1f} s (grace {grace} s)')
  assert code == 75 and 'EXIT_CODE=75' in out, out
  stopped = re.search(r'^Stopped by SIGTERM at epoch \d step \d+: saved (\S+); ', out, re.M)
  assert stopped and os.path.exists(stopped.group(1)), out
  assert_nothing_left(session=container.pid)

  # The JobSet's restart: the same command again resumes and ends the run.
  done = subprocess.run(command, cwd=REPO, env=script_env(), capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0 and 'EXIT_CODE=0' in done.stdout, done.stdout + done.stderr
  assert f'Resumed from {stopped.group(1)} at epoch ' in done.stdout, done.stdout
  assert 'Max Accuracy: 100.00%' in done.stdout
  assert any((tmp_path / 'cache').iterdir())
