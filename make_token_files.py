# SPDX-License-Identifier: BSD-3-Clause
"""Writes text as the token files train_decoder_spmd.py reads: DIR/train.bin and DIR/val.bin,
each a flat array of token ids (nanoGPT's and llm.c's layout, without a header), and
DIR/meta.json, which says the vocabulary size, the ids' dtype and the tokenizer.

The text files are read in the order given and joined; the last --val_fraction of the tokens
is val.bin, the rest train.bin. By default a token is a byte of the text (a vocabulary of 256,
uint8 ids): nothing to download, and a small model learns it in minutes. With --tokenizer FILE,
a Hugging Face `tokenizers` JSON file (tokenizer.json, read from disk, never fetched) encodes
each file's text (UTF-8); ids are uint16 when the vocabulary fits, else uint32. Each file is
written under a temporary name and renamed when whole, meta.json last: a run stopped by Ctrl-C
or SIGTERM leaves no file that looks whole, and the same command writes them all. It says how
far it is on stderr (one line redrawn on a terminal, a line every tenth of the way in a log).

  python make_token_files.py input.txt --output data/shakespeare
  python make_token_files.py books/*.txt --output data/books --tokenizer tokenizer.json
"""

import json
import os
import signal
import sys
import time

import numpy as np
from absl import app, flags

import utils

FLAGS = flags.FLAGS
flags.DEFINE_string('output', None, 'The folder to write train.bin, val.bin and meta.json to.')
flags.DEFINE_float('val_fraction', 0.1, 'The share of the tokens (the last ones) in val.bin.',
                   lower_bound=0.0, upper_bound=0.5)
flags.DEFINE_string('tokenizer', None, "A Hugging Face tokenizers JSON file (tokenizer.json); "
                    'default: the bytes of the text, a vocabulary of 256.')
utils.redefinable(FLAGS)

CHUNK = 1 << 24  # Bytes of text read and encoded at a time (16 MB).
PLAIN_SECONDS = 60  # Progress in a log: a line every tenth of the way, and at least this often.


def load_tokenizer(path):
  """(encode(text) -> ids, vocabulary size, its name for meta.json) of --tokenizer, or of bytes."""
  if path is None:
    return None, 256, 'bytes'
  try:
    import tokenizers
  except ModuleNotFoundError:
    raise utils.UsageError('--tokenizer needs the tokenizers package: pip install tokenizers '
                           '(or leave --tokenizer out: the bytes of the text)') from None
  try:
    tokenizer = tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # A missing file or not a tokenizer's JSON: its own message says which.
    raise utils.UsageError(f'cannot read --tokenizer {path} ({type(e).__name__}: '
                           f'{str(e).strip().splitlines()[0] if str(e).strip() else e}): give '
                           "a tokenizers JSON file, such as a model's tokenizer.json") from None
  encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids
  return encode, tokenizer.get_vocab_size(with_added_tokens=True), os.path.basename(path)


def id_dtype(vocab_size):
  return np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.uint32


def check_inputs(paths):
  """The size in bytes of each text file; a UsageError naming one that cannot be read."""
  if not paths:
    raise utils.UsageError('give the text files to write as tokens: make_token_files.py '
                           'FILE [FILE ...] --output DIR')
  sizes = []
  for path in paths:
    if not os.path.isfile(path):
      raise utils.UsageError(f'{path} is {"a folder" if os.path.isdir(path) else "missing"}: '
                             'give text files')
    if not os.access(path, os.R_OK):
      raise utils.UsageError(f'cannot read {path} (no permission): give files this user reads')
    sizes.append(os.path.getsize(path))
  if not sum(sizes):
    raise utils.UsageError(f'{" ".join(paths)}: empty, no text to write')
  return sizes


def tokens_of(path, encode, dtype):
  """The ids of a text file, a chunk at a time, with the bytes of text each chunk took. A
  tokenizer's chunk ends after a newline: it sees whole lines, and whole UTF-8 characters."""
  with open(path, 'rb') as f:
    if encode is None:  # Bytes: the ids are the data.
      while data := f.read(CHUNK):
        yield np.frombuffer(data, np.uint8).astype(dtype, copy=False), len(data)
      return
    rest = b''
    while True:
      data = f.read(CHUNK)
      text, rest = rest + data, b''
      if data:
        cut = text.rfind(b'\n') + 1 or len(text)
        text, rest = text[:cut], text[cut:]
      if text:
        try:
          ids = encode(text.decode('utf-8'))
        except UnicodeDecodeError as e:
          raise utils.UsageError(f'{path} is not UTF-8 text ({e.reason}): --tokenizer reads '
                                 'UTF-8; leave it out to write the bytes') from None
        yield np.asarray(ids, dtype), len(text)
      if not data:
        return


