# SPDX-License-Identifier: BSD-3-Clause
"""train_single_core.py end to end on XLA:CPU, as a user runs it."""

import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import (REPO, assert_one_error, both, losses, make_image_folder, read_json,
                      readme_command_flags, run_script, script_env, tensorboard_scalars,
                      training_losses, write_image)

SCRIPT = 'train_single_core.py'


def hlo_dump_env(folder):
  """The scripts' environment, with torch_xla dumping every graph it runs as HLO in folder."""
  return script_env(XLA_SAVE_TENSORS_FILE=str(folder / 'graphs'), XLA_SAVE_TENSORS_FMT='hlo')


def dumped_hlo(hlo_dump_dir):
  """The text of the HLO graphs that torch_xla dumped (XLA_SAVE_TENSORS_FILE)."""
  return ''.join(p.read_text() for p in hlo_dump_dir.glob('graphs*'))


def convolution_types(hlo_dump_dir):
  """Element types of the convolutions in the dumped graphs."""
  return set(re.findall(r'= (\w+)\[[\d,]*\]\{[\d,]*\} convolution\(', dumped_hlo(hlo_dump_dir)))


def graphs_taking(hlo_dump_dir, batch):
  """The distinct dumped graphs, by their inputs, that take a batch of this type (u8[16,3,32,32])."""
  return {inputs for inputs in re.findall(r'^HloModule [^,]+, entry_computation_layout=\{\((.*)\)->',
                                          dumped_hlo(hlo_dump_dir), re.M) if f'{batch}{{' in inputs}


def batch_parameters(hlo_dump_dir):
  """Types of the image-shaped (N x 3 x H x W) inputs of the dumped graphs."""
  return set(re.findall(r'= (\w+\[\d+,3,\d+,\d+\])\{[\d,]*\} parameter\(',
                        dumped_hlo(hlo_dump_dir)))


def test_readme_quick_start_flags_with_amp_train_report_and_keep_weights_and_state_in_float32(
    tmp_path):
  # The README's command with this script, 20 steps an epoch (test_resnet_mp.py runs it whole),
  # with --amp: the run of the amp flag too (one once, a process fewer). --amp is
  # torch.autocast('xla', bfloat16): the convolutions (forward and backward) in bf16, the
  # weights, their update and the optimizer state in f32. (The float32 control for this and the
  # bf16 test: test_learns_counts_every_val_image_once_and_compiles_only_in_epoch_1's run.)
  flags = readme_command_flags() + ['--num_steps', '20', '--amp']
  result = run_script(SCRIPT, *flags, '--results_json', tmp_path / 'r.json',
                      '--logdir', tmp_path / 'tb', '--ckpt_dir', tmp_path / 'ckpt',
                      env=hlo_dump_env(tmp_path))
  assert result.returncode == 0, both(result)
  out = result.stdout
  assert 'Epoch 1 train begin' in out and 'Epoch 1 train end' in out
  # No optimiser flag given: the line says so.
  assert re.search(r"^Recipe: SGD, lr 0\.1 constant, .* \(the flags' defaults\); float32 mat-mul "
                   r"precision default$", out, re.M), out
  assert re.search(r'^Epoch 1 test end \d\d:\d\d:\d\d, Accuracy=\d+\.\d\d$', out, re.M)
  assert re.search(r'^Max Accuracy: \d+\.\d\d%$', out, re.M)
  # Fake labels are constant, so the loss must fall fast.
  assert losses(out)[-1] < losses(out)[0] / 10
  results = read_json(tmp_path / 'r.json')
  assert results['train_steps'] == results['epochs'] * 20
  assert results['compilations'] > 0 and results['global_rate'] > 0
  scalars = tensorboard_scalars(tmp_path / 'tb')
  assert set(scalars) == {'Loss/train', 'Rate/train', 'LR', 'Accuracy/test'}
  assert scalars['Loss/train'] == pytest.approx(losses(out), abs=1e-5)
  assert scalars['Accuracy/test'] == [100.0] * results['epochs']
  assert convolution_types(tmp_path) == {'bf16'}
  assert results['amp'] and not results['bf16']
  state = torch.load(tmp_path / 'ckpt' / f'ckpt-{results["train_steps"]:08d}.pt', weights_only=True)
  floats = [t for t in state['model'].values() if t.is_floating_point()] + [
      s['momentum_buffer'] for s in state['optimizer']['state'].values()]
  assert floats and {t.dtype for t in floats} == {torch.float32}


