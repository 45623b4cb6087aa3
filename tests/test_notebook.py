# SPDX-License-Identifier: BSD-3-Clause
"""The scripts in a real Jupyter kernel (ipykernel running this venv's Python): the quick
start notebook executed top to bottom by nbclient, as "Run all" does, and run() and %run
in one kernel, interrupted as the notebook's "Interrupt kernel" button does."""

import contextlib
import copy
import os
import pickle
import random
import re
import shutil
import socket
import threading
import time

import nbformat
from jupyter_client.manager import start_new_kernel
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from conftest import REPO, make_cifar_python, run_processes, script_env


def test_quickstart_notebook_runs_all_cells_and_draws_the_curves(tmp_path):
  checkout = checkout_of_the_repo(tmp_path)
  make_cifar_python(tmp_path / 'cifar' / 'cifar-10-batches-py', per_batch=40, test_count=48)
  notebook = nbformat.read(checkout / 'notebooks' / 'quickstart.ipynb', as_version=4)
  assert all(not cell.get('outputs') for cell in notebook.cells)  # Stripped in the repo.
  env = script_env(QUICKSTART_DATA=str(tmp_path / 'cifar'), QUICKSTART_SMALL='1')
  client = NotebookClient(notebook, timeout=600, kernel_name='python3',
                          resources={'metadata': {'path': str(checkout / 'notebooks')}})
  client.execute(env=env)  # Raises CellExecutionError, with the cell's output, on an error.

  code = [cell for cell in notebook.cells if cell.cell_type == 'code']
  # A stream comes in chunks as the run wrote them, not in lines.
  text = [''.join(o.get('text', '') for o in cell.outputs if o.output_type == 'stream')
          for cell in code]
  assert 'nothing to install' in text[0], text[0]
  assert re.search(r'^\| Training Device=xla:0/0 Epoch=1 Step=5 ', text[1], re.M), text[1]
  assert re.search(r'samples/s on 1 replicas', text[1]), text[1]
  assert 'Wrote 200 training samples in 1 shard and 48 test samples' in text[2], text[2]
  accuracy = re.search(r'^Accuracy after 3 epochs: ([\d.]+)%$', text[3], re.M)
  assert accuracy, text[3]
  assert (checkout / 'runs' / 'quickstart' / 'ckpt' / 'best.pt').exists()
  images = [o for o in code[4].outputs if 'image/png' in o.get('data', {})]
  assert len(images) == 1, code[4].outputs


def checkout_of_the_repo(tmp_path):
  """A copy of the repo's files (not the repo itself: the notebook writes runs/ beside them)."""
  checkout = tmp_path / 'checkout'
  shutil.copytree(REPO, checkout, ignore=shutil.ignore_patterns(
      '.*', '__pycache__', 'tests', 'benchmarks', 'runs', 'data'))
  return checkout


def data_cells(checkout):
  """The quick start notebook with its set-up and CIFAR-10 cells alone (not the training ones)."""
  notebook = nbformat.read(checkout / 'notebooks' / 'quickstart.ipynb', as_version=4)
  data_cell = next(i for i, cell in enumerate(notebook.cells) if 'make_cifar_shards.run' in cell.source)
  notebook.cells = notebook.cells[:2] + [notebook.cells[data_cell]]
  return notebook


def run_data_cells(checkout, env):
  """The notebook's set-up and CIFAR-10 cells in a real kernel; returns (the data cell, the error
  it ended with or None)."""
  notebook = data_cells(checkout)
  client = NotebookClient(notebook, timeout=120, kernel_name='python3',
                          resources={'metadata': {'path': str(checkout / 'notebooks')}})
  try:
    client.execute(env=env)
    return notebook.cells[-1], None
  except CellExecutionError as e:
    return notebook.cells[-1], e


def run_data_cells_on(checkout, env, folders):
  """run_data_cells once for each folder as QUICKSTART_DATA, in one kernel (a kernel start costs
  seconds), as a reader does after a Stop: the folder set in os.environ, then both cells again.
  Returns the data cells, each with what it showed."""
  notebook = data_cells(checkout)
  notebook.cells = [copy.deepcopy(cell) for folder in folders for cell in [nbformat.v4.new_code_cell(
      f'import os\nos.environ["QUICKSTART_DATA"] = {str(folder)!r}'), *notebook.cells[1:]]]
  NotebookClient(notebook, timeout=120, kernel_name='python3', allow_errors=True,
                 resources={'metadata': {'path': str(checkout / 'notebooks')}}).execute(env=env)
  return notebook.cells[2::3]


@contextlib.contextmanager
def server_that_never_answers():
  """A port on 127.0.0.1 that takes connections and never says a word: a network that drops
  what it is sent."""
  server = socket.create_server(('127.0.0.1', 0))
  held, done = [], threading.Event()

  def accept():
    server.settimeout(0.2)
    while not done.is_set():
      with contextlib.suppress(TimeoutError):
        held.append(server.accept()[0])

  thread = threading.Thread(target=accept, daemon=True)
  thread.start()
  try:
    yield server.getsockname()[1]
  finally:
    done.set()
    thread.join()
    for connection in held:
      connection.close()
    server.close()


