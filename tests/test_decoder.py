# SPDX-License-Identifier: BSD-3-Clause
"""make_token_files.py and train_decoder_spmd.py: text written as token files (bytes), a small
decoder-only model that learns it under --sharding fsdp on four XLA:CPU devices, a kill -9 and
a Ctrl-C, then the same command resuming bit for bit, the checkpoint resumed on two devices,
every memory flag at once, and bad token files each one line."""

import json
import math
import os
import random
import re
import signal

import fsspec
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from conftest import (TRAIN_LINE, SlowLink, assert_nothing_left, assert_one_error, both,
                      finish, index_chunks, read_checkpoint, read_json, run_and_signal, run_script,
                      script_env, seeded_random, start_script, training_losses, wait_for)
from test_large_models import assert_same_state

SCRIPT = 'train_decoder_spmd.py'
WRITER = 'make_token_files.py'
FOUR = script_env(CPU_NUM_DEVICES='4')
# A model of 4 layers and 0.3M parameters on windows of 32 bytes: it compiles in seconds.
SMALL = ['--hidden_size', 64, '--num_hidden_layers', 4, '--num_attention_heads', 4,
         '--num_key_value_heads', 2, '--seq_len', 32]


def write_text(path, lines, seed):
  """English-like lines from a small grammar: learnable, so the loss falls fast."""
  rng = random.Random(seed)
  subjects = ['the cat', 'a dog', 'my sister', 'the old man', 'our teacher', 'a small bird']
  verbs = ['sees', 'likes', 'finds', 'paints', 'follows', 'remembers']
  objects = ['the river', 'a red house', 'the moon', 'some bread', 'the green door', 'a song']
  path.write_text(''.join(f'{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}.\n'
                          for _ in range(lines)))