def test_bf16_flag_trains_in_bf16(tmp_path):
  # --bf16 sets XLA_USE_BF16=1 before the runtime starts: one path for the flag and the
  # variable users export.
  env = hlo_dump_env(tmp_path)
  flags = ['--fake_data', '--model', 'resnet18', '--img_dim', 32, '--batch_size', 16,
           '--test_set_batch_size', 16, '--num_epochs', 1, '--num_steps', 12, '--log_steps', 1,
           '--bf16', '--results_json', tmp_path / 'r.json']
  result = run_script(SCRIPT, *flags, env=env)
  assert result.returncode == 0, both(result)
  assert convolution_types(tmp_path) == {'bf16'}
  assert read_json(tmp_path / 'r.json')['bf16']
  trace = losses(result.stdout)
  assert len(trace) == 12 and trace[-1] < trace[0] / 2


def test_learns_counts_every_val_image_once_and_compiles_only_in_epoch_1(tmp_path, colour_folder):
  # 21 val images with --test_set_batch_size 4: five full batches and one of a single image.
  # --mat_mul_precision highest changes nothing on XLA:CPU, which multiplies float32 as it is.
  # One of them is a red image filed under green, which a model that learned the colours
  # gets wrong: the exact accuracy is 20/21, and any padding or dropped image changes it.
  # At --lr 0.005 the last epoch's accuracy was 100% of the colours for each of 6 seeds; at
  # 0.05 the loss leaps (to 38 in epoch 3) and 3 of 12 runs (6 seeds, host and device
  # normalisation) ended at 25% to 75%.
  write_image(colour_folder / 'val' / 'green' / 'red_one.png', (220, 40, 40), 32,
              np.random.default_rng(3))
  # An animated GIF, its first frame yellow: read (torchvision's ImageFolder skips .gif), and
  # decoded at start, the last training sample.
  frames = [Image.new('RGB', (32, 32), colour) for colour in ((230, 220, 40), (30, 60, 220))]
  frames[0].save(colour_folder / 'train' / 'yellow' / 'zz.gif', save_all=True,
                 append_images=frames[1:])
  result = run_script(SCRIPT, '--datadir', colour_folder, '--model', 'resnet18', '--img_dim', 32,
                      '--batch_size', 16, '--test_set_batch_size', 4, '--num_epochs', 3,
                      '--lr', 0.005, '--num_workers', 2, '--log_steps', 5,
                      '--target_accuracy', 99, '--ckpt_dir', tmp_path / 'ckpt',
                      '--mat_mul_precision', 'highest',
                      '--results_json', tmp_path / 'r.json', env=hlo_dump_env(tmp_path))
  # Below --target_accuracy 99: upstream's exit code.
  assert result.returncode == 21, result.stdout[-3000:] + result.stderr
  assert 'is below target' in result.stdout
  results = read_json(tmp_path / 'r.json')
  # What the data is, is said at start, as ImageFolder counts it.
  assert re.search(r'^Data: 257 training and 21 evaluation samples of 3x32x32 uint8, 4 classes\n'
                   r'Model: resnet18 .*\nRecipe: SGD, lr 0\.005 constant, momentum 0\.9, weight decay '
                   r"0\.0001 \(--lr as given, the rest the flags' defaults\); float32 mat-mul "
                   r'precision highest$', result.stdout, re.M), result.stdout
  # --mat_mul_precision: on a TPU, float32 products in 6 bfloat16 passes where the graphs ask:
  # every dot and forward convolution. torch_xla 2.9 lowers the backward's convolutions (of the
  # inputs' and the weights' gradients) without a precision, which a TPU runs at its default:
  # docs/tpu.md says so, and this fails the day an upgrade changes it.
  assert results['mat_mul_precision'] == 'highest'
  products = re.findall(r'^.* (?:dot|convolution)\(.*$', dumped_hlo(tmp_path), re.M)
  asked = {(' dot(' in line or 'dim_labels=bf01_oi01->bf01' in line,  # A dot or forward convolution
            'operand_precision={highest,highest}' in line) for line in products}
  assert asked == {(True, True), (False, False)}, asked
  assert results['eval_samples'] == 21, result.stdout[-3000:]
  assert results['eval_correct'] == 20
  assert results['final_accuracy'] == pytest.approx(100 * 20 / 21)
  assert re.search(r'^Epoch 3 test end \d\d:\d\d:\d\d, Accuracy=95\.24$', result.stdout, re.M)
  # 257 training images, batch 16: 16 steps an epoch.
  assert results['train_steps'] == 48
  # Every graph (train steps, padded eval batches) is compiled in epoch 1, none after.
  counts = results['compilations_after_epoch']
  assert len(counts) == 3 and counts[0] == counts[1] == counts[2]
  assert 'chance level' not in result.stderr, result.stderr  # It learned: no warning.
  # The batches reach the device as uint8 (a quarter of float32's bytes), training and
  # evaluation, and are normalised in the step's graph: no float batch is sent.
  inputs = batch_parameters(tmp_path)
  assert {'u8[16,3,32,32]', 'u8[4,3,32,32]'} <= inputs and not {
      'f32[16,3,32,32]', 'f32[4,3,32,32]'} & inputs, inputs
  # The training step is one graph from the first step on: the momentum is made before that
  # step (utils.make_optimizer_state), not in it, which compiled a graph of its own.
  assert len(graphs_taking(tmp_path, 'u8[16,3,32,32]')) == 1
  # Without --amp or --bf16: float32 (the control for the bf16 and amp tests).
  assert convolution_types(tmp_path) == {'f32'}
  assert not results['amp'] and not results['bf16']


