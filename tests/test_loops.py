# SPDX-License-Identifier: BSD-3-Clause
"""The four training scripts repeat their loop on purpose (each is read and copied alone), and
it stays one loop: the functions that do the same job are the same text in all four, but for
the differences declared here, each once, with why. A change to one copy goes into all four."""

import ast
import difflib

from conftest import REPO

SCRIPTS = ['train_resnet_mp.py', 'train_resnet_spmd.py', 'train_single_core.py',
           'train_wds_cifar.py']
REFERENCE = 'train_resnet_mp.py'  # The others are it, with the differences below.
FUNCTIONS = ['build_optimizer', 'train_step', 'train_one_epoch', 'evaluate', 'save_checkpoint', 'restore_checkpoint',
             'stop_run', 'end_epoch', 'train', '_mp_fn']
MESH = ('train_resnet_spmd.py',)
ONE_DEVICE = ('train_single_core.py',)
SHARDS = ('train_wds_cifar.py',)
NO_SPAWN = MESH + ONE_DEVICE
NO_DDP = MESH + ONE_DEVICE + SHARDS

# (scripts, why, [(the reference's text, theirs), ...]): each text replaced wherever it stands
# in the reference's functions.
DIFFERENCES = [
    (NO_DDP, "--ddp is train_resnet_mp.py's, for torch.distributed code brought to it: the others "
     'step as they did',
     [("""  # --ddp: DDP's wrapper, whose backward all-reduces the gradients, on a step's last batch only
  # (no_sync before it: each replica adds up its own, n - 1 all-reduces fewer a step).
  with run.ddp.no_sync() if run.ddp and i < n else contextlib.nullcontext():
    # --amp: bfloat16 has float32's range, so no gradient scaler (see docs/tpu.md).
    with torch.autocast('xla', dtype=torch.bfloat16, enabled=cfg.amp):
      output = (run.ddp or run.model)(utils.normalize(images))
      loss = F.cross_entropy(utils.check_scores(output, labels, cfg.num_classes), labels) / n
    loss.backward()  # Added to the gradients of the step's batches before.""",
       """  # --amp: bfloat16 has float32's range, so no gradient scaler (see docs/tpu.md).
  with torch.autocast('xla', dtype=torch.bfloat16, enabled=cfg.amp):
    output = run.model(utils.normalize(images))
    loss = F.cross_entropy(utils.check_scores(output, labels, cfg.num_classes), labels) / n
  loss.backward()  # Added to the gradients of the step's batches before."""),
      ("""    if run.ddp:  # DDP's backward has all-reduced the gradients.
      optimizer.step()
    else:
      xm.optimizer_step(optimizer)  # All-reduces the gradients over every replica, then steps.""",
       """    xm.optimizer_step(optimizer)  # All-reduces the gradients over every replica, then steps.""")]),
    (NO_SPAWN, 'no spawn: one process (a host\'s, or the only one), whose failure main says',
     [("""A replica that fails raises (utils.replica ends the run).""",
       """A run that fails raises (main says why).""")]),
    (MESH, 'the mesh: the loss is the global batch\'s mean; the compiler reduces its gradients',
     [("""    xm.optimizer_step(optimizer)  # All-reduces the gradients over every replica, then steps.""",
       """    # Not xm.optimizer_step: the loss is the global batch's mean, whose gradients the compiler
    # has already reduced over the mesh.
    optimizer.step()""")]),
    (MESH, 'the mesh: a batch is a dict, whose keys MpDeviceLoader shards each their own way',
     [("""    for i, (images, labels) in enumerate(batches, 1):""",
       """    for i, batch in enumerate(batches, 1):"""),
      ("""        loss = loss + train_step(run, images, labels, (i, len(batches)))""",
       """        loss = loss + train_step(run, batch['images'], batch['labels'], (i, len(batches)))"""),
      ("""        labels = torch.cat([labels for _, labels in batches])""",
       """        labels = torch.cat([batch['labels'] for batch in batches])"""),
      ("""    for images, labels in loader:""",
       """    for batch in loader:
      images, labels = batch['images'], batch['labels']""")]),
    (MESH, 'the mesh: a step trains the global batch, --batch_size on each device of every host',
     [("""                   cfg.batch_size * cfg.gradient_accumulation_steps * world_size, run.log)""",
       """                   cfg.batch_size * cfg.gradient_accumulation_steps * devices, run.log)"""),
      ("""      print(f'Epoch {epoch} Replica Train Samples={samples} Device={device}/{rank}', flush=True)
      rate = xm.mesh_reduce('epoch_rate', samples / seconds, sum)""",
       """      print(f'Epoch {epoch} Host Train Samples={samples * local_devices} '
            f'Devices={local_devices} of {devices} Host={host}', flush=True)
      rate = samples * devices / seconds  # Every host runs every step.""")]),
    (MESH, 'the mesh: its sums are over every device already, no all-reduce',
     [("""  # Counted on the device and read once at the end: an .item() per step would sync.""",
       """  # Counted on the device and read once at the end: an .item() per step would sync. The
  # sums over the sharded batch are over every device of every host.""")]),
    (MESH + ONE_DEVICE, 'one program: its counts are every image\'s, no replicas to sum over',
     [("""  # Sums, not a mean of replica accuracies: replicas may hold different numbers of images.
  correct, total = xm.all_reduce(xm.REDUCE_SUM, counts).tolist()""",
       """  correct, total = counts.tolist()""")]),
    (MESH, 'the mesh: one process per host drives every device of the mesh (start_run says it)',
     [("""  rank, world_size, device = xr.global_ordinal(), xr.world_size(), torch_xla.device()
  train_loader, test_loader, num_classes = load_data(cfg, rank, world_size)
  run = start_run(cfg, num_classes, train_loader.steps, stop_signal)
  results = run.results
  train_device_loader, test_device_loader = device_loaders((train_loader, test_loader), cfg)
  if run.epoch <= cfg.num_epochs:  # Else: 'Run already finished'.
    xm.master_print(f'Replicas started: {world_size}; compiling the first step ...', flush=True)""",
       """  host, hosts, devices = xr.process_index(), xr.process_count(), xr.global_runtime_device_count()
  mesh, local_devices = build_mesh(cfg, devices, hosts), xr.addressable_runtime_device_count()
  train_loader, test_loader, num_classes = load_data(cfg, host, hosts, local_devices)
  run = start_run(cfg, num_classes, train_loader.steps, stop_signal, mesh)
  results = run.results
  train_device_loader, test_device_loader = sharded((train_loader, test_loader), mesh, cfg)""")]),
    (MESH, 'the mesh: the weights may be sharded, so each host saves and loads its own shards, '
     'under the names of the model unwrapped, and says what each device holds',
     [("""  state = dict(model=run.model.state_dict(), optimizer=run.optimizer.state_dict(),""",
       """  state = dict(model=weights(run.model), optimizer=run.optimizer.state_dict(),"""),
      ("""  return utils.write_checkpoint(state, run.cfg.ckpt_dir, run.cfg.keep_checkpoints, best)""",
       """  return sharded_checkpoints.write_sharded(state, run.cfg.ckpt_dir, run.cfg.keep_checkpoints,
                                           best)"""),
      ("""  run.model.load_state_dict(state['model'])""",
       """  # The weights in place; the rest returned.
  state = sharded_checkpoints.read_sharded(state, weights(run.model), run.optimizer)"""),
      ("""      results['train_seconds'] += seconds
""",
       """      results['train_seconds'] += seconds
      say_held(run, epoch, steps)
""")]),
    (ONE_DEVICE, 'one device: no replicas, so no gradients to all-reduce and no rates to sum',
     [("""    xm.optimizer_step(optimizer)  # All-reduces the gradients over every replica, then steps.""",
       """    xm.optimizer_step(optimizer)"""),
      ("""  rank, world_size, device = xr.global_ordinal(), xr.world_size(), torch_xla.device()""",
       """  rank, world_size, device = 0, 1, torch_xla.device()"""),
      ("""    xm.master_print(f'Replicas started: {world_size}; compiling the first step ...', flush=True)""",
       """    xm.master_print(f'Device {device}; compiling the first step ...', flush=True)"""),
      ("""      rate = xm.mesh_reduce('epoch_rate', samples / seconds, sum)""",
       """      rate = samples / seconds""")]),
    (ONE_DEVICE, 'one device: no model recipes, so --lr\'s default is the default rate',
     [("""                       recipe(run.cfg)[1]['lr'])""",
       """                       FLAGS['lr'].default)""")]),
    (SHARDS, 'the shards: CIFAR-10\'s mean and std at its 32 px and below (see mean_std)',
     [("""utils.normalize(images)""", """utils.normalize(images, *mean_std(cfg.img_dim))""")]),
    (SHARDS, 'the shards: bad data is skipped and counted, and said at the end of each epoch',
     [("""      results['train_seconds'] += seconds
""",
       """      results['train_seconds'] += seconds
      count_data(results, train_loader.order.read_counts(), epoch, rank, cfg.trainsize)
"""),
      ("""        xm.master_print(f'Epoch {epoch} test end {test_utils.now()}, Accuracy={accuracy:.2f}',
                        flush=True)""",
       """        count_test_data(cfg, int(test_loader.loader.dataset.counts.sum()), counts[1], epoch, rank)
        xm.master_print(f'Epoch {epoch} test end {test_utils.now()}, ' + (
            f'Accuracy={accuracy:.2f}' if counts[1] else NO_TEST_SAMPLE), flush=True)""")]),
]
# Functions a script does not have, and why.
ABSENT = {('_mp_fn', script): 'no spawn: main runs train() itself' for script in NO_SPAWN}


