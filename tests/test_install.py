# SPDX-License-Identifier: BSD-3-Clause
"""The install lines of the README and docs, as written, resolve on every Python they claim:
pip's own resolver on a dry run (it asks the package registry, as the install does, and
installs nothing), for a real interpreter of each version where the machine has one
(pyenv's, through pip's --python), so that pip picks the constraints' lines marked for that
Python itself.

The venv's pip (requirements-dev.txt: 25.3 or newer) reads each wheel's metadata with HTTP
range requests (--use-feature=fast-deps) and, on a dry run, downloads no wheel: a few MB per
resolution where an older pip fetched every wheel, torch's CUDA libraries included (about
8 GB per resolution, which once filled a CI machine's disk).

Five resolutions cover them all: constraints.txt pins every package each line installs (the
second test checks it on every Python), so when the union of two lines' requirement files
resolves, each line does. requirements-tpu.txt holds what requirements.txt holds, and
requirements-dev.txt holds requirements.txt."""

import concurrent.futures
import functools
import json
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile

from packaging.markers import Marker
from packaging.utils import canonicalize_name
from packaging.version import Version

from conftest import REPO

# What the README says: every line on 3.10 to 3.13, but torch_xla[tpu] 2.9 pins libtpu
# 0.0.21, which has no wheel for 3.13.
RESOLVE = [('3.10', ['requirements-dev.txt', 'requirements-tpu.txt']),
           ('3.11', ['requirements-dev.txt', 'requirements-tpu.txt']),
           ('3.12', ['requirements-dev.txt', 'requirements-tpu.txt']),
           ('3.13', ['requirements-dev.txt'])]
FAILS = ('3.13', ['requirements-tpu.txt'])
# cuDNN's, cuBLAS's, cuRAND's and cuSOLVER's wheels are tagged manylinux_2_27 only: without
# that tag, where there is no interpreter, pip finds none of them for torch.
PLATFORMS = ['manylinux_2_17_x86_64', 'manylinux2014_x86_64', 'manylinux_2_27_x86_64',
             'manylinux_2_28_x86_64', 'manylinux_2_31_x86_64', 'linux_x86_64']


def install_lines():
  """{requirements file: the words after `pip install` in its install lines in the docs}."""
  lines = {}
  for page in [REPO / 'README.md', *sorted((REPO / 'docs').glob('*.md'))]:
    for words in re.findall(r'pip install (-r requirements[-\w]*\.txt[^&\n`"]*)', page.read_text()):
      words = shlex.split(words)
      lines.setdefault(words[1], set()).add(tuple(words))
  return lines


def interpreter(version):
  """A python of this version on this machine (pyenv's, or this one), or None."""
  found = sorted(pathlib.Path('~/.pyenv/versions').expanduser().glob(f'{version}.*/bin/python'))
  if found:
    return str(found[-1])
  return sys.executable if f'{sys.version_info[0]}.{sys.version_info[1]}' == version else None


def pins_for(version):
  """The lines of constraints.txt that hold on Python `version`, without their markers."""
  kept = []
  for line in (REPO / 'constraints.txt').read_text().splitlines():
    pin, _, marker = line.partition(';')
    if pin.strip() and not pin.startswith('#') and (
        not marker or Marker(marker).evaluate({'python_version': version})):
      kept.append(pin.strip())
  return kept


def constraints_for(version, scratch):
  """Where there is no interpreter of this version pip evaluates the markers for its own
  Python: constraints.txt with the lines that hold for `version` only, for pip's
  --python-version."""
  path = pathlib.Path(scratch) / 'constraints.txt'
  path.write_text('\n'.join(pins_for(version)) + '\n')
  return str(path)


def dry_run(version, files):
  """(how, exit code, output, {name: version} of what it would install) of pip resolving
  `pip install -r F... -c constraints.txt` for this Python."""
  python = interpreter(version)
  with tempfile.TemporaryDirectory() as scratch:
    report = str(pathlib.Path(scratch) / 'report.json')
    if python:  # pip runs itself under that interpreter
      how, constraints = f'Python {version} ({python})', 'constraints.txt'
      pip, target = [sys.executable, '-m', 'pip', '--python', python], []
    else:
      how, constraints = f"this Python's pip with --python-version {version}", constraints_for(
          version, scratch)
      pip = [sys.executable, '-m', 'pip']
      target = ['--python-version', version, *[f'--platform={p}' for p in PLATFORMS]]
    command = [*pip, 'install', '--dry-run', '--ignore-installed', '--disable-pip-version-check',
               '--only-binary=:all:', '--use-feature=fast-deps', '--no-cache-dir',
               '--target', scratch, '--report', report, *target,
               *[w for f in files for w in ('-r', f)], '-c', constraints]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1200)
    installs = {}
    if done.returncode == 0:
      installs = {item['metadata']['name']: item['metadata']['version']
                  for item in json.loads(pathlib.Path(report).read_text())['install']}
  return how, done.returncode, done.stdout + done.stderr, installs


@functools.lru_cache(maxsize=None)
def resolutions():
  """[dry_run's answer] for RESOLVE's checks and then FAILS, run at once, once per session."""
  checks = [*RESOLVE, FAILS]
  with concurrent.futures.ThreadPoolExecutor(len(checks)) as pool:
    done = list(pool.map(lambda check: dry_run(*check), checks))
  for (version, files), (how, code, _, _) in zip(checks, done):
    print(version, ' '.join(files), how, 'exit', code)
  return done


def test_the_install_lines_resolve_on_every_python_the_readme_names():
  lines = install_lines()
  # The quick start's, the TPU VM's (and the pods' page) and the tests' lines, each only as
  # `-r FILE -c constraints.txt`: the same words on every Python.
  assert set(lines) == {'requirements.txt', 'requirements-tpu.txt', 'requirements-dev.txt'}, lines
  assert all(words[2:] == ('-c', 'constraints.txt') for found in lines.values()
             for words in found), lines
  done = resolutions()
  failed = {check[0]: out[-3000:] for check, (_, code, out, _) in zip(RESOLVE, done) if code != 0}
  assert not failed, failed
  # Each Python got the versions meant for it: on 3.10 the lines marked for it.
  for (version, _), (_, _, out, _) in zip(RESOLVE, done):
    numpy = next(pin for pin in pins_for(version) if pin.startswith('numpy=='))
    assert re.search(r'^Would install .*\b' + re.escape(numpy.replace('==', '-')) + r'\b', out,
                     re.M), (version, numpy, out[-3000:])
  assert pins_for('3.10') != pins_for('3.11')
  _, code, out, _ = done[-1]
  assert code != 0 and re.search(r'No matching distribution found for libtpu==0\.0\.21', out), out


def test_constraints_pin_every_package_each_line_installs():
  # A package that no line pins comes at its newest release on the day of the install: what
  # a TPU VM gets drifts from what was checked (tpu-info's rich and prometheus_client were).
  unpinned = []
  for (version, files), (_, code, out, installs) in zip(RESOLVE, resolutions()):
    assert code == 0, (version, out[-3000:])
    pins = {canonicalize_name(name): Version(pinned)
            for name, pinned in (pin.split('==') for pin in pins_for(version))}
    unpinned += [f'Python {version}, {" ".join(files)}: {name}=={installed}'
                 for name, installed in sorted(installs.items())
                 if pins.get(canonicalize_name(name)) != Version(installed)]
  assert not unpinned, 'no line of constraints.txt pins:\n' + '\n'.join(unpinned)