def test_a_loss_at_chance_level_all_epoch_names_the_lr_and_goes_on(tmp_path):
  # Four classes of one colour: the labels say nothing about the images, so the loss stays at
  # ln 4, as a model that does not learn at the default rate (no BatchNorm, say) would.
  same = {name: (128, 128, 128) for name in ('a', 'b', 'c', 'd')}
  make_image_folder(tmp_path / 'data', 'train', 32, size=16, seed=1, colours=same)
  make_image_folder(tmp_path / 'data', 'val', 2, size=16, seed=2, colours=same)
  args = ['--datadir', tmp_path / 'data', '--model', 'resnet18', '--img_dim', 16, '--batch_size',
          8, '--test_set_batch_size', 8, '--num_epochs', 2, '--log_steps', 1, '--ckpt_dir',
          tmp_path / 'ckpt', '--ckpt_every_steps', 6]
  result = run_script(SCRIPT, *args, '--num_steps', 8)
  assert result.returncode == 0, both(result)  # A warning, not an end.
  warnings = re.findall(r'^warning: the loss stayed at chance level \(ln 4 = 1\.39\) through '
                        r'epoch (\d) at the default learning rate 0\.1: the model is not '
                        r'learning; try a lower --lr \(such as 0\.01\)', result.stderr, re.M)
  assert warnings == ['1', '2'], result.stderr
  assert re.search(r'^Epoch 2 test end ', result.stdout, re.M)
  # The default --num_workers (8) is lowered to the CPUs without a line; only a number the
  # user gave is worth one.
  assert 'CPUs this process may use' not in result.stdout, result.stdout
  # Resumed after step 4 of epoch 2 (global step 12), which has 3 steps now: this run trains
  # none, so it says nothing of how the model learns (those steps were its checkpoint's run's).
  (tmp_path / 'ckpt' / 'ckpt-00000016.pt').unlink()
  result = run_script(SCRIPT, *args, '--num_steps', 3)
  assert result.returncode == 0, both(result)
  assert re.search(r'^warning: the run resumed after step 4 of an epoch that has 3 steps now: it '
                   r'trains none of them; the epoch ends here$', result.stderr, re.M), result.stderr
  assert 'chance level' not in result.stderr and not training_losses(result.stdout), result.stderr


BRANCHING_MODEL = """import torch


class Model(torch.nn.Module):  # A copier's: a Python branch on a value in its 9th training step.
  def __init__(self, num_classes):
    super().__init__()
    self.fc = torch.nn.Linear(3 * 16 * 16, num_classes)
    self.steps = 0

  def forward(self, x):
    self.steps += self.training
    y = self.fc(x.flatten(1))
    if self.steps == 9 and y.mean() > -1e9:  # Reads the value: a graph of its own, and the rest
      y = y * 1.0  # of the step's.
    return y
"""


