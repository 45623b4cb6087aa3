# SPDX-License-Identifier: BSD-3-Clause
"""A host of two replica processes, started the way torch_xla.launch starts them on a TPU
host (torch_xla/_internal/pjrt.py's run_multiprocess: a ProcessPoolExecutor by spawn whose
processes each run their replica in a thread of _run_thread_per_device, the results waited
for in order), which it does not do on XLA:CPU. Replica 0 blocks, as one waiting in a
collective for the other would; once it has, replica 1 fails (`fails`: an error it says in
one line, utils.replica_failed's os._exit(2)) or is killed (`killed`: SIGKILL, the OOM
killer's). Each replica stops on signals as the scripts' replicas do, so the pool's SIGTERM
to the others, once it is broken, is a stop to them. Run it from a folder holding utils.py
(and supervisor.py for `supervisor`: its watch instead of the kit's):

  PJRT_DEVICE=CPU python replica_pool.py fails|killed kit|supervisor
"""

import concurrent.futures
import functools
import itertools
import os
import signal
import sys
import threading
import time

import torch
from torch_xla._internal import pjrt

import utils

REPLICAS = 2


def _mp_fn(how):
  with utils.replica():
    if os.environ['PJRT_LOCAL_PROCESS_RANK'] == '0':
      open('blocked', 'w').close()
      print('replica 0 waits for replica 1', flush=True)
      threading.Event().wait()
    while not os.path.exists('blocked'):
      time.sleep(0.01)
    with open('failed_at', 'w') as f:
      f.write(str(time.time()))
    if how == 'killed':
      os.kill(os.getpid(), signal.SIGKILL)
    raise utils.BadDataError('cannot read image x.png: replace or remove the file')


def main(how, watch):
  if watch == 'supervisor':
    import supervisor
    around = supervisor.watched(launcher=True, saving=False)
  else:
    around = utils.stop_on_signals(launcher=True)
  with around, concurrent.futures.ProcessPoolExecutor(
      max_workers=REPLICAS, mp_context=torch.multiprocessing.get_context('spawn')) as executor:
    mp_fn = functools.partial(pjrt._run_thread_per_device, local_world_size=REPLICAS,
                              fn=functools.partial(_mp_fn, how),
                              initializer_fn=pjrt.initialize_multiprocess)
    results = executor.map(mp_fn, range(REPLICAS))
    print(list(itertools.chain.from_iterable(result.items() for result in results)))


if __name__ == '__main__':
  main(*sys.argv[1:])
elif __name__ == '__mp_main__':
  utils.stop_on_signals()
