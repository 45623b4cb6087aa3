# SPDX-License-Identifier: BSD-3-Clause
"""A script copied into another project: each kit (the script, utils.py and LICENSE) as
docs/scripts.md's copy line copies it, alone, as the plain command and under torchrun; and
docs/adapt.md's worked example with the optional modules."""

import ast
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

from conftest import (ONE_PROCESS, REPO, assert_nothing_left, assert_one_error, make_cifar_python,
                      read_json, script_env, training_losses, wait_for)
from test_faults import REPLICA_ENDS, run_replica_pool

KITS = ['train_resnet_mp.py', 'train_resnet_spmd.py', 'train_single_core.py', 'train_wds_cifar.py',
        'train_decoder_spmd.py']
SPMD = ('train_resnet_spmd.py', 'train_decoder_spmd.py')  # Their kits add sharded_checkpoints.py.
OPTIONAL = {'supervisor', 'command'}
WRITER = 'make_cifar_shards.py'  # The shard writer: its own copy line, supervisor.py in it.
TOKENS = 'make_token_files.py'  # The token files' writer: its own copy line, utils.py alone.
WRITERS = {WRITER: ('supervisor.py',), TOKENS: ()}


def kit_copy_lines():
  """{script: the copy line} of the kits (and the shard writer) docs/scripts.md gives."""
  page = (REPO / 'docs' / 'scripts.md').read_text()
  return {m.group(1): m.group(0) for m in re.finditer(r'^cp (\w+\.py) .*$', page, re.M)}


def copy_kit(script, project):
  """The kit's copy line of docs/scripts.md, run as it stands, into project (made empty)."""
  project.mkdir()
  line = kit_copy_lines()[script].replace('"$PROJECT"', shlex.quote(str(project)))
  subprocess.run(['bash', '-euc', line], cwd=REPO, check=True)


