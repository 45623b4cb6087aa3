# SPDX-License-Identifier: BSD-3-Clause
"""train_resnet_mp.py end to end on XLA:CPU: the spawn runs for real, with one replica, where it
is the subject; the other runs train in the command's own process (--num_cores 1)."""

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import (ONE_PROCESS, REPO, assert_one_error, assert_same_training, both, finish,
                      losses, read_json, readme_command_flags, run_and_signal, run_script,
                      script_env, seeded_random, start_script, training_losses, write_image)

SCRIPT = 'train_resnet_mp.py'


def test_readme_quick_start_spawns_trains_and_reports(tmp_path):
  flags = readme_command_flags()
  result = run_script(SCRIPT, *flags, '--results_json', tmp_path / 'r.json')
  assert result.returncode == 0, both(result)
  out = result.stdout
  # The replica spawned (the learning run below trains in-process, --num_cores 1).
  assert re.search(r'^Starting one replica per local XLA device \.\.\.\n'
                   r'Replicas started: 1; compiling the first step \.\.\.\n'
                   r'Epoch 1 train begin ', out, re.M), out[:2000]
  num_steps = int(flags[flags.index('--num_steps') + 1])
  batch_size = int(flags[flags.index('--batch_size') + 1])
  assert re.search(rf'^Epoch 1 Replica Train Samples={num_steps * batch_size} Device=xla:0/0$',
                   out, re.M)
  assert re.search(r'^Epoch 1 train end \d\d:\d\d:\d\d, Reduced GlobalRate=\d+\.\d\d$', out, re.M)
  assert re.search(r'^Epoch 1 test end \d\d:\d\d:\d\d, Accuracy=100\.00$', out, re.M)
  assert re.search(r'^Max Accuracy: 100\.00%$', out, re.M)
  assert losses(out)[-1] < losses(out)[0] / 10
  results = read_json(tmp_path / 'r.json')
  counts = results['compilations_after_epoch']
  assert counts[-1] == counts[0]
  # Said, not only in the results: every graph compiled in epoch 1.
  assert re.search(rf'^Graphs compiled: {results["compilations"]}, none after epoch 1$', out, re.M)