def test_without_data_or_network_the_data_cell_says_what_to_attach(tmp_path):
  checkout = checkout_of_the_repo(tmp_path)
  with server_that_never_answers() as port:
    proxy = f'http://127.0.0.1:{port}'  # Every download goes there, and waits.
    env = script_env(QUICKSTART_SMALL='1', http_proxy=proxy, https_proxy=proxy, HTTP_PROXY=proxy,
                     HTTPS_PROXY=proxy)
    for name in ('QUICKSTART_DATA', 'no_proxy', 'NO_PROXY'):
      env.pop(name, None)
    started = time.monotonic()
    cell, error = run_data_cells(checkout, env)
    print(f'the data cell ended after {time.monotonic() - started:.1f} s (kernel start included)')
  # It ended on its own (the client's 120 s limit would be a CellTimeoutError), in a few lines
  # that say what to do, and not in a traceback.
  assert error is not None and error.ename == 'Stop', error
  shown = ''.join(o.get('text', '') for o in cell.outputs if o.output_type == 'stream') + \
      '\n'.join(line for o in cell.outputs if o.output_type == 'error' for line in o.traceback)
  print(shown)
  assert len(shown.splitlines()) <= 15, shown
  assert re.search(r'^Stop: CIFAR-10 is not here and cannot be downloaded \(.*timed out.*\)', shown,
                   re.M), shown
  assert 'QUICKSTART_DATA' in shown and 'Traceback' not in shown, shown


def test_quickstart_data_may_be_the_cifar_folder_itself_and_is_only_read(tmp_path):
  checkout = checkout_of_the_repo(tmp_path)
  cifar = make_cifar_python(tmp_path / 'attached' / 'cifar-10-batches-py', per_batch=8,
                            test_count=8)
  before = sorted((p.name, p.stat().st_mtime_ns) for p in cifar.parent.rglob('*'))
  cell, error = run_data_cells(checkout, script_env(QUICKSTART_DATA=str(cifar),
                                                    QUICKSTART_SMALL='1'))
  assert error is None, error
  text = ''.join(o.get('text', '') for o in cell.outputs if o.output_type == 'stream')
  assert f'CIFAR-10 from {cifar}' in text and 'Wrote 40 training samples' in text, text
  assert sorted((p.name, p.stat().st_mtime_ns) for p in cifar.parent.rglob('*')) == before


def test_a_broken_release_in_quickstart_data_is_one_stop_naming_it_and_the_file(tmp_path):
  # What a user did, and its kin: each folder is set as QUICKSTART_DATA in turn in one kernel.
  seed = random.SystemRandom().randrange(2**32)
  print(f'seed {seed}')
  rng = random.Random(seed)
  checkout = checkout_of_the_repo(tmp_path)
  only_meta = tmp_path / 'only-meta'
  only_meta.mkdir()
  (only_meta / 'batches.meta').write_bytes(rng.randbytes(rng.randint(1, 64)))
  truncated, missing, wrong_rows = (make_cifar_python(
      tmp_path / name / 'cifar-10-batches-py', per_batch=8, test_count=8)
      for name in ('truncated', 'missing', 'wrong-rows'))
  pickled = (truncated / 'data_batch_2').read_bytes()
  (truncated / 'data_batch_2').write_bytes(pickled[:rng.randrange(len(pickled))])
  (missing / 'data_batch_5').unlink()
  # A pickle the notebook's check takes, which make_cifar_shards refuses (with its own line).
  with open(wrong_rows / 'data_batch_4', 'rb') as f:
    batch = pickle.load(f, encoding='bytes')
  with open(wrong_rows / 'data_batch_4', 'wb') as f:
    pickle.dump({**batch, b'data': batch[b'data'][:, :3000]}, f)
  broken = [  # Random bytes may unpickle, rarely: to something else than the release's dict.
      (only_meta, only_meta / 'batches.meta', "is not (a pickle of the release|the release's)"),
      (truncated.parent, truncated / 'data_batch_2', 'is not a pickle of the release'),
      (missing, missing / 'data_batch_5', 'is missing'),
      (wrong_rows, wrong_rows / 'data_batch_4', 'is not a CIFAR-10 batch')]
  cells = run_data_cells_on(checkout, script_env(QUICKSTART_SMALL='1'),
                            [folder for folder, _, _ in broken])
  for cell, (folder, bad_file, problem) in zip(cells, broken):
    errors = [o for o in cell.outputs if o.output_type == 'error']
    shown = ''.join(o.get('text', '') for o in cell.outputs if o.output_type == 'stream') + \
        '\n'.join(line for o in errors for line in o.traceback)
    print(shown)
    assert len(errors) == 1 and errors[0].ename == 'Stop' and len(errors[0].traceback) == 1, shown
    assert re.match(re.escape(f'Stop: QUICKSTART_DATA={folder}: {bad_file} ') + problem,
                    errors[0].traceback[0]), shown
    assert 'whole python release' in errors[0].traceback[0], shown
    assert 'Traceback' not in shown and '--cifar_dir' not in shown, shown


