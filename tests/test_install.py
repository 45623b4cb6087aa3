# SPDX-License-Identifier: BSD-3-Clause
"""The README's install lines, as written, resolve for every Python they claim: pip's own
resolver on a dry run (nothing is installed), with the real interpreter of each version
where the machine has one (pyenv's), else pip's --python-version. It asks the package
registry, as the install itself does."""

import concurrent.futures
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile


from conftest import REPO

# What the README says: the quick start's line on 3.10 to 3.13, the TPU VM's on 3.10 to 3.12
# (torch_xla[tpu] 2.9 pins libtpu 0.0.21, which has no wheel for 3.13).
SUPPORTED = {'requirements.txt': ['3.10', '3.11', '3.12', '3.13'],
             'requirements-tpu.txt': ['3.10', '3.11', '3.12']}
PLATFORMS = ['manylinux_2_17_x86_64', 'manylinux2014_x86_64', 'manylinux_2_28_x86_64',
             'manylinux_2_31_x86_64', 'linux_x86_64']


def install_lines():
  """{requirements file: the words after `pip install` of its install line in the docs}."""
  lines = {}
  for page in [REPO / 'README.md', *sorted((REPO / 'docs').glob('*.md'))]:
    for words in re.findall(r'pip install (-r requirements[-\w]*\.txt[^&\n`"]*)', page.read_text()):
      words = shlex.split(words)
      lines.setdefault(words[1], words)
  return lines


def interpreter(version):
  """A python of this version on this machine (pyenv's), or None."""
  found = sorted(pathlib.Path('~/.pyenv/versions').expanduser().glob(f'{version}.*/bin/python'))
  return found[-1] if found else None


def dry_run(version, words):
  """(exit code, output) of pip resolving `pip install WORDS` for this Python."""
  python = interpreter(version)
  target = ['--python-version', version, '--only-binary=:all:',
            *[f'--platform={p}' for p in PLATFORMS]] if python is None else ['--only-binary=:all:']
  with tempfile.TemporaryDirectory() as scratch:
    command = [str(python or sys.executable), '-m', 'pip', 'install', '--dry-run',
               '--ignore-installed', '--disable-pip-version-check', '--target', scratch,
               *target, *words]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1200)
  return done.returncode, done.stdout + done.stderr


def test_the_install_lines_resolve_on_every_python_the_readme_names():
  lines = install_lines()
  assert set(SUPPORTED) <= set(lines), lines
  assert all(words[2:] == ['-c', 'constraints.txt'] for words in lines.values()), lines
  checks = [(version, name) for name, versions in SUPPORTED.items() for version in versions]
  checks.append(('3.13', 'requirements-tpu.txt'))  # The limit the README states.
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    done = dict(zip(checks, pool.map(lambda check: dry_run(check[0], lines[check[1]]), checks)))
  failed = {check: out[-2000:] for check, (code, out) in done.items()
            if code != 0 and check != ('3.13', 'requirements-tpu.txt')}
  assert not failed, failed
  for check, (code, out) in done.items():
    print(check, 'interpreter' if interpreter(check[0]) else '--python-version', 'exit', code)
  code, out = done['3.13', 'requirements-tpu.txt']
  assert code != 0 and re.search(r'No matching distribution found for libtpu==0\.0\.21', out), out