def test_learns_with_warmup_and_decay_then_a_diverged_run_goes_on_as_its_line_says(
    tmp_path, colour_folder):
  # 21 val images, one of them a red image filed under green: exactly 20/21 correct.
  write_image(colour_folder / 'val' / 'green' / 'red_one.png', (220, 40, 40), 32,
              np.random.default_rng(3))
  # Warm-up over a quarter epoch and a division after the second: the learning rate
  # changes every step, and still nothing is compiled after epoch 1.
  ckpt_dir = tmp_path / 'ckpt'
  args = ['--datadir', colour_folder, '--model', 'resnet18', '--img_dim', 16, '--batch_size', 16,
          '--test_set_batch_size', 4, '--lr_scheduler_type', 'WarmupAndExponentialDecayScheduler',
          '--lr_warmup_epochs', 0.25, '--lr_scheduler_divide_every_n_epochs', 2, '--num_workers', 64,
          '--persistent_workers', '--log_steps', 5, '--ckpt_dir', ckpt_dir]
  # Every run here in one process, --num_cores 1: what it learns and says is the replica's code
  # alone, with or without a spawn (which the README's run above makes, and tests/test_faults.py's
  # runs with a spawned replica's loader workers: trained, evaluated, stopped, killed). Its
  # loader workers are then plain forks.
  args += ['--num_cores', 1]
  result = run_script(SCRIPT, *args, '--num_epochs', 3, '--lr', 0.03,
                      '--results_json', tmp_path / 'r.json')
  assert result.returncode == 0, both(result)
  # Its first lines, before the slow part: what it trains, then that its replica started. 64
  # loader workers are lowered to the CPUs it may use, before torch would warn.
  cpus = len(os.sched_getaffinity(0))
  assert re.match(
      rf'--num_workers 64 is more than the {cpus} CPUs this process may use: using {cpus}\n'
      r'Data: 256 training and 21 evaluation samples of 3x16x16 uint8, 4 classes\n'
      r'Model: resnet18 \(ResNet, 11\.18M parameters, 4 classes\)\n'
      r'Recipe: SGD, lr 0\.03 linear warm-up over 0\.25 epochs, then divided by 5 every 2 epochs, '
      r"momentum 0\.9, weight decay 0\.0001 \(--lr and --lr_scheduler_type as given, the rest the "
      r"flags' defaults\); float32 mat-mul precision default\n"
      r'Starting one replica \(--num_cores 1\) \.\.\.\n'
      r'Replicas started: 1; compiling the first step \.\.\.\n'
      r'Epoch 1 train begin', result.stdout), result.stdout[:2000]
  assert 'This DataLoader will create' not in result.stderr, result.stderr  # torch's warning
  results = read_json(tmp_path / 'r.json')
  assert (results['eval_correct'], results['eval_samples']) == (20, 21)
  assert re.search(r'^Epoch 3 test end \d\d:\d\d:\d\d, Accuracy=95\.24$', result.stdout, re.M)
  assert results['train_steps'] == 48
  assert re.findall(r'Replica Train Samples=(\d+)', result.stdout) == ['256'] * 3
  counts = results['compilations_after_epoch']
  assert counts[0] == counts[1] == counts[2]

  # A fourth epoch at an absurd --lr: the weights run away at once. Before, a checkpoint
  # could hold them (the loss still finite), and a resume with a lower --lr kept the saved
  # one: every run after diverged. The line names the checkpoint to go on from.
  saved = ckpt_dir / 'ckpt-00000048.pt'
  args += ['--num_workers', 0]  # Two runs more: no loader workers to start.
  code, out = finish(start_script(SCRIPT, *args, '--num_epochs', 4, '--lr', 1e6,
                                  '--results_json', tmp_path / 'diverged.json'))
  assert_one_error((code, out), 22, r'^error: the (weights|loss) \S+ \S+ at epoch 4 step \d+.*: '
                   r'training diverged; lower --lr \(it is 1e\+06\) and run again: the same '
                   rf'command resumes from {re.escape(str(saved))} with the new --lr')
  # The error is the last line, after the step lines logged (that of the step it names).
  step = int(re.search(r'epoch 4 step (\d+)', read_json(tmp_path / 'diverged.json')['diverged'])[1])
  assert out.strip().splitlines()[-1].startswith('error: '), out
  assert re.search(rf'^\| Training .* Epoch=4 Step={step} ', out, re.M), out
  assert 'Total train time' not in out, out
  assert not (ckpt_dir / 'ckpt-00000049.pt').exists() and saved.exists()  # Nothing saved.
  # Doing what it says: the lower --lr applies (scaled where the schedule is), and it learns.
  # With --metrics_debug: a run of its own once, now a process fewer. (Under torchrun:
  # tests/test_copy.py, with and without supervisor.py, signals included.)
  lower = run_script(SCRIPT, *args, '--num_epochs', 4, '--lr', 0.003,
                     '--metrics_debug', '--results_json', tmp_path / 'lower.json')
  assert lower.returncode == 0, both(lower)
  assert ONE_PROCESS.search(lower.stdout), \
      lower.stdout
  assert re.search(r'^Metric: CompileTime$', lower.stdout, re.M)  # torch_xla's report
  assert re.search(rf'^Resumed from {re.escape(str(saved))} at epoch 4 step 0, with --lr 0\.003 '
                   r"\(the checkpoint's run had 0\.03\)$", lower.stdout, re.M), lower.stdout
  assert re.search(r'^Epoch 4 test end \d\d:\d\d:\d\d, Accuracy=95\.24$', lower.stdout, re.M)
  assert len(losses(lower.stdout)) == 4  # Steps 0, 5, 10 and 15 of epoch 4 (--log_steps 5).
  assert read_json(tmp_path / 'lower.json')['train_steps'] == 64


TINY_RUN = ['--fake_data', '--model', 'resnet18', '--img_dim', 16, '--batch_size', 4,
            '--test_set_batch_size', 4, '--num_epochs', 1, '--log_steps', 1]


