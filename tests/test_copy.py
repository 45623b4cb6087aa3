"""A script copied into another project, as the README says: with the shared modules it
imports beside it, or without supervision.py under torchrun (the lines the README names
taken out)."""

import re
import subprocess
import sys

from conftest import REPO, losses, read_json, script_env

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
