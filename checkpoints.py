# SPDX-License-Identifier: BSD-3-Clause
"""Checkpoints: ckpt_dir/ckpt-GLOBALSTEP.pt files (local or any fsspec URL) that hold the
whole training state, written whole or not at all, and the exact resume from them."""

import io
import os
import pickle
import re
import sys
import zipfile

import fsspec
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr

from utils import UsageError, is_master, write_atomically

NAME = re.compile(r'^ckpt-(\d+)\.pt$')
KEYS = ('model', 'optimizer', 'lr_scheduler', 'epoch', 'step', 'global_step', 'rng', 'flags',
        'results')


class CheckpointError(UsageError):
  """A checkpoint that cannot be used."""


def list_all(ckpt_dir):
  """{global_step: path} of the checkpoints in ckpt_dir."""
  fs, path = fsspec.core.url_to_fs(ckpt_dir)
  names = [name.rsplit('/', 1)[-1] for name in fs.ls(path, detail=False)] if fs.exists(path) else []
  return {int(m.group(1)): f'{ckpt_dir.rstrip("/")}/{m.group(0)}'
          for m in map(NAME.match, names) if m}


def save(state, ckpt_dir, keep, best):
  """Saves ckpt_dir/ckpt-GLOBALSTEP.pt (and best.pt), keeping the `keep` newest up to it, and
  returns its path. Every replica calls it; the master writes; all wait until it is whole."""
  torch_xla.sync()  # Runs the step still being traced, so that saving only copies data.
  master = is_master()
  buffer = io.BytesIO() if master else None
  # SPMD: every host holds the whole (replicated) state; process 0 copies it out and writes.
  if master or not xr.is_spmd():
    xm.save(state, buffer, master_only=True, global_master=True)
  path = f'{ckpt_dir.rstrip("/")}/ckpt-{state["global_step"]:08d}.pt'
  if master:
    try:
      write_atomically(buffer.getvalue(), path)
      if best:
        write_atomically(buffer.getvalue(), f'{ckpt_dir.rstrip("/")}/best.pt')
    except OSError as e:  # A full disk or quota, a lost permission.
      raise UsageError(f'cannot write checkpoint {path} ({e}): free space in --ckpt_dir or '
                       'give another; the checkpoints already there are kept') from None
    saved = list_all(ckpt_dir)
    kept = sorted(step for step in saved if step <= state['global_step'])[-keep:]
    for old in (saved[step] for step in saved if step not in kept):
      fsspec.core.url_to_fs(old)[0].rm(fsspec.core.url_to_fs(old)[1])
    print(f'Saved checkpoint {path}', flush=True)
  if xr.world_size() > 1:
    xm.rendezvous('checkpoint_saved')
  return path


def load(path):
  """The checkpoint at path with CPU tensors (weights_only: other objects could run code)."""
  try:
    with fsspec.open(path, 'rb') as f:
      # torch.save writes a zip archive; random or truncated bytes could look like a pickle.
      if not zipfile.is_zipfile(f):
        raise EOFError('not the whole zip archive that torch.save writes')
      f.seek(0)
      state = torch.load(f, map_location='cpu', weights_only=True)
  except pickle.UnpicklingError:
    raise CheckpointError(f'checkpoint {path} holds objects other than tensors and plain '
                          'values; refused, since loading it could run code') from None
  except Exception as e:  # Truncated or corrupt: EOFError, RuntimeError, ...
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise CheckpointError(f'checkpoint {path} cannot be read: it is not a whole, readable '
                          f'checkpoint file ({reason})') from None
  missing = [key for key in KEYS if not isinstance(state, dict) or key not in state]
  if missing:
    raise CheckpointError(f'{path} is not a checkpoint of these scripts (no {", ".join(missing)})')
  return state


def find(resume, ckpt_dir):
  """(path, state) to resume from, chosen by the master for every replica, or (None, None):
  --resume PATH, else the newest readable one in ckpt_dir (warning of each unreadable one)."""
  path, state = None, None
  if xm.is_master_ordinal(local=False) and resume:
    try:
      path, state = resume, load(resume)
    except CheckpointError as e:
      raise UsageError(f'--resume: {e}') from None
  elif xm.is_master_ordinal(local=False) and ckpt_dir:
    for found in sorted(list_all(ckpt_dir).values(), reverse=True):
      try:
        path, state = found, load(found)
        break
      except CheckpointError as e:
        print(f'warning: {e}; trying the previous one', file=sys.stderr, flush=True)
  if xr.world_size() > 1:
    path = xm.mesh_reduce('resume_from', path, lambda paths: paths[0])
    state = state or (load(path) if path else None)
  return path, state


def check_same_model(model, state, path):
  """A UsageError naming a weight that differs if the checkpoint is of another model."""
  ours = {k: list(v.shape) for k, v in model.state_dict().items()}
  theirs = {k: list(v.shape) for k, v in state['model'].items()}
  differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
  if differ:
    first = differ[0]
    raise UsageError(f'checkpoint {path} was made for another model or number of classes '
                     f'({len(differ)} weight(s) differ, e.g. {first}: '
                     f'{theirs.get(first, "absent")} there, {ours.get(first, "absent")} here; it '
                     f'was saved with --model {state["flags"].get("model")}): use the flags of '
                     'that run, or another --ckpt_dir')


def resume(resume_path, ckpt_dir, training, flag_values, restart_flags, world_size):
  """Restores training = (model, optimizer, scheduler or None) and the RNGs from find()'s
  checkpoint and returns it (or None); warns of flags changed, but for restart_flags, and of
  another number of devices (world_size) than the checkpoint's run had."""
  path, state = find(resume_path, ckpt_dir)
  if state is None:
    return None
  model, optimizer, scheduler = training
  check_same_model(model, state, path)
  model.load_state_dict(state['model'])
  optimizer.load_state_dict(state['optimizer'])
  if scheduler is not None and state['lr_scheduler'] is not None:
    scheduler.load_state_dict(state['lr_scheduler'])
  torch.set_rng_state(state['rng']['torch'])
  xm.set_rng_state(state['rng']['xla'])
  saved = state['flags']
  changed = [f'--{name} {saved[name]!r} -> {value!r}' for name, value in sorted(flag_values.items())
             if name in saved and name not in restart_flags and saved[name] != value]
  if changed:
    xm.master_print(f'warning: resuming {path} with other flags ({"; ".join(changed)}): the '
                    'run will differ from one never interrupted', fd=sys.stderr, flush=True)
  saved_world = state['results'].get('world_size', world_size)
  if saved_world != world_size:
    batch = flag_values['batch_size']
    xm.master_print(f'warning: resuming {path} on {world_size} devices, saved on {saved_world}: '
                    f'the global batch is {batch * world_size} instead of {batch * saved_world} '
                    f'(--batch_size {batch} per device), so the run will differ from one never '
                    'interrupted (see docs/checkpoints.md)', fd=sys.stderr, flush=True)
  epoch, num_epochs = state['epoch'], flag_values['num_epochs']
  where = ckpt_dir or os.path.dirname(path)
  xm.master_print(f'Run already finished: {path} is the end of epoch {epoch - 1} (--num_epochs '
                  f'{num_epochs}). To train on, give more --num_epochs; to start over, remove '
                  f'{where} or give another --ckpt_dir' if epoch > num_epochs else
                  f'Resumed from {path} at epoch {epoch} step {state["step"]}', flush=True)
  return state