def test_profile_serves_traces_with_named_steps(tmp_path):
  port = 9500 + os.getpid() % 400
  # --num_cores 1: the replica's profiler server, in the command's own process (no spawn to
  # pay for: the replica's code is the same).
  cmd = [sys.executable, SCRIPT, *TINY_RUN, '--num_steps', 100000, '--log_steps', 20,
         '--profile', '--profiler_port', port, '--num_cores', 1]
  log = tmp_path / 'train.log'
  with open(log, 'w') as out:
    # A session of its own: whatever it starts must go at the end too.
    run = subprocess.Popen(list(map(str, cmd)), cwd=REPO, env=script_env(), stdout=out,
                           stderr=subprocess.STDOUT, start_new_session=True)
  try:
    deadline = time.time() + 240
    while 'Step=20 ' not in log.read_text():  # Past compilation: steps are running.
      assert run.poll() is None and time.time() < deadline, log.read_text()[-3000:]
      time.sleep(0.5)
    # Another run given the port this one serves on: one line before it trains (before, only
    # torch_xla's C++ lines, and a --profile_step trace that asked this server).
    held = run_script(SCRIPT, *TINY_RUN, '--num_steps', 2, '--profile', '--profiler_port', port,
                      '--num_cores', 1, timeout=300)
    assert_one_error(held, 2, rf'^error: --profiler_port: port {port} is taken \(Address already '
                     r'in use\): another process listens there; give another --profiler_port$')
    capture = subprocess.run(
        [sys.executable, '-c', 'import sys, torch_xla.debug.profiler as xp; '
         'xp.trace(sys.argv[1], sys.argv[2], duration_ms=2000)', f'localhost:{port}',
         str(tmp_path / 'trace')], env=script_env(), capture_output=True, text=True, timeout=120)
  finally:
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
  assert capture.returncode == 0, both(capture)
  traces = list(tmp_path.glob('trace/plugins/profile/*/*.xplane.pb'))
  assert len(traces) == 1 and b'train_step' in traces[0].read_bytes()


BAD_INPUTS = {
    'missing datadir': (['--datadir', 'nowhere'], r'nowhere/train is not a folder'),
    'unknown model': (['--fake_data', '--model', 'resnet7'], r'--model resnet7 is not a torchvision classification model .*build_model'),
    'num_cores other than 1': (['--fake_data', '--num_cores', 8], r'--num_cores=8'),
    'an lr past float32': (['--fake_data', '--lr', '1e39'],
                           r'^error: --lr 1e\+39: give a finite number that float32 holds'),
    # Unwritable --results_json and --ckpt_dir: the same probe (supervisor.check_outputs, from
    # check_job as here) in tests/test_single_core.py's cases of those names; this launcher
    # reaches it in the case below, whose check it makes first.
    'compile cache in a bucket': (['--fake_data', '--compile_cache_dir', 'gs://bucket/cache'],
                                  r"--compile_cache_dir gs://bucket/cache: .*a folder on this host's disk"),
}


@pytest.mark.parametrize('case', BAD_INPUTS)
def test_bad_input_is_one_clear_line_and_exit_2(case):
  args, message = BAD_INPUTS[case]
  assert_one_error(run_script(SCRIPT, *args, timeout=120), 2, message)


@pytest.mark.parametrize('script', ['train_resnet_mp.py', 'train_resnet_spmd.py',
                                    'train_single_core.py', 'train_wds_cifar.py'])