def test_a_graph_compiled_after_epoch_1_is_said_at_its_step_with_its_line_of_code(tmp_path):
  # The kit copied, and a model of the copier's whose 9th training step (epoch 2 step 2 of 6)
  # reads a value to branch on it: two graphs more, which --debug_graphs traces to that line.
  (tmp_path / 'mymodel.py').write_text(BRANCHING_MODEL)
  branch = BRANCHING_MODEL.splitlines().index(next(
      line for line in BRANCHING_MODEL.splitlines() if 'y.mean()' in line)) + 1
  script = (REPO / SCRIPT).read_text()
  (tmp_path / SCRIPT).write_text(script.replace(
      '  return utils.create_model(cfg.model, num_classes)\n',
      '  import mymodel\n  return mymodel.Model(num_classes)\n', 1))
  (tmp_path / 'utils.py').write_text((REPO / 'utils.py').read_text())
  (tmp_path / 'tmp').mkdir()
  result = subprocess.run(
      [sys.executable, SCRIPT, '--fake_data', '--img_dim', '16', '--batch_size', '4',
       '--num_epochs', '2', '--num_steps', '6', '--log_steps', '3', '--debug_graphs',
       '--results_json', 'r.json'], cwd=tmp_path, env=script_env(TMPDIR=str(tmp_path / 'tmp')),
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, both(result)
  said = re.search(r'^warning: 2 graphs compiled by epoch 2 step 3 \((\d+) before, (\d+) now\): '
                   r'each graph compiled after the first epoch stalls a TPU run while it compiles; '
                   r'why:\n  graph \w{8} \(\d+ inputs, [\d.]+ GB\): most likely user code trying '
                   rf'to access tensor value before torch_xla.sync, at forward \(mymodel.py:{branch}\); '
                   r'the first graph from that line\n  graph \w{8} .*, at train_one_epoch '
                   rf'\({SCRIPT}:\d+\); that line compiled graph \w{{8}} before, of the same inputs '
                   r'and bytes: a Python value or branch in the code it traced differs\n',
                   result.stderr, re.M)
  assert said and int(said[2]) == int(said[1]) + 2, result.stderr
  assert result.stderr.count('warning: ') == 1, result.stderr  # Nothing else is late.
  # Said after the line of step 3, the first after the branch's step 2; counted at the end too.
  out = result.stdout
  assert out.index('Epoch=2 Step=3 ') < out.index('Epoch 2 Replica Train'), out
  assert re.search(rf'^Graphs compiled: {said[2]}, 2 after epoch 1 \(see '
                   r'docs/performance.md#a-late-graph\)$', out, re.M), out
  assert read_json(tmp_path / 'r.json')['late_graphs'] == 2
  assert not list((tmp_path / 'tmp').iterdir())  # torch_xla's analysis file went with the run.


def test_a_run_whose_last_step_runs_away_ends_as_diverged_naming_the_weight_decay(tmp_path):
  # Its one step, the last, runs away: read as the epoch ends, though nothing is saved (it
  # ended with Accuracy=0.00 and exit code 0). A weight decay of 1e30 scales the weights by 0 or
  # less each step: the line names --weight_decay, not the --lr it did not set. (A run of --lr
  # 1e6 at the default decay is named by its --lr: tests/test_resnet_mp.py.)
  result = run_script(SCRIPT, '--fake_data', '--model', 'resnet18', '--img_dim', 16,
                      '--batch_size', 2, '--test_set_batch_size', 2, '--num_steps', 1,
                      '--num_epochs', 1, '--weight_decay', '1e30', '--results_json',
                      tmp_path / 'r.json')
  assert_one_error(result, 22, r'^error: the weights (reached \S+|became NaN or infinite) at '
                   r'epoch 1 step 0.*: training diverged; lower --weight_decay \(it is 1e\+30\) '
                   r'and run again \(exit code 22\)$')
  assert 'epoch 1 step 0' in read_json(tmp_path / 'r.json')['diverged']


def test_corrupt_image_names_the_file_in_the_last_line(tmp_path):
  data = make_image_folder(tmp_path / 'data', 'train', 8, size=16)
  make_image_folder(data, 'val', 1, size=16)
  (data / 'train' / 'red' / 'broken.png').write_bytes(b'\x89PNG\r\n\x1a\n not an image')
  # Output and errors into one file: with --seed 1 the broken image is in step 1's batch, and
  # step 0's line, printed by the log's thread, once came after the error.
  with open(tmp_path / 'out.txt', 'w') as out:
    code = subprocess.run([sys.executable, str(REPO / SCRIPT), '--datadir', str(data), '--model',
                           'resnet18', '--img_dim', '16', '--batch_size', '2', '--num_workers',
                           '1', '--num_epochs', '1', '--log_steps', '1', '--seed', '1'],
                          cwd=REPO, env=script_env(), stdout=out, stderr=subprocess.STDOUT,
                          timeout=300).returncode
  text = (tmp_path / 'out.txt').read_text()
  assert_one_error((code, text), 2, r'^error: cannot read image \S*train/red/broken\.png')
  assert text.rstrip('\n').split('\n')[-1].startswith('error: '), text


def _empty_class(tmp_path):
  data = make_image_folder(tmp_path / 'data', 'train', 2)
  make_image_folder(data, 'val', 1)
  (data / 'train' / 'purple').mkdir()
  (data / 'train' / 'purple' / 'notes.txt').write_text('no images here')
  return data


def _linked_folder(tmp, link, target):
  """A valid image folder, but for one symbolic link train/blue/LINK -> target."""
  make_image_folder(tmp / 'data', 'train', 2, size=8, seed=1)
  make_image_folder(tmp / 'data', 'val', 1, size=8, seed=2)
  (tmp / 'data' / 'train' / 'blue' / link).symlink_to(target)
  return tmp / 'data'


def _a_file(tmp):
  (tmp / 'a_file').write_text('not a folder')
  return tmp / 'a_file'


# A missing --datadir, an unknown --model and --batch_size 0: the same checks (supervisor.check_job,
# absl's lower bound) in tests/test_resnet_mp.py's cases of those names; 'zero steps' below says
# the lower bound's whole line.
BAD_INPUTS = {
    'no data flag': (lambda tmp: [], r'give --datadir DIR .* or --fake_data'),
    'empty datadir': (lambda tmp: ['--datadir', (tmp / 'train').mkdir() or tmp],
                      r'/train has no class folders'),
    'class without images': (lambda tmp: ['--datadir', _empty_class(tmp)],
                             r'class folder \S*train/purple has no images'),
    'a link loop': (lambda tmp: ['--datadir', _linked_folder(tmp, 'loop', '.')],
                    r'train reaches \S+/blue/0\.png twice, as \S+/blue/0\.png and as '
                    r'\S+/blue/loop/0\.png, through the symbolic link \S+/train/blue/loop: remove'),
    'a link into another class': (
        lambda tmp: ['--datadir', _linked_folder(tmp, 'red.png', '../red/1.png')],
        r'train reaches \S+/red/1\.png twice, as \S+/blue/red\.png and as \S+/red/1\.png, '
        r'through the symbolic link \S+/train/blue/red\.png: remove the link'),
    'zero steps': (lambda tmp: ['--fake_data', '--num_steps', 0],
                   r'--num_steps=0: 0 is not a positive integer'),
    'stray argument': (lambda tmp: ['--fake_data', 'resnet18'], r"unexpected arguments \['resnet18'\]"),
    'a momentum that must diverge': (lambda tmp: ['--fake_data', '--momentum', 1],
                                     r'^error: flag --momentum=1\.0: give a momentum below 1, such '
                                     r'as 0\.9: at 1 or more each step adds all of the last one'),
    'a weight decay past float32': (lambda tmp: ['--fake_data', '--weight_decay', '1e308'],
                                    r'^error: --weight_decay 1e\+308: give a finite number that '
                                    r'float32 holds \(at most 3\.4e\+38; see --helpshort\)$'),
    'amp and bf16': (lambda tmp: ['--fake_data', '--amp', '--bf16'],
                     r'give --amp or --bf16 \(XLA_USE_BF16=1\), not both'),
    'unwritable logdir': (lambda tmp: ['--fake_data', '--logdir', _a_file(tmp) / 'tb'],
                          r'cannot write to --logdir \S+/a_file/tb \(\w+Error'),
    'unwritable results_json': (lambda tmp: ['--fake_data', '--results_json',
                                             _a_file(tmp) / 'r.json'],
                                r'cannot write to --results_json \S+/a_file \(\w+Error'),
    'results_json a folder': (lambda tmp: ['--fake_data', '--results_json', tmp],
                              r'^error: --results_json (\S+) is a folder: give a file name, such as '
                              r'\1/results\.json$'),
    'unwritable ckpt_dir': (lambda tmp: ['--fake_data', '--ckpt_dir', _a_file(tmp) / 'ckpt'],
                            r'cannot write to --ckpt_dir \S+/a_file/ckpt \(\w+Error'),
}


@pytest.mark.parametrize('case', BAD_INPUTS)
def test_bad_input_is_one_clear_line_and_exit_2(tmp_path, case):
  make_args, message = BAD_INPUTS[case]
  result = run_script(SCRIPT, *make_args(tmp_path), '--img_dim', 16, timeout=120)
  assert_one_error(result, 2, message)
