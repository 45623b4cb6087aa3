# SPDX-License-Identifier: BSD-3-Clause
"""Upstream's commands here: --ddp, the evaluation schedule, a profile captured at a step,
gradient accumulation and --use_optimized_kwargs in a copier's project (docs/adapt.md's small
CNN, which has no BatchNorm), and every flag of docs/scripts.md's table "From upstream's
scripts" on the script it names."""

import re
import subprocess
import sys
import textwrap

import pytest

from conftest import (REPO, assert_same_training, both, read_json, script_env)
from test_copy import small_cnn_project

# The steps' losses of a batch of 8 and of two accumulated batches of 4 differ by float rounding
# alone (a mean of 8 against a mean of two means of 4): measured 1.1e-7 of the loss at most.
ACCUMULATION_TOLERANCE = 1e-4


def train(project, tmp_path, name, *flags):
  """The project's train_resnet_mp.py with the small CNN, 3 epochs of 2 steps, every step
  logged, in one process (--num_cores 1: the replica's code, with no spawn to pay for; --ddp's
  process group is one of world size 1 either way); returns (its output, its results)."""
  argv = ['train_resnet_mp.py', '--model', 'smallcnn', '--lr', '0.02', '--num_epochs', '3',
          '--num_steps', '2', '--log_steps', '1', '--num_workers', '0', '--num_cores', '1',
          '--results_json', tmp_path / f'{name}.json', *map(str, flags)]
  run = subprocess.run([sys.executable, *map(str, argv)], cwd=project, env=script_env(),
                       capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  return run.stdout, read_json(tmp_path / f'{name}.json')


def test_ddp_accumulation_eval_interval_and_a_profile_train_as_upstreams_commands_say(tmp_path):
  project = tmp_path / 'project'
  small_cnn_project(project)
  # Upstream's plain command: a batch of 8, every step, xm.optimizer_step.
  plain, plain_results = train(project, tmp_path, 'plain', '--batch_size', 8, '--eval_interval', 2)
  # --ddp and two accumulated batches of 4 for each step, a checkpoint after every step.
  ckpt = tmp_path / 'ddp'
  ddp, ddp_results = train(project, tmp_path, 'ddp', '--batch_size', 4,
                           '--gradient_accumulation_steps', 2, '--ddp', '--eval_interval', 2,
                           '--ckpt_dir', ckpt, '--ckpt_every_steps', 1, '--keep_checkpoints', 9)
  losses = [entry['loss'] for entry in plain_results['history']]
  assert len(losses) == 6
  accumulated = [entry['loss'] for entry in ddp_results['history']]
  assert accumulated == pytest.approx(losses, rel=ACCUMULATION_TOLERANCE), (accumulated, losses)
  assert losses[-1] < losses[0] - 0.01  # It learns (the CNN at lr 0.02 moves slowly).
  # Steps count optimizer steps; only epochs 2 and 3 (the last) were evaluated.
  for results in (plain_results, ddp_results):
    assert results['train_steps'] == 6 and results['train_samples'] == 48
    assert results['epochs'] == 3 and results['eval_epochs'] == [2, 3]
    assert len(results['epoch_accuracies']) == 2
    assert results['final_accuracy'] == results['epoch_accuracies'][-1]
  assert len(re.findall(r'^Epoch \d test end', ddp, re.M)) == 2
  assert 'none after epoch 1' in plain
  # --ddp compiles the step once more at epoch 2 step 0 (one input more: docs/performance.md),
  # said as the late graph it is.
  assert re.search(r'^Graphs compiled: \d+, 1 after epoch 1 ', ddp, re.M), ddp
  assert plain_results['late_graphs'] == 0 and ddp_results['late_graphs'] == 1
  # The same command without --ddp, resumed from the checkpoint after step 3 (epoch 2, step
  # 1), with a profile of step 4 on and upstream's input pipeline preset (one copy thread, the
  # order of batches kept): it ends bitwise where the --ddp run ended, its steps the same, its
  # evaluations at the same epochs, and the trace written.
  traces = tmp_path / 'traces'
  resumed, resumed_results = train(
      project, tmp_path, 'resumed', '--batch_size', 4, '--gradient_accumulation_steps', 2,
      '--eval_interval', 2, '--ckpt_dir', tmp_path / 'resumed',
      '--resume', ckpt / 'ckpt-00000003.pt', '--profile_step', 4, '--profile_duration_ms', 500,
      '--profile_logdir', traces, '--use_optimized_kwargs', 'tpuv4',
      '--host_to_device_transfer_threads', 1)
  assert ('--use_optimized_kwargs tpuv4 sets --test_set_batch_size 128 --persistent_workers True '
          '--prefetch_factor 32 --loader_prefetch_size 128 --device_prefetch_size 1\n') in resumed
  assert re.search(r'^Resumed from .*ckpt-00000003.pt at epoch 2 step 1$', resumed, re.M), resumed
  assert_same_training(tmp_path / 'resumed', ckpt)
  steps = [[(entry['global_step'], entry['loss'], entry['lr']) for entry in results['history']]
           for results in (resumed_results, ddp_results)]
  assert steps[0] == steps[1]  # The first 3 restored from the checkpoint, the rest trained.
  assert resumed_results['eval_epochs'] == [2, 3]
  assert resumed_results['epoch_accuracies'] == ddp_results['epoch_accuracies']
  assert list(traces.glob('plugins/profile/*/*.xplane.pb')), list(traces.rglob('*'))


SCRIPTS = ['train_resnet_mp.py', 'train_resnet_spmd.py', 'train_single_core.py',
           'train_wds_cifar.py']


def upstream_table():
  """[(upstream flag, the scripts here that have it, what it is here)] of docs/scripts.md's
  table "From upstream's scripts"."""
  page = (REPO / 'docs' / 'scripts.md').read_text()
  section = page.split("\n## From upstream's scripts", 1)[1].split('\n## ', 1)[0]
  rows = re.findall(r'^\| `--([\w-]+)` \| [^|]+ \| ([^|]+) \| (.+) \|$', section, re.M)
  table = []
  for flag, here, what in rows:
    named = re.findall(r'`(train_\w+\.py)`', here)
    having = ([s for s in SCRIPTS if s not in named] if here.startswith('every script') else named)
    table.append((flag, having, what))
  return table


# Each flag parsed as app.run parses it (utils.parse_flags, with the script's lines for other
# scripts' flags), one process per script: a flag the script has is said as "has". Then the
# script's own command line with one of them (its __main__ block run again, as %run does: its
# own parser, as app.run calls it), said as "command". The process of each script is a fork of
# one that imported, once, the modules every script imports (torch, torch_xla, ...: seconds of
# CPU a process); the script's own module, its flags and its parser are its own.
PARSE_EACH = textwrap.dedent('''
    import contextlib, importlib, io, os, runpy, sys, traceback
    import absl.app, absl.flags, torch, torch_xla, torch_xla.core.xla_model, torchvision
    import torch_xla.distributed.parallel_loader, torch_xla.debug.profiler, torch_xla.runtime
    import torch.utils.tensorboard, supervisor, utils
    given = sys.stdin.read().split()

    def parse_each(path, command):
      answers = os.fdopen(os.dup(1), 'w')  # utils.die sends stdout to /dev/null after its line.
      sys.argv = [path]
      script = importlib.import_module(path[:-3])
      from absl import flags
      elsewhere = {**script.supervisor.UPSTREAM_FLAGS, **getattr(script, 'ELSEWHERE', {})}

      def said(call):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
          try:
            call()
            return 'parsed'
          except SystemExit as e:
            return f'{e.code} ' + err.getvalue().strip().replace(chr(10), ' | ')

      for flag in given:
        answer = 'has' if flag[2:] in flags.FLAGS else said(
            lambda: utils.parse_flags([path, flag], elsewhere))
        print(path, flag, '=>', answer, file=answers)
      sys.argv = [path, *command]
      print(path, 'command =>', said(lambda: runpy.run_path(path, run_name='__main__')),
            file=answers)
      answers.flush()

    failed = 0
    for path, *command in (line.split() for line in sys.argv[1:]):
      sys.stdout.flush()
      sys.stderr.flush()
      pid = os.fork()
      if pid == 0:  # Ends with os._exit: not the parent's exit handlers.
        code = 1
        try:
          parse_each(path, command)
          code = 0
        except BaseException:
          traceback.print_exc()
        finally:
          sys.stderr.flush()
          os._exit(code)
      failed |= os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0
    sys.exit(failed)
''')
# The flags that found absl's guess pointing at an unrelated flag, and others, each through a
# script's own command line.
COMMANDS = {'train_resnet_mp.py': ('--compute_dtype', 'give --amp'),
            'train_resnet_spmd.py': ('--num_cores', "train_resnet_mp.py's and train_wds_cifar.py's"),
            'train_single_core.py': ('--profile_epoch', 'give --profile_step alone'),
            'train_wds_cifar.py': ('--datadir', 'give the shards with --wds_traindir')}


def test_every_upstream_flag_of_the_table_is_this_scripts_or_one_line_naming_what_does_its_job():
  table = upstream_table()
  assert len(table) >= 60, table
  given = ' '.join(f'--{flag}' for flag, _, _ in table)
  wrong = []
  done = subprocess.run([sys.executable, '-c', PARSE_EACH,
                         *(f'{script} {COMMANDS[script][0]} 2 --fake_data' for script in SCRIPTS)],
                        input=given, cwd=REPO, env=script_env(), capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, both(done)
  answers = [line.split(' ', 1) for line in done.stdout.splitlines() if ' => ' in line]
  for script in SCRIPTS:
    said = dict(answer.split(' => ', 1) for name, answer in answers if name == script)
    flag, line = COMMANDS[script]
    command = said.pop('command')
    if not command.startswith(f'2 error: {flag}: {line}') or ' | ' in command:
      wrong.append(f'{script} {flag} 2 --fake_data: {command}')
    for flag, having, what in table:
      answer = said[f'--{flag}']
      if script in having:
        if answer != 'has':
          wrong.append(f'{script} --{flag}: the table says it has it; {answer}')
        continue
      # One line that names the flag and every other flag the table names, never absl's guess.
      named = set(re.findall(r'--[\w-]+', what)) - {f'--{flag}'}
      if (not answer.startswith(f'2 error: --{flag}: ') or 'Did you mean' in answer
          or ' | ' in answer or not all(name in answer for name in named)):
        wrong.append(f'{script} --{flag}: {answer}\n  (the table: {what})')
  assert not wrong, '\n'.join(wrong)
