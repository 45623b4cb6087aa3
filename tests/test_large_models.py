# SPDX-License-Identifier: BSD-3-Clause
"""A model larger than one chip: train_resnet_spmd.py's --sharding fsdp and hybrid on four
XLA:CPU devices, against batch (data parallel), and its sharded checkpoints, saved to the Cloud
Storage emulator and restored on another mesh. (The kill -9, SIGTERM and bitwise resume of an
fsdp run: tests/test_resnet_spmd.py.)"""

import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys

import fsspec
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from conftest import (COLOURS, REPO, SlowLink, assert_one_error, both, finish, index_chunks,
                      read_checkpoint, read_json, run_script, script_env, start_script,
                      training_losses)

SCRIPT = 'train_resnet_spmd.py'

# What a run restores, through the script's own start_run (its resume), dumped to a file: the
# weights and the optimizer's state on the CPU, under --sharding fsdp and batch. Then the
# resumes of REFUSED ([[--model, --resume], ...]), each refused: what it says, a line each. Last,
# the fsdp run's save to a bucket that stalls as the shards upload (STALLED: its address).
RESTORE = '''
import json, os, sys, types
import gcsfs
import torch
import train_resnet_spmd as script
import utils
script.FLAGS(sys.argv)
script.xr.use_spmd()

def start():
  cfg = types.SimpleNamespace(**script.FLAGS.flag_values_dict())
  devices = script.xr.global_runtime_device_count()
  return script.start_run(cfg, int(os.environ['CLASSES']), 6, lambda: 0,
                          script.build_mesh(cfg, devices, 1))
restored, runs = {}, {}
for sharding in ('fsdp', 'batch'):
  script.FLAGS.sharding = sharding
  run = start()
  restored[sharding] = dict(
      model={name: weight.cpu() for name, weight in script.weights(run.model).items()},
      optimizer={index: {name: value.cpu() for name, value in state.items()}
                 for index, state in run.optimizer.state_dict()['state'].items()})
  runs[sharding] = run
torch.save(restored, os.environ['RESTORED'])
for model, resume in json.loads(os.environ['REFUSED']):
  script.FLAGS.model, script.FLAGS.resume = model, resume
  try:
    start()
  except utils.UsageError as e:
    print(f'refused: {e}')
os.environ['STORAGE_EMULATOR_HOST'] = os.environ['STALLED']
gcsfs.GCSFileSystem.clear_instance_cache()
utils.BUCKET_SECONDS, runs['fsdp'].cfg.ckpt_dir = 2, 'gs://data/stalled'
try:
  script.save_checkpoint(runs['fsdp'], 2, 0)
except utils.UsageError as e:
  print(f'refused: {e}')
'''


