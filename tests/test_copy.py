# SPDX-License-Identifier: BSD-3-Clause
"""A script copied into another project, as docs/adapt.md says: with the shared modules it
imports beside it, or without supervision.py under torchrun (the lines it names taken out)."""

import ast
import re
import shlex
import subprocess
import sys
import textwrap

from conftest import REPO, assert_one_error, losses, read_json, script_env

SHARED = ['utils.py', 'checkpoints.py', 'image_folders.py']


def without_supervision(source):
  """The script with supervision.py's lines taken out, as the README tells a copier to:
  its import, the `with supervision...:` lines (what they hold unindented), the
  `__mp_main__` block, and `lambda: 0` for supervision.stop_signal."""
  source = re.sub(r"\nelif __name__ == '__mp_main__':\n(  .*\n)+", '\n', source)
  lines, out, dedent_below = source.split('\n'), [], None
  for line in lines:
    indent = len(line) - len(line.lstrip())
    if dedent_below is not None and line.strip() and indent <= dedent_below:
      dedent_below = None
    if re.match(r'\s*with supervision\.\w+\(.*\):', line):
      dedent_below = indent
      continue
    if line.strip() == 'import supervision':
      continue
    out.append(line[2:] if dedent_below is not None else line)
  return '\n'.join(out).replace('supervision.stop_signal', 'lambda: 0')


def test_mp_script_without_supervision_trains_under_torchrun(tmp_path):
  project = tmp_path / 'project'
  project.mkdir()
  for name in SHARED:
    (project / name).write_text((REPO / name).read_text())
  script = project / 'train.py'
  script.write_text(without_supervision((REPO / 'train_resnet_mp.py').read_text()))
  assert 'supervision' not in script.read_text()
  cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node=1', script,
         '--fake_data', '--model', 'resnet18', '--img_dim', 16, '--batch_size', 4,
         '--test_set_batch_size', 4, '--num_epochs', 1, '--num_steps', 3, '--log_steps', 1,
         '--results_json', tmp_path / 'r.json']
  result = subprocess.run(list(map(str, cmd)), cwd=project, env=script_env(),
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert len(losses(result.stdout)) == 3, result.stdout
  assert read_json(tmp_path / 'r.json')['train_steps'] == 3


def readme_adapt_steps():
  """The three code blocks of docs/adapt.md's worked example: (copy commands, the two
  functions, the training command)."""
  page = (REPO / 'docs' / 'adapt.md').read_text()
  section = page.split('\n## Adapt it', 1)[1].split('\n## ', 1)[0]
  blocks = [textwrap.dedent(block) for block in
            re.findall(r'^( *)```\w*\n(.*?)^\1```', section, re.M | re.S) for block in [block[1]]]
  copy, functions, command = blocks[:3]
  return copy, functions, command


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
                   r'Recipe: SGD, lr 0\.02 constant', result.stdout, re.M), result.stdout[:2000]
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


def test_a_dataset_loader_workers_cannot_receive_is_one_line_before_any_replica(tmp_path):
  # A dataset class defined inside build_datasets, as one writes it at first: replicas start
  # their loader workers by spawn, which must pickle it, and cannot.
  project = tmp_path / 'project'
  project.mkdir()
  for name in SHARED + ['supervision.py']:
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
  result = subprocess.run(list(map(str, argv + ['--num_workers', 1])), cwd=project,
                          env=script_env(), capture_output=True, text=True, timeout=300)
  assert_one_error(result, 2, r"^error: build_datasets: the training set \(Colours\) cannot be "
                   r"sent to loader worker processes \(.*build_datasets\.<locals>\.Colours.*\): "
                   r'define its class .* at module level, or give --num_workers 0$')
  assert 'Starting' not in result.stdout, result.stdout  # Before any replica.