@pytest.fixture(scope='module')
def tokens(tmp_path_factory):
  root = tmp_path_factory.mktemp('text')
  write_text(root / 'a.txt', 1500, seed=1)
  write_text(root / 'b.txt', 500, seed=2)
  result = run_script(WRITER, root / 'a.txt', root / 'b.txt', '--output', root / 'tokens')
  assert result.returncode == 0, result.stdout + result.stderr
  # And with a tokenizer of the texts' own (byte-level BPE, as GPT-2's): more than 256 ids.
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train([str(root / 'a.txt')], trainers.BpeTrainer(
      vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  tokenizer.save(str(root / 'tokenizer.json'))
  result = run_script(WRITER, root / 'a.txt', root / 'b.txt', '--output', root / 'bpe',
                      '--tokenizer', root / 'tokenizer.json')
  assert result.returncode == 0, result.stdout + result.stderr
  return root


def test_token_files_hold_the_texts_bytes_and_say_how_to_train(tokens):
  text = (tokens / 'a.txt').read_bytes() + (tokens / 'b.txt').read_bytes()
  meta = json.loads((tokens / 'tokens' / 'meta.json').read_text())
  assert meta['vocab_size'] == 256 and meta['dtype'] == 'uint8' and meta['tokenizer'] == 'bytes'
  train = (tokens / 'tokens' / 'train.bin').read_bytes()
  val = (tokens / 'tokens' / 'val.bin').read_bytes()
  assert train + val == text and len(val) == int(len(text) * 0.1)
  assert (meta['train_tokens'], meta['val_tokens']) == (len(train), len(val))
  # With --tokenizer: its ids, in the smallest dtype that holds them, decode to the texts.
  tokenizer = Tokenizer.from_file(str(tokens / 'tokenizer.json'))
  meta = json.loads((tokens / 'bpe' / 'meta.json').read_text())
  assert meta['vocab_size'] == tokenizer.get_vocab_size() > 256, meta
  assert meta['dtype'] == 'uint16' and meta['tokenizer'] == 'tokenizer.json', meta
  ids = [np.fromfile(tokens / 'bpe' / f'{split}.bin', np.uint16) for split in ('train', 'val')]
  assert (meta['train_tokens'], meta['val_tokens']) == tuple(map(len, ids))
  assert tokenizer.decode(np.concatenate(ids).tolist()) == text.decode()
  assert len(text) > 2 * sum(map(len, ids))  # Fewer tokens than bytes: words, not letters.
  # A missing text file, and a tokenizer that is not one: one line each, nothing written.
  missing = run_script(WRITER, tokens / 'nothing.txt', '--output', tokens / 'out')
  assert_one_error(missing, 2, r'^error: \S+nothing\.txt is missing: give text files$')
  (tokens / 'not.json').write_text('{"model": 1}')
  refused = run_script(WRITER, tokens / 'a.txt', '--output', tokens / 'out', '--tokenizer',
                       tokens / 'not.json')
  assert_one_error(refused, 2, r'^error: (--tokenizer needs the tokenizers package|cannot read '
                   r'--tokenizer \S+not\.json)')
  assert not (tokens / 'out').exists() or not list((tokens / 'out').iterdir())
  # --helpshort: its flags, exit code 0 (absl's own is 1, which a shell takes for a failure).
  helped = run_script(WRITER, '--helpshort')
  assert helped.returncode == 0 and '--tokenizer' in helped.stdout, both(helped)


def test_learns_and_a_killed_then_interrupted_fsdp_run_resumes_bitwise_then_on_two_devices(tokens, tmp_path):
  # AdamW under --sharding fsdp on 4 devices, 3 epochs of 8 steps, a save every 3 steps.
  args = ['--datadir', tokens / 'tokens', *SMALL, '--batch_size', 2, '--test_set_batch_size', 4,
          '--num_epochs', 3, '--num_steps', 8, '--log_steps', 1, '--lr', 3e-3, '--sharding',
          'fsdp', '--ckpt_every_steps', 3, '--keep_checkpoints', 20, '--num_workers', 1]
  reference = start_script(SCRIPT, *args, '--ckpt_dir', tmp_path / 'reference', '--results_json',
                           tmp_path / 'reference.json', env=FOUR)
  run = [*args, '--ckpt_dir', tmp_path / 'ckpt']
  # kill -9 of the whole run in epoch 1 or 2 (a VM that crashes), then the same command.
  kill_step = seeded_random().randrange(4, 14)
  code, out = run_and_signal(SCRIPT, run, kill_step, signal.SIGKILL, env=FOUR)
  assert code == -signal.SIGKILL, out
  # Then Ctrl-C in its terminal (SIGINT to the whole process group) at its first step: every
  # device stops after the same step, which is saved; exit code 130, and nothing left running.
  process = start_script(SCRIPT, *run, env=FOUR)
  wait_for(process, TRAIN_LINE.pattern)
  os.killpg(process.pid, signal.SIGINT)
  code, out = finish(process)
  assert code == 130, out
  assert re.search(r'^Stopped by Ctrl-C \(SIGINT\) at epoch \d step \d: saved \S+; run the same '
                   r'command to resume \(exit code 130\)$', out, re.M), out
  assert_nothing_left(session=process.pid)
  result = run_script(SCRIPT, *run, '--results_json', tmp_path / 'resumed.json', env=FOUR)
  assert result.returncode == 0, result.stdout + result.stderr
  assert re.search(r'^Resumed from \S+ at epoch [12] step \d$', result.stdout, re.M), result.stdout
  code, reference_out = finish(reference)
  assert code == 0, reference_out

  # It learns: the evaluation's loss falls well below chance (ln 256 = 5.55).
  theirs = read_json(tmp_path / 'reference.json')
  assert len(theirs['eval_losses']) == 3 and theirs['final_eval_loss'] < 3.0, theirs['eval_losses']
  assert theirs['eval_losses'] == sorted(theirs['eval_losses'], reverse=True)
  assert re.search(r'^Final eval loss: [\d.]+ \(perplexity [\d.]+\), lowest [\d.]+$',
                   reference_out, re.M), reference_out
  assert re.search(r'^Epoch 1 train end .*, Reduced GlobalRate=[\d.]+ samples/s, [\d,]+ tokens/s$',
                   reference_out, re.M), reference_out
  # The resumed run is the uninterrupted one: its losses, and its last checkpoint bit for bit
  # and chunk for chunk; each device holds what it held, and no graph more was compiled.
  resumed, uninterrupted = training_losses(result.stdout), training_losses(reference_out)
  assert resumed and all(uninterrupted[key] == loss for key, loss in resumed.items())
  ours = read_json(tmp_path / 'resumed.json')
  assert ours['eval_losses'][-1] == theirs['eval_losses'][-1]
  assert ours['bytes_per_device'] == theirs['bytes_per_device']
  assert ours['compilations'] == theirs['compilations'], result.stdout
  for name in ('ckpt-00000024', 'best'):
    assert_same_state(read_checkpoint(tmp_path / 'ckpt' / f'{name}.pt'),
                      read_checkpoint(tmp_path / 'reference' / f'{name}.pt'))
  assert index_chunks(tmp_path / 'ckpt' / 'ckpt-00000024') == index_chunks(
      tmp_path / 'reference' / 'ckpt-00000024')

  # One epoch more on two devices: the same command with --num_epochs 4 resumes, and says that
  # the global batch changed.
  two = run_script(SCRIPT, *run, '--num_epochs', 4, env=script_env(CPU_NUM_DEVICES='2'))
  assert two.returncode == 0, two.stdout + two.stderr
  assert re.search(r'^warning: resuming \S+ckpt-00000024\.pt on 2 devices, saved on 4: the global '
                   r'batch is 4 instead of 8', two.stderr, re.M), two.stderr
  assert re.search(r'^Resumed from \S+ckpt-00000024\.pt at epoch 4 step 0$', two.stdout, re.M)
  assert read_checkpoint(tmp_path / 'ckpt' / 'ckpt-00000032.pt')['global_step'] == 32


def test_hybrid_with_every_memory_flag_learns_from_a_bucket_and_a_stalled_bucket_is_one_line(
    tokens, tmp_path, bucket, monkeypatch):
  # Every memory flag at once, on 4 devices: 2 groups of 2 sharing the weights, each layer
  # recomputed in the backward, 2 batches a step, the forward in bfloat16; on the tokenizer's
  # files (uint16 ids, its vocabulary) in a bucket, read by a loader worker's range requests.
  for name, value in bucket.items():
    monkeypatch.setenv(name, value)
  fsspec.filesystem('gs', skip_instance_cache=True).put(str(tokens / 'bpe'), 'data/bpe',
                                                        recursive=True)
  vocab = json.loads((tokens / 'bpe' / 'meta.json').read_text())['vocab_size']
  args = ['--datadir', 'gs://data/bpe', *SMALL, '--sharding', 'hybrid', '--fsdp_size', 2,
          '--use_gradient_checkpointing', '--gradient_accumulation_steps', 2, '--amp',
          '--batch_size', 1, '--test_set_batch_size', 4, '--num_epochs', 2, '--num_steps', 6,
          '--log_steps', 1, '--lr', 3e-3, '--num_workers', 1]
  result = run_script(SCRIPT, *args, '--results_json', tmp_path / 'results.json',
                      env=script_env(CPU_NUM_DEVICES='4', **bucket))
  assert result.returncode == 0, result.stdout + result.stderr
  assert re.search(r'^Mesh of 4 devices \(2 data x 2 fsdp, --sharding hybrid\)', result.stdout, re.M)
  results = read_json(tmp_path / 'results.json')
  assert results['vocab_size'] == vocab and results['eval_losses'][-1] < 0.8 * math.log(vocab), (
      results['eval_losses'])
  assert results['train_samples'] == 12 * 2 * 4, results['train_samples']
  counts = results['compilations_after_epoch']
  assert counts[0] == counts[1], counts  # Nothing compiled after epoch 1.
  held = results['bytes_per_device']  # Half of the weights and of both moments on each device.
  assert held['optimizer'] == 2 * held['weights'], held
  # A bucket that stalls at the first training window's read: gcsfs's deadline (BUCKET_TIMEOUT),
  # one line from the loader worker, and nothing left running.
  port = int(bucket['STORAGE_EMULATOR_HOST'].rsplit(':', 1)[1])
  link = SlowLink(port, when=b'train.bin?alt=media')  # A read of its bytes, not of its size.
  stalled = start_script(SCRIPT, *args, env=script_env(
      CPU_NUM_DEVICES='4', BUCKET_TIMEOUT='2',
      **dict(bucket, STORAGE_EMULATOR_HOST=f'http://127.0.0.1:{link.port}')))
  assert_one_error(finish(stalled), 2, r'^error: cannot read gs://data/bpe/train\.bin: a '
                   r'request to the bucket took over 2 s; check the network, then run the same '
                   r'command again$')
  assert link.trickle
  assert_nothing_left(session=stalled.pid)


def test_a_diverging_run_ends_in_one_line_with_exit_code_22_and_saves_nothing(tokens, tmp_path):
  # AdamW moves each weight by about --lr a step: at 1e4, unclipped and without warm-up, the
  # first step takes the weights past the stop vote's bound.
  result = run_script(SCRIPT, '--datadir', tokens / 'tokens', *SMALL, '--batch_size', 2,
                      '--num_steps', 6, '--log_steps', 1, '--lr', 1e4, '--max_grad_norm', 0,
                      '--lr_warmup_steps', 0, '--num_workers', 0, '--ckpt_dir', tmp_path / 'ckpt',
                      env=FOUR)
  assert_one_error(result, 22, r'^error: the weights reached [\d.e+]+ at epoch 1 step \d \(a '
                   r'network that learns holds them near 1\): training diverged; lower --lr \(it '
                   r'is 10000\) and run again: nothing was saved, so it starts over \(exit code '
                   r'22\)$')
  assert not list((tmp_path / 'ckpt').glob('ckpt-*'))


def test_a_batch_too_large_for_the_devices_is_one_line_and_exit_code_23():
  # Each device's step needs about a terabyte (its logits alone: 4096 windows of 512 tokens):
  # XLA:CPU refuses it at once, as a TPU does with RESOURCE_EXHAUSTED.
  result = run_script(SCRIPT, '--fake_data', *SMALL[:-2], '--seq_len', 512, '--batch_size', 4096,
                      '--num_epochs', 1, '--num_steps', 1, '--num_workers', 0, env=FOUR)
  assert_one_error(result, 23, r'^error: out of device memory \(XLA could not allocate [\d,.]+ GB '
                   r'for a graph\): cut what a device holds with a smaller --batch_size, '
                   r'--gradient_accumulation_steps N with --batch_size / N, --amp, '
                   r'--use_gradient_checkpointing or --sharding fsdp, and run again \(see '
                   r'docs/large_models\.md#out-of-device-memory\)$')


def test_bad_token_files_are_one_line_each(tokens, tmp_path):
  def folder(name, meta, train=b'abc' * 100, val=b'xyz' * 50):
    path = tmp_path / name
    path.mkdir()
    if meta is not None:
      (path / 'meta.json').write_text(json.dumps(meta))
    (path / 'train.bin').write_bytes(train)
    (path / 'val.bin').write_bytes(val)
    return path
  bytes_meta = dict(vocab_size=256, dtype='uint8')
  cases = [
      (folder('nometa', None), [], r'\S+nometa/meta\.json is missing: --datadir needs train\.bin, '
       r'val\.bin and meta\.json \(their vocabulary and dtype\); write the files again with '
       r'make_token_files\.py$'),
      (folder('odd', dict(vocab_size=1000, dtype='uint16'), train=b'abc' * 101), [],
       r'\S+odd/train\.bin is 303 bytes, not a whole number of uint16 ids \(2 bytes each, as '
       r'meta\.json says\): write the files again with make_token_files\.py$'),
      (folder('over', dict(vocab_size=98, dtype='uint8')), [],
       r'\S+over/train\.bin holds token id 98 at position 1, outside the vocabulary of 98 that '
       r'meta\.json says: write the files again with make_token_files\.py$'),
      (folder('short', bytes_meta), ['--seq_len', 256],
       r'\S+short/val\.bin holds 150 tokens, no window of --seq_len 256 and its next token: give a '
       r'shorter --seq_len or more text$'),
  ]
  for datadir, extra, line in cases:
    result = run_script(SCRIPT, '--datadir', datadir, *SMALL, *extra)
    assert_one_error(result, 2, '^error: ' + line)
  # Upstream's decoder flag (examples/train_decoder_only_base.py's) named as it is here.
  result = run_script(SCRIPT, '--fake_data', '--num-layers', 16)
  assert_one_error(result, 2, r"^error: --num-layers: give --num_hidden_layers \(as upstream's "
                   r'DecoderOnlyConfig names it\)$')
