# SPDX-License-Identifier: BSD-3-Clause
"""The five training scripts repeat their loop on purpose (each is read and copied alone), and
it stays one loop: the functions that do the same job are the same text in all five, but for
the differences declared here, each once, with why. A change to one copy goes into all five."""

import ast
import difflib

from conftest import REPO

SCRIPTS = ['train_resnet_mp.py', 'train_resnet_spmd.py', 'train_single_core.py',
           'train_wds_cifar.py', 'train_decoder_spmd.py']
REFERENCE = 'train_resnet_mp.py'  # The others are it, with the differences below.
FUNCTIONS = ['build_optimizer', 'train_step', 'train_one_epoch', 'evaluate', 'save_checkpoint', 'restore_checkpoint',
             'stop_run', 'end_epoch', 'train', '_mp_fn']
DECODER = ('train_decoder_spmd.py',)
MESH = ('train_resnet_spmd.py',) + DECODER
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
    (DECODER, "the decoder: AdamW, no weight decay on norms and biases (nanoGPT's and Llama's "
     'recipe)',
     [("""  """ + '"""' + """The optimizer of the model's parameters: SGD with --lr, --momentum and --weight_decay. Put
  yours here (docs/adapt.md shows AdamW); a restore gives back its state_dict whatever it holds.
  A flag value it cannot take: raise utils.UsageError (one `error:` line, exit code 2).""" + '"""' + """
  return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                         weight_decay=cfg.weight_decay)""",
       """  """ + '"""' + """AdamW with --lr and --weight_decay on the matrices (embeddings and linear layers), none on
  the norms and biases. Put yours here; a restore gives back its state_dict whatever it holds. A
  flag value it cannot take: raise utils.UsageError (one `error:` line, exit code 2).""" + '"""' + """
  matrices = [p for p in model.parameters() if p.dim() >= 2]
  others = [p for p in model.parameters() if p.dim() < 2]
  return torch.optim.AdamW([dict(params=matrices, weight_decay=cfg.weight_decay),
                            dict(params=others, weight_decay=0.0)], lr=cfg.lr, betas=BETAS)"""),
      ("""  """ + '"""' + """Puts save_checkpoint's state back into the run, with the --lr, --momentum and
  --weight_decay given now (utils.new_recipe); returns what those changed.""" + '"""',
       """  """ + '"""' + """Puts save_checkpoint's state back into the run, with the --lr and --weight_decay given now
  (utils.new_recipe); returns what those changed.""" + '"""')]),
    (DECODER, 'the decoder: windows of tokens and their next tokens, the loss at every position, '
     'the gradients clipped to --max_grad_norm',
     [("""def train_step(run, images, labels, part=(1, 1)):""",
       """def train_step(run, tokens, targets, part=(1, 1)):"""),
      ("""  of n, n --gradient_accumulation_steps), steps. Returns the loss / n.""" + '"""',
       """  of n, n --gradient_accumulation_steps), clips them and steps. Returns the loss / n.""" + '"""'),
      ("""    output = run.model(utils.normalize(images))
    loss = F.cross_entropy(utils.check_scores(output, labels, cfg.num_classes), labels) / n""",
       """    loss = lm_loss(run.model(tokens), targets, cfg.vocab_size) / n"""),
      ("""  if i == n:
    # Not xm.optimizer_step""",
       """  if i == n:
    if cfg.max_grad_norm:  # The global norm over every shard of every gradient.
      torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.max_grad_norm)
    # Not xm.optimizer_step"""),
      ("""        loss = loss + train_step(run, batch['images'], batch['labels'], (i, len(batches)))""",
       """        loss = loss + train_step(run, batch['tokens'], batch['targets'], (i, len(batches)))"""),
      ("""        labels = torch.cat([batch['labels'] for batch in batches])
        tracker.add(len(labels))""",
       """        targets = torch.cat([batch['targets'] for batch in batches]).flatten()
        tracker.add(len(targets) // cfg.seq_len)"""),
      ("""        # label is none of the classes.
        stopping = run.stop.agreed_after_step(loss, labels, f'epoch {epoch} step {step}')""",
       """        # target is none of the vocabulary's ids.
        stopping = run.stop.agreed_after_step(loss, targets, f'epoch {epoch} step {step}')"""),
      ("""  train_loader, test_loader, num_classes = load_data(cfg, host, hosts, local_devices)
  run = start_run(cfg, num_classes, train_loader.steps, stop_signal, mesh)""",
       """  train_loader, test_loader, vocab_size = load_data(cfg, host, hosts, local_devices)
  run = start_run(cfg, vocab_size, train_loader.steps, stop_signal, mesh)""")]),
    (DECODER, 'the decoder: its evaluation is the loss over every token (and its perplexity), '
     'best.pt the lowest; tokens/s beside samples/s; no target, so its end says the loss',
     [("""  """ + '"""' + """(accuracy %, correct, total) over every image once; padding (label -1) is not counted.""" + '"""',
       """  """ + '"""' + """(mean loss, its summed loss, tokens) over every window once; padding (-1) is not counted.""" + '"""'),
      ("""  counts = torch.zeros(2, dtype=torch.int64, device=torch_xla.device())""",
       """  sums = torch.zeros(2, dtype=torch.float32, device=torch_xla.device())"""),
      ("""      images, labels = batch['images'], batch['labels']
      hits = (model(utils.normalize(images)).argmax(dim=1) == labels).sum()
      counts += torch.stack([hits, (labels >= 0).sum()])
  correct, total = counts.tolist()
  return 100.0 * correct / max(total, 1), correct, total""",
       """      targets = batch['targets']
      loss = lm_loss(model(batch['tokens']), targets, cfg.vocab_size, reduction='sum')
      sums += torch.stack([loss, (targets >= 0).sum().float()])
  total, count = sums.tolist()
  return total / max(count, 1), total, int(count)"""),
      ("""def end_epoch(run, epoch, accuracy, counts):
  """ + '"""' + """Records and saves an epoch, evaluated or not (accuracy None); returns (whether to stop now,""",
       """def end_epoch(run, epoch, loss):
  """ + '"""' + """Records and saves an epoch, evaluated or not (loss None); returns (whether to stop now,"""),
      ("""  best = accuracy is not None and accuracy > results['max_accuracy']
  if accuracy is not None:  # Only evaluated epochs count for best.pt, the target and the results.
    results['epoch_accuracies'].append(accuracy)""",
       """  lowest = results['min_eval_loss']
  best = loss is not None and (lowest is None or loss < lowest)
  if loss is not None:  # Only evaluated epochs count for best.pt and the results.
    results['eval_losses'].append(loss)"""),
      ("""    results.update(final_accuracy=accuracy, eval_correct=counts[0], eval_samples=counts[1],
                   max_accuracy=max(results['max_accuracy'], accuracy))
    test_utils.write_to_summary(run.log.writer, epoch, {'Accuracy/test': accuracy})""",
       """    results.update(final_eval_loss=loss, min_eval_loss=loss if best else lowest)
    test_utils.write_to_summary(run.log.writer, epoch, {'Loss/eval': loss})"""),
      ("""  run.log.end_epoch(epoch, evaluated=accuracy is not None)  # The graphs compiled by now.""",
       """  run.log.end_epoch(epoch, evaluated=loss is not None)  # The graphs compiled by now."""),
      ("""      xm.master_print(f'Epoch {epoch} train end {test_utils.now()}, Reduced GlobalRate={rate:.2f}',
                      flush=True)
      accuracy = counts = None  # Unless evaluated (--eval_interval, --test_only_at_end).""",
       """      xm.master_print(f'Epoch {epoch} train end {test_utils.now()}, Reduced GlobalRate={rate:.2f}'
                      f' samples/s, {rate * cfg.seq_len:,.0f} tokens/s', flush=True)
      loss = None  # Unless evaluated (--eval_interval, --test_only_at_end)."""),
      ("""        accuracy, *counts = evaluate(run.model, test_device_loader, cfg)""",
       """        loss, _, tokens = evaluate(run.model, test_device_loader, cfg)"""),
      ("""        xm.master_print(f'Epoch {epoch} test end {test_utils.now()}, Accuracy={accuracy:.2f}',
                        flush=True)""",
       """        xm.master_print(f'Epoch {epoch} test end {test_utils.now()}, Eval loss={loss:.4f} '
                        f'perplexity={perplexity(loss):.2f} ({tokens:,} tokens)',
                        flush=True)"""),
      ("""      stop, saved = end_epoch(run, epoch, accuracy, counts)""",
       """      stop, saved = end_epoch(run, epoch, loss)"""),
      ("""  return results, utils.say_finished(results, cfg.target_accuracy)  # Done: 0, or 21 below target""",
       """  return results, say_finished(results)  # Done: 0""")]),
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


def test_the_five_loops_differ_only_where_declared():
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
