# SPDX-License-Identifier: BSD-3-Clause
"""What a user who copies one training script reads: the script and the repo's modules it
imports (followed through their own imports), without supervision.py, which a copier
running under torchrun or a launcher of their own may leave out (see its docstring), and
command.py, which only run() and %run need, and with them. Lines are counted twice: those a reader reads (not blank: code, comments and
docstrings) and all of them (as `wc -l` counts). Also the longest function and the most parameters of
each file, and the imports between the repo's files (a shared module imports no script).

  python benchmarks/copy_size.py
"""

import ast
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = ['train_resnet_mp.py', 'train_resnet_spmd.py', 'train_single_core.py',
           'train_wds_cifar.py', 'make_cifar_shards.py', 'launch_pod.py']
OPTIONAL = ('supervision.py', 'command.py')


def local_imports(path):
  """The repo's .py files that the file at path imports."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.add(node.module)
  return sorted(f'{name}.py' for name in names if (REPO / f'{name}.py').is_file())


def needed(script):
  """script and every repo file it imports, directly or through another."""
  found, todo = [], [script]
  while todo:
    name = todo.pop()
    if name not in found:
      found.append(name)
      todo += local_imports(REPO / name)
  return found


def lines(name):
  return len((REPO / name).read_text().splitlines())


def read_lines(name):
  return sum(1 for line in (REPO / name).read_text().splitlines() if line.strip())


def functions(name):
  """(longest function or method in lines, its name, most parameters, its name)."""
  longest, most = (0, ''), (0, '')
  for node in ast.walk(ast.parse((REPO / name).read_text())):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      params = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if a.arg not in ('self', 'cls')]
      longest = max(longest, (node.end_lineno - node.lineno + 1, node.name))
      most = max(most, (len(params), node.name))
  return (*longest, *most)


def main():
  print('| script | files it needs | lines read, without supervision.py and command.py | with '
        'them | all lines (wc -l), without | with |')
  print('|---|---|---|---|---|---|')
  for script in SCRIPTS:
    files = needed(script)
    counts = []
    for count in (read_lines, lines):
      total = sum(map(count, files))
      counts += [total - sum(count(name) for name in OPTIONAL if name in files), total]
    print(f'| {script} | {" ".join(files[1:]) or "-"} | {" | ".join(map(str, counts))} |')
  print()
  print('| file | lines read | lines | imports from the repo | longest function | most parameters |')
  print('|---|---|---|---|---|---|')
  shared = sorted({f for s in SCRIPTS for f in needed(s)} - set(SCRIPTS))
  cycles = []
  for name in SCRIPTS + shared:
    imports = local_imports(REPO / name)
    cycles += [f'{name} imports {i}' for i in imports if name in shared and i in SCRIPTS]
    length, long_name, params, params_name = functions(name)
    print(f'| {name} | {read_lines(name)} | {lines(name)} | {" ".join(imports) or "-"} | {length} ({long_name}) | '
          f'{params} ({params_name}) |')
  print()
  print('\n'.join(cycles) or 'No shared module imports a script.')
  return 1 if cycles else 0


if __name__ == '__main__':
  sys.exit(main())