class Kernel:
  """A Jupyter kernel of this venv's Python, driven as a notebook front end drives it."""

  def __init__(self, cwd, env):
    self.manager, self.client = start_new_kernel(kernel_name='python3', cwd=str(cwd), env=env)

  def pid(self):
    return self.manager.provisioner.process.pid

  def execute(self, code, on_output=None, timeout=600):
    """Runs a cell; returns (its stdout and stderr, its error as the front end shows it or
    None). on_output(text so far) is called as output comes; it may interrupt the kernel."""
    msg_id = self.client.execute(code)
    output, error = '', None
    while True:
      message = self.client.get_iopub_msg(timeout=timeout)
      if message['parent_header'].get('msg_id') != msg_id:
        continue
      kind, content = message['msg_type'], message['content']
      if kind == 'stream':
        output += content['text']
        if on_output:
          on_output(output)
      elif kind == 'error':
        error = f'{content["ename"]}: {content["evalue"]}\n' + '\n'.join(content['traceback'])
      elif kind == 'status' and content['execution_state'] == 'idle':
        return output, error

  def close(self):
    self.client.stop_channels()
    self.manager.shutdown_kernel(now=True)


def test_run_and_percent_run_in_one_kernel_interrupted_and_resumed(tmp_path):
  mark = f'notebook-test-{os.getpid()}-{time.time_ns()}'
  kernel = Kernel(REPO, script_env(RUN_MARK=mark))
  try:
    output, error = kernel.execute(
        'import signal, threading\n'
        'before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), '
        'threading.active_count())')
    assert error is None, error

    # %run twice: a run that trains, then one with a bad flag (one line, no traceback).
    tiny = '--fake_data --model resnet18 --img_dim 16 --batch_size 4 --test_set_batch_size 4'
    output, error = kernel.execute(f'%run train_single_core.py {tiny} --num_epochs 1 '
                                   '--num_steps 3 --log_steps 1')
    assert error is None and 'Max Accuracy: 100.00%' in output, (output, error)
    assert len(re.findall(r'^\| Training ', output, re.M)) == 3, output
    output, error = kernel.execute('%run train_single_core.py --fake_data --model nosuchnet')
    assert error and error.startswith('UsageError: --model nosuchnet is not a torchvision '
                                      'classification model'), (output, error)
    assert 'Traceback' not in error + output and 'File "' not in error, (output, error)

    # run() of another script: a bad flag is an exception with the command's one line.
    output, error = kernel.execute(
        f'import train_resnet_mp\ntrain_resnet_mp.run({tiny.split() + ["--num_steps", "0"]})')
    assert error and error.startswith('UsageError: flag --num_steps=0: 0 is not a positive integer'), error
    assert 'Traceback' not in error + output and 'File "' not in error, (output, error)

    # Interrupt kernel while the replicas compile their first step: a stop with a checkpoint.
    ckpt_dir = tmp_path / 'ckpt'
    flags = tiny.split() + ['--num_steps', '12', '--log_steps', '1', '--ckpt_dir', str(ckpt_dir)]
    sent = []

    def interrupt_once(output):
      if not sent and 'Epoch 1 train begin' in output:
        kernel.manager.interrupt_kernel()
        sent.append(True)

    output, error = kernel.execute(f'train_resnet_mp.run({flags + ["--num_epochs", "2"]})',
                                   on_output=interrupt_once)
    print(output, error, sep='\n')  # In the report when an assert below fails.
    assert sent and error, (output, error)
    # Named after the button that sent it, in every line about it.
    stopped = re.match(r'Stopped: Stopped by Interrupt \(SIGINT\) at epoch 1 step (\d+): saved '
                       r'(\S+); run the same command to resume \(exit code 130\)', error)
    assert stopped and re.search(r'^Stopping after this step and saving \(Interrupt again to end '
                                 r'at once without saving\)', output, re.M), (output, error)
    assert 'Ctrl-C' not in output + error, (output, error)
    assert os.path.exists(stopped.group(2))
    deadline = time.monotonic() + 5
    while (left := [p for p in run_processes(mark=mark) if p != kernel.pid()]) and (
        time.monotonic() < deadline):
      time.sleep(0.1)
    assert not left, f'processes of the run still alive: {left}'
    output, error = kernel.execute('import sys\nprint(sys.last_value.checkpoint)')
    assert output.strip() == stopped.group(2), (output, error)

    # The same call, with one epoch fewer: it resumes and returns the whole history.
    output, error = kernel.execute(
        f'results = train_resnet_mp.run({flags + ["--num_epochs", "1"]})\n'
        'print(results["train_steps"], [entry["step"] for entry in results["history"]], '
        'results["epoch_accuracies"])')
    assert error is None, (output, error)
    assert f'Resumed from {stopped.group(2)} at epoch 1 step {stopped.group(1)}' in output, output
    assert output.strip().endswith(f'12 {list(range(12))} [100.0]'), output

    output, error = kernel.execute(
        'print(before == (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), '
        'threading.active_count()))')
    assert (output, error) == ('True\n', None)
  finally:
    kernel.close()