class Progress:
  """Bytes of text done of all, their rate and the time left: on a terminal a line redrawn in
  place, in a log a plain line at each tenth of the way and at least every PLAIN_SECONDS."""

  def __init__(self, total, stream=sys.stderr):
    self.total, self.done, self.stream, self.live = total, 0, stream, stream.isatty()
    self.start = self.said = time.monotonic()
    self.tenths = 0

  def add(self, count):
    self.done += count
    now, tenths = time.monotonic(), self.done * 10 // self.total
    if self.live and (now - self.said >= 0.2 or self.done >= self.total):
      self.stream.write('\r' + self.line(now) + ('\n' if self.done >= self.total else ''))
      self.stream.flush()
      self.said = now
    elif not self.live and (tenths > self.tenths or now - self.said >= PLAIN_SECONDS):
      print(self.line(now), file=self.stream, flush=True)
      self.said, self.tenths = now, tenths

  def line(self, now):
    seconds = max(now - self.start, 1e-9)
    rate = self.done / seconds
    left = (self.total - self.done) / rate if rate else 0
    return (f'{self.done / 1e6:,.1f} of {self.total / 1e6:,.1f} MB of text encoded '
            f'({self.done * 100 // self.total}%), {rate / 1e6:,.1f} MB/s, '
            + (f'done in {seconds:.0f} s' if self.done >= self.total else f'{left:.0f} s left'))


def write_tokens(paths, sizes, encode, dtype, output):
  """Writes every file's ids to output/train.bin.tmp; returns the count."""
  progress, count = Progress(sum(sizes)), 0
  with open(os.path.join(output, 'train.bin.tmp'), 'wb') as f:
    for path in paths:
      for ids, done in tokens_of(path, encode, dtype):
        f.write(ids.tobytes())
        count += len(ids)
        progress.add(done)
  return count


def split_tokens(output, count, dtype):
  """Moves the last --val_fraction of train.bin.tmp's ids to val.bin.tmp; returns (train, val)."""
  val = int(count * FLAGS.val_fraction)
  itemsize, train_path = np.dtype(dtype).itemsize, os.path.join(output, 'train.bin.tmp')
  with open(train_path, 'r+b') as f, open(os.path.join(output, 'val.bin.tmp'), 'wb') as out:
    f.seek((count - val) * itemsize)
    while data := f.read(CHUNK):
      out.write(data)
    f.truncate((count - val) * itemsize)
  return count - val, val


def main(argv):
  paths = argv[1:]
  try:
    if not FLAGS.output:
      raise utils.UsageError('give --output DIR, the folder to write train.bin, val.bin and '
                             'meta.json to')
    sizes = check_inputs(paths)
    encode, vocab_size, name = load_tokenizer(FLAGS.tokenizer)
    dtype = id_dtype(vocab_size)
    try:
      os.makedirs(FLAGS.output, exist_ok=True)
      count = write_tokens(paths, sizes, encode, dtype, FLAGS.output)
      train, val = split_tokens(FLAGS.output, count, dtype)
      for split in ('train', 'val'):
        path = os.path.join(FLAGS.output, f'{split}.bin')
        os.replace(path + '.tmp', path)
      meta = dict(vocab_size=vocab_size, dtype=np.dtype(dtype).name, tokenizer=name,
                  train_tokens=train, val_tokens=val, sources=[os.path.basename(p) for p in paths])
      utils.write_atomically(json.dumps(meta, indent=2).encode() + b'\n',
                             os.path.join(FLAGS.output, 'meta.json'))
    except OSError as e:
      raise utils.UsageError(f'cannot write --output {FLAGS.output} ({type(e).__name__}: {e}): '
                             'give a folder this job can write, with room for the tokens')
  except utils.UsageError as e:
    remove_partial(FLAGS.output)
    utils.die(e)
  print(f'Wrote {train:,} training and {val:,} validation tokens ({name}, vocabulary '
        f'{vocab_size:,}, {np.dtype(dtype).name}) to {FLAGS.output}. Train with:')
  print(f'  python train_decoder_spmd.py --datadir {FLAGS.output}')


def parse_flags(argv):
  """The text files (the arguments that are not flags); a bad flag is one line, exit code 2."""
  try:
    return FLAGS(argv)
  except SystemExit:  # absl's --help prints, then exits 1.
    sys.exit(0)
  except flags.Error as e:
    utils.die(f'{e} (see --helpshort)')


def remove_partial(output):
  """Removes the temporary files a stopped or failed run left in output."""
  for split in ('train', 'val'):
    path = os.path.join(output or '', f'{split}.bin.tmp')
    if output and os.path.exists(path):
      os.remove(path)


class Preempted(BaseException):
  """SIGTERM, raised where the writing is, as Ctrl-C raises KeyboardInterrupt."""


def preempted(signum, frame):
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  raise Preempted()


if __name__ == '__main__':
  signal.signal(signal.SIGTERM, preempted)
  signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    app.run(main, flags_parser=parse_flags)
  except (KeyboardInterrupt, Preempted) as e:
    remove_partial(FLAGS.output)
    name, code = ((f'{utils.INTERRUPT} (SIGINT)', utils.EXIT_INTERRUPTED)
                  if isinstance(e, KeyboardInterrupt) else ('SIGTERM', utils.EXIT_PREEMPTED))
    utils.die(f'stopped by {name}: nothing is half-written (the files of this run are removed); '
              'run the same command to write them', code)