def test_help_answers_before_torch_loads_and_into_a_closed_pipe(script):
  # Without PJRT_DEVICE: torch_xla, once imported, warns that it defaults to the CPU.
  env = script_env()
  del env['PJRT_DEVICE']
  result = run_script(script, '--helpshort', env=env, timeout=120)
  assert result.returncode == 0 and result.stderr == '', result.stderr
  assert '--ckpt_dir' in result.stdout and '--batch_size' in result.stdout
  assert result.stdout.startswith((REPO / script).read_text().split('"""')[1].splitlines()[0])
  # Into a pipe whose reader has left (head, once it has its lines): before, a traceback.
  piped = subprocess.run(['bash', '-c', f'{shlex.quote(sys.executable)} {script} --helpfull | '
                          'true; exit ${PIPESTATUS[0]}'], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
  assert piped.returncode == 0 and piped.stderr == '', piped.stderr


def test_too_little_data_for_a_batch_or_a_profile_step_is_a_clear_error(tmp_path, colour_folder):
  # Found by the replica as it makes its loaders: --num_cores 1 runs it in this process.
  result = run_script(SCRIPT, '--datadir', colour_folder, '--model', 'resnet18',
                      '--batch_size', 300, '--num_workers', 0, '--num_cores', 1, timeout=300)
  assert_one_error(result, 2, r'^error: 256 training images make no batch of 300')
  # A --profile_step the run never reaches: before, it trained without a trace or a word.
  result = run_script(SCRIPT, '--datadir', colour_folder, '--model', 'resnet18', '--batch_size',
                      64, '--num_epochs', 2, '--profile_step', 8, '--logdir', tmp_path / 'tb',
                      '--num_workers', 0, '--num_cores', 1, timeout=300)
  assert_one_error(result, 2, r"^error: --profile_step 8 is past the run's last step \(7: steps "
                   r"count from 0 at the run's start\): give a step it trains, or more "
                   r'--num_epochs$')


def test_killed_and_stopped_run_ends_bitwise_equal(tmp_path):
  # The resnet50 recipe's warm-up and decay, over 3 short epochs: the schedule's state must
  # resume too. With --amp: its casts are part of the traced step, and a resumed run must
  # compute the very same bfloat16 work.
  args = ['--fake_data', '--model', 'resnet18', '--img_dim', 16, '--batch_size', 4,
          '--test_set_batch_size', 4, '--num_epochs', 3, '--num_steps', 4, '--log_steps', 1,
          '--lr_scheduler_type', 'WarmupAndExponentialDecayScheduler',
          '--lr_scheduler_divide_every_n_epochs', 1, '--ckpt_every_steps', 2, '--amp']
  # The uninterrupted run and the resumed one train in one process (--num_cores 1): the stops
  # are the spawned runs' (a replica's process to end), the resume and its bitwise equal
  # training the replica's code alone, the same with or without a spawn.
  reference = start_script(SCRIPT, *args, '--ckpt_dir', tmp_path / 'reference', '--num_cores', 1,
                           '--results_json', tmp_path / 'reference.json')
  ckpt_dir = tmp_path / 'ckpt'
  # With torch_xla's compile cache (written; XLA:CPU cannot read it back): the same training.
  run = args + ['--ckpt_dir', ckpt_dir, '--compile_cache_dir', tmp_path / 'cache']
  kill_step = seeded_random().randrange(1, 5)
  # SIGKILL to the command alone: its replica must not train on without it.
  code, out = run_and_signal(SCRIPT, run, kill_step, signal.SIGKILL, to='command')
  assert code == -signal.SIGKILL, out

  # SIGTERM to the command alone (`kill PID`): it passes it on to the replica.
  code, out = run_and_signal(SCRIPT, run, 0, signal.SIGTERM, to='command')
  assert code == 75, f'kill at step {kill_step}\n{out}'
  # Said at once, naming SIGTERM (a second one, a supervisor's, changes nothing).
  assert re.search(r'^Stopping after this step and saving \(SIGTERM\)\n(?:.*\n)*?'
                   r'Stopped by SIGTERM at epoch \d step \d: saved \S+; run the same command to '
                   r'resume \(exit code 75\)$', out, re.M), out

  result = run_script(SCRIPT, *run, '--num_cores', 1, '--results_json', tmp_path / 'r.json')
  assert result.returncode == 0, result.stdout + result.stderr
  assert re.search(r'^Resumed from \S+ at epoch \d step \d$', result.stdout, re.M), result.stdout
  code, reference_out = finish(reference)
  assert code == 0, reference_out
  resumed, uninterrupted = training_losses(result.stdout), training_losses(reference_out)
  assert resumed and all(uninterrupted[key] == loss for key, loss in resumed.items())
  assert_same_training(ckpt_dir, tmp_path / 'reference')
  assert read_json(tmp_path / 'r.json')['train_steps'] == 12
  # One folder per replica process (replica 0's, spawned or not), one file per graph it compiled.
  assert [p.name for p in (tmp_path / 'cache').iterdir()] == ['process-0']
  assert len(list((tmp_path / 'cache' / 'process-0').iterdir())) >= 5
  # Saving every 2 steps compiles nothing new after the first epoch.
  compiled = read_json(tmp_path / 'reference.json')['compilations_after_epoch']
  assert compiled == [compiled[0]] * 3, compiled