def test_every_kit_is_its_script_utils_and_licence_and_imports_nothing_else():
  lines = kit_copy_lines()
  assert sorted(lines) == sorted(KITS + list(WRITERS)), lines
  ours = {path.stem for path in REPO.glob('*.py')}
  # A writer's line holds what it imports: supervisor.py is not optional in the shard writer's.
  for writer, modules in WRITERS.items():
    assert lines[writer] == f'cp {writer} {" ".join(modules + ("utils.py", "LICENSE"))} "$PROJECT"/'
  for script in KITS + list(WRITERS):
    # The SPMD scripts' kits add their sharded checkpoints' module.
    extra = ('sharded_checkpoints.py',) if script in SPMD else ()
    if script not in WRITERS:
      assert lines[script] == f'cp {script} utils.py {" ".join(extra + ("LICENSE",))} "$PROJECT"/'
    for name in (script, 'utils.py') + extra + WRITERS.get(script, ()):
      imported = set()
      for node in ast.walk(ast.parse((REPO / name).read_text())):
        if isinstance(node, ast.Import):
          imported |= {alias.name.split('.')[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
          imported.add(node.module.split('.')[0])
      # The optional modules only where the script guards their import (or in run()).
      assert imported & ours <= {'utils', *(e[:-3] for e in extra)} | OPTIONAL, (name, imported & ours)
      assert ('supervisor' not in imported or 'supervisor = None' in (REPO / name).read_text()
              or script == WRITER)


def test_token_writer_kit_alone_stops_on_ctrl_c_and_sigterm_leaving_nothing_and_then_writes(
    tmp_path):
  # make_token_files.py as its copy line copies it. Its train.bin.tmp made a named pipe that
  # this test reads a little of: the writer is held mid-write (the pipe full) when the signal
  # comes, whatever the machine's pace. Ctrl-C (SIGINT to its group), then SIGTERM: exit codes
  # 130 and 75, one line each, the partial file removed, no train.bin, no meta.json.
  project = tmp_path / 'project'
  copy_kit(TOKENS, project)
  text, output = tmp_path / 'text.txt', tmp_path / 'tokens'
  text.write_text('the cat sees the moon.\n' * 50_000)  # 1.1 MB: many times a pipe's 64 KB
  output.mkdir()
  stops = ((signal.SIGINT, 130, r'Ctrl-C \(SIGINT\)'), (signal.SIGTERM, 75, 'SIGTERM'))
  for sig, code, name in stops:
    os.mkfifo(output / 'train.bin.tmp')
    # Open before the writer starts (not blocked, whatever it does), and kept open until it ends.
    pipe = os.open(output / 'train.bin.tmp', os.O_RDONLY | os.O_NONBLOCK)
    try:
      process = start_in(project, TOKENS, text, '--output', output)
      read = 0
      while read < 4096:
        assert select.select([pipe], [], [], 120)[0], 'the writer wrote nothing in 120 s'
        chunk = os.read(pipe, 4096 - read)
        assert chunk, process.communicate(timeout=120)[0]  # It ended first: why.
        read += len(chunk)
      (os.killpg if sig == signal.SIGINT else os.kill)(process.pid, sig)
      out, _ = process.communicate(timeout=120)
    finally:
      os.close(pipe)
    assert_one_error((process.returncode, out), code, rf'^error: stopped by {name}: nothing is '
                     r'half-written \(the files of this run are removed\); run the same command '
                     r'to write them$')
    assert os.listdir(output) == [], os.listdir(output)
    assert_nothing_left(session=process.pid)
  # The same command again writes the files, and says the command that trains on them.
  process = start_in(project, TOKENS, text, '--output', output)
  out, _ = process.communicate(timeout=120)
  assert process.returncode == 0, out
  assert f'python train_decoder_spmd.py --datadir {output}' in out
  written = (output / 'train.bin').read_bytes() + (output / 'val.bin').read_bytes()
  assert written == text.read_bytes()


def start_in(project, *argv):
  """A copied script started in its project, in a session of its own, output merged."""
  return subprocess.Popen([sys.executable, *map(str, argv)], cwd=project, env=script_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                          start_new_session=True)


def signal_after_training_lines(process, count, sig, to_group):
  """sig to the command (`kill PID`) or its group (a terminal's Ctrl-C) once it has printed
  count training lines; returns (exit code, the whole output)."""
  out = wait_for(process, r'^\| Training ', count)
  (os.killpg if to_group else os.kill)(process.pid, sig)
  rest, _ = process.communicate(timeout=300)
  return process.returncode, out + rest


def test_kit_alone_stops_on_sigterm_and_resumes(tmp_path):
  # The mp kit without supervisor.py: spawned replica, SIGTERM to the command alone; a second
  # run on its --ckpt_dir refused by the replica. (That a resume is bitwise that of a run
  # never stopped is utils.py's, the same with or without supervisor.py:
  # tests/test_resnet_mp.py checks it.)
  project = tmp_path / 'project'
  copy_kit('train_resnet_mp.py', project)
  argv = ['train_resnet_mp.py', '--fake_data', '--model', 'resnet18', '--img_dim', 16,
          '--batch_size', 4, '--test_set_batch_size', 4, '--num_epochs', 2, '--num_steps', 4,
          '--log_steps', 1, '--lr', 0.02, '--ckpt_dir', tmp_path / 'ckpt']
  process = start_in(project, *argv, '--results_json', tmp_path / 'r.json')
  # The same command again while it trains (held): its spawned replica refuses the folder, and
  # the replica's line and exit code are the run's, in one line.
  out = wait_for(process, r'^\| Training ')
  os.killpg(process.pid, signal.SIGSTOP)
  second = start_in(project, *argv)
  second_out, _ = second.communicate(timeout=300)
  os.killpg(process.pid, signal.SIGCONT)
  assert_one_error((second.returncode, second_out), 2, r'^error: --ckpt_dir \S+ is in use by '
                   r'another run \(process \d+ on \S+, since [-\d]+ [:\d]+\): let it end or '
                   r'stop it, or give this run another --ckpt_dir$')
  assert_nothing_left(session=second.pid)
  code, rest = signal_after_training_lines(process, 2, signal.SIGTERM, to_group=False)
  out += rest
  assert code == 75, out[-3000:]
  assert 'Data:' not in out  # supervisor.py's lines: it is not there.
  stopped = re.search(r'^Stopped by SIGTERM at epoch (\d) step (\d): saved \S+ckpt-\d+\.pt; run the '
                      r'same command to resume \(exit code 75\)$', out, re.M)
  assert stopped, out[-3000:]
  assert read_json(tmp_path / 'r.json')['preempted'] is True
  assert_nothing_left(session=process.pid)
  # The resume is the replica's (utils.py's restore), not the spawn's: in the command's own
  # process, one process fewer to pay for.
  resumed = start_in(project, *argv, '--results_json', tmp_path / 'r.json', '--num_cores', 1)
  out, _ = resumed.communicate(timeout=600)
  assert resumed.returncode == 0, out[-3000:]
  assert ONE_PROCESS.search(out), out
  assert re.search(rf'^Resumed from \S+ at epoch {stopped[1]} step {stopped[2]}$', out, re.M), out
  assert read_json(tmp_path / 'r.json')['train_steps'] == 8


def readme_adapt_steps():
  """The three code blocks of docs/adapt.md's worked example: (copy commands, the two
  functions, the training command)."""
  page = (REPO / 'docs' / 'adapt.md').read_text()
  section = page.split('\n## Adapt it', 1)[1].split('\n## ', 1)[0].split('A worked example', 1)[1]
  blocks = [textwrap.dedent(block) for block in
            re.findall(r'^( *)```\w*\n(.*?)^\1```', section, re.M | re.S) for block in [block[1]]]
  copy, functions, command = blocks[:3]
  return copy, functions, command


def small_cnn_project(project):
  """docs/adapt.md's worked example (its copy commands and its two functions) in project."""
  copy, functions, _ = readme_adapt_steps()
  project.mkdir()
  shell = re.sub(r'^PROJECT=\S+', f'PROJECT={shlex.quote(str(project))}', copy, flags=re.M)
  subprocess.run(['bash', '-euc', shell], cwd=REPO, check=True)
  script = project / 'train_resnet_mp.py'
  source = script.read_text()
  start = source.index('def build_model(')
  end = source.index('\n# ---', start)
  script.write_text(source[:start] + functions.rstrip() + '\n\n' + source[end:])


# docs/adapt.md's training set with batch 8 of 8 samples held back (from its fifth sample) until
# the file RELEASE names exists. MpDeviceLoader sends batches to the device in groups of
# --device_prefetch_size (4): the loop waits at step 8, the first of a group.
HELD_BACK = """\
  class HeldBack(torch.utils.data.Dataset):
    def __init__(self, dataset):
      self.dataset, self.calls = dataset, 0

    def __len__(self):
      return len(self.dataset)

    def __getitem__(self, index):
      self.calls += 1
      while self.calls == 8 * 8 + 5 and not os.path.exists(os.environ['RELEASE']):
        time.sleep(0.01)
      return self.dataset[index]

  return HeldBack(colour_images(512)), colour_images(100), 3
"""


def test_a_stop_trains_the_step_the_signal_lands_in_and_two_more_and_saves_them(tmp_path):
  # docs/checkpoints.md#stopping. A copier saw 4 to 9 step lines after the stop line: the log,
  # printed by a thread of its own once the device has computed a step, can trail the training
  # on a busy host. Here the signal lands in a known step: the training loop waits for batch 8
  # when it comes, so step 8 is the first to read it, with steps 9 and 10 the vote's lag; the
  # checkpoint holds steps 0 to 10, whatever the log's pace. The vote is the replica's loop,
  # the same in a spawned replica: it runs here in the command's own process (--num_cores 1).
  project = tmp_path / 'project'
  small_cnn_project(project)
  script = project / 'train_resnet_mp.py'
  source = script.read_text()
  assert source.count('  return colour_images(512), colour_images(100), 3\n') == 1
  script.write_text(source.replace(
      '  return colour_images(512), colour_images(100), 3\n', HELD_BACK))
  release = tmp_path / 'release'
  process = subprocess.Popen(
      [sys.executable, 'train_resnet_mp.py', '--model', 'smallcnn', '--lr', '0.02', '--batch_size',
       '8', '--num_workers', '0', '--num_cores', '1', '--log_steps', '1', '--ckpt_dir',
       str(tmp_path / 'ckpt')],
      cwd=project, env=script_env(RELEASE=str(release)), stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
  # Should the run never print what is waited for, it is ended: the test fails, not hangs.
  timer = threading.Timer(300, lambda: process.poll() is None and os.killpg(process.pid, 9))
  timer.start()
  try:
    out = wait_for(process, r'^\| Training .* Step=7 ')
    os.killpg(process.pid, signal.SIGINT)  # As Ctrl-C in a terminal: every process of the run.
    out += wait_for(process, r'^Stopping after this step and saving')
  finally:
    release.touch()
  rest, _ = process.communicate(timeout=300)
  timer.cancel()
  out += rest
  assert process.returncode == 130, out
  assert ONE_PROCESS.search(out), out
  assert sorted(os.listdir(tmp_path / 'ckpt')) == ['.lock', 'ckpt-00000011.pt'], out
  held = torch.load(tmp_path / 'ckpt' / 'ckpt-00000011.pt', weights_only=True)
  assert (held['epoch'], held['step']) == (1, 11)
  # Every step line it holds, and no other, before the line that names it.
  before, after = out.split('Stopping at epoch 1 step 11: saving a checkpoint ...\n')
  assert [int(step) for step in re.findall(r'^\| Training .* Step=(\d+) ', before, re.M)] == list(
      range(11)), out
  assert not re.search(r'Step=', after) and re.match(
      r'Saved checkpoint \S+ckpt-00000011\.pt\nStopped by Ctrl-C \(SIGINT\) at epoch 1 step 11: saved \S+ckpt-00000011\.pt; run the '
      r'same command to resume \(exit code 130\)\n', after), out
  assert_nothing_left(session=process.pid)


def test_readme_adapt_it_example_learns_in_a_project_with_its_own_utils(tmp_path):
  copy, functions, command = readme_adapt_steps()
  project = tmp_path / 'myproject'
  (project / 'utils').mkdir(parents=True)  # The user's own utils package, which ours must not hide.
  (project / 'utils' / '__init__.py').write_text('GREETING = "the project\'s own utils"\n')
  # Step 1, in the repo as the page says, into the project instead of ~/myproject.
  shell = re.sub(r'^PROJECT=\S+', f'PROJECT={shlex.quote(str(project))}', copy, flags=re.M)
  assert shell != copy
  subprocess.run(['bash', '-euc', shell], cwd=REPO, check=True)
  # Every module of ours the copied files import, at their top or inside a function (run()
  # imports command.py), is in the project: a missing one would be "No module named ..." only
  # when that path runs. And ours is imported as xla_utils, not as the project's utils.
  imported = set()
  for path in project.glob('*.py'):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        imported |= {alias.name.split('.')[0] for alias in node.names}
      elif isinstance(node, ast.ImportFrom) and node.module:
        imported.add(node.module.split('.')[0])
  ours = {path.stem for path in REPO.glob('*.py')} | {'xla_utils'}
  missing = sorted(name for name in imported & ours if not (project / f'{name}.py').exists())
  assert not missing, f'imported but not copied: {missing}'
  assert 'command' in imported and 'xla_utils' in imported and 'utils' not in imported

  # Step 2: the two functions of the copied script replaced by the README's, nothing else.
  script = project / 'train_resnet_mp.py'
  source = script.read_text()
  start = source.index('def build_model(')
  end = source.index('\n# ---', start)
  script.write_text(source[:start] + functions.rstrip() + '\n\n' + source[end:])
  # Step 3: the README's command, with a results file to check.
  argv = shlex.split(command)
  assert argv[:2] == ['python', 'train_resnet_mp.py'], argv
  result = subprocess.run([sys.executable, *argv[1:], '--results_json', tmp_path / 'r.json'],
                          cwd=project, env=script_env(), capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  # The first lines say what it trains, as the README shows them.
  assert re.search(r'^Data: 512 training and 100 evaluation samples of 3x24x24 float32, 3 classes\n'
                   r'Model: smallcnn \(Sequential, [\d.]+M parameters, 3 classes\)\n'
                   r'Recipe: SGD, lr 0\.02 constant, momentum 0\.9, weight decay 0\.0001 \(--lr as '
                   r"given, --lr_scheduler_type from the default recipe, the rest the flags' "
                   r'defaults\); float32 mat-mul precision default$', result.stdout, re.M), \
      result.stdout[:2000]
  results = read_json(tmp_path / 'r.json')
  assert results['model'] == 'smallcnn'
  assert results['final_accuracy'] > 90, result.stdout[-3000:]
  # Every evaluation image counted once; the padding (shaped from the data, not --img_dim)
  # is not counted; and nothing was compiled after the first epoch.
  assert results['eval_samples'] == 100
  after = results['compilations_after_epoch']
  assert len(after) == 3 and after[0] == after[1] == after[2], after
  # The project's own utils package is still its own.
  check = subprocess.run([sys.executable, '-c', 'import utils; print(utils.GREETING)'],
                         cwd=project, capture_output=True, text=True, check=True)
  assert check.stdout.strip() == "the project's own utils"


@pytest.mark.parametrize('kit', ['with supervisor.py', 'alone'])
def test_a_dataset_loader_workers_cannot_receive_is_one_line(tmp_path, kit):
  # A dataset class defined inside build_datasets, as one writes it at first: replicas start
  # their loader workers by spawn, which must pickle it, and cannot. Said before any replica
  # starts with supervisor.py, by the replica without it.
  project = tmp_path / 'project'
  project.mkdir()
  for name in ['utils.py', 'supervisor.py'][:2 if kit == 'with supervisor.py' else 1]:
    (project / name).write_text((REPO / name).read_text())
  source = (REPO / 'train_resnet_mp.py').read_text()
  start = source.index('def build_datasets(')
  end = source.index('\n# ---', start)
  local_class = textwrap.dedent('''\
      def build_datasets(cfg):
        class Colours(torch.utils.data.Dataset):
          def __init__(self, count):
            self.images = torch.rand(count, 3, 16, 16, generator=torch.Generator().manual_seed(count))
          def __len__(self):
            return len(self.images)
          def __getitem__(self, index):
            return self.images[index], index % 3
        return Colours(64), Colours(16), 3
      ''')
  (project / 'train.py').write_text(source[:start] + local_class + source[end:])
  argv = [sys.executable, 'train.py', '--model', 'resnet18', '--batch_size', 8, '--num_epochs', 1]
  result = subprocess.run(list(map(str, argv + ['--num_workers', 2])), cwd=project,
                          env=script_env(), capture_output=True, text=True, timeout=300)
  assert_one_error(result, 2, r"^error: build_datasets: the training set \(Colours\) cannot be "
                   r"sent to loader worker processes \(.*build_datasets\.<locals>\.Colours.*\): "
                   r'define its class .* at module level, or give --num_workers 0$')
  assert ('Starting' in result.stdout) == (kit == 'alone'), result.stdout


@pytest.fixture(scope='module')
def kit_shards(tmp_path_factory):
  """The wds kit's shards, written by the shard writer as its copy line copies it (into a
  folder of its own: the kit stays alone); once for the tests of this module that read them
  (only read: a process of imports fewer)."""
  root = tmp_path_factory.mktemp('kit_shards')
  copy_kit(WRITER, root / 'writer')
  make_cifar_python(root / 'cifar-10-batches-py', per_batch=16, test_count=16)
  written = subprocess.run(
      [sys.executable, WRITER, '--cifar_dir', root / 'cifar-10-batches-py', '--output',
       root / 'shards' / 'c', '--samples_per_shard', '20'], cwd=root / 'writer',
      env=script_env(), capture_output=True, text=True, timeout=300)
  assert written.returncode == 0, written.stdout + written.stderr
  assert sorted(os.listdir(root / 'shards')) == [
      'c-classes.txt', 'c-test-000000.tar', *(f'c-train-{i:06d}.tar' for i in range(4))]
  return root / 'shards'


def kit_args(script, shards=None):
  """Small flags for a run of the script's kit; the wds kit's read shards (kit_shards)."""
  common = ['--test_set_batch_size', 4, '--num_epochs', 2, '--log_steps', 1, '--lr', 0.02]
  if script == 'train_decoder_spmd.py':  # Random tokens, a vocabulary of 32,000.
    return ['--fake_data', '--hidden_size', 32, '--num_hidden_layers', 2, '--seq_len', 16,
            '--batch_size', 2, '--num_steps', 6, *common]
  if script != 'train_wds_cifar.py':
    return ['--fake_data', '--model', 'resnet18', '--img_dim', 16, '--batch_size', 4,
            '--num_steps', 6, *common]
  return ['--wds_traindir', shards / 'c-train-{000000..000003}.tar', '--trainsize',
          80, '--wds_testdir', shards / 'c-test-000000.tar', '--testsize', 16,
          '--batch_size', 4, '--num_workers', 1, '--shuffle_buffer', 20, '--num_steps', 6,
          *common]


@pytest.mark.parametrize('script', ['train_single_core.py', 'train_resnet_spmd.py',
                                    'train_wds_cifar.py', 'train_decoder_spmd.py'])
def test_each_kit_alone_stops_on_ctrl_c_with_a_checkpoint(tmp_path, script, request):
  project = tmp_path / 'project'
  copy_kit(script, project)
  shards = request.getfixturevalue('kit_shards') if script == 'train_wds_cifar.py' else None
  argv = [script, *kit_args(script, shards), '--ckpt_dir', tmp_path / 'ckpt',
          '--results_json', tmp_path / 'r.json']
  process = start_in(project, *argv)
  code, out = signal_after_training_lines(process, 2, signal.SIGINT, to_group=True)
  assert code == 130, out[-3000:]
  assert re.search(r'^Stopped by Ctrl-C \(SIGINT\) at epoch \d step \d: saved \S+; run the same '
                   r'command to resume \(exit code 130\)$', out, re.M), out[-3000:]
  assert read_json(tmp_path / 'r.json')['interrupted'] is True
  assert_nothing_left(session=process.pid)
  # (The kit's resume is utils.py's, the same for every script: bitwise above, with the mp kit.)


def test_kit_alone_ends_a_diverging_run_and_a_replica_says_a_bad_path_in_one_line(tmp_path):
  project = tmp_path / 'project'
  copy_kit('train_single_core.py', project)
  nan = start_in(project, 'train_single_core.py', '--fake_data', '--model', 'resnet18',
                 '--img_dim', 16, '--batch_size', 8, '--num_epochs', 1, '--num_steps', 12,
                 '--log_steps', 1, '--lr', 1e6)
  out, _ = nan.communicate(timeout=600)
  # At this --lr the fake data's loss swung between 0 and 1e16 without becoming NaN, and the
  # run passed as done: the weights that ran away end it.
  assert_one_error((nan.returncode, out), 22, r'^error: the (weights|loss) \S+ \S+ at epoch 1 step '
                   r'\d+.*: training diverged; lower --lr \(it is 1e\+06\) and run again \(exit '
                   r'code 22\)$')
  # The mp kit's replica, without supervisor.py, says a missing --datadir in one line: here in
  # the command's own process (a spawned replica's line and code are the run's: the refused
  # --ckpt_dir of test_kit_alone_stops_on_sigterm_and_resumes).
  copy_kit('train_resnet_mp.py', tmp_path / 'mp')
  missing = start_in(tmp_path / 'mp', 'train_resnet_mp.py', '--datadir', tmp_path / 'nowhere',
                     '--model', 'resnet18', '--img_dim', 16, '--num_cores', 1)
  out, _ = missing.communicate(timeout=600)
  assert ONE_PROCESS.search(out), out
  assert_one_error((missing.returncode, out), 2, r'^error: \S+/nowhere/train is not a folder: '
                   r'\S+/nowhere needs train and val with one folder of images per class')


@pytest.mark.parametrize('how,code,line', REPLICA_ENDS[1:], ids=['killed'])  # See test_faults.py.
def test_kit_alone_ends_every_replica_of_a_host_when_one_fails(tmp_path, how, code, line):
  # On a TPU host of several replicas, the others would wait for it forever in their next
  # collective (pytorch/xla#7974); here one waits as they would (see tests/replica_pool.py).
  project = tmp_path / 'project'
  copy_kit('train_resnet_mp.py', project)
  code_seen, out, seconds = run_replica_pool(project, how, 'kit')
  assert_one_error((code_seen, out), code, line)
  assert seconds < 10, out


def test_grey_images_are_one_line_naming_the_fix_for_an_rgb_model_and_train_with_a_grey_one(
    tmp_path, colour_folder):
  # A copier's edit: grey images (uint8, as docs/adapt.md prefers) for the torchvision model.
  project = tmp_path / 'project'
  copy_kit('train_single_core.py', project)
  shutil.copy(REPO / 'supervisor.py', project)  # The checks at start are its.
  script = project / 'train_single_core.py'
  source = script.read_text()
  assert source.count('transform=v2.Compose([') == 2
  script.write_text(source.replace('transform=v2.Compose([', 'transform=v2.Compose([v2.Grayscale(), '))
  args = ['train_single_core.py', '--datadir', colour_folder, '--model', 'resnet18', '--img_dim',
          16, '--batch_size', 8, '--test_set_batch_size', 8, '--num_epochs', 1, '--num_steps', 4,
          '--log_steps', 1, '--num_workers', 0]
  out, _ = (refused := start_in(project, *args)).communicate(timeout=300)
  assert_one_error((refused.returncode, out), 2, r"^error: build_model's model cannot take "
                   r"build_datasets' samples \(1x16x16 uint8\): .*; give 3-channel images "
                   r'\(v2\.RGB\(\) in the transform\) or a model whose first layer takes 1$')
  # The model's first layer for one channel: utils.normalize takes grey images too.
  source = script.read_text()
  script.write_text(source.replace(
      '  return utils.create_model(cfg.model, num_classes)',
      '  model = utils.create_model(cfg.model, num_classes)\n'
      '  model.conv1 = torch.nn.Conv2d(1, 64, 7, 2, 3, bias=False)\n'
      '  return model'))
  out, _ = (grey := start_in(project, *args)).communicate(timeout=600)
  assert grey.returncode == 0, out[-3000:]
  assert re.search(r'^Data: 256 training and 20 evaluation samples of 1x16x16 uint8', out, re.M)
  trained = [float(loss) for loss in training_losses(out).values()]
  assert len(trained) == 4 and all(np.isfinite(trained)), out


KIT_MISTAKES = {
    # On XLA the cross entropy takes label 7 of 3 classes without an error: such a run trained
    # to exit 0. Every batch's labels are counted in the step's graph, read with the stop vote.
    'a label outside the classes': (
        'labels[20] = 7  # In the middle: a check of the first and last samples misses it.',
        'num_classes',
        r'^error: label 7 in the batch of epoch 1 step \d is not one of the 3 classes \(labels 0 '
        r"to 2\): fix the dataset's labels, or the class count build_datasets returns$"),
    # A label of shape (1,) each made a batch's (8, 1), which the loss refused in a traceback.
    'labels of shape (1,)': (
        'labels = labels.view(-1, 1)', 'num_classes',
        r"^error: the labels of a batch of 8 are torch\.int64 of shape \(8, 1\): expected \(8,\), "
        r"an integer class each; fix build_datasets' labels \(an int each, or a tensor of shape "
        r'\(\)\)$'),
    # Images as numpy and PIL hold them (a copier's own arrays): "16-channel images" was all it
    # said. The layout, and the way to the one the step takes.
    'images of height x width x channels': (
        'images = (images * 255).to(torch.uint8).permute(0, 2, 3, 1)', 'num_classes',
        r'^error: uint8 images of 16x16x3 are height x width x channels: the step takes channels x '
        r'height x width; give each image as image\.permute\(2, 0, 1\) in build_datasets, '
        r'or add v2\.ToImage\(\) to the transform, which makes a PIL image or numpy array '
        r'channels-first$'),
    # Scores for 2 classes of 3 trained label 2 silently too; a shape the loss refuses was a
    # traceback. The shape is known as the step is traced: one line before any compile.
    'a model with a score too few': (
        '', 'num_classes - 1',
        r'^error: the model returns outputs of shape \(8, 2\) for a batch of 8: expected \(8, 3\), '
        r'a score for each of the 3 classes; fix build_model, or the class count build_datasets '
        r'returns$'),
}


@pytest.mark.parametrize('mistake', KIT_MISTAKES)
def test_kit_alone_ends_a_run_whose_labels_or_model_outputs_are_not_the_classes(tmp_path, mistake):
  label_line, outputs, error = KIT_MISTAKES[mistake]
  project = tmp_path / 'project'
  copy_kit('train_resnet_mp.py', project)
  script = project / 'train_resnet_mp.py'
  source = script.read_text()
  start = source.index('def build_model(')
  end = source.index('\n# ---', start)
  script.write_text(source[:start] + textwrap.dedent(f'''\
      def build_model(cfg, num_classes):  # Small: it compiles in a second.
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, {outputs}))


      def build_datasets(cfg):
        images = torch.rand(48, 3, 16, 16, generator=torch.Generator().manual_seed(0))
        labels = torch.arange(48) % 3
        {label_line}
        dataset = torch.utils.data.TensorDataset(images, labels)
        return dataset, dataset, 3
      ''') + source[end:])
  # The checks are the step's (utils.py's), not the spawn's: the replica's code in the
  # command's own process (a spawned replica's failing line and code are the run's: the
  # refused --ckpt_dir of test_kit_alone_stops_on_sigterm_and_resumes).
  process = start_in(project, 'train_resnet_mp.py', '--model', 'linear', '--batch_size', 8,
                     '--num_epochs', 1, '--log_steps', 1, '--num_workers', 0, '--num_cores', 1)
  out, _ = process.communicate(timeout=600)
  assert_one_error((process.returncode, out), 2, error)
  assert ONE_PROCESS.search(out), out
  assert 'test end' not in out, out


def test_kit_alone_a_bug_in_a_copiers_parse_is_its_traceback_not_a_bad_shard(tmp_path,
                                                                             kit_shards):
  # A copier's parse that takes the labels for class names: its ValueError, raised in a loader
  # worker of the replica, ends the run as a bug of that parse, a traceback that ends in it
  # (exit code 1), not a warning that blames each shard, then no readable sample.
  project = tmp_path / 'project'
  copy_kit('train_wds_cifar.py', project)
  script = project / 'train_wds_cifar.py'
  # First, a shard pattern the shell expanded: without supervisor.py, absl's line (docs/scripts.md).
  unquoted = subprocess.run(['bash', '-c', f'{shlex.quote(sys.executable)} train_wds_cifar.py '
                             '--wds_traindir s/c-train-{0..2}.tar --trainsize 8 --wds_testdir '
                             's/c-test-0.tar'], cwd=project, env=script_env(), capture_output=True,
                            text=True, timeout=300)
  assert_one_error(unquoted, 2, r"^error: unexpected arguments \['s/c-train-1\.tar', "
                   r"'s/c-train-2\.tar'\]: every option is a --flag \(see --helpshort\)$")
  source = script.read_text()
  start, end = source.index('def parse('), source.index('def decode(')
  script.write_text(source[:start] + textwrap.dedent('''\
      def parse(sample, num_classes):
        return 'rgb', sample['rgb'], ['cat', 'dog'].index(sample['cls'].decode())


      ''') + source[end:])
  # A loader worker's exception, the same from a plain fork as from a spawned replica's fork
  # server: the replica runs in the command's own process (--num_cores 1), its worker forked.
  process = start_in(project, 'train_wds_cifar.py', *kit_args('train_wds_cifar.py', kit_shards),
                     '--num_cores', 1)
  out, _ = process.communicate(timeout=300)
  assert process.returncode == 1, out[-3000:]
  assert ONE_PROCESS.search(out), out
  frames = re.findall(r'^  File "[^"]*/([^/"]+)", line \d+, in (\w+)$', out, re.M)
  assert frames[-1] == ('train_wds_cifar.py', 'parse'), out[-3000:]
  assert re.search(r"^ValueError: '\d' is not in list\n*\Z", out, re.M), out[-3000:]
  assert 'warning' not in out and 'error:' not in out, out[-3000:]
  assert_nothing_left(session=process.pid)