def functions(script):
  """{name: (first line number, its lines)} of the script's FUNCTIONS."""
  source = (REPO / script).read_text()
  lines = source.splitlines()
  return {node.name: (node.lineno, lines[node.lineno - 1:node.end_lineno])
          for node in ast.parse(source).body
          if isinstance(node, ast.FunctionDef) and node.name in FUNCTIONS}


def unexpected(script, name, expected, found, first_line):
  """The lines where found differs from expected, named by the script's line numbers, as a diff
  (- expected, + found)."""
  said = []
  matcher = difflib.SequenceMatcher(a=expected, b=found, autojunk=False)
  for kind, a1, a2, b1, b2 in matcher.get_opcodes():
    if kind != 'equal':
      where = (f'line {first_line + b1}' if b2 - b1 == 1 else f'before line {first_line + b1}'
               if b1 == b2 else f'lines {first_line + b1}-{first_line + b2 - 1}')
      said.append(f'{script} {where} ({name}), where {REFERENCE} with the declared differences '
                  'has the - lines:\n' + '\n'.join([f'-{line}' for line in expected[a1:a2]] +
                                                   [f'+{line}' for line in found[b1:b2]]))
  return said


def test_the_four_loops_differ_only_where_declared():
  reference = functions(REFERENCE)
  assert sorted(reference) == sorted(FUNCTIONS)
  problems, used = [], set()
  for script in SCRIPTS[1:]:
    theirs = functions(script)
    for name in FUNCTIONS:
      if (name, script) in ABSENT or name not in theirs:
        if (name, script) not in ABSENT:
          problems.append(f'{script} has no {name}: write it as {REFERENCE} has it')
        elif name in theirs:
          problems.append(f'{script} has {name}, declared absent: remove that from ABSENT')
        continue
      text = '\n'.join(reference[name][1])
      for number, (scripts, why, replacements) in enumerate(DIFFERENCES):
        if script in scripts:
          for old, new in replacements:
            if old in text:
              text = text.replace(old, new)
              used.add((number, old, script))
      problems += unexpected(script, name, text.splitlines(), theirs[name][1], theirs[name][0])
  for number, (scripts, why, replacements) in enumerate(DIFFERENCES):
    for script in scripts:
      for old, _ in replacements:
        if (number, old, script) not in used:
          problems.append(f'declared for {script} ({why}), but {REFERENCE} has no {old!r} '
                          'there: remove it, or write the reference as it is')
  assert not problems, '\n\n'.join(problems)
