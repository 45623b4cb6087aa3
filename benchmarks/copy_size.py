# SPDX-License-Identifier: BSD-3-Clause
"""What a user who copies one training script reads: the files its copy line in
docs/scripts.md copies (the kit: the script and utils.py; LICENSE is not counted), and
what the optional modules (supervisor.py, command.py) add. Lines are counted twice: all of
them, as `wc -l` counts them, and those a reader reads (not blank: code, comments and
docstrings). Also the repo's modules each file imports that the kit lacks (none but the
optional ones, whose import is guarded), the longest function and the most parameters of
each file, and the imports between the repo's files (a shared module imports no script).

  python benchmarks/copy_size.py
"""

import ast
import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = ['train_resnet_mp.py', 'train_resnet_spmd.py', 'train_single_core.py',
           'train_wds_cifar.py', 'train_decoder_spmd.py', 'make_cifar_shards.py',
           'make_token_files.py', 'launch_pod.py']
OPTIONAL = ('supervisor.py', 'command.py')


def kits():
  """{script: the .py files its copy line in docs/scripts.md copies}."""
  page = (REPO / 'docs' / 'scripts.md').read_text()
  return {m.group(1): [name for name in m.group(0).split()[1:] if name.endswith('.py')]
          for m in re.finditer(r'^cp (train_\w+\.py) .*$', page, re.M)}


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
  print('| script | its kit (the copy line) | lines (wc -l) | lines read | imported, not in the kit | '
        f'with {" and ".join(OPTIONAL)}: lines | lines read |')
  print('|---|---|---|---|---|---|---|')
  for script, kit in kits().items():
    lacking = sorted(set(needed(script)) - set(kit) - set(OPTIONAL))
    counts = [sum(map(count, names)) for names in (kit, kit + list(OPTIONAL))
              for count in (lines, read_lines)]
    print(f'| {script} | {" ".join(kit)} | {counts[0]} | {counts[1]} | {" ".join(lacking) or "-"} '
          f'| {counts[2]} | {counts[3]} |')
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