def test_fsdp_and_hybrid_train_as_batch_does_and_shard_what_each_device_holds(
    tmp_path, colour_folder, bucket, monkeypatch):
  args = ['--datadir', colour_folder, '--model', 'resnet18', '--img_dim', 16, '--batch_size', 2,
          '--test_set_batch_size', 2, '--num_epochs', 1, '--num_steps', 3, '--log_steps', 1,
          '--lr', 0.005, '--num_workers', 0]
  four = script_env(CPU_NUM_DEVICES='4', **bucket)
  runs = {'batch': start_script(SCRIPT, *args, '--results_json', tmp_path / 'batch.json',
                                env=four),
          'hybrid': start_script(SCRIPT, *args, '--sharding', 'hybrid', '--fsdp_size', 2,
                                 '--use_gradient_checkpointing', '--results_json',
                                 tmp_path / 'hybrid.json', env=four)}
  outputs = {mode: finish(process) for mode, process in runs.items()}
  fsdp = run_script(SCRIPT, *args, '--sharding', 'fsdp', '--ckpt_dir', 'gs://data/fsdp',
                    '--ckpt_every_steps', 2, '--results_json', tmp_path / 'fsdp.json', env=four)
  outputs['fsdp'] = fsdp.returncode, fsdp.stdout + fsdp.stderr
  for mode, (code, out) in outputs.items():
    assert code == 0, f'{mode}\n{out[-3000:]}'
  assert re.search(r'^Mesh of 4 devices \(2 data x 2 fsdp, --sharding hybrid\); compiling',
                   outputs['hybrid'][1], re.M)

  # The same losses from the same seed: one program each, whose sums (the gradients' reduce-
  # scatter under fsdp, the blocks' recomputed activations) run in another order. Training
  # amplifies that, fast at 16 px (layer4's BatchNorm normalises 8 values per channel), as it
  # does four devices against one (tests/test_resnet_spmd.py): measured against batch, step 0
  # equal, step 1 within 2e-5, step 2 within 8e-4, step 4 apart by a tenth (at 32 px too).
  # Stated: steps 0 and 1 within 1e-4, step 2 within 1e-3 of the loss.
  losses = {mode: {step: float(loss) for step, loss in training_losses(out).items()}
            for mode, (code, out) in outputs.items()}
  assert len(losses['batch']) == 3
  for mode in ('fsdp', 'hybrid'):
    assert losses[mode].keys() == losses['batch'].keys()
    for (epoch, step), loss in losses['batch'].items():
      assert abs(losses[mode][epoch, step] - loss) <= (1e-4 if step < 2 else 1e-3 * loss), losses

  # What each device holds: a quarter of the weights and of their momentum under fsdp, a half
  # under hybrid's groups of 2 (up to the shards of a dimension that 4 does not divide).
  held = {mode: read_json(tmp_path / f'{mode}.json')['bytes_per_device'] for mode in losses}
  whole = held['batch']['weights']
  assert held['batch']['optimizer'] == whole > 40e6  # resnet18's 11.2M float32 weights
  for mode, share in (('fsdp', 4), ('hybrid', 2)):
    for kind in ('weights', 'optimizer'):
      assert whole / share <= held[mode][kind] <= whole / share * 1.01, (mode, kind, held)
  assert re.search(r'^Each device holds 11\.\d MB of weights and 11\.\d MB of optimizer state$',
                   outputs['fsdp'][1], re.M)

  # The checkpoint, on the bucket: the file, and beside it the folder of shards it names, in
  # which each weight and its momentum are four chunks, one per device, each a quarter of it.
  for name, value in bucket.items():
    monkeypatch.setenv(name, value)
  fs = fsspec.filesystem('gs', skip_instance_cache=True)
  assert sorted(fs.ls('data/fsdp', detail=False)) == [
      'data/fsdp/best.pt', 'data/fsdp/ckpt-00000002', 'data/fsdp/ckpt-00000002.pt',
      'data/fsdp/ckpt-00000003', 'data/fsdp/ckpt-00000003.pt']
  fs.get('data/fsdp/', str(tmp_path / 'fsdp'), recursive=True)
  saved = read_checkpoint(tmp_path / 'fsdp' / 'ckpt-00000003.pt')
  assert saved['shards'] == 'ckpt-00000003' and (saved['epoch'], saved['step']) == (2, 0)
  index = FileSystemReader(tmp_path / 'fsdp' / 'ckpt-00000003').read_metadata()
  parameters = [name for name in saved['model'] if not re.search(r'running_|num_batches', name)]
  for name in parameters:
    tensor = index.state_dict_metadata[f'model.{name}']
    momentum = index.state_dict_metadata[f'optimizer.{parameters.index(name)}.momentum_buffer']
    for stored in (tensor, momentum):
      sizes = [list(chunk.sizes) for chunk in stored.chunks]
      largest = max(range(len(stored.size)), key=lambda dim: stored.size[dim])
      quarter = list(stored.size)
      quarter[largest] //= 4
      assert len(sizes) == 4 and (stored.size[largest] % 4 or sizes == [quarter] * 4), (name, sizes)

  # Damaged copies: shards cut short after they were written, and an index crafted to run a
  # command as it loads.
  damaged = tmp_path / 'damaged'
  fs.get('data/fsdp/', str(damaged), recursive=True)
  for shards in (damaged / 'ckpt-00000002').glob('*.distcp'):
    shards.write_bytes(shards.read_bytes()[:100_000])

  class Command:
    def __reduce__(self):
      return os.system, (f'touch {tmp_path / "ran"}',)
  (damaged / 'ckpt-00000003' / '.metadata').write_bytes(pickle.dumps(Command()))
  # And a folder put in another's place: step 2's shards, of the same model, under step 3's name.
  swapped = tmp_path / 'swapped'
  fs.get('data/fsdp/', str(swapped), recursive=True)
  shutil.rmtree(swapped / 'ckpt-00000003')
  shutil.copytree(swapped / 'ckpt-00000002', swapped / 'ckpt-00000003')

  # Restored on two devices under fsdp, and under batch, from the bucket: the very weights and
  # optimizer state saved on four (resharded: each device reads its own part). Then another
  # model, the damaged ones and the swapped one: each one line, before anything trains; the
  # command not run. Then a save whose upload stalls: one deadline (2 s) and one line, and no
  # request after the one that stalled (neither the file's last part nor its removal).
  restored = tmp_path / 'restored.pt'
  refused = [['resnet34', 'gs://data/fsdp/ckpt-00000003.pt'],
             ['resnet18', str(damaged / 'ckpt-00000002.pt')],
             ['resnet18', str(damaged / 'ckpt-00000003.pt')],
             ['resnet18', str(swapped / 'ckpt-00000003.pt')]]
  link = SlowLink(int(bucket['STORAGE_EMULATOR_HOST'].rsplit(':', 1)[1]), when=b'__0_0.distcp')
  result = subprocess.run(
      [sys.executable, '-c', RESTORE, *map(str, args), '--num_epochs', '2', '--resume',
       'gs://data/fsdp/ckpt-00000003.pt'],
      cwd=REPO, env=script_env(CPU_NUM_DEVICES='2', CLASSES=str(len(COLOURS)),
                               RESTORED=str(restored), REFUSED=json.dumps(refused),
                               STALLED=f'http://127.0.0.1:{link.port}', **bucket),
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, both(result)
  assert len(re.findall(r'^Resumed from gs://data/fsdp/ckpt-00000003\.pt at epoch 2 step 0$',
                        result.stdout, re.M)) == 2, result.stdout
  cannot_read = (r'nothing was changed; make it readable, or move it out of --ckpt_dir to resume '
                 r'from the one before')
  lines = [r'checkpoint gs://data/fsdp/ckpt-00000003\.pt holds another model: \S+ is .* there, .* '
           r'here \(\d+ of \d+ weights differ\); it was saved .*with --model resnet18 \(resnet34 '
           r'now\): give the flags of that run, or another --ckpt_dir',
           rf'cannot read checkpoint \S+ckpt-00000002 \(\w+Error: .*\): {cannot_read}',
           r"cannot read checkpoint \S+ckpt-00000003 \(UnpicklingError: posix\.system is not part "
           rf"of a checkpoint's index\): {cannot_read}",
           r'\S+swapped/ckpt-00000003 is not the folder of shards saved with \S+swapped/'
           r'ckpt-00000003\.pt \(its index names another save\): nothing was changed; put back the '
           r'folder saved with it, or move both out of --ckpt_dir to resume from the one before',
           r'cannot write checkpoint gs://data/stalled/ckpt-00000003: a request to the bucket took '
           r'over 2 s; check the network, then run the same command again']
  said = re.findall(r'^refused: (.*)$', result.stdout, re.M)
  assert len(said) == 5, said
  assert link.trickle and link.later == 0, link.later
  for line, text in zip(lines, said):
    assert re.fullmatch(line, text), text
  assert not (tmp_path / 'ran').exists()
  for sharding, state in torch.load(restored, weights_only=True).items():
    assert state['model'].keys() == saved['model'].keys()
    differ = [name for name, weight in saved['model'].items()
              if not torch.equal(state['model'][name], weight)]
    assert not differ, (sharding, differ[:3])
    for index, values in saved['optimizer']['state'].items():
      assert torch.equal(state['optimizer'][index]['momentum_buffer'], values['momentum_buffer'])


def test_sharding_mistakes_are_one_line_naming_what_to_give(tmp_path):
  env = script_env(CPU_NUM_DEVICES='4')
  for args, message in [
      (['--sharding', 'spatial'], r"^error: flag --sharding=spatial: upstream's spatial, conv and "
       r'linear shard one layer\'s activations as demonstrations; a model larger than one chip '
       r'trains with --sharding fsdp \(hybrid across slices\)$'),
      (['--sharding', 'tensor'], r'^error: flag --sharding=tensor: value should be one of '
       r'<batch\|fsdp\|hybrid> \(see --helpshort\)$'),
      (['--sharding', 'hybrid'], r'^error: flags sharding=hybrid, fsdp_size=None: --sharding hybrid takes '
       r'--fsdp_size N'),
      (['--sharding', 'hybrid', '--fsdp_size', 3, '--fake_data', '--model', 'resnet18',
        '--img_dim', 16], r'^error: --fsdp_size 3 does not divide the 4 devices: give a divisor, '
       r"such as 4 \(one host's\)$")]:
    assert_one_error(run_script(SCRIPT, *args, env=env, timeout=300), 2, message)
  # A checkpoint of one file (another script's) is not taken for this script's sharded kind.
  ckpt = tmp_path / 'ckpt-00000001.pt'
  torch.save(dict(model={}, flags={}, results={'script': 'train_resnet_mp.py'}, epoch=1, step=1,
                  global_step=1), ckpt)
  assert_one_error(run_script(SCRIPT, '--fake_data', '--model', 'resnet18', '--img_dim', 16,
                              '--resume', ckpt, env=env, timeout=300), 2,
                   r'^error: checkpoint \S+ckpt-00000001\.pt is one file \(by train_resnet_mp\.py\) '
                   r'and train_resnet_spmd\.py resumes only sharded checkpoints: give one of a run '
                   r'of this script as it is now, or another --ckpt_dir$')


# sharded_checkpoints' rotation, six saves in a row (steps 1 to 6, the best at 1 and 4,
# --keep_checkpoints 2), each folder of "shards" one file, in a folder that holds the shards of
# a save cut short (step 0, no file) and of a newer one (step 9, which a resume passed over):
# what is left after each.
ROTATION = '''
import json, os, sys
import sharded_checkpoints
def shards(folder):
  os.makedirs(folder, exist_ok=True)
  open(os.path.join(folder, '__0_0.distcp'), 'w').close()
ckpt_dir = sys.argv[1]
shards(os.path.join(ckpt_dir, 'ckpt-00000000'))
shards(os.path.join(ckpt_dir, 'ckpt-00000009'))
for step in range(1, 7):
  sharded_checkpoints.write_with_folder(dict(global_step=step, model={}, flags={}, results={},
                                             epoch=1, step=step), ckpt_dir, 2, step in (1, 4), shards)
  print(json.dumps(sorted(os.listdir(ckpt_dir))))
'''


def test_sharded_checkpoints_rotate_with_their_folders_and_keep_the_one_best_pt_names(tmp_path):
  ckpt_dir = tmp_path / 'ckpt'
  result = subprocess.run([sys.executable, '-c', ROTATION, str(ckpt_dir)], cwd=REPO,
                          env=script_env(), capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, both(result)
  listings = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('[')]
  pairs = lambda *steps: [name for step in steps for name in (f'ckpt-{step:08d}',  # noqa: E731
                                                              f'ckpt-{step:08d}.pt')]
  newer = 'ckpt-00000009'  # Stays: a newer step's folder.
  assert listings[0] == ['best.pt', *pairs(1), newer]  # The older folder no file named is gone.
  assert listings[2] == ['best.pt', 'ckpt-00000001', *pairs(2, 3), newer]  # best.pt's stays.
  # Step 4 is the best now: the folder best.pt alone kept (step 1's) goes.
  assert listings[3] == ['best.pt', *pairs(3, 4), newer]
  assert listings[5] == ['best.pt', 'ckpt-00000004', *pairs(5, 6), newer]
  assert torch.load(ckpt_dir / 'best.pt', weights_only=True)['shards'] == 'ckpt-00000004'


def assert_same_state(ours, theirs):
  """Two checkpoints hold bitwise equal weights and optimizer state, all of it."""
  assert ours['model'].keys() == theirs['model'].keys()
  differ = [name for name in ours['model'] if not torch.equal(ours['model'][name],
                                                              theirs['model'][name])]
  assert not differ, f'{len(differ)} weights differ, e.g. {differ[0]}'
  assert ours['optimizer']['state'].keys() == theirs['optimizer']['state'].keys()
  for index, values in theirs['optimizer']['state'].items():
    for name, value in values.items():
      assert torch.equal(ours['optimizer']['state'][index][name], value), (index, name)


def test_the_docs_adamw_under_fsdp_resumes_mid_epoch_as_the_run_it_goes_on(tmp_path):
  # docs/adapt.md's build_optimizer, put in place of the script's in a copy of the kit, under
  # --sharding fsdp on 3 devices, which divide none of the head's 1000 rows. A fresh run, and
  # the same command in a folder that holds what a run killed after its third save left (epoch
  # 2 step 2): the resume holds on each device what the fresh run does (the moments sharded,
  # not whole), compiles the graphs it compiled (AdamW's state made before the first step in
  # both), and saves checkpoints equal to the fresh run's, bit for bit and chunk for chunk.
  # (AdamW resumed after a kill -9 at a random step: tests/test_decoder.py.)
  page = (REPO / 'docs' / 'adapt.md').read_text()
  block = re.search(r'^```python\n(def build_optimizer\(.*?)^```', page, re.M | re.S)[1]
  source = (REPO / SCRIPT).read_text()
  ours = re.search(r'^def build_optimizer\(.*?(?=^\S)', source, re.M | re.S)[0]
  project = tmp_path / 'project'
  project.mkdir()
  (project / SCRIPT).write_text(source.replace(ours, block + '\n\n'))
  for name in ('utils.py', 'sharded_checkpoints.py', 'supervisor.py', 'command.py'):
    (project / name).write_text((REPO / name).read_text())
  args = [sys.executable, SCRIPT, '--fake_data', '--model', 'resnet18', '--img_dim', '16',
          '--batch_size', '2', '--num_steps', '4', '--num_epochs', '2', '--sharding', 'fsdp',
          '--ckpt_every_steps', '2', '--lr', '0.001', '--log_steps', '1', '--keep_checkpoints',
          '10']
  env = script_env(CPU_NUM_DEVICES='3')
  assert_one_error(subprocess.run([*args, '--lr', '0.1'], cwd=project, env=env,
                                  capture_output=True, text=True, timeout=300), 2,
                   r"^error: --lr 0\.1 is SGD's rate: give AdamW's, such as 0\.001$")

  def run(name):
    return subprocess.Popen([*args, '--ckpt_dir', tmp_path / name, '--results_json',
                             tmp_path / f'{name}.json'], cwd=project, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  code, fresh = finish(run('fresh'))
  assert code == 0, fresh
  assert re.search(r'^Recipe: AdamW, lr 0\.001 constant, weight decay 0\.0001 \(', fresh, re.M)
  held = read_json(tmp_path / 'fresh.json')
  assert re.search(r'^Each device holds 15\.6 MB of weights and 31\.\d MB of optimizer state$',
                   fresh, re.M), fresh  # A third of resnet18's 46.8 MB, and of its 2 moments.
  saved = {8: read_checkpoint(tmp_path / 'fresh' / 'ckpt-00000008.pt')}
  for step in (6,):
    (tmp_path / f'from{step}').mkdir()
    shutil.copy(tmp_path / 'fresh' / f'ckpt-{step:08d}.pt', tmp_path / f'from{step}')
    shutil.copytree(tmp_path / 'fresh' / f'ckpt-{step:08d}', tmp_path / f'from{step}' /
                    f'ckpt-{step:08d}')
  resumes = {step: run(f'from{step}') for step in (6,)}
  for step, process in resumes.items():
    code, out = finish(process)
    assert code == 0, out
    epoch = 1 + step // 4
    assert re.search(rf'^Resumed from \S+ckpt-{step:08d}\.pt at epoch {epoch} step 2$', out, re.M)
    results = read_json(tmp_path / f'from{step}.json')
    assert results['bytes_per_device'] == held['bytes_per_device'], out
    assert results['compilations'] == held['compilations'], out
    assert re.search(rf'^Graphs compiled: {results["compilations"]}, none after epoch {epoch}$',
                     out, re.M), out
    assert 'GSPMD' not in out and 'Traceback' not in out, out  # XLA's C++ warnings: quiet.
    for later in [later for later in saved if later > step]:
      name = f'ckpt-{later:08d}'
      assert_same_state(read_checkpoint(tmp_path / f'from{step}' / f'{name}.pt'), saved[later])
      assert (index_chunks(tmp_path / f'from{step}' / name) ==
              index_chunks(tmp_path / 'fresh' / name)), (step, later)
  # The moments are three chunks each, as the weights are (a third each, or none padded).
  chunks = index_chunks(tmp_path / 'fresh' / 'ckpt-00000008')
  assert len(chunks['optimizer.0.exp_avg']) == len(chunks['model.conv1.weight']) == 3, chunks


class _Reduced:
  """Pickles as the call getattr(owner, name), as Python 3.11.2 (Debian 12's python3) pickles
  an Enum member."""

  def __init__(self, owner, name):
    self.owner, self.name = owner, name

  def __reduce__(self):
    return getattr, (self.owner, self.name)


def test_the_shards_index_takes_an_enum_member_pickled_by_getattr_and_nothing_else():
  # Under Python 3.11.2 the index's _MEM_FORMAT_ENCODING member came as getattr(class, name),
  # and every sharded checkpoint was refused there. Any other getattr is still refused.
  import sharded_checkpoints
  from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING
  member = next(iter(_MEM_FORMAT_ENCODING))

  def load(owner, name):
    data = pickle.dumps(_Reduced(owner, name), protocol=4)  # As torch writes the index.
    return sharded_checkpoints.ShardsReader.Unpickler(io.BytesIO(data)).load()

  assert load(_MEM_FORMAT_ENCODING, member.name) is member
  for owner, name in ((_MEM_FORMAT_ENCODING, '__class__'), (torch.Size, 'count')):
    with pytest.raises(pickle.UnpicklingError, match=r"^getattr\(.*\) is not part of a "
                       r"checkpoint's index$"):
      load(owner, name)


# A batch of other ranks through the script's own device loader on 4 devices: the rows each
# device holds of each entry.
BATCH_ROWS = '''
import sys, types
import torch, torch_xla
import torch_xla.distributed.spmd as xs
import train_resnet_spmd as script
script.FLAGS(sys.argv)
script.xr.use_spmd()
cfg = types.SimpleNamespace(**script.FLAGS.flag_values_dict())
mesh = script.build_mesh(cfg, script.xr.global_runtime_device_count(), 1)
rows = torch.arange(8)
batch = dict(tokens=rows[:, None] * 100 + torch.arange(5), labels=rows,
             images=rows.float().view(8, 1, 1, 1).expand(8, 3, 4, 4).contiguous())
for batch in script.sharded([[batch]], mesh, cfg)[0]:
  for name, tensor in batch.items():
    shards = xs.XLAShardedTensor(tensor).local_shards
    print(name, [[int(row) for row in shard.data.reshape(len(shard.data), -1)[:, 0]]
                 for shard in shards], [list(shard.data.shape[1:]) for shard in shards][0])
'''


def test_a_batch_of_tokens_is_split_across_the_devices_as_images_are(tmp_path):
  # A (N, T) batch of token ids, beside (N,) labels and (N, C, H, W) images: each of 4 devices
  # holds its quarter of the rows of each, whole along the other dimensions (one spec of the
  # images' rank sent the tokens whole to every device).
  result = subprocess.run([sys.executable, '-c', BATCH_ROWS, '--sharding', 'fsdp'], cwd=REPO,
                          env=script_env(CPU_NUM_DEVICES='4'), capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 0, both(result)
  quarters = '[[0, 1], [2, 3], [4, 5], [6, 7]]'
  assert result.stdout.splitlines() == [
      'tokens [[0, 100], [200, 300], [400, 500], [600, 700]] [5]', f'labels {quarters} []',
      f'images {quarters} [3, 4, 4]'], result.stdout


def test_a_storage_failure_is_one_line_and_a_planners_bug_its_traceback():
  # What sharded_checkpoints says of a save or load of shards that failed, as dcp raises it
  # (a CheckpointException holding each rank's exception): the disk's, the network's or a
  # shard file's failure as one line; anything else (a bug in a planner) as it is.
  import sharded_checkpoints
  import utils
  from torch.distributed.checkpoint.api import CheckpointException

  def said(error):
    return sharded_checkpoints.shards_error(CheckpointException('write', {0: (error, [])}),
                                            'cannot write checkpoint F', 'free space')
  full = said(OSError(28, 'No space left on device'))
  assert str(full) == ('cannot write checkpoint F (OSError: [Errno 28] No space left on device): '
                       'free space')
  cut = said(RuntimeError('[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598'))
  assert isinstance(cut, utils.UsageError) and 'unexpected pos 704' in str(cut)
  for bug in (KeyError('model.fc.weight'), RuntimeError('shape mismatch in the plan'), TypeError()):
    assert said(bug) is bug
